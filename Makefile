# The README's two commands: `make demo` and `make test`. Both start from nothing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned here because its CPU wheel lies on this disk; never let pip fetch another.
TORCH := torch==2.13.0
PROMPT ?= The capital of France is

.PHONY: setup setup-dev demo test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

setup: $(BIN)/python
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q "$(TORCH)" -e ".[model]"

# mlx-vlm is a test oracle only (its Gemma 4 model and converter); its declared dependencies
# (datasets, opencv, mlx-audio, ...) serve its own CLI and processors, which the tests do not run.
setup-dev: setup
	$(BIN)/pip install -q "$(TORCH)" -e ".[model,dev]"
	$(BIN)/pip install -q --no-deps mlx-vlm==0.7.10

demo: setup
	$(BIN)/hearth generate --max-tokens 64 "$(PROMPT)"

test: setup-dev
	$(BIN)/python -m pytest -q

lint: setup-dev
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

bench: setup-dev
	$(BIN)/python benchmarks/cpu_decode.py

clean:
	rm -rf $(VENV) build src/*.egg-info
