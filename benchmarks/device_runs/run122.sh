#!/usr/bin/env bash
# Run 122 (one call of the device tool, about 6 minutes): Q/K/V biases in the Q/K/V kernels' epilogue
# (lithos/custom_calls/NOTES.md, "Q/K/V biases in the Q/K/V kernels"), asked for with LITHOS_QKV_BIASES_IN_KERNEL=1
# until this run passes (then make it the default and drop the switch: packed_matvec.biases_in_kernel).
#   bash benchmarks/device_runs/run122.sh
# - GPU tests (16 cases): the bf16 and FP8-cache Q/K/V kernels with biases against their twins (and one without),
#   the packed kernel with biases (Q8_0, Q4_K, mixed) and without, and the fused path's biased families (Qwen2, a
#   Llama with attention biases, Qwen2 over packed Q/K/V);
# - steps (fused): Qwen2.5-7B with the biases in the kernel and in the split form, Llama-3.1-8B as the same call's
#   yardstick, and Qwen1.5-MoE-A2.7B with the biases in the kernel (run 120: 3.255 ms in the split form).
# Everything lands in $OUT/run122.tar.gz, rewritten after every step.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 LITHOS_CACHE_DIR=$PWD/.carry/kcache
work=/tmp/r122
mkdir -p "$work"
save() { tar -C "$work" -czf "$OUT/run122.tar.gz" .; }
start=$SECONDS
log() { echo "== $* at $((SECONDS - start)) s"; }
lithos=(python3 -c 'import sys; from lithos.cli import main; sys.exit(main())')

log build
python3 -m lithos.custom_calls.build --kernel qkv_rope --kernel matvec --kernel attention --kernel lm_head \
  --kernel expert_matvec --kernel matvec_packed_q8_0 --kernel matvec_packed_q4_k --kernel matvec_packed_k_mix \
  --kernel matvec_packed_q4_1 >"$work/build.log" 2>&1 || tail -5 "$work/build.log"
log tests
cases=(
  "tests/test_custom_calls_gpu.py::test_qkv_rope_append[llama-3.1-8b-1-False]"
  "tests/test_custom_calls_gpu.py::test_qkv_rope_append[llama-3.1-8b-1-True]"
  "tests/test_custom_calls_gpu.py::test_qkv_rope_append[llama-3.2-1b-8-True]"
  "tests/test_custom_calls_gpu.py::test_qkv_rope_append[odd-3-True]"
  "tests/test_kv_fp8_gpu.py::test_qkv_rope_append_fp8[llama-3.1-8b-4-True]"
  "tests/test_custom_calls_packed_gpu.py::test_packed_qkv_rope_append[q4_k-llama-3.1-8b-1]"
  "tests/test_custom_calls_packed_gpu.py::test_packed_qkv_rope_append_of_mixed_formats[formats0]"
  "tests/test_custom_calls_packed_gpu.py::test_packed_qkv_rope_append_with_biases[1-formats0]"
  "tests/test_custom_calls_packed_gpu.py::test_packed_qkv_rope_append_with_biases[1-formats1]"
  "tests/test_custom_calls_packed_gpu.py::test_packed_qkv_rope_append_with_biases[1-formats3]"
  "tests/test_custom_calls_packed_gpu.py::test_packed_qkv_rope_append_with_biases[4-formats0]"
  "tests/test_custom_calls_packed_gpu.py::test_packed_qkv_rope_append_with_biases[4-formats1]"
  "tests/test_fused_path.py::test_fused_generation_equals_reference[qwen2_hd64]"
  "tests/test_fused_path.py::test_fused_generation_equals_reference[llama_bias_hd64]"
  "tests/test_fused_path.py::test_fused_norms_and_biases_over_packed_attention[q8_0-q8_0-qwen2_hd64]"
  "tests/test_fused_path.py::test_fused_norms_and_biases_over_packed_attention[q4_1-q8_0-qwen2_hd64]"
  "tests/test_fused_path.py::test_fused_qkv_biases_in_the_kernel[None-qwen2_hd64]"
  "tests/test_fused_path.py::test_fused_qkv_biases_in_the_kernel[None-llama_bias_hd64]"
  "tests/test_fused_path.py::test_fused_qkv_biases_in_the_kernel[q8_0-qwen2_hd64]"
)
env LITHOS_QKV_BIASES_IN_KERNEL=1 XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python3 -m pytest -q -p no:cacheprovider "${cases[@]}" \
  >"$work/tests.log" 2>&1
grep -E "passed|failed|FAILED|Error" "$work/tests.log" | tail -12
save

step() {  # step SHAPE TAG (LITHOS_QKV_BIASES_IN_KERNEL from the caller)
  local shape=$1 tag=run122-$2
  timeout 120 "${lithos[@]}" bench --shape "$shape" --context 1024 --kernels fused --out "$work" --tag "$tag" \
    >"$work/$tag.log" 2>&1
  grep -E "^$shape" "$work/$tag.log"
  save
}
log steps
LITHOS_QKV_BIASES_IN_KERNEL=1 step qwen2.5-7b qwen2.5-7b-biases-in-kernel
LITHOS_QKV_BIASES_IN_KERNEL=0 step qwen2.5-7b qwen2.5-7b-split
step llama-3.1-8b llama-3.1-8b
LITHOS_QKV_BIASES_IN_KERNEL=1 step qwen1.5-moe-a2.7b qwen1.5-moe-a2.7b-biases-in-kernel
log done
