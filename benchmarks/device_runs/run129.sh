#!/usr/bin/env bash
# Run 129 (written 2026-12-06, thirty-fifth session): tiled O's and down's one-token activations staged once in the
# ring's memory (commit 6d0e6a9, StagedActivations), first on a GPU. Two calls:
#   RUN_LIMIT=SECONDS bash benchmarks/device_runs/run129.sh staged   (its GPU cases first: every single tiled matrix
#                                                                     against the interpreter; then the 8B MXFP4 step
#                                                                     with gate/up in tiles (the default) and with
#                                                                     gate/up and down, each timed and traced; then
#                                                                     the other tiled and MXFP4 megakernel cases)
#   RUN_LIMIT=SECONDS bash benchmarks/device_runs/run129.sh bf16     (issue 4's figures: the bf16 1B and 8B steps at
#                                                                     1K on every path, one bench call, and the 1B
#                                                                     megakernel and fused steps twice more; then the
#                                                                     trace's GPU test, which now reads the weights'
#                                                                     formats from the record)
# A part is skipped when the call's time left (RUN_LIMIT, default 430 s) is too short for it.
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:-staged}
source benchmarks/device_runs/lib.sh run129 "$phase"

case $phase in
  staged)
    log build
    python3 benchmarks/build_variants.py gate_up gate_up,down gate_up,o gate_up,qkv o,gate_up,down >"$work/build.log" 2>&1
    grep -E "FAILED|rror" "$work/build.log" | cut -c1-300
    log tests
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 run_tests gpu-tests-single-matrix 200 -n 3 tests/test_megakernel_gpu.py \
      -k tiled_single_matrix
    log steps
    mxfp4_step gate_up
    fits 150 "the down-tiles step" && mxfp4_step gate_up,down
    fits 150 "the O-and-down-tiles step" && mxfp4_step o,gate_up,down
    fits 90 "the other tiled and MXFP4 cases" && XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 run_tests gpu-tests-mk-mxfp4 \
      "$((run_limit - (SECONDS - run_start) - 10))" -n 3 tests/test_megakernel_gpu.py \
      -k "(tiled or mxfp4) and not tiled_single_matrix" ;;
  bf16)
    log build
    python3 -m lithos.custom_calls.build --kernel matvec --kernel qkv_rope --kernel lm_head --kernel attention \
      --kernel megakernel >"$work/build.log" 2>&1 || tail -5 "$work/build.log"
    log bench
    bench bf16 300 --shape llama-3.2-1b --shape llama-3.1-8b --kernels reference,fused,megakernel
    for repeat in 1 2; do
      fits 60 "repeat $repeat" && bench "bf16-1b-repeat$repeat" 90 --shape llama-3.2-1b --kernels fused,megakernel
    done
    fits 60 "the trace's test" && run_tests gpu-tests-trace 90 tests/test_megakernel_gpu.py -k trace_records ;;
  *) echo "usage: run129.sh [staged|bf16]"; exit 2 ;;
esac
log done
