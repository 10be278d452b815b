#!/usr/bin/env bash
# Run 119 (the next device run: five calls of the device tool's 10 minutes at most, about 28 minutes in all; the
# phases are independent, in order of need, so a session with less device time runs the first and leaves the rest):
#   bash benchmarks/device_runs/run119.sh tests     (the GPU cases of the 4- to 6-bit K-quants: about 6 minutes)
#   bash benchmarks/device_runs/run119.sh tests2    (the GPU cases of Q3_K, Q2_K and the IQ4 formats: about 5)
#   bash benchmarks/device_runs/run119.sh kquants   (the 4- to 6-bit K-quant steps: about 6)
#   bash benchmarks/device_runs/run119.sh low       (the Q3_K, Q2_K and IQ4_XS steps: about 6)
#   bash benchmarks/device_runs/run119.sh tiles     (MXFP4 groups in tiles: about 4)
#   bash benchmarks/device_runs/run119.sh moe       (Qwen3-30B-A3B as a Q4_K_M GGUF holds it, reference and fused: not
#                                                   yet timed; the random codes are made on the host first)
# Each phase first builds the megakernel variants and fused kernels it needs, all at once (cached on a warm
# machine). It checks and times what was written after run 118 (lithos/custom_calls/NOTES.md, "Q4_K and Q6_K rows
# through the lane ring", "K_MIX through the ring", "Q5_K through the ring", "Q3_K and Q2_K kept packed", "IQ4_NL
# and IQ4_XS kept packed"):
# - tests: K_MIX's 36-byte records and Q5_K's re-packed ones on the fused kernels (with every Q4_K and Q6_K case:
#   their register path reads records by word shifts since run 117); K_MIX and Q5_K rows through the megakernel's
#   lane ring (asked for with LITHOS_MK_RING_NEW=1 until this run passed: the default since, the define ignored); O
#   and down in formats of their own (a Q4_K_M file as the megakernel now reads it: Q/K/V and down in K_MIX, O, gate
#   and up in Q4_K);
# - tests2: the new Q3_K, Q2_K, IQ4_NL and IQ4_XS formats on the fused kernels and the megakernel (IQ4 through the
#   ring, asked for as above);
# - kquants: 8B Q4_K_M and Q5_K (fused and megakernel), 8B Q6_K and 1B Q4_K on the megakernel;
# - low: 8B Q3_K, Q2_K and IQ4_XS (fused and megakernel);
# - tiles: the MXFP4 groups in tiles not yet timed (gate/up + down, gate/up + down + O) beside the default.
# Everything lands in $OUT/run119-<phase>.tar.gz, rewritten after every step.
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:?usage: run119.sh tests|tests2|kquants|low|tiles|moe}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 LITHOS_CACHE_DIR=$PWD/.carry/kcache LITHOS_KERNEL_DEFINES=LITHOS_MK_RING_NEW=1
work=/tmp/r119
mkdir -p "$work"
save() { tar -C "$work" -czf "$OUT/run119-$phase.tar.gz" .; }
start=$SECONDS
log() { echo "== $* at $((SECONDS - start)) s"; }
lithos=(python3 -c 'import sys; from lithos.cli import main; sys.exit(main())')
gpu_pytest=(env XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.12 python3 -m pytest -q
  -p no:cacheprovider)
case $phase in  # the megakernel builds each phase uses (benchmarks/build_variants.py)
  tests) variants="q4_k:q6_k:q6_k q6_k:q4_k:bfloat16 q5_k:q5_k:q6_k q4_k:k_mix:bfloat16 q4_k:q4_k:bfloat16
    k_mix:q4_k:bfloat16:q4_k:k_mix k_mix:q5_k:bfloat16:q5_k:k_mix q5_0:q5_1:q8_0" ;;
  tests2) variants="q3_k:q2_k:q6_k k_mix:q3_k:bfloat16:q3_k:k_mix iq4_nl:iq4_xs:iq4_nl iq4_xs:iq4_xs:iq4_xs" ;;
  kquants) variants="k_mix:q4_k:bfloat16:q4_k:k_mix q5_k:q5_k:bfloat16 q6_k:q6_k:bfloat16 q4_k:q4_k:bfloat16" ;;
  low) variants="q3_k:q3_k:bfloat16 q2_k:q2_k:bfloat16 iq4_xs:iq4_xs:bfloat16" ;;
  tiles) variants="gate_up gate_up,down gate_up,down,o" ;;
  moe) variants="" ;;  # the fused kernels only (the megakernel has no mixture-of-experts step)
  *) echo "usage: run119.sh tests|tests2|kquants|low|tiles|moe"; exit 2 ;;
esac

log build  # all at once (2-3 minutes on 16 cores): the tests and benches would build them one by one
# shellcheck disable=SC2086
python3 benchmarks/build_variants.py $variants >"$work/build-$phase.log" 2>&1
grep FAILED "$work/build-$phase.log" | cut -c1-300

if [ "$phase" = tests ] || [ "$phase" = tests2 ]; then
  log "$phase"
  if [ "$phase" = tests ]; then select="q4_k or q5 or q6_k or k_mix or mixed"; else select="q2_k or q3_k or iq4"; fi
  timeout 300 "${gpu_pytest[@]}" -n 6 tests/test_megakernel_gpu.py tests/test_custom_calls_packed_gpu.py \
    -k "$select" >"$work/$phase.log" 2>&1
  grep -E "passed|failed|FAILED|Error" "$work/$phase.log" | tail -30
  save
  log done
  exit 0
fi

step() {  # step TILES SHAPE FORMAT KERNELS
  local tiles=$1 shape=$2 fmt=$3 kernels=$4
  local tag=run119-${shape##*-}-$fmt-${tiles//,/+}
  LITHOS_TILES=$tiles timeout "${STEP_TIMEOUT:-150}" "${lithos[@]}" bench --shape "$shape" --context 1024 --weight-format "$fmt" \
    --kernels "$kernels" --out "$work" --tag "$tag" >"$work/$tag.log" 2>&1
  grep -E "^$shape" "$work/$tag.log" | sed "s/^/$tiles /"
  save
}
log "$phase"
if [ "$phase" = kquants ]; then
  step gate_up llama-3.1-8b q4_k_m fused,megakernel
  step gate_up llama-3.1-8b q5_k fused,megakernel
  step gate_up llama-3.1-8b q6_k megakernel
  step gate_up llama-3.2-1b q4_k megakernel
elif [ "$phase" = moe ]; then
  STEP_TIMEOUT=480 step gate_up qwen3-30b-a3b q4_k_m reference,fused  # 61 GB of random bf16 weights packed first
elif [ "$phase" = low ]; then
  step gate_up llama-3.1-8b q3_k fused,megakernel
  step gate_up llama-3.1-8b q2_k fused,megakernel
  step gate_up llama-3.1-8b iq4_xs fused,megakernel
else
  step gate_up llama-3.1-8b mxfp4 megakernel
  step gate_up,down llama-3.1-8b mxfp4 megakernel
  step gate_up,down,o llama-3.1-8b mxfp4 megakernel
fi
log done
