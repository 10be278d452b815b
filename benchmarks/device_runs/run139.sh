#!/usr/bin/env bash
# Run 139 (written 2026-12-07, forty-third session): the default with the attention's combine four elements a thread
# in the 2-16-token kernels and two in the one-token kernel (run 138: four paid in the rounds and cost the one-token
# step), its GPU cases (the engine's split layouts in the MXFP4 greedy generation first, which no call has finished),
# and which of run 138's two losing changes made its build with all three the fastest 8B round:
#   keys3  LITHOS_MK_ATTN_KEYS=3 (NOTES.md, "Three keys a loop step in the 4-16-token attention")
#   stage  LITHOS_MK_STAGE_STEPS=1 (NOTES.md, "The 2-16-token gate/up B staged a k-step a thread")
#   RUN_LIMIT=SECONDS bash benchmarks/device_runs/run139.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/device_runs/lib.sh run139 all
unset LITHOS_TILES  # the default layouts: Q/K/V + gate/up for steps, every group for rounds
declare -A defines=([keys3]="LITHOS_MK_ATTN_KEYS=3" [stage]="LITHOS_MK_STAGE_STEPS=1")
gpu=tests/test_megakernel_gpu.py
# The engine's split layouts first (the longest case), then the combine at 1, 2, 4 and 16 tokens.
cases=(
  "$gpu::test_megakernel_greedy_generation_over_mxfp4_equals_reference[default-tiles]"
  "$gpu::test_megakernel_equals_interpreter[1-llama-3.2-1b]"
  "$gpu::test_megakernel_equals_interpreter[2-llama-3.2-1b]"
  "$gpu::test_megakernel_equals_interpreter[4-smollm2-like]"
  "$gpu::test_megakernel_equals_interpreter[16-llama-3.2-1b]"
  "$gpu::test_megakernel_equals_interpreter_with_head_dim_256[1000-1]"
  "$gpu::test_megakernel_equals_interpreter_with_head_dim_256[1000-16]"
  "$gpu::test_megakernel_greedy_generation_equals_reference[llama_hd64]"
)
log build
build_variant "" &
build_variant keys3 &
build_variant stage &
wait
grep -E "FAILED|rror" "$work"/build*.log | cut -c1-300
log rounds
spec_round 8b-mxfp4 1 "" keys3 stage
log tests
left=$(($(seconds_left) - 10))
fits 90 "the GPU cases" && XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 run_tests gpu-tests $((left < 240 ? left : 240)) -n 3 \
  -rA "${cases[@]}"
log rounds-again
spec_round 8b-mxfp4 2 "" keys3 stage
log done
