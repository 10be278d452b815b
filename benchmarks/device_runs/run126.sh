#!/usr/bin/env bash
# Run 126 (one call of the device tool, up to 8 minutes; written 2026-12-05): the mixture families' fused path
# after run 125, with the experts' gate/up and SwiGLU kernel the default and the routers XLA's again (the router
# kernel, slower on Qwen3-30B-A3B, removed), and its expert kernels at two blocks an SM.
#   bash benchmarks/device_runs/run126.sh
# In order of need, each step saved as it ends: the GPU tests of the MoE families' fused path (against the
# reference path) and of the gated expert kernel; Qwen1.5-MoE-A2.7B and Qwen3-30B-A3B Q4_K_M fused steps at 1K;
# the Qwen3-30B-A3B Q4_K_M step kernel by kernel, now laid out as the bench times it (run 125's trace had the
# Q/K/V split in three projections: step_timeline did not lay the params out); then the 30B step with the expert
# kernels built for two blocks an SM (NOTES.md, "The expert kernels' occupancy"), and their GPU tests in that build
# with what time is left.
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/device_runs/lib.sh run126 all

log build
python3 -m lithos.custom_calls.build --kernel qkv_rope --kernel qk_norm_rope --kernel matvec --kernel attention \
  --kernel lm_head --kernel expert_matvec --kernel matvec_packed_q4_k --kernel matvec_packed_k_mix \
  >"$work/build.log" 2>&1 || tail -5 "$work/build.log"
log tests
packed=tests/test_custom_calls_packed_gpu.py
run_tests gpu-tests-moe 150 tests/test_moe_fused.py "$packed::test_expert_gate_up_silu" "$packed::test_expert_matvec"
log steps
bench_step qwen1.5-moe-a2.7b qwen1.5-moe-a2.7b
bench_step qwen3-30b-a3b qwen3-30b-a3b-q4_k_m --weight-format q4_k_m
log trace
timeout 150 python3 -m lithos.step_timeline --shape qwen3-30b-a3b --weight-format q4_k_m --kernels fused \
  --anchor pick_tokens --steps 16 --out "$work/run126-timeline-a3b-q4_k_m.json" \
  >"$work/run126-timeline-a3b-q4_k_m.log" 2>&1
head -30 "$work/run126-timeline-a3b-q4_k_m.log"
save
log variants
# The expert kernels' occupancy (NOTES.md): two blocks an SM, with and without fewer loads in flight a warp, each
# kernel build keyed by its defines.
LITHOS_KERNEL_DEFINES="LITHOS_EXPERT_MIN_BLOCKS=2 LITHOS_EXPERT_UNROLL=2" bench_step qwen3-30b-a3b \
  qwen3-30b-a3b-q4_k_m-experts-2-blocks-unroll-2 --weight-format q4_k_m
LITHOS_KERNEL_DEFINES="LITHOS_EXPERT_MIN_BLOCKS=2" bench_step qwen3-30b-a3b qwen3-30b-a3b-q4_k_m-experts-2-blocks \
  --weight-format q4_k_m
left=$((430 - (SECONDS - run_start)))  # the session's device time: about 7.5 minutes a call
if [ "$left" -gt 50 ]; then
  export LITHOS_KERNEL_DEFINES="LITHOS_EXPERT_MIN_BLOCKS=2 LITHOS_EXPERT_UNROLL=2"
  run_tests gpu-tests-experts-unroll-2 "$left" "$packed::test_expert_gate_up_silu" "$packed::test_expert_matvec"
fi
log done
