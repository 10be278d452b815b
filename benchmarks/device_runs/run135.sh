#!/usr/bin/env bash
# Run 135 (written 2026-12-06, thirty-eighth session): the single-matrix tiled tasks' own one-token geometry
# (NOTES.md, "Chunks in flight in the single-matrix tiles"). On 8B a Q/K/V task holds 3 tiles and an O or down task 2,
# so at gate/up's (4 tiles a step, 1 step in flight) a warp has 2-3 chunks in flight where gate/up's has 8. This times
# (2, 2) and (1, 4) against the default, 8B MXFP4 at 1K, with Q/K/V + gate/up and with every group tiled, then traces
# the fastest build with every group tiled:
#   RUN_LIMIT=SECONDS bash benchmarks/device_runs/run135.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/device_runs/lib.sh run135 single
declare -A geometry=([two]="LITHOS_MK_SINGLE_TILES=2 LITHOS_MK_SINGLE_DEPTH=2"
  [four]="LITHOS_MK_SINGLE_TILES=1 LITHOS_MK_SINGLE_DEPTH=4")

log build
python3 benchmarks/build_variants.py qkv,gate_up >"$work/build.log" 2>&1 &
for name in two four; do
  LITHOS_KERNEL_DEFINES=${geometry[$name]} python3 benchmarks/build_variants.py qkv,gate_up qkv,o,gate_up,down \
    >"$work/build-$name.log" 2>&1 &
done
wait
grep -E "FAILED|rror" "$work"/build*.log | cut -c1-300
log steps
for round in 1 2; do
  for case in "qkv,gate_up" "qkv,gate_up two" "qkv,gate_up four" "qkv,o,gate_up,down two" "qkv,o,gate_up,down four"; do
    read -r tiles name <<<"$case"
    tag="mxfp4-${tiles//,/-}${name:+-$name}-$round"
    fits 60 "$tag" && LITHOS_KERNEL_DEFINES=${name:+${geometry[$name]}} LITHOS_TILES=$tiles bench "$tag" 60 \
      --shape llama-3.1-8b --weight-format mxfp4 --kernels megakernel
  done
done
log trace
# The faster geometry with every group tiled, by its first round's step (the table's fifth column).
step() { awk '/^llama/ {print $5}' "$work/run135-mxfp4-qkv-o-gate_up-down-$1-1.log"; }
best=$(printf '%s %s\n' "$(step two)" two "$(step four)" four | sort -n | head -1 | cut -d' ' -f2)
fits 120 "the traced step ($best)" && LITHOS_KERNEL_DEFINES=${geometry[$best]} TAG_SUFFIX=-$best \
  mxfp4_step qkv,o,gate_up,down
log done
