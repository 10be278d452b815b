#!/usr/bin/env bash
# Run 142 (written 2026-12-07, forty-fourth session; the one-token kernel's tiles added in the forty-fifth): the
# tiled single-matrix tasks' chunks through the lane ring (LITHOS_MK_TILE_RING=1, "ring"; NOTES.md, "The tiled loops'
# chunks through the lane ring") against the default.
#   RUN_LIMIT=SECONDS bash benchmarks/device_runs/run142.sh [all|rounds]
# `all`: the two builds (both layouts `lithos bench --spec` reads), the 8B and 1B MXFP4 rounds in each, the GPU cases
# in the ring build. `rounds`: the 8B MXFP4 round again in each build, a traced 8B MXFP4 round in the ring build, the
# one-token steps in each (each round's table gives them: Q/K/V tiled through the ring in that build), the 8B MXFP4
# step with every group tiled in each (the bf16 build's kernels are the same in both: no tiles).
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:-all}
source benchmarks/device_runs/lib.sh run142 "$phase"
unset LITHOS_TILES  # the default layouts: Q/K/V + gate/up for steps, every group for rounds
declare -A defines=([ring]="LITHOS_MK_TILE_RING=1")
gpu=tests/test_megakernel_gpu.py
# The ring pipeline at 1-16 tokens: Q/K/V (two-part B, rotary tiles), O and down, one and several n-blocks, spread
# scales, the odd shape; the engine's greedy generation with verification rounds in MXFP4 (every group tiled).
single=test_tiled_single_matrix_megakernel_equals_interpreter
cases=(
  "$gpu::test_megakernel_greedy_generation_over_mxfp4_equals_reference[default-tiles]"
  "$gpu::$single[qkv-llama-3.1-8b-1]"
  "$gpu::$single[down-llama-3.1-8b-1]"
  "$gpu::$single[down-llama-3.1-8b-8]"
  "$gpu::$single[down-llama-3.2-1b-16]"
  "$gpu::$single[down-smollm2-like--16]"
  "$gpu::$single[o-llama-3.1-8b-1]"
  "$gpu::$single[o-smollm2-like-4]"
  "$gpu::$single[o-llama-3.2-1b-16]"
  "$gpu::$single[qkv-smollm2-like-3]"
  "$gpu::$single[qkv-llama-3.1-8b-8]"
  "$gpu::$single[qkv-llama-3.2-1b-16]"
)
build_all ring
if [ "$phase" = rounds ]; then
  log rounds
  spec_round 8b-mxfp4 2 "" ring
  log trace
  fits 80 "the traced round (ring)" && LITHOS_KERNEL_DEFINES=${defines[ring]} traced round-8b-mxfp4-ring 80 --spec \
    ngram --no-acceptance --kernels megakernel --draft-tokens 7 --shape llama-3.1-8b --weight-format mxfp4 --steps 32 \
    --runs 1
  # The 8B MXFP4 step with every group tiled (O and down too: rows are the default at one token), in each build.
  log all-tiles
  for name in "" ring; do
    fits 60 "the all-tiles step (${name:-default})" && LITHOS_TILES=qkv,o,gate_up,down \
      LITHOS_KERNEL_DEFINES=${name:+${defines[$name]}} bench "step-8b-mxfp4-all-tiles${name:+-$name}" 60 \
      --shape llama-3.1-8b --weight-format mxfp4 --kernels megakernel
  done
  log done
  exit 0
fi
log rounds
spec_round 8b-mxfp4 1 "" ring
spec_round 1b-mxfp4 1 "" ring
log tests
fits 100 "the GPU cases (ring)" && LITHOS_KERNEL_DEFINES=${defines[ring]} XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 \
  run_tests gpu-tests-ring $(($(seconds_left) - 10)) -n 3 -rA "${cases[@]}"
log done
