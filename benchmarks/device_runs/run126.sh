#!/usr/bin/env bash
# Run 126 (two calls of the device tool; written 2026-12-05; `experts` run in part that day: its first step,
# then the session's device time ran out while the second built its kernels).
# experts: the Qwen3-30B-A3B Q4_K_M fused step after run 125 (the experts' gate/up and SwiGLU kernel the default,
# the routers XLA's again: the router kernel, slower on that step, removed) beside the same step with its expert
# kernels built for two blocks an SM (NOTES.md, "The expert kernels' occupancy"), then as time allows: the GPU
# tests of the expert kernels in that build, of the MoE families' fused path and the expert kernels in the default
# build, the step kernel by kernel as the bench lays it out (run 125's trace had the Q/K/V split in three
# projections: step_timeline did not lay the params out), and Nsight Compute on both builds' expert kernels.
#   RUN_LIMIT=SECONDS bash benchmarks/device_runs/run126.sh [experts]   (what the call has: a part is skipped when
#                                                                       too little is left for it; default 430)
#   bash benchmarks/device_runs/run126.sh records   (another call, 3-5 minutes: Q4_K's scale records in one load,
#                                                    NOTES.md: the Q4_K kernels' GPU tests, then the 8B Q4_K
#                                                    fused step against the sources before it)
# The sources before the records change travel as an untracked copy (not committed), made from the repository root:
#   mkdir -p benchmarks/device_runs/base126 && git archive dbd9529 lithos | tar -x -C benchmarks/device_runs/base126
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:-experts}
source benchmarks/device_runs/lib.sh run126 "$phase"
two_blocks="LITHOS_EXPERT_TWO_BLOCKS=1"
packed=tests/test_custom_calls_packed_gpu.py

case $phase in
  experts)
    log build
    step_kernels=(--kernel qk_norm_rope --kernel attention --kernel lm_head --kernel expert_matvec
      --kernel matvec_packed_q4_k --kernel matvec_packed_k_mix)
    python3 -m lithos.custom_calls.build "${step_kernels[@]}" >"$work/build.log" 2>&1 || tail -5 "$work/build.log"
    # The two-block build too, every kernel of the step: a define is part of each library's key, so the step loads
    # all of them built with it (one source of every format: a minute or more, which inside its step's 120 s left no
    # time to time it, 2026-12-05; built alone, the step's other kernels still compiled inside it, 2026-12-06).
    LITHOS_KERNEL_DEFINES=$two_blocks python3 -m lithos.custom_calls.build "${step_kernels[@]}" \
      >>"$work/build.log" 2>&1 || tail -5 "$work/build.log"
    log steps
    bench_step qwen3-30b-a3b qwen3-30b-a3b-q4_k_m --weight-format q4_k_m
    fits 45 "the two-block step" &&
      LITHOS_KERNEL_DEFINES=$two_blocks bench_step qwen3-30b-a3b qwen3-30b-a3b-q4_k_m-experts-two-blocks \
        --weight-format q4_k_m
    fits 50 "the two-block build's tests" &&
      LITHOS_KERNEL_DEFINES=$two_blocks run_tests gpu-tests-experts-two-blocks 50 \
        "$packed::test_expert_gate_up_silu" "$packed::test_expert_matvec"
    fits 90 "the tests" && run_tests gpu-tests-moe 90 tests/test_moe_fused.py::test_fused_step_equals_reference \
      "$packed::test_expert_gate_up_silu" "$packed::test_expert_matvec"
    if fits 60 "the trace"; then
      log trace
      timeout 60 python3 -m lithos.step_timeline --shape qwen3-30b-a3b --weight-format q4_k_m --kernels fused \
        --anchor pick_tokens --steps 16 --out "$work/run126-timeline-a3b-q4_k_m.json" \
        >"$work/run126-timeline-a3b-q4_k_m.log" 2>&1
      head -30 "$work/run126-timeline-a3b-q4_k_m.log"
      save
    fi
    # Nsight Compute on the first layer's two expert kernels (gate/up, down), each build, in a short bench run (not
    # beside jax's profiler): where their time goes (occupancy, the warps' stalls, bytes against the peak).
    for build in default two-blocks; do
      fits 120 "Nsight Compute, $build build" || break
      defines=$([ "$build" = default ] || echo "$two_blocks")
      LITHOS_KERNEL_DEFINES=$defines timeout 110 ncu --clock-control none --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
        -k regex:expert_matvec -c 2 \
        "${lithos[@]}" bench --shape qwen3-30b-a3b --weight-format q4_k_m --context 1024 --kernels fused --steps 8 \
        --loops 1 --runs 16 --out "$work/ncu-$build" >"$work/run126-ncu-experts-$build.txt" 2>&1
      shown="expert_matvec_kernel|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued"
      grep -E "$shown" "$work/run126-ncu-experts-$build.txt" | head -16
      save
    done ;;
  records)
    base=$PWD/benchmarks/device_runs/base126
    [ -d "$base/lithos" ] || { echo "no $base/lithos: make it as this script's header says"; exit 2; }
    log records
    python3 -m lithos.custom_calls.build --kernel matvec_packed_q4_k --kernel qkv_rope --kernel attention \
      --kernel lm_head >"$work/build.log" 2>&1 || tail -5 "$work/build.log"
    run_tests gpu-tests-q4_k 150 tests/test_custom_calls_packed_gpu.py -k q4_k
    STEP_TIMEOUT=200 SOURCES=$base bench_step llama-3.1-8b llama-3.1-8b-q4_k-word-loads --weight-format q4_k
    bench_step llama-3.1-8b llama-3.1-8b-q4_k --weight-format q4_k ;;
  *) echo "usage: run126.sh [experts|records]"; exit 2 ;;
esac
log done
