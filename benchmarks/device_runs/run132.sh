#!/usr/bin/env bash
# Run 132 (2026-12-06): run 131 timed the 8B MXFP4 step 3.210 ms in the default build and 3.030 with the attention's
# second step's keys loaded during the wait (LITHOS_MK_ATTN_SECOND_AHEAD=1), one call each, where NOTES.md predicted
# 0-2%. This run says whether that holds and where it comes from:
#   RUN_LIMIT=SECONDS bash benchmarks/device_runs/run132.sh [all|steps|tiles]
# the 1B and 8B MXFP4 steps, default and define; the MXFP4 GPU cases (packed against the interpreter, greedy generation
# against the reference with the default tiles) and the ring's in the define's build; a traced step of each build
# (`steps`: the two steps alone). `tiles`: the tiled builds' attention spilled too (the O + gate/up + down build's
# one-token kernel 176 -> 19 local accesses with the define, all of the attention's 144 gone), so which matrix groups
# pay in tiles is asked again with the define: the 8B MXFP4 step of the default build, then with the define of gate/up,
# O + gate/up + down and every group in tiles, and the O + gate/up + down one traced.
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:-all}
source benchmarks/device_runs/lib.sh run132 "$phase"

ahead="LITHOS_MK_ATTN_SECOND_AHEAD=1"
if [ "$phase" = tiles ]; then
  log build
  python3 benchmarks/build_variants.py gate_up >"$work/build.log" 2>&1 &
  LITHOS_KERNEL_DEFINES=$ahead python3 benchmarks/build_variants.py gate_up o,gate_up,down qkv,o,gate_up,down \
    >"$work/build-ahead.log" 2>&1
  wait
  grep -E "FAILED|rror" "$work"/build*.log | cut -c1-300
  log steps
  fits 60 "the default step" && LITHOS_TILES=gate_up bench mxfp4-gate_up 60 --shape llama-3.1-8b \
    --weight-format mxfp4 --kernels megakernel
  for tiles in gate_up o,gate_up,down qkv,o,gate_up,down; do
    fits 60 "the $tiles step with the define" && LITHOS_KERNEL_DEFINES=$ahead LITHOS_TILES=$tiles \
      bench "mxfp4-ahead-${tiles//,/-}" 60 --shape llama-3.1-8b --weight-format mxfp4 --kernels megakernel
  done
  fits 90 "the O + gate/up + down step with the define, traced" && LITHOS_KERNEL_DEFINES=$ahead TAG_SUFFIX=-ahead \
    mxfp4_step o,gate_up,down
  log done
  exit 0
fi
log build
python3 benchmarks/build_variants.py gate_up >"$work/build.log" 2>&1 &
[ "$phase" = all ] && tested=mxfp4:mxfp4:bfloat16  # the packed GPU cases' build
LITHOS_KERNEL_DEFINES=$ahead python3 benchmarks/build_variants.py gate_up ${tested:-} \
  >"$work/build-ahead.log" 2>&1
wait
grep -E "FAILED|rror" "$work"/build*.log | cut -c1-300
log steps
for defines in "" "$ahead"; do
  fits 70 "the MXFP4 steps ($defines)" && LITHOS_KERNEL_DEFINES=$defines bench "mxfp4${defines:+-ahead}" 70 \
    --shape llama-3.2-1b --shape llama-3.1-8b --weight-format mxfp4 --kernels megakernel
done
[ "$phase" = steps ] && { save; log done; exit 0; }
log tests
fits 120 "the GPU cases" && LITHOS_KERNEL_DEFINES=$ahead XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 \
  run_tests gpu-tests-ahead $((run_limit - (SECONDS - run_start) - 5)) -n 3 tests/test_megakernel_gpu.py \
  tests/test_ring_cache_gpu.py -k "(mxfp4 and not all-tiles) or (ring and megakernel)"
log traces
for defines in "" "$ahead"; do
  name=trace${defines:+-ahead}
  fits 40 "a traced MXFP4 step ($defines)" && LITHOS_KERNEL_DEFINES=$defines \
    LITHOS_MEGAKERNEL_TRACE="$work/$name.json" timeout 40 "${lithos[@]}" bench --shape llama-3.1-8b --context 1024 --weight-format mxfp4 --kernels megakernel \
    --steps 32 --runs 1 >/dev/null 2>&1 &&
    python3 -m lithos.custom_calls.megakernel.trace "$work/$name.json" >"$work/$name.log" 2>&1 &&
    head -9 "$work/$name.log" | tail -7
done
save
log done
