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
source benchmarks/device_runs/lib.sh run125 "$phase"
base=$PWD/benchmarks/device_runs/base125
[ -d "$base/lithos" ] || { echo "no $base/lithos: make it as this script's header says"; exit 2; }

case $phase in
  route)
    log build
    python3 -m lithos.custom_calls.build --kernel moe_route --kernel qkv_rope --kernel matvec --kernel attention \
      --kernel lm_head --kernel expert_matvec >"$work/build.log" 2>&1 || tail -5 "$work/build.log"
    log tests
    run_tests gpu-tests-route 90 tests/test_moe_route_gpu.py "tests/test_moe_fused.py::test_fused_step_equals_reference"
    log steps
    export LITHOS_MOE_ROUTE=1  # read by the sources under test; the ones before have no such kernel
    bench_step qwen1.5-moe-a2.7b qwen1.5-moe-a2.7b-route
    SOURCES=$base bench_step qwen1.5-moe-a2.7b qwen1.5-moe-a2.7b-xla
    python3 -m lithos.custom_calls.build --kernel qk_norm_rope --kernel matvec_packed_q4_k \
      --kernel matvec_packed_k_mix >>"$work/build.log" 2>&1
    bench_step qwen3-30b-a3b qwen3-30b-a3b-q4_k_m-route --weight-format q4_k_m
    SOURCES=$base bench_step qwen3-30b-a3b qwen3-30b-a3b-q4_k_m-xla --weight-format q4_k_m ;;
  *) echo "usage: run125.sh route"; exit 2 ;;
esac
log done
