#!/usr/bin/env bash
# Run 138 (written 2026-12-07, forty-first session): the two changes run 137 could not time alone and one more, in
# builds of both layouts that `lithos bench --spec` reads (its plain step in Q/K/V + gate/up tiles, its rounds in
# every group's):
#   combine  LITHOS_MK_COMBINE_VEC=4, the attention's combine four elements a thread (NOTES.md, "The attention's
#            combine four elements a thread")
#   stage    LITHOS_MK_STAGE_STEPS=1, the tiled gate/up's B staged a k-step a thread (NOTES.md, "The 2-16-token
#            gate/up B staged a k-step a thread"; MXFP4 builds only)
#   keys3    LITHOS_MK_ATTN_KEYS=3, three keys a lane group and loop step in the 4-16-token attention too (NOTES.md,
#            "Three keys a loop step in the 4-16-token attention")
#   every    the three together
# and the default's 16-row LM head (kept after run 137) where run 137 did not reach: its GPU cases, the 8B bf16
# round, a traced 8B MXFP4 round.
#   RUN_LIMIT=SECONDS [VARIANTS="keys3 every"] bash benchmarks/device_runs/run138.sh [all|rounds|table]
# `all`: the builds, the 8B MXFP4 round in each build, the default build's GPU cases (with the MXFP4 greedy generation
# in the engine's two layouts) in the time left. `rounds`: the 1B MXFP4 round in each build, the 8B MXFP4 round
# again, the GPU cases in the build with every change, the 8B bf16 round and a traced 8B MXFP4 round of the default.
# `table`, for an H200: the README table's 1K rows again (run 79's call: every path of the 1B and 8B shapes, bf16,
# then MXFP4).
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:-all}
source benchmarks/device_runs/lib.sh run138 "$phase"
unset LITHOS_TILES  # the default layouts: Q/K/V + gate/up for steps, every group for rounds
declare -A defines=([combine]="LITHOS_MK_COMBINE_VEC=4" [stage]="LITHOS_MK_STAGE_STEPS=1"
  [keys3]="LITHOS_MK_ATTN_KEYS=3" [every]="LITHOS_MK_COMBINE_VEC=4 LITHOS_MK_STAGE_STEPS=1 LITHOS_MK_ATTN_KEYS=3")
spec=(--spec ngram --no-acceptance --kernels megakernel)
gpu=tests/test_megakernel_gpu.py
# The 1-16-token kernels' head and combine (bf16: two shapes, head dimension 256), the tiled gate/up at 4-16 tokens and
# down at 8, greedy generation with verification rounds (bf16; MXFP4 in the engine's two layouts).
cases=(
  "$gpu::test_megakernel_greedy_generation_over_mxfp4_equals_reference[default-tiles]"
  "$gpu::test_megakernel_equals_interpreter[4-smollm2-like]"
  "$gpu::test_megakernel_equals_interpreter[16-llama-3.2-1b]"
  "$gpu::test_megakernel_equals_interpreter_with_head_dim_256[1000-16]"
  "$gpu::test_tiled_gate_up_megakernel_equals_interpreter[llama-3.1-8b-8]"
  "$gpu::test_tiled_gate_up_megakernel_equals_interpreter[llama-3.2-1b-16]"
  "$gpu::test_tiled_single_matrix_megakernel_equals_interpreter[down-llama-3.1-8b-8]"
  "$gpu::test_megakernel_greedy_generation_equals_reference[llama_hd64]"
)
if [ "$phase" = table ]; then
  log build
  build_variant ""
  grep -E "FAILED|rror" "$work"/build*.log | cut -c1-300
  log table
  for format in "" mxfp4; do
    fits 200 "the ${format:-bf16} paths" && bench "paths${format:+-$format}" 200 --shape llama-3.2-1b \
      --shape llama-3.1-8b ${format:+--weight-format $format} --kernels reference,fused,megakernel
  done
  log done
  exit 0
fi
# VARIANTS (default: all four; a blank: the default build alone) narrows the builds and the rounds, for a call shorter
# than the builds of all of them (`rounds` runs the GPU cases of `every` only where it is built).
read -ra variants <<<"${VARIANTS:-combine stage keys3 every}"
log build
build_variant "" gate_up gate_up,down &
for name in "${variants[@]}"; do
  if [ "$name" = every ]; then build_variant every gate_up gate_up,down & else build_variant "$name" & fi
done
wait
grep -E "FAILED|rror" "$work"/build*.log | cut -c1-300
if [ "$phase" = rounds ]; then
  log rounds
  spec_round 1b-mxfp4 1 "" "${variants[@]}"
  spec_round 8b-mxfp4 2 "" "${variants[@]}"
  log tests
  [[ " ${variants[*]} " == *" every "* ]] && fits 130 "the GPU cases (every)" &&
    LITHOS_KERNEL_DEFINES=${defines[every]} XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 run_tests gpu-tests-every 120 -n 3 -rA \
      "${cases[@]}"
  log bf16
  spec_round 8b-bf16 1 ""
  log trace
  fits 80 "the traced round" && traced round-8b-mxfp4 80 "${spec[@]}" --draft-tokens 7 --shape llama-3.1-8b \
    --weight-format mxfp4 --steps 32 --runs 1
  log done
  exit 0
fi
log rounds
spec_round 8b-mxfp4 1 "" "${variants[@]}"
# The GPU cases in what is left (at most 150 s): the cases until then are reported where the limit stops them.
log tests
left=$(($(seconds_left) - 10))
fits 60 "the GPU cases" && XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 run_tests gpu-tests $((left < 150 ? left : 150)) -n 3 \
  -rA "${cases[@]}"
log done
