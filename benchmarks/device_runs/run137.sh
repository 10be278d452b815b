#!/usr/bin/env bash
# Run 137 (written 2026-12-06, fortieth session): the LM head of the 4-16-token kernels in the 16-row layout
# (LITHOS_MK_WIDE_HEAD; NOTES.md, "The LM head of the 4-16-token kernels in the 16-row layout"), and the first rounds
# timed in the layout speculative decoding now reads by default (every MXFP4 group in tiles: Model.round_params).
#   RUN_LIMIT=SECONDS bash benchmarks/device_runs/run137.sh [all|rounds|mini]
# `all`: the builds (the define off and on), the 4-16-token GPU cases in the build with it, the 8B MXFP4, 8B bf16 and
# 1B MXFP4 rounds once in each build, a traced 8B MXFP4 verification step with it. `rounds`: the rounds again, then
# the one-token steps (the define leaves the one-token kernel as it was). `mini`, for a call of about 4 minutes: the
# two MXFP4 builds with every group tiled and the 8B MXFP4 round in each, alternating.
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:-all}
source benchmarks/device_runs/lib.sh run137 "$phase"
unset LITHOS_TILES  # the default layouts: Q/K/V + gate/up for steps, every group for rounds
wide="LITHOS_MK_WIDE_HEAD=1"
spec=(--spec ngram --no-acceptance --kernels megakernel)
# rounds ROUND: the 8B MXFP4 (k = 7), 8B bf16 (k = 7) and 1B MXFP4 (k = 15) rounds, the default build then the wide
# head's, tagged with ROUND.
rounds() {
  local name
  for name in "" wide; do
    fits 60 "the 8B MXFP4 round ($name)" && LITHOS_KERNEL_DEFINES=${name:+$wide} bench \
      "round-8b-mxfp4${name:+-$name}-$1" 60 "${spec[@]}" --draft-tokens 7 --shape llama-3.1-8b --weight-format mxfp4
    fits 60 "the 8B bf16 round ($name)" && LITHOS_KERNEL_DEFINES=${name:+$wide} bench \
      "round-8b-bf16${name:+-$name}-$1" 60 "${spec[@]}" --draft-tokens 7 --shape llama-3.1-8b
    fits 45 "the 1B MXFP4 round ($name)" && LITHOS_KERNEL_DEFINES=${name:+$wide} bench \
      "round-1b-mxfp4${name:+-$name}-$1" 45 "${spec[@]}" --draft-tokens 15 --shape llama-3.2-1b --weight-format mxfp4
  done
}
if [ "$phase" = mini ]; then  # a call of about 4 minutes: the 8B MXFP4 round alone, alternating
  log build
  python3 benchmarks/build_variants.py qkv,o,gate_up,down >"$work/build.log" 2>&1 &
  LITHOS_KERNEL_DEFINES=$wide python3 benchmarks/build_variants.py qkv,o,gate_up,down >"$work/build-wide.log" 2>&1
  wait
  grep -E "FAILED|rror" "$work"/build*.log | cut -c1-300
  log rounds
  for round in 1 2; do
    for name in "" wide; do
      fits 40 "the 8B MXFP4 round ($name)" && LITHOS_KERNEL_DEFINES=${name:+$wide} bench \
        "mini-round-8b-mxfp4${name:+-$name}-$round" 40 "${spec[@]}" --draft-tokens 7 --shape llama-3.1-8b \
        --weight-format mxfp4
    done
  done
  log done
  exit 0
fi
log build
python3 benchmarks/build_variants.py qkv,gate_up qkv,o,gate_up,down >"$work/build.log" 2>&1 &
LITHOS_KERNEL_DEFINES=$wide python3 benchmarks/build_variants.py qkv,o,gate_up,down >"$work/build-wide.log" 2>&1
wait
grep -E "FAILED|rror" "$work"/build*.log | cut -c1-300
if [ "$phase" = rounds ]; then
  log rounds
  rounds 2
  log steps
  for name in "" wide; do
    fits 45 "the steps ($name)" && LITHOS_KERNEL_DEFINES=${name:+$wide} bench "steps${name:+-$name}" 45 \
      --shape llama-3.2-1b --shape llama-3.1-8b --weight-format mxfp4 --kernels megakernel
  done
  log done
  exit 0
fi
log tests
# The head of every 4-16-token kernel the GPU cases build: bf16 (two shapes, head dimension 256), MXFP4 in the
# default tiles, and greedy generation with verification rounds (bf16 and MXFP4).
cases=(
  "tests/test_megakernel_gpu.py::test_megakernel_equals_interpreter[4-smollm2-like]"
  "tests/test_megakernel_gpu.py::test_megakernel_equals_interpreter[16-smollm2-like]"
  "tests/test_megakernel_gpu.py::test_megakernel_equals_interpreter[16-llama-3.2-1b]"
  "tests/test_megakernel_gpu.py::test_megakernel_equals_interpreter_with_head_dim_256[1000-16]"
  "tests/test_megakernel_gpu.py::test_tiled_single_matrix_megakernel_equals_interpreter[down-llama-3.1-8b-8]"
  "tests/test_megakernel_gpu.py::test_megakernel_greedy_generation_equals_reference[llama_hd64]"
  "tests/test_megakernel_gpu.py::test_megakernel_greedy_generation_over_mxfp4_equals_reference[default-tiles]"
)
fits 130 "the GPU cases" && LITHOS_KERNEL_DEFINES=$wide XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 run_tests gpu-tests-wide \
  120 -n 3 -rA "${cases[@]}"
log rounds
rounds 1
log trace
fits 80 "the traced round" && LITHOS_KERNEL_DEFINES=$wide traced round-8b-mxfp4-wide 80 "${spec[@]}" --draft-tokens 7 \
  --shape llama-3.1-8b --weight-format mxfp4 --steps 32 --runs 1
log done
