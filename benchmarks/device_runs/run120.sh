#!/usr/bin/env bash
# Run 120 (one call of the device tool, about 8 minutes): Qwen3's per-head Q/K norms on the fused path, and the
# mixture-of-experts families' fused attention (lithos/custom_calls/NOTES.md, "Qwen3 on the fused path").
#   bash benchmarks/device_runs/run120.sh
# - GPU tests: the fused path against the reference on the Qwen3-8B shape (1 and 8 new tokens) beside the llama
#   shapes it already passed, and the Qwen3-MoE / Mixtral fused steps (test_moe_fused.py: the kernels, not twins);
# - steps: Qwen3-8B bf16 (reference, fused), Qwen3-30B-A3B as a Q4_K_M GGUF holds it (reference, fused: run 119
#   timed 6.447 / 6.379 ms with its attention on jax.numpy), and Llama-3.1-8B bf16 fused, whose layer loop moved
#   into `llama.fused_layers` (run 79: 4.880 ms); Qwen1.5-MoE-A2.7B bf16 (reference, fused; never timed).
# Everything lands in $OUT/run120.tar.gz, rewritten after every step.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 LITHOS_CACHE_DIR=$PWD/.carry/kcache
work=/tmp/r120
mkdir -p "$work"
save() { tar -C "$work" -czf "$OUT/run120.tar.gz" .; }
start=$SECONDS
log() { echo "== $* at $((SECONDS - start)) s"; }
lithos=(python3 -c 'import sys; from lithos.cli import main; sys.exit(main())')

log tests
env XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 timeout 240 python3 -m pytest -q \
  -p no:cacheprovider tests/test_fused_path.py tests/test_moe_fused.py >"$work/tests.log" 2>&1
grep -E "passed|failed|FAILED|Error" "$work/tests.log" | tail -20
save

step() {  # step SHAPE FORMAT KERNELS
  local shape=$1 fmt=$2 kernels=$3 tag
  tag=run120-$shape${fmt:+-$fmt}
  timeout "${STEP_TIMEOUT:-150}" "${lithos[@]}" bench --shape "$shape" --context 1024 ${fmt:+--weight-format "$fmt"} \
    --kernels "$kernels" --out "$work" --tag "$tag" >"$work/$tag.log" 2>&1
  grep -E "^$shape" "$work/$tag.log"
  save
}
log steps
step qwen3-8b "" reference,fused
STEP_TIMEOUT=240 step qwen3-30b-a3b q4_k_m reference,fused
step qwen1.5-moe-a2.7b "" reference,fused  # bf16; Q/K/V biases added between the projection calls and RoPE
step llama-3.1-8b "" fused
log done
