#!/usr/bin/env bash
# Run 136 (written 2026-12-06, thirty-ninth session): a one-token tiled task's first chunks (on 8B a Q/K/V or O task's
# whole matrix) copied into shared memory before its wait (LITHOS_MK_TILES_AHEAD, bits; NOTES.md, "A one-token tiled
# task's whole matrix in shared memory before its wait"). Builds the default and the define's builds (1: the
# single-matrix kinds; 3: gate/up too) of Q/K/V + gate/up and of Q/K/V + O + gate/up tiled; times the 1B and 8B MXFP4
# steps of the five cases; runs the one-token tiled GPU cases and the MXFP4 greedy generation in the build with 3;
# traces the 8B step with 3 and Q/K/V + gate/up tiled; times the steps again:
#   RUN_LIMIT=SECONDS bash benchmarks/device_runs/run136.sh [all|short|rounds]
# `short`, for a call of about 5 minutes: the Q/K/V + gate/up builds alone, their steps, the Q/K/V GPU cases and the
# MXFP4 greedy generation in the build with 3, the steps again. `rounds`: the MXFP4 verification rounds with every
# group tiled against the default's Q/K/V + gate/up.
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:-all}
source benchmarks/device_runs/lib.sh run136 "$phase"
ahead="LITHOS_MK_TILES_AHEAD=1"
declare -A defines=([ahead]=$ahead [both]="LITHOS_MK_TILES_AHEAD=3")
generation="tests/test_megakernel_gpu.py::test_megakernel_greedy_generation_over_mxfp4_equals_reference[default-tiles]"
single="tests/test_megakernel_gpu.py::test_tiled_single_matrix_megakernel_equals_interpreter"
# short_steps ROUND: the 1B and 8B MXFP4 steps, Q/K/V + gate/up tiled, the default and then the define's builds.
short_steps() {
  local name
  for name in "" ahead both; do
    fits 45 "the steps ($name)" && LITHOS_KERNEL_DEFINES=${name:+${defines[$name]}} LITHOS_TILES=qkv,gate_up \
      bench "mxfp4-qkv-gate_up${name:+-$name}-short-$1" 45 --shape llama-3.2-1b --shape llama-3.1-8b \
      --weight-format mxfp4 --kernels megakernel
  done
}
if [ "$phase" = rounds ]; then
  # The verification rounds with every group tiled against the default (NOTES.md, "O and down in tiles for the
  # verification rounds"): the 8B k = 7 and 1B k = 15 rounds, twice, alternating.
  log build
  python3 benchmarks/build_variants.py qkv,gate_up qkv,o,gate_up,down >"$work/build.log" 2>&1
  grep -E "FAILED|rror" "$work"/build*.log | cut -c1-300
  log rounds
  for round in 1 2; do
    for tiles in qkv,gate_up qkv,o,gate_up,down; do
      fits 90 "the 8B round ($tiles)" && LITHOS_TILES=$tiles bench "round-8b-${tiles//,/-}-$round" 90 \
        --spec ngram --draft-tokens 7 --no-acceptance --shape llama-3.1-8b --weight-format mxfp4 --kernels megakernel
      fits 60 "the 1B round ($tiles)" && LITHOS_TILES=$tiles bench "round-1b-${tiles//,/-}-$round" 60 \
        --spec ngram --draft-tokens 15 --no-acceptance --shape llama-3.2-1b --weight-format mxfp4 --kernels megakernel
    done
  done
  # Where an 8-token step's time goes: the trace of the last verification step of an 8B k = 7 round, each layout.
  log trace
  for tiles in qkv,gate_up qkv,o,gate_up,down; do
    fits 90 "the traced round ($tiles)" && LITHOS_TILES=$tiles traced "round-8b-${tiles//,/-}" 90 --spec ngram \
      --draft-tokens 7 --no-acceptance --shape llama-3.1-8b --weight-format mxfp4 --kernels megakernel --steps 32 \
      --runs 1
  done
  log done
  exit 0
fi
if [ "$phase" = short ]; then
  log build
  python3 benchmarks/build_variants.py qkv,gate_up >"$work/build.log" 2>&1 &
  LITHOS_KERNEL_DEFINES=$ahead python3 benchmarks/build_variants.py qkv,gate_up >"$work/build-ahead.log" 2>&1 &
  LITHOS_KERNEL_DEFINES=${defines[both]} python3 benchmarks/build_variants.py qkv,gate_up >"$work/build-both.log" 2>&1
  wait
  grep -E "FAILED|rror" "$work"/build*.log | cut -c1-300
  log steps
  short_steps 1
  log tests
  fits 100 "the GPU cases" && LITHOS_KERNEL_DEFINES=${defines[both]} XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 run_tests \
    gpu-tests-ahead-short 90 -n 3 -rA "$generation" "$single[qkv-llama-3.1-8b-1]" "$single[qkv-llama-3.2-1b-1]" \
    "$single[qkv-smollm2-like--1]"
  log steps
  short_steps 2
  log done
  exit 0
fi

log build
python3 benchmarks/build_variants.py qkv,gate_up qkv,o,gate_up >"$work/build.log" 2>&1 &
LITHOS_KERNEL_DEFINES=$ahead python3 benchmarks/build_variants.py qkv,gate_up qkv,o,gate_up \
  >"$work/build-ahead.log" 2>&1 &
LITHOS_KERNEL_DEFINES=${defines[both]} python3 benchmarks/build_variants.py qkv,gate_up gate_up,o gate_up,down \
  >"$work/build-both.log" 2>&1
wait
grep -E "FAILED|rror" "$work"/build*.log | cut -c1-300

# steps ROUND: the 1B and 8B MXFP4 steps of the five cases, tagged with ROUND.
steps() {
  local case tiles name tag
  for case in "qkv,gate_up" "qkv,gate_up ahead" "qkv,gate_up both" "qkv,o,gate_up ahead" "qkv,o,gate_up"; do
    read -r tiles name <<<"$case"
    tag="mxfp4-${tiles//,/-}${name:+-$name}-$1"
    fits 60 "$tag" && LITHOS_KERNEL_DEFINES=${name:+${defines[$name]}} LITHOS_TILES=$tiles bench "$tag" 60 \
      --shape llama-3.2-1b --shape llama-3.1-8b --weight-format mxfp4 --kernels megakernel
  done
}
log steps
steps 1
log tests
tests=("$generation")
for c in qkv-llama-3.2-1b-1 qkv-llama-3.1-8b-1 qkv-smollm2-like--1 o-llama-3.1-8b-1 o-smollm2-like--1 \
  down-llama-3.1-8b-1 qkv-llama-3.1-8b-8; do
  tests+=("$single[$c]")
done
fits 130 "the GPU cases" && LITHOS_KERNEL_DEFINES=${defines[both]} XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 \
  run_tests gpu-tests-ahead 120 -n 3 -rA "${tests[@]}"

log trace
fits 80 "the traced step" && LITHOS_KERNEL_DEFINES=${defines[both]} TAG_SUFFIX=-both-traced mxfp4_step qkv,gate_up
log steps
steps 2
log done
