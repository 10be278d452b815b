#!/usr/bin/env bash
# Run 131 (written 2026-12-06, thirty-fifth session, for the next device session): the tiled tasks' barrier mark
# (NOTES.md, after run 130: "The trace did not say which of the two it is") first on a GPU, and what it says of the
# tiled epilogue. One call:
#   RUN_LIMIT=SECONDS bash benchmarks/device_runs/run131.sh barrier   (the trace GPU tests, the bf16 build's and the
#                                                                      tiled build's; then the 8B MXFP4 step with O,
#                                                                      gate/up and down in tiles, timed and traced,
#                                                                      beside the default, timed)
#   RUN_LIMIT=SECONDS bash benchmarks/device_runs/run131.sh ahead     (the attention's second step's keys during the
#                                                                      wait, LITHOS_MK_ATTN_SECOND_AHEAD=1 (NOTES.md,
#                                                                      "The second step's keys during the wait"): the
#                                                                      bf16 megakernel's GPU cases and the ring's in
#                                                                      that build; then the 8B and 1B bf16 steps and
#                                                                      the 8B MXFP4 step, default and define
#                                                                      alternating, and a traced 8B step of each)
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
  ahead)
    ahead="LITHOS_MK_ATTN_SECOND_AHEAD=1"
    log build
    python3 benchmarks/build_variants.py gate_up >"$work/build.log" 2>&1 &
    LITHOS_KERNEL_DEFINES=$ahead python3 benchmarks/build_variants.py gate_up >"$work/build-ahead.log" 2>&1
    wait
    grep -E "FAILED|rror" "$work"/build*.log | cut -c1-300
    log tests
    LITHOS_KERNEL_DEFINES=$ahead XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 run_tests gpu-tests-ahead 200 -n 3 \
      tests/test_megakernel_gpu.py tests/test_ring_cache_gpu.py -k "megakernel and not packed and not tiled"
    log steps
    for round in 1 2; do
      for defines in "" "$ahead"; do
        fits 60 "the bf16 steps ($defines)" && LITHOS_KERNEL_DEFINES=$defines bench \
          "bf16${defines:+-ahead}-$round" 60 --shape llama-3.2-1b --shape llama-3.1-8b --kernels megakernel
      done
    done
    for defines in "" "$ahead"; do
      fits 60 "the MXFP4 step ($defines)" && LITHOS_KERNEL_DEFINES=$defines bench "mxfp4${defines:+-ahead}" 60 \
        --shape llama-3.1-8b --weight-format mxfp4 --kernels megakernel
    done
    for defines in "" "$ahead"; do
      fits 40 "a traced 8B step ($defines)" && LITHOS_KERNEL_DEFINES=$defines \
        LITHOS_MEGAKERNEL_TRACE="$work/trace${defines:+-ahead}.json" timeout 40 "${lithos[@]}" bench \
        --shape llama-3.1-8b --context 1024 --kernels megakernel --steps 32 --runs 1 >/dev/null 2>&1 &&
        python3 -m lithos.custom_calls.megakernel.trace "$work/trace${defines:+-ahead}.json" \
          >"$work/trace${defines:+-ahead}.log" 2>&1 && grep -E "^attention" "$work/trace${defines:+-ahead}.log"
    done
    save ;;
  *) echo "usage: run131.sh [barrier|ahead]"; exit 2 ;;
esac
log done
