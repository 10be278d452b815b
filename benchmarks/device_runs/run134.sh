#!/usr/bin/env bash
# Run 134 (written 2026-12-06 after run 133): the default build on CUDA is now the attention's second keys loaded
# during the wait in every packed build, and Q/K/V with gate/up in fragment tiles (LITHOS_TILES default qkv,gate_up).
# Run 133 timed only the 8B one-token step that way. This times what the change moved and was not timed:
#   RUN_LIMIT=SECONDS bash benchmarks/device_runs/run134.sh [all|rounds|bf16-rounds]
# `all`: the GPU cases of the default MXFP4 build (against the interpreter, greedy generation and verification against
# the reference) and of the gate/up-only build; the 1B and 8B MXFP4 steps, qkv,gate_up against gate_up, twice; a traced
# 8B step of the new default (how near its 4.2 us floor the Q/K/V stage's tiled dots come). `rounds`: the 8B k = 7
# and 1B k = 15 verification rounds, qkv,gate_up against gate_up (NOTES.md predicts the 8B round within -8% .. +2%),
# each round followed by the 8B bf16 pair of `bf16-rounds` where the call's time allows.
# `bf16-rounds`: the bf16 build's 8- and 16-token kernels spill in the attention's loop where its one-token kernel
# does not (SASS: 43 and 69 local accesses, 10 each with the keys ahead), so the 8B bf16 k = 7 round, default against
# LITHOS_MK_ATTN_SECOND_AHEAD=1, twice (NOTES.md, "The second step's keys during the wait", predicts 1-3% faster).
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:-all}
source benchmarks/device_runs/lib.sh run134 "$phase"

log build
ahead="LITHOS_MK_ATTN_SECOND_AHEAD=1"
# bf16_pair ROUND: the 8B bf16 k = 7 round, the default build and then the keys ahead, tagged with ROUND.
bf16_pair() {
  local defines
  for defines in "" "$ahead"; do
    fits 90 "the 8B bf16 round ($defines)" && LITHOS_KERNEL_DEFINES=$defines \
      bench "round-8b-bf16${defines:+-ahead}-$1" 90 --spec ngram --draft-tokens 7 --no-acceptance \
      --shape llama-3.1-8b --kernels megakernel
  done
}
if [ "$phase" = bf16-rounds ]; then
  python3 benchmarks/build_variants.py gate_up >"$work/build.log" 2>&1 &
  LITHOS_KERNEL_DEFINES=$ahead python3 benchmarks/build_variants.py gate_up >"$work/build-ahead.log" 2>&1
  wait
  grep -E "FAILED|rror" "$work"/build*.log | cut -c1-300
  log rounds
  for round in 1 2; do
    bf16_pair "$round"
  done
  log done
  exit 0
fi
if [ "$phase" = rounds ]; then
  # The bf16 build with the define is built beside the MXFP4 ones, so that the 8B bf16 pair follows the MXFP4 rounds
  # in the same call when its time allows (`bf16-rounds` alone otherwise).
  LITHOS_KERNEL_DEFINES=$ahead python3 benchmarks/build_variants.py gate_up >"$work/build-ahead.log" 2>&1 &
fi
python3 benchmarks/build_variants.py gate_up qkv,gate_up >"$work/build.log" 2>&1
wait
grep -E "FAILED|rror" "$work"/build*.log | cut -c1-300
if [ "$phase" = rounds ]; then
  log rounds
  for round in 1 2; do
    for tiles in qkv,gate_up gate_up; do
      fits 90 "the 8B round ($tiles)" && LITHOS_TILES=$tiles bench "round-8b-${tiles//,/-}-$round" 90 \
        --spec ngram --draft-tokens 7 --no-acceptance --shape llama-3.1-8b --weight-format mxfp4 --kernels megakernel
      fits 60 "the 1B round ($tiles)" && LITHOS_TILES=$tiles bench "round-1b-${tiles//,/-}-$round" 60 \
        --spec ngram --draft-tokens 15 --no-acceptance --shape llama-3.2-1b --weight-format mxfp4 --kernels megakernel
    done
    bf16_pair "$round"
  done
  log done
  exit 0
fi
log tests
fits 150 "the GPU cases" && XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 run_tests gpu-tests 150 -n 3 \
  tests/test_megakernel_gpu.py -k "(mxfp4 and not all-tiles) or tiled_gate_up or (single_matrix and qkv)"
log steps
for round in 1 2; do
  for tiles in qkv,gate_up gate_up; do
    fits 70 "the MXFP4 steps ($tiles)" && LITHOS_TILES=$tiles bench "mxfp4-${tiles//,/-}-$round" 70 \
      --shape llama-3.2-1b --shape llama-3.1-8b --weight-format mxfp4 --kernels megakernel
  done
done
log trace
fits 150 "the traced step" && TAG_SUFFIX=-traced mxfp4_step qkv,gate_up
log done
