#!/usr/bin/env bash
# Run 143 (written 2026-12-07, forty-sixth session): what making LITHOS_MK_TILE_RING=1 the default waits for (NOTES.md,
# "Run 142 measured"). The ring build's GPU cases, with the layouts they read built first (run 142's tests compiled
# them one by one and ran out of time), and the one-token step the change would make the default (every group tiled,
# through the ring) against today's (Q/K/V + gate/up tiled, registers) on both shapes.
#   RUN_LIMIT=SECONDS bash benchmarks/device_runs/run143.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/device_runs/lib.sh run143 all
unset LITHOS_TILES  # the default layouts: Q/K/V + gate/up for steps, every group for rounds
declare -A defines=([ring]="LITHOS_MK_TILE_RING=1")
gpu=tests/test_megakernel_gpu.py
single=test_tiled_single_matrix_megakernel_equals_interpreter
# Q/K/V and O through the ring at 1-16 tokens (run 142 passed down's), and the engine's greedy generation in MXFP4.
cases=(
  "$gpu::test_megakernel_greedy_generation_over_mxfp4_equals_reference"
  "$gpu::$single[qkv-llama-3.1-8b-1]"
  "$gpu::$single[qkv-llama-3.2-1b-1]"
  "$gpu::$single[qkv-smollm2-like-3]"
  "$gpu::$single[qkv-llama-3.1-8b-8]"
  "$gpu::$single[qkv-llama-3.2-1b-16]"
  "$gpu::$single[qkv-smollm2-like--1]"
  "$gpu::$single[o-llama-3.1-8b-1]"
  "$gpu::$single[o-smollm2-like-4]"
  "$gpu::$single[o-llama-3.2-1b-16]"
  "$gpu::$single[o-smollm2-like--1]"
)
log build
# The single-matrix cases read gate/up plus their group in tiles.
build_variant "" &
build_variant ring gate_up,qkv gate_up,o gate_up,down &
wait
grep -E "FAILED|rror" "$work"/build*.log | cut -c1-300
log steps
# The one-token step: the default build in its layout, then the ring build with every group tiled; 1B and 8B.
fits 120 "the default step" && bench step-mxfp4 120 --shape llama-3.2-1b --shape llama-3.1-8b --weight-format mxfp4 \
  --kernels megakernel
fits 120 "the ring's all-tiles step" && LITHOS_KERNEL_DEFINES=${defines[ring]} LITHOS_TILES=qkv,o,gate_up,down \
  bench step-mxfp4-all-tiles-ring 120 --shape llama-3.2-1b --shape llama-3.1-8b --weight-format mxfp4 \
  --kernels megakernel
log tests
fits 120 "the GPU cases (ring)" && LITHOS_KERNEL_DEFINES=${defines[ring]} XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 \
  run_tests gpu-tests-ring $(($(seconds_left) - 10)) -n 3 -rA "${cases[@]}"
log done
