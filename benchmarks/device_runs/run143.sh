#!/usr/bin/env bash
# Run 143 (written 2026-12-07, forty-sixth session): what making LITHOS_MK_TILE_RING=1 the default waits for (NOTES.md,
# "Run 142 measured"). The ring build's GPU cases, with the layouts they read built first (run 142's tests compiled
# them one by one and ran out of time), and the one-token step the change would make the default (every group tiled,
# through the ring) against today's (Q/K/V + gate/up tiled, registers) on both shapes. `gate_up`: the one-token gate/up
# tiles through the ring too (LITHOS_MK_GATE_UP_RING=1, "gur"; NOTES.md, "The one-token gate/up tiles through the ring
# too") beside the ring build, every group tiled, and its one-token gate/up cases. `trace`: the ring build with every
# group tiled against the same with the one-token Q/K/V tiles in registers (LITHOS_MK_QKV_RING=0, "qreg"; NOTES.md,
# "The one-token Q/K/V tiles kept in registers in a ring build"), 1B and 8B steps; then one traced 8B MXFP4 step of the
# default and of the ring build in the default layout (run 142: 50 us slower, not yet attributed to a stage), and of
# both builds with every group tiled.
#   RUN_LIMIT=SECONDS bash benchmarks/device_runs/run143.sh [all|lean|cases|gate_up|trace]
# If the ring build's cases pass and its 1B all-tiles step is no slower than the default's: `git apply
# benchmarks/device_runs/ring-default.patch` (the ring on by default; one layout, every group tiled, for steps and
# rounds, so Model.round_params goes; the old build kept as the variant LITHOS_MK_TILE_RING=0), then write run 143's
# figures where its tiles_wanted docstring says RUN143.
# Ran 2026-12-07 (forty-eighth session, one H100): `all` on the tree before the patch, which then went in; `trace`
# and `gate_up` on the patched tree (there the default build is the ring build; benchmarks/results/logs/
# 2026-12-07-h100-run143.log).
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:-all}
source benchmarks/device_runs/lib.sh run143 "$phase"
unset LITHOS_TILES  # the default layouts: Q/K/V + gate/up for steps, every group for rounds
declare -A defines=([ring]="LITHOS_MK_TILE_RING=1" [gur]="LITHOS_MK_TILE_RING=1 LITHOS_MK_GATE_UP_RING=1"
  [qreg]="LITHOS_MK_TILE_RING=1 LITHOS_MK_QKV_RING=0")
gpu=tests/test_megakernel_gpu.py
if [ "$phase" = trace ]; then
  export BUILD_TOKENS=1  # one-token steps alone
  build_all ring qreg
  log steps
  for name in ring qreg; do
    fits 120 "the all-tiles step ($name)" && LITHOS_KERNEL_DEFINES=${defines[$name]} LITHOS_TILES=qkv,o,gate_up,down \
      bench "step-mxfp4-all-tiles-$name-3" 120 --shape llama-3.2-1b --shape llama-3.1-8b --weight-format mxfp4 \
      --kernels megakernel
  done
  log trace
  for run in ring: default: qreg:qkv,o,gate_up,down ring:qkv,o,gate_up,down; do
    name=${run%%:*} tiles=${run#*:}
    [ "$name" = default ] && name=""
    if [ -n "$tiles" ]; then export LITHOS_TILES=$tiles; else unset LITHOS_TILES; fi  # unset: the default layout
    fits 70 "the traced step (${run})" && LITHOS_KERNEL_DEFINES=${name:+${defines[$name]}} \
      traced "step-8b-mxfp4-${name:-default}${tiles:+-all-tiles}" 70 --shape llama-3.1-8b --weight-format mxfp4 \
      --kernels megakernel --steps 32 --runs 1
  done
  log done
  exit 0
fi
if [ "$phase" = gate_up ]; then
  export BUILD_TOKENS=1  # one-token steps and cases alone
  log build
  build_variant ring &
  build_variant gur gate_up &  # the gate/up cases read gate/up alone in tiles
  wait
  grep -E "FAILED|rror" "$work"/build*.log | cut -c1-300
  # The one-token step with every group tiled, 1B and 8B: the ring build, then with the gate/up ring; a pair, the
  # GPU cases, then a second pair in the time left.
  all_tiles_pair() {
    local name
    for name in ring gur; do
      fits 120 "the all-tiles step ($name, $1)" && LITHOS_KERNEL_DEFINES=${defines[$name]} \
        LITHOS_TILES=qkv,o,gate_up,down bench "step-mxfp4-all-tiles-$name-$1" 120 --shape llama-3.2-1b \
        --shape llama-3.1-8b --weight-format mxfp4 --kernels megakernel
    done
  }
  log steps
  all_tiles_pair 1
  log tests
  tiled=test_tiled_gate_up_megakernel_equals_interpreter
  fits 100 "the gate/up cases (gur)" && LITHOS_KERNEL_DEFINES=${defines[gur]} XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 \
    run_tests gpu-tests-gur 120 -n 3 -rA "$gpu::$tiled[llama-3.2-1b-1]" "$gpu::$tiled[llama-3.1-8b-1]" \
    "$gpu::$tiled[smollm2-like-1]" "$gpu::$tiled[narrow-1]" "$gpu::$tiled[smollm2-like--1]"
  log steps
  all_tiles_pair 2
  log done
  exit 0
fi
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
if [ "$phase" = cases ]; then
  # The least device time: the ring build's Q/K/V and O cases (what making it the default waits for), then its 1B
  # step with every group tiled in the time left.
  log build
  build_variant ring gate_up,qkv gate_up,o
  grep -E "FAILED|rror" "$work"/build*.log | cut -c1-300
  log tests
  fits 90 "the GPU cases (ring)" && LITHOS_KERNEL_DEFINES=${defines[ring]} XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 \
    run_tests gpu-tests-ring $(($(seconds_left) - 60)) -n 3 -rA "${cases[@]:1}"
  log steps
  fits 50 "the ring's all-tiles step" && LITHOS_KERNEL_DEFINES=${defines[ring]} LITHOS_TILES=qkv,o,gate_up,down \
    bench step-mxfp4-all-tiles-ring 50 --shape llama-3.2-1b --weight-format mxfp4 --kernels megakernel
  log done
  exit 0
fi
# `lean`: the same with the 1B step alone, for a call with less device time (run 142 timed both 8B steps, 2.774-2.782
# and 2.752-2.754 ms; the 1B step in the all-tiles ring build has not run).
shapes=(--shape llama-3.2-1b --shape llama-3.1-8b) step_limit=120
[ "$phase" = lean ] && shapes=(--shape llama-3.2-1b) step_limit=75
log build
# The single-matrix cases read gate/up plus their group in tiles.
build_variant "" &
build_variant ring gate_up,qkv gate_up,o gate_up,down &
wait
grep -E "FAILED|rror" "$work"/build*.log | cut -c1-300
log steps
# The one-token step: the default build in its layout, then the ring build with every group tiled; 1B and 8B.
fits $step_limit "the default step" && bench step-mxfp4 $step_limit "${shapes[@]}" --weight-format mxfp4 \
  --kernels megakernel
fits $step_limit "the ring's all-tiles step" && LITHOS_KERNEL_DEFINES=${defines[ring]} LITHOS_TILES=qkv,o,gate_up,down \
  bench step-mxfp4-all-tiles-ring $step_limit "${shapes[@]}" --weight-format mxfp4 --kernels megakernel
log tests
fits 120 "the GPU cases (ring)" && LITHOS_KERNEL_DEFINES=${defines[ring]} XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 \
  run_tests gpu-tests-ring $(($(seconds_left) - 10)) -n 3 -rA "${cases[@]}"
log done
