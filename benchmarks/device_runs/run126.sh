#!/usr/bin/env bash
# Run 126 (one call of the device tool, up to 8 minutes; written 2026-12-05): the mixture families' fused path
# after run 125, with the experts' gate/up and SwiGLU kernel the default and the routers XLA's again (the router
# kernel, slower on Qwen3-30B-A3B, removed), and where its expert kernels spend their time.
#   bash benchmarks/device_runs/run126.sh
# In order of need, each step saved as it ends: the GPU tests of the MoE families' fused path (against the
# reference path) and of the gated expert kernel; Qwen1.5-MoE-A2.7B and Qwen3-30B-A3B Q4_K_M fused steps at 1K;
# the Qwen3-30B-A3B Q4_K_M step kernel by kernel, now laid out as the bench times it (run 125's trace had the
# Q/K/V split in three projections: step_timeline did not lay the params out); then Nsight Compute (on a short
# bench run: not beside jax's profiler) on the step's first expert and packed projection kernels (run 125: the
# experts' gate/up at 21 us a layer for 14 MB, some 670 GB/s, their down at 15 us for 11 MB) with what time is left.
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
log ncu
left=$((440 - (SECONDS - run_start)))  # the session's device time: about 8 minutes a call
if [ "$left" -gt 60 ]; then
  timeout "$left" ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section WarpStateStats --section MemoryWorkloadAnalysis -k "regex:expert_matvec|packed_matvec" -c 4 \
    "${lithos[@]}" bench --shape qwen3-30b-a3b --weight-format q4_k_m --context 1024 --kernels fused \
    --steps 8 --loops 1 --runs 16 --out "$work/ncu" --tag run126-ncu >"$work/run126-ncu-experts.txt" 2>&1
  shown="expert_matvec|packed_matvec|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per"
  shown+="|Grid Size|Block Size|Warp Cycles Per Issued|Issue Slots Busy|Compute \(SM\) Throughput"
  grep -E "$shown" "$work/run126-ncu-experts.txt" | head -60
  save
fi
log done
