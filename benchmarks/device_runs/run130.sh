#!/usr/bin/env bash
# Run 130 (written 2026-12-06, thirty-fifth session): the tiled O's and down's residual asked for before the block's
# barrier (NOTES.md, "The tiled projections' residual asked for before the block's barrier"; not kept: to repeat it,
# `git apply benchmarks/results/logs/2026-12-06-mk-run130-tiled-residual-ahead.patch` first). One call:
#   RUN_LIMIT=SECONDS bash benchmarks/device_runs/run130.sh residual   (the single-matrix GPU cases of down and O
#                                                                       first; then the 8B MXFP4 step of the default
#                                                                       build (gate/up in tiles, untouched) and of O +
#                                                                       gate/up + down, then that one traced)
# A part is skipped when the call's time left (RUN_LIMIT, default 430 s) is too short for it.
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:-residual}
source benchmarks/device_runs/lib.sh run130 "$phase"

case $phase in
  residual)
    log build
    python3 benchmarks/build_variants.py gate_up gate_up,down gate_up,o o,gate_up,down >"$work/build.log" 2>&1
    grep -E "FAILED|rror" "$work/build.log" | cut -c1-300
    log tests
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 run_tests gpu-tests-single-matrix 110 -n 3 tests/test_megakernel_gpu.py \
      -k "tiled_single_matrix and not qkv"
    log steps
    fits 50 "the default step" && LITHOS_TILES=gate_up bench mxfp4-gate_up 60 --shape llama-3.1-8b \
      --weight-format mxfp4 --kernels megakernel
    fits 50 "the O + gate/up + down step" && LITHOS_TILES=o,gate_up,down bench mxfp4-o-gate_up-down 60 \
      --shape llama-3.1-8b --weight-format mxfp4 --kernels megakernel
    fits 40 "its trace" && LITHOS_TILES=o,gate_up,down LITHOS_MEGAKERNEL_TRACE="$work/trace.json" timeout 45 \
      "${lithos[@]}" bench --shape llama-3.1-8b --context 1024 --weight-format mxfp4 --kernels megakernel --steps 32 \
      --runs 1 >"$work/trace-bench.log" 2>&1 && python3 -m lithos.custom_calls.megakernel.trace "$work/trace.json" \
      >"$work/trace.log" 2>&1 && tail -8 "$work/trace.log"
    save ;;
  *) echo "usage: run130.sh [residual]"; exit 2 ;;
esac
log done
