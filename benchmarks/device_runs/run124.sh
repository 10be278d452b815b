#!/usr/bin/env bash
# Run 124 (one call of the device tool, about 4-5 minutes, the session's last device time): the router kernel
# (csrc/moe_route.cu, lithos/custom_calls/NOTES.md "The router in one launch"), never run on a GPU before.
#   bash benchmarks/device_runs/run124.sh route
# In order of need, each step saved as it ends (the budget may stop the call before the last):
# - build the kernels the steps use; the router kernel's GPU tests (tests/test_moe_route_gpu.py, 16 cases);
# - Qwen1.5-MoE-A2.7B fused, 1K (run 122: 3.024 ms on an H100);
# - the mixture families' fused path against the reference path (tests/test_moe_fused.py);
# - Qwen3-30B-A3B as a Q4_K_M file holds it, fused, 1K (run 122: 4.865 ms).
# Everything lands in $OUT/run124-route.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: run124.sh route}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 LITHOS_CACHE_DIR=$PWD/.carry/kcache XLA_PYTHON_CLIENT_PREALLOCATE=false
work=/tmp/r124
mkdir -p "$work"
save() { tar -C "$work" -czf "$OUT/run124-$phase.tar.gz" .; }
start=$SECONDS
log() { echo "== $* at $((SECONDS - start)) s"; }
lithos=(python3 -c 'import sys; from lithos.cli import main; sys.exit(main())')

step() {  # step SHAPE TAG [BENCH ARGS...]
  local shape=$1 tag=run124-$2
  shift 2
  timeout 150 "${lithos[@]}" bench --shape "$shape" --context 1024 --kernels fused "$@" --out "$work" --tag "$tag" \
    >"$work/$tag.log" 2>&1
  grep -E "^$shape" "$work/$tag.log"
  save
}
tests() {  # tests NAME PYTEST ARGS...
  local name=$1
  shift
  timeout 150 python3 -m pytest -q -p no:cacheprovider "$@" >"$work/$name.log" 2>&1
  grep -E "passed|failed|FAILED|Error" "$work/$name.log" | tail -8
  save
}
case $phase in
  route)
    log build
    python3 -m lithos.custom_calls.build --kernel moe_route --kernel qkv_rope --kernel qk_norm_rope --kernel matvec \
      --kernel attention --kernel lm_head --kernel expert_matvec --kernel matvec_packed_q4_k \
      --kernel matvec_packed_k_mix >"$work/build.log" 2>&1 || tail -5 "$work/build.log"
    log tests
    tests gpu-tests-route tests/test_moe_route_gpu.py
    log steps
    step qwen1.5-moe-a2.7b qwen1.5-moe-a2.7b
    log fused-tests
    tests gpu-tests-moe-fused tests/test_moe_fused.py
    log steps
    step qwen3-30b-a3b qwen3-30b-a3b-q4_k_m --weight-format q4_k_m ;;
  *) echo "usage: run124.sh route"; exit 2 ;;
esac
log done
