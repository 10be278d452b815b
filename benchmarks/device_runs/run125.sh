#!/usr/bin/env bash
# Run 125 (two calls of the device tool, route 5-8 minutes, trace up to 9; written 2026-12-05, run that day with a
# third, `base`; its route phase needs the sources of 7a6c5e0: the router kernel it tests was removed after it): the
# router kernel as a grid of blocks with the last to arrive routing (run 124's one-block form made the steps
# slower: NOTES.md, "The router in one launch"), and the experts' gate/up with its SwiGLU in one launch ("The
# experts' gate/up with its SwiGLU"), asked for with LITHOS_MOE_NEW=route and =route,gate_up, against the sources
# before both in the same call.
# Those sources travel as an untracked copy (not committed): before the call, from the repository root,
#   mkdir -p benchmarks/device_runs/base125 && git archive e69af71 lithos | tar -x -C benchmarks/device_runs/base125
#   bash benchmarks/device_runs/run125.sh route   (tests and steps, below)
#   bash benchmarks/device_runs/run125.sh trace   (a second call, up to 9 minutes: where the Qwen3-30B-A3B Q4_K_M
#                                                  fused step goes, kernel by kernel, with the MoE kernels that
#                                                  `route` found to gain named in LITHOS_MOE_NEW by the caller)
# In order of need, each step saved as it ends: the two kernels' GPU tests (with the plain expert kernel's, whose
# source they share) and the MoE families' fused path with them; the Q/K/V kernels' cases (their stores shared
# after run 123); Qwen1.5-MoE-A2.7B fused, 1K, with the router kernel,
# with both, and with neither; then Qwen3-30B-A3B as a Q4_K_M file holds it, the same three.
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: run125.sh route|base|trace}
source benchmarks/device_runs/lib.sh run125 "$phase"
base=$PWD/benchmarks/device_runs/base125

case $phase in
  route)
    [ -d "$base/lithos" ] || { echo "no $base/lithos: make it as this script's header says"; exit 2; }
    log build
    python3 -m lithos.custom_calls.build --kernel moe_route --kernel qkv_rope --kernel qk_norm_rope --kernel matvec \
      --kernel attention --kernel lm_head --kernel expert_matvec --kernel matvec_packed_q4_k >"$work/build.log" 2>&1 ||
      tail -5 "$work/build.log"
    log tests
    gpu=tests/test_custom_calls_gpu.py fp8=tests/test_kv_fp8_gpu.py packed=tests/test_custom_calls_packed_gpu.py
    run_tests gpu-tests-moe 150 tests/test_moe_route_gpu.py "$packed::test_expert_gate_up_silu" \
      "$packed::test_expert_matvec" "$packed::test_expert_matvec_kernel_reads_only_routed_experts" \
      "tests/test_moe_fused.py::test_fused_step_equals_reference"
    # The Q/K/V kernels' stores, shared since run 123 (QkvStore, cache_store.h): bf16, FP8 and packed, and the
    # per-head norm kernel.
    run_tests gpu-tests-qkv 120 "$gpu::test_qkv_rope_append[llama-3.1-8b-1-True]" \
      "$gpu::test_qkv_rope_append[odd-3-True]" "$gpu::test_qkv_project_then_qk_norm_rope_append" \
      "$fp8::test_qkv_rope_append_fp8[llama-3.1-8b-4-True]" "$fp8::test_qk_norm_rope_append_fp8" \
      "$packed::test_packed_qkv_rope_append[q4_k-llama-3.1-8b-1]" "$packed::test_packed_qkv_project"
    log steps
    # LITHOS_MOE_NEW is read by the sources under test; the ones before have neither kernel.
    LITHOS_MOE_NEW=route bench_step qwen1.5-moe-a2.7b qwen1.5-moe-a2.7b-route
    LITHOS_MOE_NEW=route,gate_up bench_step qwen1.5-moe-a2.7b qwen1.5-moe-a2.7b-route-gate-up
    SOURCES=$base bench_step qwen1.5-moe-a2.7b qwen1.5-moe-a2.7b-xla
    python3 -m lithos.custom_calls.build --kernel matvec_packed_k_mix >>"$work/build.log" 2>&1
    LITHOS_MOE_NEW=route bench_step qwen3-30b-a3b qwen3-30b-a3b-q4_k_m-route --weight-format q4_k_m
    LITHOS_MOE_NEW=route,gate_up bench_step qwen3-30b-a3b qwen3-30b-a3b-q4_k_m-route-gate-up --weight-format q4_k_m
    SOURCES=$base bench_step qwen3-30b-a3b qwen3-30b-a3b-q4_k_m-xla --weight-format q4_k_m ;;
  base)
    # A third call after `route` (whose sources-before steps found no configs/ in the copy, fixed in lib.sh): the
    # same cards' steps with neither kernel and with both, one after the other.
    [ -d "$base/lithos" ] || { echo "no $base/lithos: make it as this script's header says"; exit 2; }
    log steps
    export STEP_TIMEOUT=240  # on a fresh machine each tree builds its kernels in its first step
    SOURCES=$base bench_step qwen1.5-moe-a2.7b qwen1.5-moe-a2.7b-xla-2
    LITHOS_MOE_NEW=route,gate_up bench_step qwen1.5-moe-a2.7b qwen1.5-moe-a2.7b-route-gate-up-2
    SOURCES=$base bench_step qwen3-30b-a3b qwen3-30b-a3b-q4_k_m-xla-2 --weight-format q4_k_m
    LITHOS_MOE_NEW=route,gate_up bench_step qwen3-30b-a3b qwen3-30b-a3b-q4_k_m-route-gate-up-2 --weight-format q4_k_m ;;
  trace)
    log trace
    timeout 500 python3 -m lithos.step_timeline --shape qwen3-30b-a3b --weight-format q4_k_m --kernels fused \
      --anchor pick_tokens --steps 16 --out "$work/run125-timeline-a3b-q4_k_m.json" \
      >"$work/run125-timeline-a3b-q4_k_m.log" 2>&1
    head -40 "$work/run125-timeline-a3b-q4_k_m.log"
    save ;;
  *) echo "usage: run125.sh route|base|trace"; exit 2 ;;
esac
log done
