#!/usr/bin/env bash
# Run 122 (three calls of the device tool, 4-7 minutes each, and a fourth for a trace): the Q/K/V kernels written
# on 2026-12-05 and not yet run on a GPU, asked for with LITHOS_QKV_NEW=1 (lithos/custom_calls/NOTES.md, "Q/K/V
# biases in the Q/K/V kernels" and "Per-head Q/K norms in two launches"). Where they pass, make them the default and
# drop the switch (packed_matvec.new_qkv_kernels).
#   bash benchmarks/device_runs/run122.sh tests   (the GPU tests below)
#   bash benchmarks/device_runs/run122.sh steps   (the bf16 steps below)
#   bash benchmarks/device_runs/run122.sh steps2  (the Q4_K_M and mixture-of-experts steps below)
#   bash benchmarks/device_runs/run122.sh trace   (where the Qwen3-30B-A3B Q4_K_M fused step goes, kernel by kernel,
#                                                  with the new kernels: run 121's ran past its 200 s)
# - GPU tests (42 cases): the bf16 and FP8-cache Q/K/V kernels with biases (and one case without), the packed one
#   with biases (Q8_0, Q4_K, mixed) and without; qkv_project and qk_norm_rope_append (bf16 and FP8 caches), the
#   packed projection (Q8_0, Q4_K, MXFP4); the fused path's Qwen2, Qwen3 and biased Llama over them, and a Q4_K_M
#   mix's Q/K/V laid out in K_MIX;
# - steps (fused, 1K): Qwen2.5-7B, Qwen3-8B and Llama-3.1-8B as a Q4_K_M file holds it (Q/K/V then laid out in
#   K_MIX) with LITHOS_QKV_NEW=1 and without (the split form), Llama-3.1-8B bf16 as the same call's yardstick,
#   Qwen1.5-MoE-A2.7B and Qwen3-30B-A3B (Q4_K_M) with the new kernels (run 120: 3.255 and 5.281 ms split).
# Everything lands in $OUT/run122-<phase>.tar.gz, rewritten after every step.
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: run122.sh tests|steps|steps2|trace}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 LITHOS_CACHE_DIR=$PWD/.carry/kcache
work=/tmp/r122
mkdir -p "$work"
save() { tar -C "$work" -czf "$OUT/run122-$phase.tar.gz" .; }
start=$SECONDS
log() { echo "== $* at $((SECONDS - start)) s"; }
lithos=(python3 -c 'import sys; from lithos.cli import main; sys.exit(main())')

step() {  # step SHAPE TAG [BENCH ARGS...] (LITHOS_QKV_NEW from the caller)
  local shape=$1 tag=run122-$2
  shift 2
  timeout "${STEP_TIMEOUT:-120}" "${lithos[@]}" bench --shape "$shape" --context 1024 --kernels fused "$@" \
    --out "$work" --tag "$tag" >"$work/$tag.log" 2>&1
  grep -E "^$shape" "$work/$tag.log"
  save
}
case $phase in
  tests)
    log build
    python3 -m lithos.custom_calls.build --kernel qkv_rope --kernel qk_norm_rope --kernel matvec --kernel attention \
      --kernel lm_head --kernel expert_matvec --kernel matvec_packed_q8_0 --kernel matvec_packed_q4_k \
      --kernel matvec_packed_k_mix --kernel matvec_packed_q4_1 --kernel matvec_packed_mxfp4 >"$work/build.log" 2>&1 ||
      tail -5 "$work/build.log"
    log tests
    gpu=tests/test_custom_calls_gpu.py fp8=tests/test_kv_fp8_gpu.py packed=tests/test_custom_calls_packed_gpu.py
    fused=tests/test_fused_path.py
    cases=(
      "$gpu::test_qkv_rope_append[llama-3.1-8b-1-False]" "$gpu::test_qkv_rope_append[llama-3.1-8b-1-True]"
      "$gpu::test_qkv_rope_append[llama-3.2-1b-8-True]" "$gpu::test_qkv_rope_append[odd-3-True]"
      "$gpu::test_qkv_project_then_qk_norm_rope_append"
      "$fp8::test_qkv_rope_append_fp8[llama-3.1-8b-4-True]" "$fp8::test_qk_norm_rope_append_fp8"
      "$packed::test_packed_qkv_rope_append[q4_k-llama-3.1-8b-1]"
      "$packed::test_packed_qkv_rope_append_of_mixed_formats[formats0]"
      "$packed::test_packed_qkv_rope_append_with_biases" "$packed::test_packed_qkv_project"
      "$fused::test_fused_generation_equals_reference[qwen2_hd64]"
      "$fused::test_fused_generation_equals_reference[qwen3_hd64]"
      "$fused::test_fused_norms_and_biases_over_packed_attention" "$fused::test_fused_new_qkv_kernels"
      "$fused::test_fused_qkv_of_mixed_k_quants_in_one_format"
    )
    env LITHOS_QKV_NEW=1 XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 300 python3 -m pytest -q -p no:cacheprovider \
      "${cases[@]}" >"$work/tests.log" 2>&1
    grep -E "passed|failed|FAILED|Error" "$work/tests.log" | tail -12
    save ;;
  steps)
    log steps
    LITHOS_QKV_NEW=1 step qwen2.5-7b qwen2.5-7b-new
    LITHOS_QKV_NEW=0 step qwen2.5-7b qwen2.5-7b-split
    LITHOS_QKV_NEW=1 step qwen3-8b qwen3-8b-new
    LITHOS_QKV_NEW=0 step qwen3-8b qwen3-8b-split
    step llama-3.1-8b llama-3.1-8b ;;
  steps2)
    log steps
    LITHOS_QKV_NEW=1 step llama-3.1-8b llama-3.1-8b-q4_k_m-new --weight-format q4_k_m
    LITHOS_QKV_NEW=0 step llama-3.1-8b llama-3.1-8b-q4_k_m-split --weight-format q4_k_m
    LITHOS_QKV_NEW=1 step qwen1.5-moe-a2.7b qwen1.5-moe-a2.7b-new
    LITHOS_QKV_NEW=1 STEP_TIMEOUT=200 step qwen3-30b-a3b qwen3-30b-a3b-q4_k_m-new --weight-format q4_k_m ;;
  trace)
    log trace
    LITHOS_QKV_NEW=1 timeout 500 python3 -m lithos.step_timeline --shape qwen3-30b-a3b --weight-format q4_k_m \
      --kernels fused --anchor pick_tokens --out "$work/run122-timeline-a3b-q4_k_m.json" \
      >"$work/run122-timeline-a3b-q4_k_m.log" 2>&1
    head -40 "$work/run122-timeline-a3b-q4_k_m.log"
    save ;;
  *) echo "usage: run122.sh tests|steps|steps2|trace"; exit 2 ;;
esac
log done
