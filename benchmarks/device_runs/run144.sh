#!/usr/bin/env bash
# Run 144 (written 2026-12-07, forty-eighth session): the one-token O projection's chunks asked for after its wait
# (LITHOS_MK_O_LATE_FILL=1, "late"; NOTES.md, "The one-token O projection's chunks after its wait") against the
# default, both MXFP4 shapes: a pair of steps, one traced 8B step of each, the variant's one-token O cases and MXFP4
# greedy generation, then a second pair in the time left. One-token libraries alone (BUILD_TOKENS=1).
#   RUN_LIMIT=SECONDS bash benchmarks/device_runs/run144.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/device_runs/lib.sh run144 late
unset LITHOS_TILES  # the default layout: every MXFP4 group tiled (run 143)
declare -A defines=([late]="LITHOS_MK_O_LATE_FILL=1")
export BUILD_TOKENS=1
nvidia-smi --query-gpu=name --format=csv,noheader
build_all late
steps_pair() {
  local name
  for name in "" late; do
    fits 75 "the step pair (${name:-default}, $1)" && LITHOS_KERNEL_DEFINES=${name:+${defines[$name]}} \
      bench "step-mxfp4-${name:-default}-$1" 75 --shape llama-3.2-1b --shape llama-3.1-8b --weight-format mxfp4 \
      --kernels megakernel
  done
}
log steps
steps_pair 1
log trace
for name in "" late; do
  fits 60 "the traced step (${name:-default})" && LITHOS_KERNEL_DEFINES=${name:+${defines[$name]}} \
    traced "step-8b-mxfp4-${name:-default}" 60 --shape llama-3.1-8b --weight-format mxfp4 --kernels megakernel \
    --steps 32 --runs 1
done
log tests
gpu=tests/test_megakernel_gpu.py single=test_tiled_single_matrix_megakernel_equals_interpreter
fits 100 "the GPU cases (late)" && LITHOS_KERNEL_DEFINES=${defines[late]} XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 \
  run_tests gpu-tests-late 120 -n 3 -rA "$gpu::test_megakernel_greedy_generation_over_mxfp4_equals_reference" \
  "$gpu::$single[o-llama-3.1-8b-1]" "$gpu::$single[o-smollm2-like--1]"
log steps
steps_pair 2
log done
