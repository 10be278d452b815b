#!/usr/bin/env bash
# Run 135 (written 2026-12-06, thirty-eighth session): the single-matrix tiled tasks' own one-token geometry
# (NOTES.md, "Chunks in flight in the single-matrix tiles"). On 8B a Q/K/V task holds 3 tiles and an O or down task 2,
# so at gate/up's (4 tiles a step, 1 step in flight) a warp has 2-3 chunks in flight where gate/up's has 8. This times
# (2, 2) against the default, 8B MXFP4 at 1K, alternating twice, then traces the (2, 2) build with every group tiled:
#   RUN_LIMIT=SECONDS bash benchmarks/device_runs/run135.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/device_runs/lib.sh run135 single
two="LITHOS_MK_SINGLE_TILES=2 LITHOS_MK_SINGLE_DEPTH=2"

log build
python3 benchmarks/build_variants.py qkv,gate_up >"$work/build.log" 2>&1 &
LITHOS_KERNEL_DEFINES=$two python3 benchmarks/build_variants.py qkv,gate_up qkv,o,gate_up,down \
  >"$work/build-two.log" 2>&1
wait
grep -E "FAILED|rror" "$work"/build*.log | cut -c1-300
log steps
for round in 1 2; do
  for case in "qkv,gate_up" "qkv,gate_up $two" "qkv,o,gate_up,down $two"; do
    read -r tiles defines <<<"$case"
    tag="mxfp4-${tiles//,/-}${defines:+-two}-$round"
    fits 60 "$tag" && LITHOS_KERNEL_DEFINES=$defines LITHOS_TILES=$tiles bench "$tag" 60 --shape llama-3.1-8b \
      --weight-format mxfp4 --kernels megakernel
  done
done
log trace
fits 120 "the traced step" && LITHOS_KERNEL_DEFINES=$two TAG_SUFFIX=-two mxfp4_step qkv,o,gate_up,down
log done
