#!/usr/bin/env bash
# Run 135 (written 2026-12-06, thirty-eighth session): the single-matrix tiled tasks' own one-token geometry
# (NOTES.md, "Chunks in flight in the single-matrix tiles"). On 8B a Q/K/V task holds 3 tiles and an O or down task 2,
# so at gate/up's (4 tiles a step, 1 step in flight) a warp has 2-3 chunks in flight where gate/up's has 8. This times
# (1, 4) and (2, 2) against the default, 8B MXFP4 at 1K, with Q/K/V + gate/up and with every group tiled; runs the
# single-matrix tiled GPU cases at one token in the (1, 4) build and the MXFP4 greedy generation in the default one
# (its Q/K/V in tiles since run 133); then traces the faster geometry with every group tiled and repeats the steps:
#   RUN_LIMIT=SECONDS bash benchmarks/device_runs/run135.sh [all|short]
# The knob was removed after the run (both geometries slower): apply
# benchmarks/results/logs/2026-12-06-h100-run135-single-tiles.patch first, or the defines build the default's code.
# `short`, for a call of under 6 minutes: the default build's MXFP4 greedy generation, then the default against (1, 4)
# with Q/K/V + gate/up and with every group tiled, once each, as far as the call's time goes.
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:-all}
source benchmarks/device_runs/lib.sh run135 "$phase"
declare -A geometry=([two]="LITHOS_MK_SINGLE_TILES=2 LITHOS_MK_SINGLE_DEPTH=2"
  [four]="LITHOS_MK_SINGLE_TILES=1 LITHOS_MK_SINGLE_DEPTH=4")
all=qkv,o,gate_up,down

# steps ROUND SECONDS CASE...: the 8B MXFP4 step of each case ("TILES [GEOMETRY]"), tagged with ROUND.
steps() {
  local round=$1 limit=$2 case tiles name tag
  shift 2
  for case in "$@"; do
    read -r tiles name <<<"$case"
    tag="mxfp4-${tiles//,/-}${name:+-$name}-$round"
    fits "$limit" "$tag" && LITHOS_KERNEL_DEFINES=${name:+${geometry[$name]}} LITHOS_TILES=$tiles bench "$tag" \
      "$limit" --shape llama-3.1-8b --weight-format mxfp4 --kernels megakernel
  done
}
generation="tests/test_megakernel_gpu.py::test_megakernel_greedy_generation_over_mxfp4_equals_reference[default-tiles]"
if [ "$phase" = short ]; then
  log build
  python3 benchmarks/build_variants.py qkv,gate_up >"$work/build.log" 2>&1 &
  LITHOS_KERNEL_DEFINES=${geometry[four]} python3 benchmarks/build_variants.py qkv,gate_up $all \
    >"$work/build-four.log" 2>&1
  wait
  grep -E "FAILED|rror" "$work"/build*.log | cut -c1-300
  log tests
  fits 60 "the generation test" && run_tests gpu-tests-default 100 "$generation"
  log steps
  steps short 55 "qkv,gate_up" "qkv,gate_up four" "$all four"
  log done
  exit 0
fi
log build
python3 benchmarks/build_variants.py qkv,gate_up >"$work/build.log" 2>&1 &
LITHOS_KERNEL_DEFINES=${geometry[two]} python3 benchmarks/build_variants.py $all >"$work/build-two.log" 2>&1 &
LITHOS_KERNEL_DEFINES=${geometry[four]} python3 benchmarks/build_variants.py qkv,gate_up $all gate_up,down gate_up,o \
  gate_up,qkv >"$work/build-four.log" 2>&1
wait
grep -E "FAILED|rror" "$work"/build*.log | cut -c1-300
cases=("qkv,gate_up" "qkv,gate_up four" "$all four" "$all two")
log steps
steps 1 60 "${cases[@]}"
log tests
tests=()
for c in down-llama-3.2-1b-1 down-llama-3.1-8b-1 down-smollm2-like-1 down-smollm2-like--1 o-llama-3.1-8b-1 \
  o-smollm2-like--1 qkv-llama-3.2-1b-1 qkv-llama-3.1-8b-1 qkv-smollm2-like--1; do
  tests+=("tests/test_megakernel_gpu.py::test_tiled_single_matrix_megakernel_equals_interpreter[$c]")
done
if fits 150 "the GPU cases"; then
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 run_tests gpu-tests-default 150 "$generation" &
  LITHOS_KERNEL_DEFINES=${geometry[four]} XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 run_tests gpu-tests-four 150 -n 3 \
    "${tests[@]}"
  wait
fi
log trace
# The faster geometry with every group tiled, by its first round's step (the table's fifth column).
step() { awk '/^llama/ {print $5}' "$work/run135-mxfp4-qkv-o-gate_up-down-$1-1.log"; }
best=$(printf '%s %s\n' "$(step two)" two "$(step four)" four | sort -n | head -1 | cut -d' ' -f2)
fits 150 "the traced step ($best)" && LITHOS_KERNEL_DEFINES=${geometry[$best]} TAG_SUFFIX=-$best mxfp4_step $all
log steps
steps 2 60 "${cases[@]}"
log done
