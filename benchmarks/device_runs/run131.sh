#!/usr/bin/env bash
# Run 131 (written 2026-12-06, thirty-fifth session, for the next device session): the tiled tasks' barrier mark
# (NOTES.md, after run 130: "The trace did not say which of the two it is") first on a GPU, and what it says of the
# tiled epilogue. One call:
#   RUN_LIMIT=SECONDS bash benchmarks/device_runs/run131.sh barrier   (the trace GPU tests, the bf16 build's and the
#                                                                      tiled build's; then the 8B MXFP4 step with O,
#                                                                      gate/up and down in tiles, timed and traced,
#                                                                      beside the default, timed)
# A part is skipped when the call's time left (RUN_LIMIT, default 430 s) is too short for it.
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:-barrier}
source benchmarks/device_runs/lib.sh run131 "$phase"

case $phase in
  barrier)
    log build
    python3 benchmarks/build_variants.py gate_up gate_up,down o,gate_up,down >"$work/build.log" 2>&1
    grep -E "FAILED|rror" "$work/build.log" | cut -c1-300
    log tests
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 run_tests gpu-tests-trace 150 -n 3 tests/test_megakernel_gpu.py -k trace
    log steps
    fits 60 "the default step" && LITHOS_TILES=gate_up bench mxfp4-gate_up 60 --shape llama-3.1-8b \
      --weight-format mxfp4 --kernels megakernel
    fits 90 "the O + gate/up + down step, traced" && mxfp4_step o,gate_up,down ;;
  *) echo "usage: run131.sh [barrier]"; exit 2 ;;
esac
log done
