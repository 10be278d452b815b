#!/usr/bin/env bash
# Run 141 (written 2026-12-07, forty-fourth session): the megakernel's 4-16-token attention splits on tensor cores
# out of line (LITHOS_MK_ATTN_MMA=1, "mma"; NOTES.md, "The tensor-core split out of line") against the default.
#   RUN_LIMIT=SECONDS bash benchmarks/device_runs/run141.sh
# The two builds (both layouts `lithos bench --spec` reads); the 8B MXFP4, 1B MXFP4 and 8B bf16 rounds in each; the
# GPU cases in the mma build; a traced 8B MXFP4 round in the mma build.
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/device_runs/lib.sh run141 all
unset LITHOS_TILES  # the default layouts: Q/K/V + gate/up for steps, every group for rounds
declare -A defines=([mma]="LITHOS_MK_ATTN_MMA=1")
gpu=tests/test_megakernel_gpu.py
# The mma splits at 4, 8 and 16 tokens: head dimensions 64 and 128, the odd group (two passes of row tiles), long
# splits (several chunks a warp); the engine's greedy generation with verification rounds, bf16 and MXFP4.
cases=(
  "$gpu::test_megakernel_equals_interpreter_at_long_context[llama-3.1-8b-4096-8]"
  "$gpu::test_megakernel_greedy_generation_over_mxfp4_equals_reference[default-tiles]"
  "$gpu::test_megakernel_equals_interpreter_at_long_context[smollm2-like-6000-16]"
  "$gpu::test_megakernel_equals_interpreter[4-llama-3.2-1b]"
  "$gpu::test_megakernel_equals_interpreter[16-smollm2-like]"
  "$gpu::test_megakernel_greedy_generation_equals_reference[mistral_hd64_window]"
)
log build
build_variant "" &
build_variant mma &
wait
grep -E "FAILED|rror" "$work"/build*.log | cut -c1-300
log rounds
spec_round 8b-mxfp4 1 "" mma
spec_round 1b-mxfp4 1 "" mma
spec_round 8b-bf16 1 "" mma
log tests
fits 100 "the GPU cases (mma)" && LITHOS_KERNEL_DEFINES=${defines[mma]} XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 \
  run_tests gpu-tests-mma 190 -n 3 -rA "${cases[@]}"
log trace
fits 70 "the traced round (mma)" && LITHOS_KERNEL_DEFINES=${defines[mma]} traced round-8b-mxfp4-mma 70 --spec ngram \
  --no-acceptance --kernels megakernel --draft-tokens 7 --shape llama-3.1-8b --weight-format mxfp4 --steps 32 --runs 1
log done
