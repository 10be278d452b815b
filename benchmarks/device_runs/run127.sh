#!/usr/bin/env bash
# Run 127 (written 2026-12-06): the GGUF decoders' instructions (NOTES.md, "Codes with their half2 bias left in",
# "The codes' mask and the f16 exponent in one LOP3") and Q4_K's scale records in one load (run 126's `records`,
# not yet run), in two calls:
#   RUN_LIMIT=SECONDS bash benchmarks/device_runs/run127.sh tests   (the GPU tests of the changed formats' fused
#                                                                    kernels and megakernel builds: 5-8 minutes)
#   RUN_LIMIT=SECONDS bash benchmarks/device_runs/run127.sh steps   (the 8B Q4_K fused step as the tree has it, at
#                                                                    3eabf69 (before the decoders' changes) and at
#                                                                    dbd9529 (records word by word); the 8B Q4_K_M
#                                                                    megakernel step as the tree has it and at
#                                                                    3eabf69)
#   RUN_LIMIT=SECONDS bash benchmarks/device_runs/run127.sh one     (where one call is all there is: the Q4_1, Q4_K
#                                                                    and K_MIX fused kernels' GPU tests, the 8B Q4_K
#                                                                    fused step as the tree has it and at 3eabf69,
#                                                                    then the megakernel's Q4_1 and Q4_K_M tests)
#   bash benchmarks/device_runs/run127.sh tiny    (two minutes: the Q4_1, Q4_K and K_MIX matvec and gate/up kernels'
#                                                  GPU tests alone)
# A part is skipped when the call's time left (RUN_LIMIT, default 430 s) is too short for it. The sources before
# travel as untracked copies (not committed), made from the repository root:
#   mkdir -p benchmarks/device_runs/base126 && git archive dbd9529 lithos | tar -x -C benchmarks/device_runs/base126
#   mkdir -p benchmarks/device_runs/base127 && git archive 3eabf69 lithos | tar -x -C benchmarks/device_runs/base127
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:-tests}
source benchmarks/device_runs/lib.sh run127 "$phase"
# The megakernel builds the tests and steps read: SmolLM2's Q4_1 (Q8_0 head), Q4_K_M and Q5_K_M files as the
# megakernel reads them, Q4_K alone and with Q6_K (the ring's Q4_K and Q6_K steps), Q2_K, Q5_1, IQ4 (its bytes
# masked in one LOP3 too: "The codes' mask and the f16 exponent in one LOP3").
variants="q4_1:q4_1:q8_0 k_mix:q4_k:bfloat16:q4_k:k_mix q4_k:q4_k:bfloat16 q4_k:q6_k:q6_k k_mix:q5_k:bfloat16:q5_k:k_mix
  q3_k:q2_k:q6_k q5_0:q5_1:q8_0 iq4_nl:iq4_xs:iq4_nl"
megakernel_steps=(--kernels megakernel --weight-format q4_k_m)
megakernel_cases="q4_1-q4_1-q8_0 or k_mix-q4_k-q4_k-k_mix or q4_k-q6_k-q6_k or k_mix-q5_k-q5_k-k_mix or q3_k-q2_k-q6_k"
megakernel_cases+=" or q5_0-q5_1-q8_0 or iq4_nl-iq4_xs-iq4_nl"

case $phase in
  tests)
    log build
    # shellcheck disable=SC2086
    python3 benchmarks/build_variants.py $variants >"$work/build.log" 2>&1
    grep FAILED "$work/build.log" | cut -c1-300
    fits 180 "the fused kernels' tests" && run_tests gpu-tests-fused-biased 180 -n 3 \
      tests/test_custom_calls_packed_gpu.py -k "q4_k or q4_1 or k_mix or q5_1 or q5_k or q2_k or q4_0 or iq4"
    fits 120 "the megakernel's tests" && XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 run_tests gpu-tests-megakernel-biased \
      "$((run_limit - (SECONDS - run_start) - 10))" -n 3 tests/test_megakernel_gpu.py -k "$megakernel_cases" ;;
  one)
    log build
    cases="q4_k or q4_1 or k_mix"
    if [ "$run_limit" -ge 500 ]; then
      python3 benchmarks/build_variants.py q4_1:q4_1:q8_0 k_mix:q4_k:bfloat16:q4_k:k_mix q4_k:q4_k:bfloat16 \
        >"$work/build.log" 2>&1
    else  # too short a call for the megakernel builds: the fused kernels alone
      cases="($cases) and not megakernel"
      python3 -m lithos.custom_calls.build --kernel matvec_packed_q4_k --kernel matvec_packed_q4_1 \
        --kernel matvec_packed_k_mix --kernel matvec_packed_q8_0 --kernel qkv_rope --kernel attention --kernel lm_head \
        --kernel matvec --kernel expert_matvec >"$work/build.log" 2>&1
    fi
    grep -E "FAILED|rror" "$work/build.log" | cut -c1-300
    fits 150 "the fused kernels' tests" && run_tests gpu-tests-fused-q4 140 -n 3 \
      tests/test_custom_calls_packed_gpu.py -k "$cases"
    fits 60 "the step" && bench_step llama-3.1-8b llama-3.1-8b-q4_k --weight-format q4_k
    fits 150 "the step at 3eabf69" && STEP_TIMEOUT=140 SOURCES=$PWD/benchmarks/device_runs/base127 bench_step \
      llama-3.1-8b llama-3.1-8b-q4_k-at-3eabf69 --weight-format q4_k
    fits 60 "the megakernel's tests" && run_tests gpu-tests-megakernel-q4 "$((run_limit - (SECONDS - run_start)))" \
      -n 3 tests/test_megakernel_gpu.py -k "q4_1-q4_1-q8_0 or k_mix-q4_k-q4_k-k_mix" ;;
  tiny)
    log build
    python3 -m lithos.custom_calls.build --kernel matvec_packed_q4_k --kernel matvec_packed_q4_1 \
      --kernel matvec_packed_k_mix >"$work/build.log" 2>&1
    grep -E "FAILED|rror" "$work/build.log" | cut -c1-300
    run_tests gpu-tests-matvec-q4 90 -n 2 tests/test_custom_calls_packed_gpu.py \
      -k "(test_packed_matvec or test_packed_gate_up_silu) and (q4_k or q4_1 or k_mix)" ;;
  steps)
    for base in base126 base127; do
      [ -d "benchmarks/device_runs/$base/lithos" ] || { echo "no $base: make it as this script's header says"; exit 2; }
    done
    log build
    # shellcheck disable=SC2086
    python3 benchmarks/build_variants.py k_mix:q4_k:bfloat16:q4_k:k_mix >"$work/build.log" 2>&1
    grep FAILED "$work/build.log" | cut -c1-300
    log steps
    bench_step llama-3.1-8b llama-3.1-8b-q4_k --weight-format q4_k
    fits 200 "the step at 3eabf69" && STEP_TIMEOUT=190 SOURCES=$PWD/benchmarks/device_runs/base127 bench_step \
      llama-3.1-8b llama-3.1-8b-q4_k-at-3eabf69 --weight-format q4_k
    fits 200 "the step at dbd9529" && STEP_TIMEOUT=190 SOURCES=$PWD/benchmarks/device_runs/base126 bench_step \
      llama-3.1-8b llama-3.1-8b-q4_k-at-dbd9529 --weight-format q4_k
    fits 100 "the megakernel step" && bench_step llama-3.1-8b llama-3.1-8b-q4_k_m-megakernel "${megakernel_steps[@]}"
    fits 250 "the megakernel step at 3eabf69" && STEP_TIMEOUT=240 \
      SOURCES=$PWD/benchmarks/device_runs/base127 bench_step llama-3.1-8b llama-3.1-8b-q4_k_m-megakernel-at-3eabf69 \
      "${megakernel_steps[@]}" ;;
  *) echo "usage: run127.sh [tests|steps|one|tiny]"; exit 2 ;;
esac
log done
