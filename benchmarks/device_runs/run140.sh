#!/usr/bin/env bash
# Run 140 (written 2026-12-07, forty-third session): the megakernel's 4-16-token attention splits on tensor cores
# (LITHOS_MK_ATTN_MMA=1, "mma"; NOTES.md, "The 4-16-token attention on tensor cores in the megakernel") against the
# default, and the fused split kernel's GPU tests after its tensor-core loop moved to split_attention_mma.h.
#   RUN_LIMIT=SECONDS bash benchmarks/device_runs/run140.sh [all|rounds]
# `all`: the two builds (both layouts `lithos bench --spec` reads), the 8B MXFP4 round in each, the GPU cases in the
# mma build, then the fused attention's GPU cases. `rounds`: the 1B MXFP4 and 8B bf16 rounds in each build, the 8B
# MXFP4 round again, a traced 8B MXFP4 round in each build (the mma build's first), the fused ring-cache cases.
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:-all}
source benchmarks/device_runs/lib.sh run140 "$phase"
unset LITHOS_TILES  # the default layouts: Q/K/V + gate/up for steps, every group for rounds
declare -A defines=([mma]="LITHOS_MK_ATTN_MMA=1")
gpu=tests/test_megakernel_gpu.py
# The mma splits at 4, 8 and 16 tokens: head dimensions 64 and 128, the odd group (two passes of row tiles), long
# splits (several chunks a warp), a window; head dimension 256 keeps the FMA splits; the engine's greedy generation
# with verification rounds, bf16 and MXFP4.
cases=(
  "$gpu::test_megakernel_greedy_generation_over_mxfp4_equals_reference[default-tiles]"
  "$gpu::test_megakernel_equals_interpreter_at_long_context[llama-3.1-8b-4096-8]"
  "$gpu::test_megakernel_equals_interpreter_at_long_context[smollm2-like-6000-16]"
  "$gpu::test_megakernel_equals_interpreter[4-smollm2-like]"
  "$gpu::test_megakernel_equals_interpreter[16-smollm2-like]"
  "$gpu::test_megakernel_equals_interpreter[4-llama-3.2-1b]"
  "$gpu::test_megakernel_equals_interpreter[16-llama-3.2-1b]"
  "$gpu::test_megakernel_equals_interpreter_with_head_dim_256[1000-16]"
  "$gpu::test_megakernel_greedy_generation_equals_reference[llama_hd64]"
  "$gpu::test_megakernel_greedy_generation_equals_reference[mistral_hd64_window]"
)
log build
build_variant "" &
build_variant mma &
wait
grep -E "FAILED|rror" "$work"/build*.log | cut -c1-300
if [ "$phase" = rounds ]; then
  log rounds
  spec_round 1b-mxfp4 1 "" mma
  spec_round 8b-bf16 1 "" mma
  spec_round 8b-mxfp4 2 "" mma
  log trace
  for name in mma ""; do
    fits 80 "the traced round (${name:-default})" && LITHOS_KERNEL_DEFINES=${name:+${defines[$name]}} traced \
      "round-8b-mxfp4${name:+-$name}" 80 --spec ngram --no-acceptance --kernels megakernel --draft-tokens 7 \
      --shape llama-3.1-8b --weight-format mxfp4 --steps 32 --runs 1
  done
  log ring
  left=$(($(seconds_left) - 10))
  fits 60 "the ring-cache cases" && run_tests ring-tests $((left < 120 ? left : 120)) -n 3 tests/test_ring_cache_gpu.py
  log done
  exit 0
fi
log rounds
spec_round 8b-mxfp4 1 "" mma
log tests
fits 90 "the GPU cases (mma)" && LITHOS_KERNEL_DEFINES=${defines[mma]} XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 \
  run_tests gpu-tests-mma 220 -n 3 -rA "${cases[@]}"
log fused
left=$(($(seconds_left) - 10))
fits 60 "the fused attention's cases" && XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 run_tests fused-attention-tests \
  $((left < 150 ? left : 150)) -n 3 tests/test_custom_calls_gpu.py -k attention
log done
