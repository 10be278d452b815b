#!/usr/bin/env bash
# Run 128 (written 2026-12-06, thirty-fourth session): the tree's health on a GPU and its headline figures, then
# where the 8B MXFP4 step loses with down in fragment tiles (run 119: +11%, not yet traced). Two calls:
#   RUN_LIMIT=SECONDS bash benchmarks/device_runs/run128.sh health   (the bf16 1B and 8B steps at 1K on every path,
#                                                                     one bench call; then the GPU tests of the bf16
#                                                                     fused kernels, the ring and FP8 caches and the
#                                                                     bf16 megakernel, last run in runs 60-65)
#   RUN_LIMIT=SECONDS bash benchmarks/device_runs/run128.sh mxfp4    (the 8B MXFP4 megakernel step traced with gate/up
#                                                                     in tiles (the default) and with gate/up and down,
#                                                                     each timed untraced too; the fused MXFP4 step;
#                                                                     then the packed and tiled megakernel GPU tests)
#   RUN_LIMIT=SECONDS bash benchmarks/device_runs/run128.sh depth    (the down-tiles step, traced, in the default
#                                                                     (4, 1) build and with two steps of two tiles in
#                                                                     flight a warp)
# A part is skipped when the call's time left (RUN_LIMIT, default 430 s) is too short for it.
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:-health}
source benchmarks/device_runs/lib.sh run128 "$phase"
depth="LITHOS_MK_TILE_PAIRS=2 LITHOS_MK_TILE_DEPTH=2"

case $phase in
  health)
    log build
    python3 -m lithos.custom_calls.build --kernel matvec --kernel qkv_rope --kernel lm_head --kernel attention \
      --kernel qk_norm_rope --kernel megakernel >"$work/build.log" 2>&1 || tail -5 "$work/build.log"
    log bench
    bench bf16 300 --shape llama-3.2-1b --shape llama-3.1-8b --kernels reference,fused,megakernel
    log tests
    fits 120 "the fused kernels' tests" && run_tests gpu-tests-fused 200 -n 3 tests/test_custom_calls_gpu.py \
      tests/test_ring_cache_gpu.py tests/test_kv_fp8_gpu.py
    fits 60 "the megakernel's tests" && XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 run_tests gpu-tests-megakernel \
      "$((run_limit - (SECONDS - run_start) - 10))" -n 3 tests/test_megakernel_gpu.py \
      -k "not packed and not tiled and not mxfp4" ;;
  mxfp4)
    log build
    python3 benchmarks/build_variants.py gate_up gate_up,down >"$work/build.log" 2>&1
    grep -E "FAILED|rror" "$work/build.log" | cut -c1-300
    log steps
    mxfp4_step gate_up
    fits 150 "the down-tiles step" && mxfp4_step gate_up,down
    fits 90 "the fused step" && bench mxfp4-fused 90 --shape llama-3.1-8b --weight-format mxfp4 --kernels fused
    fits 90 "the packed megakernel's tests" && XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 run_tests gpu-tests-mk-mxfp4 \
      "$((run_limit - (SECONDS - run_start) - 10))" -n 3 tests/test_megakernel_gpu.py -k "tiled or mxfp4" ;;
  depth)
    # Down's tiles with two steps of two tiles in flight a warp (LITHOS_MK_TILE_PAIRS=2 LITHOS_MK_TILE_DEPTH=2, every
    # tiled kind: gate/up's too) beside the default (4, 1): whether down's tiled task waits on its loads in flight.
    log build
    python3 benchmarks/build_variants.py gate_up,down >"$work/build.log" 2>&1 &
    LITHOS_KERNEL_DEFINES="$depth" python3 benchmarks/build_variants.py gate_up,down >"$work/build-depth.log" 2>&1
    wait
    grep -E "FAILED|rror" "$work"/build*.log | cut -c1-300
    log steps
    mxfp4_step gate_up,down
    LITHOS_KERNEL_DEFINES="$depth" TAG_SUFFIX=-r2d2 mxfp4_step gate_up,down ;;
  *) echo "usage: run128.sh [health|mxfp4|depth]"; exit 2 ;;
esac
log done
