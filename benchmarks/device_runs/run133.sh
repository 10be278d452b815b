#!/usr/bin/env bash
# Run 133 (2026-12-06, after run 132 `tiles`): with the attention's second step's keys loaded during the wait
# (LITHOS_MK_ATTN_SECOND_AHEAD=1), the 8B MXFP4 step with every group tiled was faster than with gate/up alone
# (2.985 against 3.031 ms), and with O + gate/up + down slower (3.076): so Q/K/V pays in tiles and O and down do not.
# This asks for Q/K/V + gate/up, between gate/up alone and every group, twice:
#   bash benchmarks/device_runs/run133.sh
# Each tag's record is its last round's (the same tag twice writes one JSON); the call's output has both
# (benchmarks/results/logs/2026-12-06-h100-run133-steps.log).
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/device_runs/lib.sh run133 qkv
a=LITHOS_MK_ATTN_SECOND_AHEAD=1
LITHOS_KERNEL_DEFINES=$a python3 benchmarks/build_variants.py gate_up qkv,gate_up qkv,o,gate_up,down \
  >"$work/build.log" 2>&1
grep -E "FAILED|rror" "$work/build.log" | cut -c1-200
for t in qkv,gate_up gate_up qkv,o,gate_up,down qkv,gate_up gate_up; do
  LITHOS_KERNEL_DEFINES=$a LITHOS_TILES=$t bench "mxfp4-ahead-${t//,/-}" 60 --shape llama-3.1-8b --weight-format mxfp4 \
    --kernels megakernel
done
save
