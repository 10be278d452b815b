#!/usr/bin/env bash
# Run 137 (written 2026-12-06, fortieth session): three changes to the 4-16-token kernels, measured in the layouts the
# verification rounds now read by default (every MXFP4 group in tiles: Model.round_params):
#   wide     LITHOS_MK_WIDE_HEAD=1, the LM head in the 16-row layout (NOTES.md, "The LM head of the 4-16-token
#            kernels in the 16-row layout")
#   combine  LITHOS_MK_COMBINE_VEC=4, the attention's combine four elements a thread (NOTES.md, "The attention's
#            combine four elements a thread")
#   stage    LITHOS_MK_STAGE_STEPS=1, the tiled gate/up's B staged a k-step a thread (NOTES.md, "The 2-16-token
#            gate/up B staged a k-step a thread"; MXFP4 builds only)
#   every    the three together
#   RUN_LIMIT=SECONDS bash benchmarks/device_runs/run137.sh [all|rounds|mini]
# `all`: the builds, the 1-16-token GPU cases in the build with every change, the 8B MXFP4 round in the default
# build and in each build of a change, a traced 8B MXFP4 verification step in the build with every change. `rounds`:
# the 1B MXFP4 round and a second 8B MXFP4 round in each build, the 8B bf16 round in the default, wide and combine
# builds, then the one-token steps of the default and of every change. `mini`, for a call of about 4 minutes: the
# MXFP4 builds with every group tiled, default and every change, and the 8B MXFP4 round in each, alternating.
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:-all}
source benchmarks/device_runs/lib.sh run137 "$phase"
unset LITHOS_TILES  # the default layouts: Q/K/V + gate/up for steps, every group for rounds
declare -A defines=([wide]="LITHOS_MK_WIDE_HEAD=1" [combine]="LITHOS_MK_COMBINE_VEC=4" [stage]="LITHOS_MK_STAGE_STEPS=1"
  [every]="LITHOS_MK_WIDE_HEAD=1 LITHOS_MK_COMBINE_VEC=4 LITHOS_MK_STAGE_STEPS=1")
spec=(--spec ngram --no-acceptance --kernels megakernel)
# build NAME TILES...: build_variants.py of the MXFP4 layouts TILES (and the bf16 build) with NAME's defines.
build() {
  local name=$1
  shift
  LITHOS_KERNEL_DEFINES=${name:+${defines[$name]}} python3 benchmarks/build_variants.py "$@" \
    >"$work/build${name:+-$name}.log" 2>&1
}
log build
if [ "$phase" = mini ]; then
  build "" qkv,o,gate_up,down &
  build every qkv,o,gate_up,down
  wait
  grep -E "FAILED|rror" "$work"/build*.log | cut -c1-300
  log rounds
  spec_round 8b-mxfp4 mini-1 "" every
  spec_round 8b-mxfp4 mini-2 "" every
  log done
  exit 0
fi
build "" qkv,gate_up qkv,o,gate_up,down &
build wide qkv,o,gate_up,down &
build combine qkv,o,gate_up,down &
build stage qkv,o,gate_up,down &
build every qkv,gate_up qkv,o,gate_up,down gate_up gate_up,down  # the last two: the GPU cases' layouts
wait
grep -E "FAILED|rror" "$work"/build*.log | cut -c1-300
if [ "$phase" = rounds ]; then
  log rounds
  spec_round 1b-mxfp4 1 "" wide combine stage every
  spec_round 8b-mxfp4 2 "" wide combine stage every
  spec_round 8b-bf16 1 "" wide combine
  log steps
  for name in "" every; do
    fits 45 "the steps (${name:-default})" && LITHOS_KERNEL_DEFINES=${name:+${defines[$name]}} bench \
      "steps${name:+-$name}" 45 --shape llama-3.2-1b --shape llama-3.1-8b --weight-format mxfp4 --kernels megakernel
  done
  log done
  exit 0
fi
log tests
# The head and the combine of every 4-16-token kernel the GPU cases build (bf16: two shapes, head dimension 256; MXFP4:
# gate/up tiled at 4-16 tokens, down at 8), the one-token combine, and greedy generation with verification rounds
# (bf16 and MXFP4).
gpu=tests/test_megakernel_gpu.py
cases=(
  "$gpu::test_megakernel_equals_interpreter[1-smollm2-like]"
  "$gpu::test_megakernel_equals_interpreter[4-smollm2-like]"
  "$gpu::test_megakernel_equals_interpreter[16-smollm2-like]"
  "$gpu::test_megakernel_equals_interpreter[16-llama-3.2-1b]"
  "$gpu::test_megakernel_equals_interpreter_with_head_dim_256[1000-16]"
  "$gpu::test_tiled_gate_up_megakernel_equals_interpreter[narrow-4]"
  "$gpu::test_tiled_gate_up_megakernel_equals_interpreter[llama-3.1-8b-8]"
  "$gpu::test_tiled_gate_up_megakernel_equals_interpreter[llama-3.2-1b-16]"
  "$gpu::test_tiled_gate_up_megakernel_equals_interpreter[smollm2-like--4]"
  "$gpu::test_tiled_single_matrix_megakernel_equals_interpreter[down-llama-3.1-8b-8]"
  "$gpu::test_megakernel_greedy_generation_equals_reference[llama_hd64]"
  "$gpu::test_megakernel_greedy_generation_over_mxfp4_equals_reference[default-tiles]"
)
fits 160 "the GPU cases" && LITHOS_KERNEL_DEFINES=${defines[every]} XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 run_tests \
  gpu-tests-every 150 -n 3 -rA "${cases[@]}"
log rounds
spec_round 8b-mxfp4 1 "" wide combine stage every
log trace
fits 80 "the traced round" && LITHOS_KERNEL_DEFINES=${defines[every]} traced round-8b-mxfp4-every 80 "${spec[@]}" \
  --draft-tokens 7 --shape llama-3.1-8b --weight-format mxfp4 --steps 32 --runs 1
log done
