#!/usr/bin/env bash
# The GPU tables of docs/benchmarks.md, each part within one 10-minute device call. Tables land
# in $OUT (default benchmarks/results/tmp); each stage has its own time limit, so one slow
# stage cannot take the others down.
#   OUT=/tmp/out benchmarks/gpu_suite.sh headline  # bf16 and 4-bit decode and prefill of 12B, E4B,
#                                                  # 26B-A4B and 31B, HF transformers beside (one call)
#   OUT=/tmp/out benchmarks/gpu_suite.sh long      # Gemma 3 12B at 8k and 32k; KV layouts to 128k
#   OUT=/tmp/out benchmarks/gpu_suite.sh checks    # GPU tests, bf16 parity against HF, server first tokens
#   OUT=/tmp/out MODELS=gemma3-12b benchmarks/gpu_suite.sh revisions  # this tree against BASE
#     (default .base/src: `git archive REV src | tar -x -C .base`, carried), bench alternating
#   OUT=/tmp/out benchmarks/gpu_suite.sh concurrency  # the batched step's GPU tests, batch-1
#                                                  # beside, aggregate decode at 1-64 streams
#                                                  # (HF_PEER=1: HF's continuous batching beside)
#   OUT=/tmp/out benchmarks/gpu_suite.sh media        # image and audio prompts' first token vs HF
#   OUT=/tmp/out benchmarks/gpu_suite.sh gguf         # GGUF block kernels' tests, then gguf-bench
#   OUT=/tmp/out GGUF_TYPES="Q8_0 Q4_0" benchmarks/gpu_suite.sh gguf-bench  # random Gemma 3 12B
#     GGUF files (default Q4_K_M) written on the device (needs the `gguf` package), `hearth bench`
#   OUT=/tmp/out benchmarks/gpu_suite.sh gguf-sweep   # the GGUF GEMV's launches at 12B shapes
# `--random` benches read text through the embedded model's tokenizer: on a machine without
# its package, carry .gpu from `python benchmarks/device_tokenizer.py --out .gpu`.
# Candidate kernels, sweeps, profiles and A/B runs live in benchmarks/lab/.
set -u
PART=${1:-headline}
OUT=${OUT:-benchmarks/results/tmp}
# Logs apart from the tables: the device returns at most 8 files from $OUT.
LOGS=${LOGS:-$OUT}
mkdir -p "$OUT" "$LOGS"
export PYTHONPATH=$PWD/src:$PWD/.gpu/stub${PYTHONPATH:+:$PYTHONPATH} OUT  # and what the caller installed (e.g. /tmp/site)
stage() {  # stage SECONDS NAME COMMAND...
  local limit=$1 name=$2; shift 2
  echo "=== $name"
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
  echo "=== $name: exit $?"
  grep -E '^\||passed|failed|Error' "$LOGS/$name.log" | tail -40
}
bench() {  # bench SECONDS NAME MODEL ARGS...: one `hearth bench --random` table, $OUT/NAME.md
  local limit=$1 name=$2 model=$3; shift 3
  stage "$limit" "$name" python -m hearth.cli bench --random "$model" "$@" --out "$OUT/$name.md"
}
case "$PART" in
headline)
  bench 90 bench-gemma3-12b gemma3-12b --hf --contexts 512 --prefill 512,4096
  bench 80 bench-e4b e4b --hf --contexts 512 --prefill 512,4096
  bench 60 bench-26b-a4b 26b-a4b --contexts 512 --prefill 4096
  bench 90 bench-31b 31b --contexts 512 --prefill 4096
  for m in gemma3-12b 26b-a4b e4b; do
    bench 70 "bench-$m-4bit" "$m" --quant 4bit --contexts 512 --prefill 4096
  done
  ;;
long)
  bench 60 bench-gemma3-12b-long gemma3-12b --contexts 8192,32768 --prefill 512
  bench 200 bench-gemma3-12b-kv gemma3-12b --kv-quant off,4@full,turbo:k4v3@full --contexts 8192,32768,131000 --prefill 512 --steps 16
  ;;
checks)
  stage 150 gpu-tests python -m pytest -q -x tests/ops/test_launch.py tests/runtime/test_graph_decoder.py tests/runtime/test_batch_graphs_gpu.py tests/engine/test_bench.py tests/ops/test_fused_kernels.py tests/ops/test_gemv.py tests/ops/test_decode_attention.py tests/models/test_gemma4_kernel_path.py tests/layers/test_attention_kernel_path.py tests/models/test_gemma4_vision.py
  stage 90 parity python benchmarks/gpu_parity.py --out "$OUT/gpu_parity.md"
  stage 60 parity-96 python benchmarks/gpu_parity.py --prompt 96 --out "$OUT/gpu_parity_prompt96.md"
  stage 130 ttft python benchmarks/gpu_fresh_prompt_ttft.py --models e4b,gemma3-12b
  stage 150 ttft-hits python benchmarks/gpu_fresh_prompt_ttft.py --models e4b,gemma3-12b --lengths 128 --hits 1024+64,1920+128,3968+128
  ;;
concurrency)
  stage 150 batch-tests python -m pytest -q -x tests/runtime/test_batch_graphs_gpu.py tests/runtime/test_batch_decode.py tests/runtime/test_scheduler_batched.py
  bench 90 conc-baseline-gemma3-12b gemma3-12b --contexts 512 --prefill 512
  bench 150 conc-gemma3-12b gemma3-12b --concurrency 1,4,16,64
  bench 150 conc-gemma3-12b-4bit gemma3-12b --quant 4bit --concurrency 1,4,16,64
  bench 120 conc-e4b e4b --concurrency 1,4,16,64
  bench 150 conc-26b-a4b 26b-a4b --concurrency 1,4,16,64
  [ -n "${HF_PEER:-}" ] && stage 300 hf-conc-gemma3-12b python benchmarks/hf_continuous_batching.py --random gemma3-12b --concurrency 1,4,16,64 --out "$OUT/hf-conc-gemma3-12b.md"
  ;;
media)
  stage 330 image-ttft python benchmarks/gpu_image_ttft.py --models e4b,31b
  stage 200 audio-ttft python benchmarks/gpu_audio_ttft.py --models e4b
  ;;
gguf-sweep)
  stage 420 gguf-gemv python benchmarks/lab/gpu_gguf_gemv.py --types "${GGUF_KERNEL_TYPES:-Q4_K,Q6_K}"
  ;;
gguf | gguf-bench)
  if [ "$PART" = gguf ]; then
    stage 240 gguf-tests python -m pytest -q -p no:cacheprovider tests/ops/test_gguf_matmul.py tests/models/test_gguf_kernel_path.py
  fi
  for type in ${GGUF_TYPES:-Q4_K_M}; do
    file=${GGUF_DIR:-/tmp}/gemma3-12b-$type.gguf
    stage 150 "write-$type" python benchmarks/write_random_gguf.py "$file" --type "$type"
    stage 240 "bench-gguf-$type" python -m hearth.cli bench "$file" --contexts 512 --prefill 512,4096 --out "$OUT/bench-gguf-$type.md"
    rm -f "$file"
  done
  ;;
revisions)
  stage 580 revisions python benchmarks/ab_revisions.py --base "${BASE:-.base/src}" --new src --models "${MODELS:-gemma3-12b,e4b,26b-a4b}" --quant none,4bit --rounds "${ROUNDS:-1}" --out "$OUT/ab_revisions.md"
  ;;
*)
  echo "unknown part: $PART (headline, long, checks, concurrency, media, gguf, gguf-bench, gguf-sweep, revisions)" >&2
  exit 2
  ;;
esac
