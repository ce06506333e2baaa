"""The runner: the generate loop, sampling, step strategies and graph capture."""
