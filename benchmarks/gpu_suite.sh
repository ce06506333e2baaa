#!/usr/bin/env bash
# Every GPU check and measurement of the kernels and the decode loop, in one run on the H200.
# Tables land in $OUT (default benchmarks/results/tmp); each stage has its own time limit so
# one slow stage cannot take the others down. Two parts, each within one 10-minute device call:
#   OUT=/tmp/out benchmarks/gpu_suite.sh kernels   # checks, kernels, Gemma 3 12B
#   OUT=/tmp/out benchmarks/gpu_suite.sh models    # KV layouts at long context, Gemma 4 models
#   OUT=/tmp/out benchmarks/gpu_suite.sh pending   # the MoE prefill plan: grouped kernels, A/B
#   OUT=/tmp/out benchmarks/gpu_suite.sh pdl       # PDL on/off A/B with logit checks, MoE plan
#   OUT=/tmp/out benchmarks/gpu_suite.sh epilogue  # GEMV add-norm epilogue: tests, parity, A/B, bench
#   OUT=/tmp/out benchmarks/gpu_suite.sh final     # headline benches after PDL
#   OUT=/tmp/out benchmarks/gpu_suite.sh ncu       # Nsight Compute on the 4-bit GEMV
#   OUT=/tmp/out benchmarks/gpu_suite.sh sweeps    # GEMV launch sweeps in CUDA graphs, A/B
#   OUT=/tmp/out benchmarks/gpu_suite.sh next      # E4B 4-bit launches, x reorder on short K
#   OUT=/tmp/out benchmarks/gpu_suite.sh folded    # 4-bit A/B and benches after the folded offsets
#   OUT=/tmp/out benchmarks/gpu_suite.sh moe       # fused MoE norms: parity, 26B A/B and bench
#   OUT=/tmp/out benchmarks/gpu_suite.sh ple       # per-layer GeGLU in its GEMV: parity, E4B A/B
#   OUT=/tmp/out benchmarks/gpu_suite.sh bench4    # 4-bit headline benches (12B, E4B)
#   OUT=/tmp/out benchmarks/gpu_suite.sh e4b4      # where E4B prefill's 40 ms (bf16) and 81 ms (4-bit) at 512 go
#   OUT=/tmp/out benchmarks/gpu_suite.sh launch    # the fast Triton launch: GPU tests, prefill A/B with logits
#   OUT=/tmp/out benchmarks/gpu_suite.sh graphs    # prefill from CUDA graphs (padded chunks), decoders reused
#   OUT=/tmp/out benchmarks/gpu_suite.sh graphs-bench  # headline benches with prefill graphs on
#   OUT=/tmp/out benchmarks/gpu_suite.sh moe-tall  # MoE prefill tiles of 128 rows: A/B with logits
#   OUT=/tmp/out benchmarks/gpu_suite.sh moe-tall2 # 256-row tiles; 128-row tiles from 64 mean rows
#   OUT=/tmp/out benchmarks/gpu_suite.sh continuation  # prompt-cache hits through continuation graphs
#   OUT=/tmp/out benchmarks/gpu_suite.sh gemv-stages   # bf16 GEMV with a pipelined K loop: sweep, A/B
#   OUT=/tmp/out benchmarks/gpu_suite.sh affine-stages # 4/8-bit GEMV whole steps pipelined: A/B, logits
#   OUT=/tmp/out benchmarks/gpu_suite.sh wide          # qkv, gate/up: GEMV vs cuBLAS sweep, A/B
#   OUT=/tmp/out benchmarks/gpu_suite.sh wide-check    # pinned wide launches vs fp64, parity, chat
#   OUT=/tmp/out benchmarks/gpu_suite.sh chat          # a growing conversation: decoders grown or not
#   OUT=/tmp/out benchmarks/gpu_suite.sh prefetch      # L2 prefetch, add-norm GEMV: checks, E4B and 26B A/B
#   OUT=/tmp/out benchmarks/gpu_suite.sh prefetch-min  # the same, E4B only, in one short call
#   OUT=/tmp/out benchmarks/gpu_suite.sh prefetch-e4b  # (or in two:) add-norm check, E4B A/B
#   OUT=/tmp/out benchmarks/gpu_suite.sh prefetch-26b  # 26B-A4B A/B, parity
#   OUT=/tmp/out benchmarks/gpu_suite.sh prefetch2     # the prefetch on 12B bf16 and 4-bit, E4B 4-bit
#   OUT=/tmp/out benchmarks/gpu_suite.sh expert-prefetch  # 26B-A4B's experts prefetched: A/B, parity
#   OUT=/tmp/out benchmarks/gpu_suite.sh refresh       # what 2026-12-05 left: the A/Bs above, 1-2 line
#                                                      # affine prefetch, E4B and 26B-A4B headline decode
#   OUT=/tmp/out benchmarks/gpu_suite.sh final-h100    # MoE decode fusions, few-KV-head attention tiles: GeGLU
#                                                      # check, parity, A/Bs, benches (2026-12-05 evening)
#   OUT=/tmp/out benchmarks/gpu_suite.sh profiles      # E4B and 26B-A4B decode profiles; few-KV-head tile A/B
#   OUT=/tmp/out benchmarks/gpu_suite.sh after-1205    # GPU checks of the routing rewrite, route A/B, headline benches
#   OUT=/tmp/out benchmarks/gpu_suite.sh headline2     # every model's headline in one call, bf16 and 4-bit (HF beside)
#   OUT=/tmp/out benchmarks/gpu_suite.sh grouped-sweep # MoE prefill: grouped matmul launches at 26B-A4B shapes
#   OUT=/tmp/out benchmarks/gpu_suite.sh after-sweep   # its new tall tile end to end; 4-bit headline rows
#   OUT=/tmp/out benchmarks/gpu_suite.sh mma-gluon     # load-only floors, the Gluon tensor-core 4-bit GEMV,
#                                                      # the float experts' GeGLU store (one-row pairing)
#   OUT=/tmp/out benchmarks/gpu_suite.sh prefill-fusions   # grouped GeGLU output, token-major attention
#                                                          # output: checks, 26B-A4B bf16 prefill A/B
#   OUT=/tmp/out benchmarks/gpu_suite.sh prefill-fusions2  # the same A/B at 4 bits, E4B and 12B
#   OUT=/tmp/out benchmarks/gpu_suite.sh headline3         # headline rows the prefill fusions move
#   OUT=/tmp/out benchmarks/gpu_suite.sh attn512           # D=512 prefill attention: two value
#                                                          # splits (default) or one, A/B from graphs
#   OUT=/tmp/out benchmarks/gpu_suite.sh persistent        # a GEMV chain: a launch each, or one
#                                                          # persistent kernel with grid barriers
#   OUT=/tmp/out benchmarks/gpu_suite.sh headline4         # the table, HF beside, one call
#   OUT=/tmp/out benchmarks/gpu_suite.sh split-sum         # 4-bit split-K sums by their own launch
#   OUT=/tmp/out benchmarks/gpu_suite.sh split-sum-sweep   # the split launches swept again, A/B
#   OUT=/tmp/out benchmarks/gpu_suite.sh split-norm        # 4-bit o/down partials summed by the norm
#   OUT=/tmp/out benchmarks/gpu_suite.sh mlp-fusions       # 4-bit MLP: norm stores x's order, GeGLU stores
#   OUT=/tmp/out benchmarks/gpu_suite.sh unrolled-experts  # MoE experts and short rows on the unrolled
#                                                          # GEMV: checks, sweep, A/Bs, 4-bit benches
#   OUT=/tmp/out benchmarks/gpu_suite.sh embed4            # 4-bit token rows by one kernel: A/Bs
#   OUT=/tmp/out benchmarks/gpu_suite.sh rotary            # RoPE tables by one kernel: A/Bs (on since)
set -u
PART=${1:-kernels}
OUT=${OUT:-benchmarks/results/tmp}
# Logs apart from the tables: the device returns at most 8 files from $OUT.
LOGS=${LOGS:-$OUT}
mkdir -p "$OUT" "$LOGS"
export PYTHONPATH=$PWD/src OUT
stage() {  # stage SECONDS NAME COMMAND...
  local limit=$1 name=$2; shift 2
  echo "=== $name"
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
  echo "=== $name: exit $?"
  grep -E '^\||passed|failed|Error' "$LOGS/$name.log" | tail -40
}
if [ "$PART" = headline ]; then  # the headline numbers, within one device call
stage 45 tests python -m pytest -q -x tests/test_static_cache.py tests/test_bench.py -k "gpu or graph"
stage 100 affine python benchmarks/gpu_kernels_affine.py
stage 130 bench-12b python -m hearth.cli bench --random gemma3-12b --hf --out "$OUT/bench-gemma3-12b.md"
stage 90 bench-12b-4bit python -m hearth.cli bench --random gemma3-12b --quant 4bit --contexts 512,32768 --prefill 4096 --out "$OUT/bench-gemma3-12b-4bit.md"
stage 140 bench-12b-kv python -m hearth.cli bench --random gemma3-12b --kv-quant off,4,turbo:k8v3,turbo:k4v3 --contexts 8192,32768,131000 --prefill 512 --steps 16 --out "$OUT/bench-gemma3-12b-kv.md"
stage 60 bench-26b python -m hearth.cli bench --random 26b-a4b --contexts 512 --prefill 512,4096 --out "$OUT/bench-26b-a4b.md"
elif [ "$PART" = rest ]; then  # what the headline call left: affine kernels, KV layouts, Gemma 4
stage 90 affine python benchmarks/gpu_kernels_affine.py
stage 130 bench-12b-kv python -m hearth.cli bench --random gemma3-12b --kv-quant off,4,turbo:k8v3,turbo:k4v3 --contexts 8192,32768,131000 --prefill 512 --steps 16 --out "$OUT/bench-gemma3-12b-kv.md"
stage 70 bench-e4b python -m hearth.cli bench --random e4b --hf --contexts 512 --prefill 512,4096 --steps 16 --out "$OUT/bench-e4b.md"
stage 90 bench-31b python -m hearth.cli bench --random 31b --contexts 512 --prefill 4096 --steps 16 --out "$OUT/bench-31b.md"
elif [ "$PART" = kernels2 ]; then  # this session's new kernels, each against its reference
for i in $(seq 0 13); do ATTN_WARM=$i/14 timeout 150 python benchmarks/gpu_kernels_attention.py --sweep-only >/dev/null 2>&1 & done
stage 60 turbo-append python benchmarks/gpu_turbo_append.py
wait
stage 120 attention python benchmarks/gpu_kernels_attention.py --sweep-only
stage 60 gemv python benchmarks/gpu_gemv_bf16.py
stage 150 prefill-attention python benchmarks/gpu_kernels_prefill_attention.py --no-16k
stage 200 grouped python benchmarks/gpu_kernels_grouped.py
elif [ "$PART" = e2e ]; then  # end to end after kernels2: KV layouts at 32k, prefill per model
stage 200 bench-12b-kv python -m hearth.cli bench --random gemma3-12b --kv-quant off,4,4@full,turbo:k4v3@full --contexts 8192,32768 --prefill 4096 --steps 16 --out "$OUT/bench-gemma3-12b-kv.md"
stage 120 bench-31b python -m hearth.cli bench --random 31b --contexts 512 --prefill 4096 --steps 16 --out "$OUT/bench-31b.md"
stage 100 bench-26b python -m hearth.cli bench --random 26b-a4b --contexts 512 --prefill 4096 --steps 16 --out "$OUT/bench-26b-a4b.md"
stage 90 bench-e4b python -m hearth.cli bench --random e4b --contexts 512 --prefill 4096 --steps 16 --out "$OUT/bench-e4b.md"
elif [ "$PART" = attention-gemv ]; then  # decode attention sweep and the 4-bit GEMV variants
for i in $(seq 0 13); do ATTN_WARM=$i/14 timeout 150 python benchmarks/gpu_kernels_attention.py --sweep-only >/dev/null 2>&1 & done
stage 60 turbo-append python benchmarks/gpu_turbo_append.py
wait
stage 120 attention python benchmarks/gpu_kernels_attention.py --sweep-only
stage 250 gemv-affine-variants python benchmarks/gpu_gemv_affine_variants.py
elif [ "$PART" = prefill-kv ]; then  # prefill kernels against references, then KV layouts at 32k
stage 130 prefill-attention python benchmarks/gpu_kernels_prefill_attention.py --no-16k
stage 180 grouped python benchmarks/gpu_kernels_grouped.py
stage 220 bench-12b-kv python -m hearth.cli bench --random gemma3-12b --kv-quant off,4,4@full,turbo:k4v3@full --contexts 8192,32768 --prefill 4096 --steps 16 --out "$OUT/bench-gemma3-12b-kv.md"
elif [ "$PART" = verify ]; then  # kernel checks after a change: tests on CUDA, attention, affine, parity
for i in $(seq 0 13); do ATTN_WARM=$i/14 timeout 150 python benchmarks/gpu_kernels_attention.py --sweep-only >/dev/null 2>&1 & done
stage 150 tests python -m pytest -q -x tests/test_static_cache.py tests/test_bench.py
wait
stage 120 attention python benchmarks/gpu_kernels_attention.py --sweep-only
stage 150 affine python benchmarks/gpu_kernels_affine.py
stage 90 parity python benchmarks/gpu_parity.py --out "$OUT/gpu_parity.md"
elif [ "$PART" = decode ]; then  # end to end: 12B bf16, 4-bit, KV layouts to 128k; E4B, 26B-A4B
stage 100 bench-12b python -m hearth.cli bench --random gemma3-12b --contexts 512,8192,32768 --prefill 512,4096 --out "$OUT/bench-gemma3-12b.md"
stage 100 bench-12b-4bit python -m hearth.cli bench --random gemma3-12b --quant 4bit --contexts 512,32768 --prefill 4096 --out "$OUT/bench-gemma3-12b-4bit.md"
stage 200 bench-12b-kv python -m hearth.cli bench --random gemma3-12b --kv-quant off,4@full,turbo:k4v3@full --contexts 8192,32768,131000 --prefill 512 --steps 16 --out "$OUT/bench-gemma3-12b-kv.md"
stage 60 bench-e4b python -m hearth.cli bench --random e4b --contexts 512 --prefill 512,4096 --steps 16 --out "$OUT/bench-e4b.md"
stage 60 bench-26b python -m hearth.cli bench --random 26b-a4b --contexts 512 --prefill 512,4096 --steps 16 --out "$OUT/bench-26b-a4b.md"
elif [ "$PART" = profile ]; then  # prefill medians (E4B), 12B 4-bit, where decode time goes
stage 90 bench-e4b python -m hearth.cli bench --random e4b --contexts 512 --prefill 4096 --steps 16 --out "$OUT/bench-e4b.md"
stage 60 profile-e4b-prefill python benchmarks/gpu_profile_decode.py --model e4b --prefill 4096
stage 90 bench-12b-4bit python -m hearth.cli bench --random gemma3-12b --quant 4bit --contexts 512,32768 --prefill 4096 --out "$OUT/bench-gemma3-12b-4bit.md"
stage 80 profile-12b-4bit python benchmarks/gpu_profile_decode.py --model gemma3-12b --quant 4bit --context 512
stage 80 profile-12b python benchmarks/gpu_profile_decode.py --model gemma3-12b --context 512
elif [ "$PART" = pending ]; then  # the MoE plan kernels against the torch plan, 26B prefill A/B (run 2026-12-03 night)
stage 200 grouped python benchmarks/gpu_kernels_grouped.py
stage 150 ab-26b-prefill python benchmarks/ab_decode.py --models 26b-a4b --prefill 4096 --variants base,plan-torch --rounds 3 --name 26b_prefill_plan
stage 120 bench-26b python -m hearth.cli bench --random 26b-a4b --contexts 512 --prefill 512,4096 --steps 16 --out "$OUT/bench-26b-a4b.md"
elif [ "$PART" = pdl ]; then  # programmatic dependent launch on/off, logits checked; the MoE plan
stage 20 plan python benchmarks/gpu_plan_check.py
stage 270 ab-12b-pdl python benchmarks/ab_decode.py --models gemma3-12b --variants base,pdl-off,fused-geglu-down,wide-gemv,all-gemv --rounds 3 --check --name 12b_pdl
stage 110 ab-12b-4bit-pdl python benchmarks/ab_decode.py --models gemma3-12b --quant 4bit --variants base,pdl-off --rounds 3 --check --name 12b_4bit_pdl
stage 130 ab-26b-prefill python benchmarks/ab_decode.py --models 26b-a4b --prefill 4096 --variants base,plan-torch --rounds 3 --name 26b_prefill_plan
elif [ "$PART" = pdl2 ]; then  # after PDL: 12B launch choices, Gemma 4 PDL A/B, profiles, benches
stage 120 ab-12b-choices python benchmarks/ab_decode.py --models gemma3-12b --variants base,attn-fused-merge,cublas-gemv,pdl-off --rounds 3 --check --name 12b_pdl_choices
stage 150 ab-gemma4-pdl python benchmarks/ab_decode.py --models e4b,26b-a4b --variants base,pdl-off --rounds 3 --check --name gemma4_pdl
stage 60 profile-12b python benchmarks/gpu_profile_decode.py --model gemma3-12b --context 512
stage 100 bench-12b python -m hearth.cli bench --random gemma3-12b --contexts 512,8192,32768 --prefill 512,4096 --out "$OUT/bench-gemma3-12b.md"
stage 70 bench-12b-4bit python -m hearth.cli bench --random gemma3-12b --quant 4bit --contexts 512,32768 --prefill 4096 --out "$OUT/bench-gemma3-12b-4bit.md"
elif [ "$PART" = epilogue ]; then  # the GEMV's add-norm epilogue: GPU tests, parity, A/B, bench
stage 60 tests python -m pytest -q -x tests/test_static_cache.py tests/test_bench.py -k "gpu or graph"
stage 80 parity python benchmarks/gpu_parity.py --out "$OUT/gpu_parity.md"
stage 130 ab-12b-epilogue python benchmarks/ab_decode.py --models gemma3-12b --variants base,down-cublas,pdl-off --rounds 3 --check --name 12b_epilogue
stage 150 ab-gemma4-pdl python benchmarks/ab_decode.py --models e4b,26b-a4b --variants base,pdl-off --rounds 3 --check --name gemma4_pdl
stage 100 bench-12b python -m hearth.cli bench --random gemma3-12b --contexts 512,8192,32768 --prefill 512,4096 --out "$OUT/bench-gemma3-12b.md"
elif [ "$PART" = final ]; then  # the headline numbers after PDL, then launch widths of the small kernels
stage 100 bench-12b python -m hearth.cli bench --random gemma3-12b --contexts 512,8192,32768 --prefill 512,4096 --out "$OUT/bench-gemma3-12b.md"
stage 60 bench-12b-4bit python -m hearth.cli bench --random gemma3-12b --quant 4bit --contexts 512,32768 --prefill 4096 --out "$OUT/bench-gemma3-12b-4bit.md"
stage 60 bench-e4b python -m hearth.cli bench --random e4b --contexts 512 --prefill 4096 --steps 16 --out "$OUT/bench-e4b.md"
stage 70 bench-26b python -m hearth.cli bench --random 26b-a4b --contexts 512 --prefill 4096 --steps 16 --out "$OUT/bench-26b-a4b.md"
stage 80 bench-31b python -m hearth.cli bench --random 31b --contexts 512 --prefill 4096 --steps 16 --out "$OUT/bench-31b.md"
stage 130 ab-12b-widths python benchmarks/ab_decode.py --models gemma3-12b --variants base,norm-w4,norm-w16,attn-n32-w8,gelu-2048,rope-w4 --rounds 2 --name 12b_widths
elif [ "$PART" = widths ]; then  # 12B decode: launch widths and tiles of the small kernels
stage 300 ab-12b-widths python benchmarks/ab_decode.py --models gemma3-12b --variants base,norm-w4,norm-w16,attn-n32-w8,gelu-512,gelu-2048,rope-w4,rope-w1 --rounds 3 --name 12b_widths
elif [ "$PART" = repeat ]; then  # GPU tests after PDL; 12B bf16 decode twice more (spread)
stage 90 tests python -m pytest -q -x tests/test_static_cache.py tests/test_bench.py -k "gpu or graph"
stage 70 bench-12b-a python -m hearth.cli bench --random gemma3-12b --contexts 512,8192 --prefill 512 --out "$OUT/bench-gemma3-12b-a.md"
stage 70 bench-12b-b python -m hearth.cli bench --random gemma3-12b --contexts 512,8192 --prefill 512 --out "$OUT/bench-gemma3-12b-b.md"
elif [ "$PART" = pdl-prefill ]; then  # does PDL change prefill? E4B and 12B at 4096 tokens
stage 100 ab-e4b-prefill python benchmarks/ab_decode.py --models e4b --prefill 4096 --variants base,pdl-off --rounds 3 --name e4b_prefill_pdl
stage 100 ab-12b-prefill python benchmarks/ab_decode.py --models gemma3-12b --prefill 4096 --variants base,pdl-off --rounds 3 --name 12b_prefill_pdl
elif [ "$PART" = ncu ]; then  # what bounds the 4-bit GEMV (needs ncu + counters)
stage 200 ncu-gemv bash benchmarks/ncu_gemv_affine.sh
stage 200 ncu-gemv-x-order bash benchmarks/ncu_gemv_affine.sh x-order
elif [ "$PART" = sweeps ]; then  # GEMV launches timed in CUDA graphs, then end to end against the old ones
stage 330 sweep-4bit python benchmarks/gpu_gemv_affine_sweep.py --no-head
stage 200 sweep-8bit python benchmarks/gpu_gemv_affine_sweep.py --bits 8 --no-head
GEMV_CONFIGS_JSON=benchmarks/results/gemv_configs_before_sweep-2026-12-03.json \
  stage 230 ab-4bit python benchmarks/ab_decode.py --quant 4bit --variants base,gemv-json --check --name 12b_4bit_gemv
elif [ "$PART" = next ]; then  # next 4-bit checks: x reorder (short K, as a kernel), register caps, E4B launches
stage 100 affine python benchmarks/gpu_kernels_affine.py
stage 240 ab-4bit python benchmarks/ab_decode.py --models gemma3-12b,e4b --quant 4bit --variants base,exact-codes,gemv4-r80 --rounds 2 --check --name 4bit_next
stage 250 sweep-4bit python benchmarks/gpu_gemv_affine_sweep.py --no-head
# then, with its JSON: GEMV_CONFIGS_JSON=... ab_decode.py --models e4b --quant 4bit --variants base,gemv-json
elif [ "$PART" = folded ]; then  # after the folded offsets and the PDL reorder: GPU tests, 4-bit A/B, benches
stage 60 tests python -m pytest -q -x tests/test_static_cache.py tests/test_bench.py -k "gpu or graph"
GEMV_CONFIGS_JSON=benchmarks/results/gpu_gemv_affine_sweep_folded-2026-12-03.json \
  stage 230 ab-4bit python benchmarks/ab_decode.py --models gemma3-12b,e4b --quant 4bit --variants base,gemv4-split-x-codes-major,gemv-json --rounds 2 --check --name 4bit_folded
stage 80 bench-12b-4bit python -m hearth.cli bench --random gemma3-12b --quant 4bit --contexts 512,32768 --prefill 4096 --out "$OUT/bench-gemma3-12b-4bit.md"
stage 60 bench-e4b-4bit python -m hearth.cli bench --random e4b --quant 4bit --contexts 512 --prefill 4096 --steps 16 --out "$OUT/bench-e4b-4bit.md"
stage 90 bench-31b-4bit python -m hearth.cli bench --random 31b --quant 4bit --contexts 512 --prefill 512 --steps 16 --out "$OUT/bench-31b-4bit.md"
elif [ "$PART" = moe ]; then  # the fused MoE norms: GPU tests, tiny-model parity vs HF, 26B A/B; 12B 4-bit launches
stage 60 tests python -m pytest -q -x tests/test_static_cache.py tests/test_bench.py -k "gpu or graph"
stage 90 parity python benchmarks/gpu_parity.py --out "$OUT/gpu_parity.md"
stage 150 ab-26b python benchmarks/ab_decode.py --models 26b-a4b --variants base,moe-norms-apart --rounds 3 --check --name 26b_moe_norms
GEMV_CONFIGS_JSON=benchmarks/results/gpu_gemv_affine_sweep_folded-2026-12-03.json \
  stage 100 ab-12b-4bit python benchmarks/ab_decode.py --models gemma3-12b --quant 4bit --variants base,gemv-json --rounds 3 --check --name 12b_4bit_json
stage 70 bench-26b python -m hearth.cli bench --random 26b-a4b --contexts 512 --prefill 4096 --steps 16 --out "$OUT/bench-26b-a4b.md"
elif [ "$PART" = ple ]; then  # the per-layer input's GeGLU inside its projection: GPU tests, parity, E4B A/B and bench
stage 120 tests python -m pytest -q -x tests/test_static_cache.py tests/test_bench.py -k "gpu or graph"
stage 80 parity python benchmarks/gpu_parity.py --out "$OUT/gpu_parity.md"
stage 100 ab-e4b python benchmarks/ab_decode.py --models e4b --variants base,ple-geglu-apart --rounds 3 --check --name e4b_ple_geglu
stage 70 bench-e4b python -m hearth.cli bench --random e4b --contexts 512 --prefill 4096 --steps 16 --out "$OUT/bench-e4b.md"
elif [ "$PART" = bench4 ]; then  # 4-bit headline benches with every default of the evening (bf16 x)
stage 90 bench-12b-4bit python -m hearth.cli bench --random gemma3-12b --quant 4bit --contexts 512,32768 --prefill 4096 --out "$OUT/bench-gemma3-12b-4bit.md"
stage 50 bench-e4b-4bit python -m hearth.cli bench --random e4b --quant 4bit --contexts 512 --prefill 512 --steps 16 --out "$OUT/bench-e4b-4bit.md"
elif [ "$PART" = e4b4 ]; then  # E4B prefills 512 tokens in 81 ms at 4 bits, 40 ms in bf16 (both host-bound?): by kernel, with wall time
stage 90 profile-e4b-4bit python benchmarks/gpu_profile_decode.py --model e4b --quant 4bit --prefill 512
stage 90 profile-e4b python benchmarks/gpu_profile_decode.py --model e4b --prefill 512
stage 90 bench-12b-4bit python -m hearth.cli bench --random gemma3-12b --quant 4bit --contexts 512 --prefill 512,4096 --steps 16 --out "$OUT/bench-gemma3-12b-4bit.md"
stage 60 bench-e4b-4bit python -m hearth.cli bench --random e4b --quant 4bit --contexts 512 --prefill 512,4096 --steps 16 --out "$OUT/bench-e4b-4bit.md"
elif [ "$PART" = launch ]; then  # host-bound prefills: Triton's launch path against the fast one
stage 100 tests python -m pytest -q -x tests/test_launch.py tests/test_static_cache.py tests/test_kernels_fused.py tests/test_kernels_gemv.py tests/test_kernels_decode_attention.py tests/test_gemma4_kernel_path.py tests/test_attention_kernel_path.py
stage 70 ab-e4b python benchmarks/ab_decode.py --models e4b --prefill 512 --variants base,triton-launch --check --name e4b_prefill512_launch
stage 70 ab-e4b-4bit python benchmarks/ab_decode.py --models e4b --quant 4bit --prefill 512 --variants base,triton-launch --check --name e4b_4bit_prefill512_launch
stage 50 ab-e4b-decode python benchmarks/ab_decode.py --models e4b --steps 32 --rounds 1 --variants base,triton-launch --check --name e4b_decode_launch
stage 90 ab-26b python benchmarks/ab_decode.py --models 26b-a4b --prefill 4096 --variants base,triton-launch --check --name 26b_prefill4096_launch
stage 70 ab-12b python benchmarks/ab_decode.py --models gemma3-12b --prefill 512 --variants base,triton-launch --check --name 12b_prefill512_launch
stage 60 bench-e4b-4bit python -m hearth.cli bench --random e4b --quant 4bit --contexts 512 --prefill 512,4096 --steps 16 --out "$OUT/bench-e4b-4bit.md"
elif [ "$PART" = graphs ]; then  # prefill from CUDA graphs, decoders reused (the default) against neither
stage 100 tests python -m pytest -q tests/test_static_cache.py tests/test_launch.py tests/test_bench.py
stage 70 ab-e4b python benchmarks/ab_decode.py --models e4b --prefill 512 --variants base,no-prefill-graphs --check --name e4b_prefill512_graphs
stage 70 ab-e4b-4bit python benchmarks/ab_decode.py --models e4b --quant 4bit --prefill 512 --variants base,no-prefill-graphs --check --name e4b_4bit_prefill512_graphs
stage 80 ab-e4b-4k python benchmarks/ab_decode.py --models e4b --prefill 4096 --variants base,no-prefill-graphs --check --name e4b_prefill4096_graphs
stage 70 ab-12b python benchmarks/ab_decode.py --models gemma3-12b --prefill 512 --variants base,no-prefill-graphs --check --name 12b_prefill512_graphs
stage 130 ttft python benchmarks/gpu_fresh_prompt_ttft.py --models e4b,gemma3-12b
elif [ "$PART" = graphs-bench ]; then  # headline benches with prefill graphs on, decode A/B
stage 120 tests python -m pytest -q tests/test_static_cache.py tests/test_launch.py tests/test_bench.py -k "gpu or graph or launch"
stage 90 bench-e4b python -m hearth.cli bench --random e4b --contexts 512 --prefill 512,4096 --steps 16 --out "$OUT/bench-e4b.md"
stage 90 bench-e4b-4bit python -m hearth.cli bench --random e4b --quant 4bit --contexts 512 --prefill 512,4096 --steps 16 --out "$OUT/bench-e4b-4bit.md"
stage 110 bench-12b python -m hearth.cli bench --random gemma3-12b --contexts 512 --prefill 512,4096 --steps 16 --out "$OUT/bench-gemma3-12b.md"
stage 110 bench-26b python -m hearth.cli bench --random 26b-a4b --contexts 512 --prefill 512,4096 --steps 16 --out "$OUT/bench-26b-a4b.md"
stage 120 bench-31b python -m hearth.cli bench --random 31b --contexts 512 --prefill 512,4096 --steps 16 --out "$OUT/bench-31b.md"
stage 60 ab-e4b-decode python benchmarks/ab_decode.py --models e4b --steps 32 --rounds 1 --variants base,no-prefill-graphs --check --name e4b_decode_graphs
elif [ "$PART" = moe-tall ]; then  # MoE prefill tiles of 128 rows at many rows per expert
stage 90 tests python -m pytest -q tests/test_kernels_grouped.py tests/test_gemma4_kernel_path.py
stage 110 ab-26b-4k python benchmarks/ab_decode.py --models 26b-a4b --prefill 4096 --variants base,grouped-m64 --check --name 26b_prefill4096_tall_tiles
stage 100 ab-26b-2k python benchmarks/ab_decode.py --models 26b-a4b --prefill 2048 --variants base,grouped-m64 --check --name 26b_prefill2048_tall_tiles
stage 150 ab-26b-4bit-4k python benchmarks/ab_decode.py --models 26b-a4b --quant 4bit --prefill 4096 --variants base,grouped-m64 --check --name 26b_4bit_prefill4096_tall_tiles
elif [ "$PART" = moe-tall2 ]; then  # taller MoE tiles, and 128-row tiles from fewer rows
stage 110 ab-26b-4k python benchmarks/ab_decode.py --models 26b-a4b --prefill 4096 --variants base,grouped-m256 --check --name 26b_prefill4096_m256
stage 110 ab-26b-4bit-4k python benchmarks/ab_decode.py --models 26b-a4b --quant 4bit --prefill 4096 --variants base,grouped-m256 --check --name 26b_4bit_prefill4096_m256
stage 100 ab-26b-1k python benchmarks/ab_decode.py --models 26b-a4b --prefill 1024 --variants base,grouped-tall-from-64 --check --name 26b_prefill1024_tall_from_64
stage 100 ab-26b-4bit-1k python benchmarks/ab_decode.py --models 26b-a4b --quant 4bit --prefill 1024 --variants base,grouped-tall-from-64 --check --name 26b_4bit_prefill1024_tall_from_64
elif [ "$PART" = continuation ]; then  # prompt-cache hits from continuation graphs (on since this ran)
stage 150 tests python -m pytest -q tests/test_static_cache.py tests/test_bench.py -k "gpu or graph"
stage 300 ttft-hits python benchmarks/gpu_fresh_prompt_ttft.py --models e4b,gemma3-12b,31b --lengths 128 --hits 1024+64,1920+128,3968+128
elif [ "$PART" = gemv-stages ]; then  # bf16 GEMV: LOOP_STAGES and taller K tiles, then end to end
# Compile every swept launch in parallel first (16 CPUs there): the timed sweep then finds them cached.
for i in $(seq 0 13); do timeout 150 python benchmarks/gpu_gemv_bf16_sweep.py --pipelined --warm $i/14 >/dev/null 2>&1 & done
wait
stage 200 sweep-bf16 python benchmarks/gpu_gemv_bf16_sweep.py --pipelined
stage 230 ab-bf16-gemv python benchmarks/ab_decode.py --models gemma3-12b,e4b,26b-a4b --variants base,gemv-bf16-json --rounds 3 --check --name bf16_gemv_pipelined
elif [ "$PART" = affine-stages ]; then  # the affine GEMV's whole steps in a pipelined loop (bit-identical on CPU)
stage 100 affine python benchmarks/gpu_kernels_affine.py
stage 300 ab-4bit python benchmarks/ab_decode.py --models gemma3-12b,e4b --quant 4bit --variants base,affine-stages2,affine-stages3 --rounds 2 --check --name affine_stages_4bit
stage 120 ab-8bit python benchmarks/ab_decode.py --models gemma3-12b --quant 8bit --variants base,affine-stages3 --rounds 2 --check --name affine_stages_8bit
elif [ "$PART" = wide ]; then  # qkv, gate/up: pinned GEMV launches against cuBLAS, then end to end
for i in $(seq 0 13); do timeout 150 python benchmarks/gpu_gemv_bf16_sweep.py --wide --warm $i/14 >/dev/null 2>&1 & done
wait
stage 150 sweep-wide python benchmarks/gpu_gemv_bf16_sweep.py --wide
stage 230 ab-wide python benchmarks/ab_decode.py --models gemma3-12b,e4b,26b-a4b --variants base,wide-gemv-json --rounds 3 --check --name wide_gemv
stage 150 ab-wide-31b python benchmarks/ab_decode.py --models 31b --variants base,wide-gemv-json --rounds 2 --check --name wide_gemv_31b
elif [ "$PART" = wide-check ]; then  # the pinned wide launches' error vs cuBLAS's; parity; then chat
stage 60 wide-check python benchmarks/gpu_gemv_bf16_sweep.py --wide-check
stage 100 tests python -m pytest -q tests/test_static_cache.py -k "gpu or graph or grows"
stage 300 chat python benchmarks/gpu_fresh_prompt_ttft.py --models e4b,gemma3-12b --lengths "" --chat 8
stage 90 parity python benchmarks/gpu_parity.py --out "$OUT/gpu_parity.md"
elif [ "$PART" = chat ]; then  # each turn's first token, decoders replaced at their size or grown
stage 120 tests python -m pytest -q tests/test_static_cache.py -k "gpu or graph or grows"
stage 300 chat python benchmarks/gpu_fresh_prompt_ttft.py --models e4b,gemma3-12b --lengths "" --chat 8
elif [ "$PART" = prefetch ]; then  # L2 prefetch before the PDL wait, add-norm GEMV: checks, Gemma 4 A/B
stage 60 add-norm env PYTHONPATH=$PWD/src:$PWD/benchmarks python benchmarks/gpu_gemv_add_norm.py
stage 170 ab-e4b python benchmarks/ab_decode.py --models e4b --variants prefetch-off,prefetch-on,gemv-prefetch,attn-prefetch,prefetch-lines-32,ple-norm-apart,ple-norm-fused --rounds 3 --check --name e4b_prefetch
stage 90 parity python benchmarks/gpu_parity.py --out "$OUT/gpu_parity.md"
stage 170 ab-26b python benchmarks/ab_decode.py --models 26b-a4b --variants prefetch-off,prefetch-on,gemv-prefetch,attn-prefetch,prefetch-lines-32 --rounds 3 --check --name 26b_prefetch
elif [ "$PART" = prefetch-e4b ]; then  # the shortest call: the add-norm GEMV's check, E4B's A/B
stage 60 add-norm env PYTHONPATH=$PWD/src:$PWD/benchmarks python benchmarks/gpu_gemv_add_norm.py
stage 170 ab-e4b python benchmarks/ab_decode.py --models e4b --variants prefetch-off,prefetch-on,gemv-prefetch,attn-prefetch,ple-norm-apart,ple-norm-fused --rounds 3 --check --name e4b_prefetch
elif [ "$PART" = prefetch-min ]; then  # the least that says whether the defaults should change
stage 150 ab-e4b python benchmarks/ab_decode.py --models e4b --variants prefetch-off,prefetch-on,ple-norm-fused --rounds 3 --check --name e4b_prefetch
elif [ "$PART" = prefetch-26b ]; then  # then 26B-A4B's A/B and the tiny models' parity
stage 170 ab-26b python benchmarks/ab_decode.py --models 26b-a4b --variants prefetch-off,prefetch-on,gemv-prefetch,attn-prefetch --rounds 3 --check --name 26b_prefetch
stage 90 parity python benchmarks/gpu_parity.py --out "$OUT/gpu_parity.md"
elif [ "$PART" = prefetch2 ]; then  # the same A/B on Gemma 3 12B bf16 and 4-bit, E4B 4-bit; E4B's step
stage 130 ab-12b-prefetch python benchmarks/ab_decode.py --models gemma3-12b --variants prefetch-off,prefetch-on,prefetch-lines-32 --rounds 3 --check --name 12b_prefetch
stage 250 ab-4bit-prefetch python benchmarks/ab_decode.py --models gemma3-12b,e4b --quant 4bit --variants prefetch-off,prefetch-on,prefetch-lines-32 --rounds 3 --check --name 4bit_prefetch
stage 70 profile-e4b python benchmarks/gpu_profile_decode.py --model e4b --context 512
elif [ "$PART" = expert-prefetch ]; then  # the gathered float-expert GEMV's prefetch at the router's ids
stage 200 ab-26b-experts python benchmarks/ab_decode.py --models 26b-a4b --variants prefetch-off,base,expert-prefetch-8,expert-prefetch-16 --rounds 3 --check --name 26b_expert_prefetch
stage 90 parity python benchmarks/gpu_parity.py --out "$OUT/gpu_parity.md"
elif [ "$PART" = refresh ]; then  # expert and 1-2 line affine prefetch A/Bs; headline decode with the new defaults
stage 150 ab-26b-experts python benchmarks/ab_decode.py --models 26b-a4b --variants prefetch-off,base,expert-prefetch-8,expert-prefetch-16 --rounds 3 --check --name 26b_expert_prefetch
stage 100 ab-4bit-affine python benchmarks/ab_decode.py --models gemma3-12b --quant 4bit --variants base,affine-prefetch-1,affine-prefetch-2 --rounds 3 --check --name 12b_4bit_affine_prefetch
stage 90 bench-e4b python -m hearth.cli bench --random e4b --contexts 512 --prefill 512 --out "$OUT/bench-e4b.md"
stage 90 bench-26b python -m hearth.cli bench --random 26b-a4b --contexts 512 --prefill 512 --out "$OUT/bench-26b-a4b.md"
elif [ "$PART" = final-h100 ]; then  # the evening's defaults: expert GeGLU check, parity, A/Bs, benches
stage 50 expert-geglu python benchmarks/gpu_expert_geglu.py
stage 80 parity python benchmarks/gpu_parity.py --out "$OUT/gpu_parity.md"
stage 90 ab-e4b python benchmarks/ab_decode.py --models e4b --variants base,attn-few-heads-off --rounds 3 --check --name e4b_few_heads
stage 110 ab-26b python benchmarks/ab_decode.py --models 26b-a4b --variants base,attn-few-heads-off,expert-gate-geglu-off,slot-sum-apart --rounds 3 --check --name 26b_evening_defaults
stage 70 bench-e4b python -m hearth.cli bench --random e4b --contexts 512 --prefill 4096 --out "$OUT/bench-e4b.md"
stage 70 bench-26b python -m hearth.cli bench --random 26b-a4b --contexts 512 --prefill 4096 --out "$OUT/bench-26b-a4b.md"
elif [ "$PART" = profiles ]; then  # where E4B's and 26B-A4B's decode steps go now; few-head tiles
stage 70 profile-e4b python benchmarks/gpu_profile_decode.py --model e4b --context 512
stage 80 profile-26b python benchmarks/gpu_profile_decode.py --model 26b-a4b --context 512
stage 140 ab-e4b-tiles python benchmarks/ab_decode.py --models e4b --variants base,attn-few-n32,attn-few-n16-w2,attn-few-n16-s2 --rounds 3 --check --name e4b_few_heads_tiles
elif [ "$PART" = after-1205 ]; then  # what 2026-12-05 left: GPU checks of the routing rewrite, A/Bs, benches
stage 60 tests python -m pytest -q -x tests/test_kernels_fused.py
stage 80 parity python benchmarks/gpu_parity.py --out "$OUT/gpu_parity.md"
stage 110 ab-26b-route python benchmarks/ab_decode.py --models 26b-a4b --variants base,route-w4 --rounds 3 --check --name 26b_route_warps
for m in e4b 26b-a4b gemma3-12b 31b; do
stage 90 bench-$m python -m hearth.cli bench --random $m --contexts 512 --prefill 4096 --out "$OUT/bench-$m.md"
done
elif [ "$PART" = headline2 ]; then  # the table on one machine: bf16, 4-bit, HF in the same run
stage 90 bench-12b python -m hearth.cli bench --random gemma3-12b --hf --contexts 512 --prefill 512,4096 --out "$OUT/bench-gemma3-12b.md"
stage 60 bench-12b-long python -m hearth.cli bench --random gemma3-12b --contexts 8192,32768 --prefill 512 --out "$OUT/bench-gemma3-12b-long.md"
stage 80 bench-e4b python -m hearth.cli bench --random e4b --hf --contexts 512 --prefill 512,4096 --out "$OUT/bench-e4b.md"
stage 60 bench-26b python -m hearth.cli bench --random 26b-a4b --contexts 512 --prefill 4096 --out "$OUT/bench-26b-a4b.md"
stage 90 bench-31b python -m hearth.cli bench --random 31b --contexts 512 --prefill 4096 --out "$OUT/bench-31b.md"
for m in gemma3-12b e4b 26b-a4b; do
stage 70 bench-$m-4bit python -m hearth.cli bench --random $m --quant 4bit --contexts 512 --prefill 4096 --out "$OUT/bench-$m-4bit.md"
done
elif [ "$PART" = headline3 ]; then  # headline2's rows the prefill fusions move (26B-A4B bf16 ran apart)
stage 90 bench-12b python -m hearth.cli bench --random gemma3-12b --hf --contexts 512 --prefill 512,4096 --out "$OUT/bench-gemma3-12b.md"
stage 80 bench-e4b python -m hearth.cli bench --random e4b --hf --contexts 512 --prefill 512,4096 --out "$OUT/bench-e4b.md"
stage 90 bench-31b python -m hearth.cli bench --random 31b --contexts 512 --prefill 4096 --out "$OUT/bench-31b.md"
stage 70 bench-26b-a4b-4bit python -m hearth.cli bench --random 26b-a4b --quant 4bit --contexts 512 --prefill 4096 --out "$OUT/bench-26b-a4b-4bit.md"
elif [ "$PART" = attn512 ]; then  # the split tiles' A/B (run 2026-12-06 on an H100: split adopted)
stage 130 ab-e4b-4k python benchmarks/ab_decode.py --models e4b --prefill 4096 --variants base,attn512-unsplit --check --name e4b_prefill4096_attn512
stage 150 ab-26b-4k python benchmarks/ab_decode.py --models 26b-a4b --prefill 4096 --variants base,attn512-unsplit --check --name 26b_prefill4096_attn512
stage 200 ab-31b-4k python benchmarks/ab_decode.py --models 31b --prefill 4096 --variants base,attn512-unsplit --check --name 31b_prefill4096_attn512
elif [ "$PART" = headline4 ]; then  # the table with today's defaults, HF beside (one call)
stage 90 bench-12b python -m hearth.cli bench --random gemma3-12b --hf --contexts 512 --prefill 512,4096 --out "$OUT/bench-gemma3-12b.md"
stage 80 bench-e4b python -m hearth.cli bench --random e4b --hf --contexts 512 --prefill 512,4096 --out "$OUT/bench-e4b.md"
stage 60 bench-26b python -m hearth.cli bench --random 26b-a4b --contexts 512 --prefill 4096 --out "$OUT/bench-26b-a4b.md"
stage 90 bench-31b python -m hearth.cli bench --random 31b --contexts 512 --prefill 4096 --out "$OUT/bench-31b.md"
for m in gemma3-12b 26b-a4b e4b; do
stage 70 bench-$m-4bit python -m hearth.cli bench --random $m --quant 4bit --contexts 512 --prefill 4096 --out "$OUT/bench-$m-4bit.md"
done
elif [ "$PART" = split-sum ]; then  # 4-bit K-split partials added by their own launch: A/Bs
stage 170 ab-12b-4bit python benchmarks/ab_decode.py --models gemma3-12b --quant 4bit --variants base,split-sum-launch --check --name 12b_4bit_split_sum
stage 150 ab-e4b-4bit python benchmarks/ab_decode.py --models e4b --quant 4bit --variants base,split-sum-launch --check --name e4b_4bit_split_sum
stage 150 ab-26b-4bit python benchmarks/ab_decode.py --models 26b-a4b --quant 4bit --variants base,split-sum-launch --check --name 26b_4bit_split_sum
elif [ "$PART" = split-sum-sweep ]; then  # the K-split launches again, now that splits sum apart
stage 200 sweep-12b python benchmarks/gpu_gemv_affine_sweep.py --only "12B qkv,12B o,12B down"
stage 80 ab-12b-4bit python benchmarks/ab_decode.py --models gemma3-12b --quant 4bit --variants base,gemv-json --check --name 12b_4bit_split_sum_sweep
cp "$OUT/gpu_gemv_affine_sweep_4bit.json" "$OUT/gpu_gemv_affine_sweep_4bit_12b.json"; cp "$OUT/gpu_gemv_affine_sweep_4bit.md" "$OUT/gpu_gemv_affine_sweep_4bit_12b.md"
stage 170 sweep-e4b python benchmarks/gpu_gemv_affine_sweep.py --shapes e4b --only "E4B qkv,E4B o,E4B down"
stage 80 ab-e4b-4bit python benchmarks/ab_decode.py --models e4b --quant 4bit --variants base,gemv-json --check --name e4b_4bit_split_sum_sweep
elif [ "$PART" = split-norm ]; then  # 4-bit o/down partials added by the norm kernel: A/Bs
stage 40 tests python -m pytest -q -x tests/test_kernels_fused.py -k partials
stage 170 ab-12b-4bit python benchmarks/ab_decode.py --models gemma3-12b --quant 4bit --variants base,split-norm-apart --check --name 12b_4bit_split_norm
stage 150 ab-e4b-4bit python benchmarks/ab_decode.py --models e4b --quant 4bit --variants base,split-norm-apart --check --name e4b_4bit_split_norm
stage 150 ab-26b-4bit python benchmarks/ab_decode.py --models 26b-a4b --quant 4bit --variants base,split-norm-apart --check --name 26b_4bit_split_norm
elif [ "$PART" = mlp-fusions ]; then  # 4-bit MLP launches fewer: norm order, GeGLU stores
stage 150 ab-12b-4bit python benchmarks/ab_decode.py --models gemma3-12b --quant 4bit --variants base,mlp-fusions-off,gate-up-geglu-off,norm-order-off --check --name 12b_4bit_mlp_fusions
stage 200 ab-e4b-4bit python benchmarks/ab_decode.py --models e4b --quant 4bit --variants base,mlp-fusions-off,gate-up-geglu-off,norm-order-off --check --name e4b_4bit_mlp_fusions
stage 150 ab-31b-4bit python benchmarks/ab_decode.py --models 31b --quant 4bit --variants base,mlp-fusions-off --check --name 31b_4bit_mlp_fusions
elif [ "$PART" = unrolled-experts ]; then  # 2026-12-06 (third session), measured on an H100
stage 150 experts python benchmarks/gpu_kernels_affine.py --experts
stage 300 gathered-sweep python benchmarks/gpu_gathered_gemv_sweep.py
stage 150 ab-26b-4bit python benchmarks/ab_decode.py --models 26b-a4b --quant 4bit --variants base,gathered-tile,short-rows-split --check --name 26b_4bit_unrolled_experts
stage 120 ab-12b-4bit python benchmarks/ab_decode.py --models gemma3-12b --quant 4bit --variants base,short-rows-split --check --name 12b_4bit_short_rows
stage 120 ab-e4b-4bit python benchmarks/ab_decode.py --models e4b --quant 4bit --variants base,short-rows-split --check --name e4b_4bit_short_rows
for m in gemma3-12b e4b 26b-a4b; do
stage 70 bench-$m-4bit python -m hearth.cli bench --random $m --quant 4bit --contexts 512 --prefill 4096 --out "$OUT/bench-$m-4bit.md"
done
elif [ "$PART" = embed4 ]; then  # packed token tables' rows by one kernel: 4-bit A/Bs
stage 150 ab-e4b-4bit python benchmarks/ab_decode.py --models e4b --quant 4bit --variants base,embed-torch --rounds 3 --check --name e4b_4bit_embed_kernel
stage 130 ab-12b-4bit python benchmarks/ab_decode.py --models gemma3-12b --quant 4bit --variants base,embed-torch --rounds 3 --check --name 12b_4bit_embed_kernel
stage 150 ab-26b-4bit python benchmarks/ab_decode.py --models 26b-a4b --quant 4bit --variants base,embed-torch --rounds 3 --check --name 26b_4bit_embed_kernel
elif [ "$PART" = rotary ]; then  # RoPE tables by one kernel (on since this ran, 2026-12-06): bits, A/Bs, GPU tests
stage 30 trig-bits python benchmarks/gpu_trig_bits.py
for spec in "e4b 4bit" "gemma3-12b 4bit" "26b-a4b 4bit" "e4b bf16" "gemma3-12b bf16"; do
set -- $spec
stage 90 ab-$1-$2 python benchmarks/ab_decode.py --models $1 --quant $2 --variants base,rotary-torch --rounds 3 --check --name ${1}_$2_rotary_kernel
done
stage 150 gpu-tests python -m pytest -q -x tests/test_static_cache.py tests/test_bench.py tests/test_gemma4_kernel_path.py
elif [ "$PART" = persistent ]; then  # run 2026-12-06 on an H100: barriers cost more than launches
stage 400 persistent python benchmarks/gpu_persistent_chain.py
elif [ "$PART" = grouped-sweep ]; then  # the MoE prefill's grouped matmul launches at 26B-A4B shapes
stage 80 profile-26b-prefill python benchmarks/gpu_profile_decode.py --model 26b-a4b --prefill 4096
stage 380 grouped-sweep python benchmarks/gpu_grouped_sweep.py
stage 100 bench-26b python -m hearth.cli bench --random 26b-a4b --contexts 512 --prefill 4096 --out "$OUT/bench-26b-a4b.md"
elif [ "$PART" = after-sweep ]; then  # the grouped matmul's new tall tile, end to end; 4-bit headline rows
stage 90 tests python -m pytest -q -x tests/test_kernels_grouped.py
stage 100 bench-26b python -m hearth.cli bench --random 26b-a4b --contexts 512 --prefill 1024,4096 --out "$OUT/bench-26b-a4b.md"
for m in 26b-a4b gemma3-12b e4b; do
stage 80 bench-$m-4bit python -m hearth.cli bench --random $m --quant 4bit --contexts 512 --prefill 4096 --out "$OUT/bench-$m-4bit.md"
done
elif [ "$PART" = mma-gluon ]; then  # what feeds the 4-bit GEMV: load-only floors, tensor-core GEMV
stage 100 load-patterns python benchmarks/gpu_gemv_load_patterns.py
stage 300 mma-gluon python benchmarks/gpu_gemv_affine_mma_gluon.py
stage 90 expert-geglu python benchmarks/gpu_expert_geglu.py
elif [ "$PART" = prefill-fusions ]; then  # fewer round trips of prefill intermediates
stage 150 grouped-geglu python benchmarks/gpu_grouped_geglu.py
stage 330 ab-26b-4k python benchmarks/ab_decode.py --models 26b-a4b --prefill 4096 --variants base,prefill-fusions-off,grouped-geglu-apart,prefill-slot-sum-apart,attn-out-head-major --check --name 26b_prefill4096_fusions
elif [ "$PART" = prefill-fusions2 ]; then
stage 60 grouped-geglu python benchmarks/gpu_grouped_geglu.py
stage 170 ab-26b-4bit-4k python benchmarks/ab_decode.py --models 26b-a4b --quant 4bit --prefill 4096 --variants base,prefill-fusions-off --check --name 26b_4bit_prefill4096_fusions
stage 150 ab-e4b-4k python benchmarks/ab_decode.py --models e4b --prefill 4096 --variants base,attn-out-head-major --check --name e4b_prefill4096_attn_out
stage 150 ab-12b-4k python benchmarks/ab_decode.py --models gemma3-12b --prefill 4096 --variants base,attn-out-head-major --check --name 12b_prefill4096_attn_out
stage 90 profile-26b-prefill python benchmarks/gpu_profile_decode.py --model 26b-a4b --prefill 4096
elif [ "$PART" = kernels ]; then
stage 120 tests python -m pytest -q -x tests/test_kernels_fused.py tests/test_static_cache.py tests/test_bench.py
stage 150 affine python benchmarks/gpu_kernels_affine.py
stage 60 gemv python benchmarks/gpu_gemv_bf16.py
stage 90 parity python benchmarks/gpu_parity.py --out "$OUT/gpu_parity.md"
stage 150 bench-12b python -m hearth.cli bench --random gemma3-12b --hf --out "$OUT/bench-gemma3-12b.md"
stage 120 bench-12b-4bit python -m hearth.cli bench --random gemma3-12b --quant 4bit --contexts 512,32768 --prefill 4096 --out "$OUT/bench-gemma3-12b-4bit.md"
else
stage 150 bench-12b-kv python -m hearth.cli bench --random gemma3-12b --kv-quant off,4,turbo:k8v3,turbo:k4v3 --contexts 8192,32768,131000 --prefill 512 --out "$OUT/bench-gemma3-12b-kv.md"
stage 120 bench-e4b python -m hearth.cli bench --random e4b --hf --contexts 512,8192 --prefill 512,4096 --out "$OUT/bench-e4b.md"
stage 120 bench-26b python -m hearth.cli bench --random 26b-a4b --contexts 512,8192 --prefill 512,4096 --out "$OUT/bench-26b-a4b.md"
stage 150 bench-31b python -m hearth.cli bench --random 31b --contexts 512,8192 --prefill 512,4096 --out "$OUT/bench-31b.md"
fi
