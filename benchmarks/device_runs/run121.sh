#!/usr/bin/env bash
# Run 121 (one call of the device tool, 3-5 minutes): where the mixtures of experts' fused steps go, kernel by kernel
# (`lithos.step_timeline`: a jax profiler trace of the bench's loop), for Qwen3-30B-A3B as a Q4_K_M GGUF holds it
# (run 120 on an H100: fused 5.281 ms against a floor of 0.791) and Qwen1.5-MoE-A2.7B in bf16 (3.255 against 1.575).
#   bash benchmarks/device_runs/run121.sh trace
# Everything lands in $OUT/run121-<phase>.tar.gz, rewritten after every step.
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: run121.sh trace}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 LITHOS_CACHE_DIR=$PWD/.carry/kcache
work=/tmp/r121
mkdir -p "$work"
save() { tar -C "$work" -czf "$OUT/run121-$phase.tar.gz" .; }
start=$SECONDS
log() { echo "== $* at $((SECONDS - start)) s"; }

timeline() {  # timeline TAG SHAPE [ARGS...]
  local tag=$1 shape=$2
  shift 2
  timeout "${STEP_TIMEOUT:-200}" python3 -m lithos.step_timeline --shape "$shape" --kernels fused --anchor pick_tokens \
    --out "$work/run121-timeline-$tag.json" "$@" >"$work/run121-timeline-$tag.log" 2>&1
  head -30 "$work/run121-timeline-$tag.log"
  save
}

case $phase in
  trace)
    log trace
    timeline a3b-q4_k_m qwen3-30b-a3b --weight-format q4_k_m
    timeline qwen1.5-moe qwen1.5-moe-a2.7b ;;
  *) echo "usage: run121.sh trace"; exit 2 ;;
esac
log done
