#!/usr/bin/env bash
# Run 120 (three calls of the device tool, 5-8 minutes each): Qwen3's per-head Q/K norms and Qwen2's Q/K/V biases on
# the fused path, and the mixture-of-experts families' fused attention (lithos/custom_calls/NOTES.md, "Qwen3 and
# Qwen2 on the fused path").
#   bash benchmarks/device_runs/run120.sh tests   (the GPU tests below)
#   bash benchmarks/device_runs/run120.sh dense   (Qwen3-8B, Qwen2.5-7B, Phi-4 and Llama-3.1-8B bf16)
#   bash benchmarks/device_runs/run120.sh moe     (Qwen3-30B-A3B as a Q4_K_M GGUF holds it, Qwen1.5-MoE-A2.7B bf16)
# - GPU tests: the fused path against the reference on the model shapes (Qwen3-8B beside the llama shapes it already
#   passed), the Qwen3-MoE / Qwen2-MoE / Mixtral fused steps (test_moe_fused.py: the kernels, not twins);
# - steps (reference and fused): Qwen3-8B, Qwen2.5-7B and Phi-4 (never timed), Llama-3.1-8B fused only, whose layer
#   loop moved into `llama.fused_layers` (run 79: 4.880 ms); Qwen3-30B-A3B (run 119: 6.447 / 6.379 ms with its
#   attention on jax.numpy) and Qwen1.5-MoE-A2.7B (never timed).
# Everything lands in $OUT/run120-<phase>.tar.gz, rewritten after every step.
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: run120.sh tests|dense|moe}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 LITHOS_CACHE_DIR=$PWD/.carry/kcache
work=/tmp/r120
mkdir -p "$work"
save() { tar -C "$work" -czf "$OUT/run120-$phase.tar.gz" .; }
start=$SECONDS
log() { echo "== $* at $((SECONDS - start)) s"; }
lithos=(python3 -c 'import sys; from lithos.cli import main; sys.exit(main())')

step() {  # step SHAPE FORMAT KERNELS
  local shape=$1 fmt=$2 kernels=$3 tag
  tag=run120-$shape${fmt:+-$fmt}
  timeout "${STEP_TIMEOUT:-150}" "${lithos[@]}" bench --shape "$shape" --context 1024 ${fmt:+--weight-format "$fmt"} \
    --kernels "$kernels" --out "$work" --tag "$tag" >"$work/$tag.log" 2>&1
  grep -E "^$shape" "$work/$tag.log"
  save
}

case $phase in
  tests)
    log tests
    env XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 540 python3 -m pytest -q \
      -p no:cacheprovider tests/test_fused_path.py tests/test_moe_fused.py >"$work/tests.log" 2>&1
    grep -E "passed|failed|FAILED|Error" "$work/tests.log" | tail -20
    save ;;
  dense)
    log steps
    step qwen3-8b "" reference,fused
    step qwen2.5-7b "" reference,fused
    step phi-4 "" reference,fused
    step llama-3.1-8b "" fused ;;
  moe)
    log steps
    STEP_TIMEOUT=240 step qwen3-30b-a3b q4_k_m reference,fused
    step qwen1.5-moe-a2.7b "" reference,fused ;;
  *) echo "usage: run120.sh tests|dense|moe"; exit 2 ;;
esac
log done
