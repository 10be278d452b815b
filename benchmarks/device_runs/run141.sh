#!/usr/bin/env bash
# Run 141 (written 2026-12-07, forty-fourth session; brought up to date in the forty-eighth, after run 143), for an
# H200: the README table's 1K rows again in this build (the MXFP4 rows were an older build's: runs 109 and 118),
# MXFP4 first, then bf16 in the time left: the 1B and 8B shapes in one bench call each. `rounds`: the verification
# rounds the README quotes from H100s (ngram drafts, no acceptance run: 8B MXFP4 and bf16 at k = 7, 1B MXFP4 at
# k = 15), on the H200.
#   RUN_LIMIT=SECONDS bash benchmarks/device_runs/run141.sh [table|rounds]
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:-table}
source benchmarks/device_runs/lib.sh run141 "$phase"
unset LITHOS_TILES  # the default layout: every MXFP4 group tiled, for steps and rounds alike (run 143)
declare -A defines=()
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "$phase" = rounds ]; then
  BUILD_TOKENS=8,16 build_all
  log rounds
  spec_round 8b-mxfp4 1 ""
  spec_round 1b-mxfp4 1 ""
  spec_round 8b-bf16 1 ""
  log done
  exit 0
fi
log build
# The one-token libraries of the default layout (every group tiled, since run 143) and the one before it (Q/K/V +
# gate/up), beside the bf16 build's.
python3 benchmarks/build_variants.py --tokens 1 qkv,gate_up qkv,o,gate_up,down >"$work/build.log" 2>&1
grep -E "FAILED|rror" "$work"/build*.log | cut -c1-300
log table
# MXFP4: the fused and megakernel paths (the table's reference figures are another call's: 29 ms a step on 8B).
fits 120 "the MXFP4 paths" && bench paths-mxfp4 150 --shape llama-3.2-1b --shape llama-3.1-8b --weight-format mxfp4 \
  --kernels fused,megakernel
fits 150 "the bf16 paths" && bench paths 200 --shape llama-3.2-1b --shape llama-3.1-8b \
  --kernels reference,fused,megakernel
log done
