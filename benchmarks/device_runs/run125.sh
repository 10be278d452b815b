#!/usr/bin/env bash
# Run 125 (one call of the device tool, what is left of the session's device time): the router kernel as a grid
# of blocks with the last to arrive routing (run 124's one-block form made the steps slower: NOTES.md, "The router
# in one launch"), asked for with LITHOS_MOE_ROUTE=1, against the sources before the router kernel in the same call.
# Those sources travel as an untracked copy (not committed): before the call, from the repository root,
#   mkdir -p benchmarks/device_runs/base125 && git archive e69af71 lithos | tar -x -C benchmarks/device_runs/base125
#   bash benchmarks/device_runs/run125.sh route
# In order of need, each step saved as it ends: the router kernel's GPU tests; Qwen1.5-MoE-A2.7B fused, 1K, with
# the kernel and without; then Qwen3-30B-A3B as a Q4_K_M file holds it, with and without.
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: run125.sh route}
export PYTHONUNBUFFERED=1 LITHOS_CACHE_DIR=$PWD/.carry/kcache XLA_PYTHON_CLIENT_PREALLOCATE=false
work=/tmp/r125
mkdir -p "$work"
save() { tar -C "$work" -czf "$OUT/run125-$phase.tar.gz" .; }
start=$SECONDS
log() { echo "== $* at $((SECONDS - start)) s"; }
# -P: the lithos on PYTHONPATH, not the working directory's
lithos=(python3 -P -c 'import sys; from lithos.cli import main; sys.exit(main())')
base=$PWD/benchmarks/device_runs/base125
[ -d "$base/lithos" ] || { echo "no $base/lithos: make it as this script's header says"; exit 2; }

step() {  # step SOURCES SHAPE TAG [BENCH ARGS...]
  local sources=$1 shape=$2 tag=run125-$3
  shift 3
  PYTHONPATH=$sources timeout 120 "${lithos[@]}" bench --shape "$shape" --context 1024 --kernels fused "$@" \
    --out "$work" --tag "$tag" >"$work/$tag.log" 2>&1
  grep -E "^$shape" "$work/$tag.log"
  save
}
case $phase in
  route)
    log build
    PYTHONPATH=$PWD python3 -m lithos.custom_calls.build --kernel moe_route --kernel qkv_rope --kernel matvec \
      --kernel attention --kernel lm_head --kernel expert_matvec >"$work/build.log" 2>&1 || tail -5 "$work/build.log"
    log tests
    PYTHONPATH=$PWD timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_moe_route_gpu.py \
      "tests/test_moe_fused.py::test_fused_step_equals_reference" >"$work/gpu-tests-route.log" 2>&1
    grep -E "passed|failed|FAILED|Error" "$work/gpu-tests-route.log" | tail -8
    save
    log steps
    export LITHOS_MOE_ROUTE=1  # read by the sources under test; the ones before have no such kernel
    step "$PWD" qwen1.5-moe-a2.7b qwen1.5-moe-a2.7b-route
    step "$base" qwen1.5-moe-a2.7b qwen1.5-moe-a2.7b-xla
    PYTHONPATH=$PWD python3 -m lithos.custom_calls.build --kernel qk_norm_rope --kernel matvec_packed_q4_k \
      --kernel matvec_packed_k_mix >>"$work/build.log" 2>&1
    step "$PWD" qwen3-30b-a3b qwen3-30b-a3b-q4_k_m-route --weight-format q4_k_m
    step "$base" qwen3-30b-a3b qwen3-30b-a3b-q4_k_m-xla --weight-format q4_k_m ;;
  *) echo "usage: run125.sh route"; exit 2 ;;
esac
log done
