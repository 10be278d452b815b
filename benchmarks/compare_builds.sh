#!/usr/bin/env bash
# Build variants side by side on one GPU, in one call: for the default build and each variant given
# (LITHOS_KERNEL_DEFINES strings), run the fused kernels' GPU tests at 4-16 positions, tune the
# 8-position launch parameters into the variant's own copy of the table, and time the speculative rounds
# (k = 7) of the 8B and 1B shapes. Everything lands in one tarball under OUT_DIR.
#
#   benchmarks/compare_builds.sh OUT_DIR "" "LITHOS_ATTENTION_MMA=128" "LITHOS_FUSED_MMA_CHUNKS=2"
#
# An empty string is the default build. SHAPES, TESTS (a pytest -k expression), TUNE_KERNELS (a comma
# list), ROUND_KERNELS (the paths the rounds time: fused unless given, e.g. fused,megakernel) and
# EXTRA_TESTS (more test files, run without their megakernel cases, e.g. "tests/test_ring_cache_gpu.py
# tests/test_kv_fp8_gpu.py") override the defaults; SKIP_TESTS=1 runs no tests (a build already tested),
# SKIP_TUNE=1 times the rounds on the committed table.
# The tarball is rewritten after every step, so a call cut short by its time limit still returns what ran.
# Time on the H200 (run 59): the builds about 50 s together; per build, the 36 attention tests 53 s, the
# 84 row-group tests about 85 s, tuning one kernel over both shapes about 20 s, each round about 20 s.
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(realpath "$1"); shift
[ $# -gt 0 ] || { echo "usage: $0 OUT_DIR DEFINES..." >&2; exit 2; }
shapes=${SHAPES:-"llama-3.1-8b llama-3.2-1b"}
tests=${TESTS:-"not -1] and not decode_attention or decode_attention and not -1-"}
tune_kernels=${TUNE_KERNELS:-matvec,gate_up_silu,qkv_rope_append,lm_head_argmax,decode_attention}
round_kernels=${ROUND_KERNELS:-fused}
kernels="--kernel matvec --kernel qkv_rope --kernel lm_head --kernel attention"
[[ $round_kernels == *megakernel* ]] && kernels+=" --kernel megakernel"  # built with the rest, not on first use
work=$(mktemp -d)
save() { tar -C "$work" -czf "$out/compare_builds.tar.gz" .; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
lithos() { python3 -c 'import sys; from lithos.cli import main; sys.exit(main())' "$@"; }
start=$SECONDS
log() { echo "== $* at $((SECONDS - start)) s"; }
# The tests share one GPU across workers: no preallocation.
gpu_pytest() { XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.1 python3 -m pytest -q -n 8 -p no:cacheprovider "$@"; }

for defines in "$@"; do  # every build first, in parallel: the compiles overlap
  LITHOS_KERNEL_DEFINES="$defines" python3 -m lithos.custom_calls.build $kernels >"$work/build-${defines:-default}.log" 2>&1 &
done
wait
log built
for defines in "$@"; do
  name=${defines:-default}; name=${name// /+}; name=${name//=/-}; dir=$work/$name; mkdir -p "$dir"
  export LITHOS_KERNEL_DEFINES="$defines" LITHOS_TUNING_DIR=$dir
  cp lithos/custom_calls/tuning/*.json "$dir/" 2>/dev/null
  if [ -z "${SKIP_TESTS:-}" ]; then
    log "tests $name"
    gpu_pytest tests/test_custom_calls_gpu.py -k "$tests" >"$dir/tests.log" 2>&1
    tail -1 "$dir/tests.log"
    if [ -n "${EXTRA_TESTS:-}" ]; then
      gpu_pytest $EXTRA_TESTS -k "not megakernel" >"$dir/extra-tests.log" 2>&1
      tail -1 "$dir/extra-tests.log"
    fi
    save
  fi
  if [ -z "${SKIP_TUNE:-}" ]; then
    log "tune $name"
    lithos tune $(printf -- '--shape %s ' $shapes) --tokens 8 --trials 10 \
      --kernels "$tune_kernels" --out "$dir" >"$dir/tune.log" 2>&1
    tail -12 "$dir/tune.log"
    save
  fi
  for shape in $shapes; do
    log "round $name $shape"
    lithos bench --spec ngram --draft-tokens 7 --shape "$shape" --context 1024 --steps 32 --runs 4 \
      --kernels "$round_kernels" --no-acceptance --out "$dir/$shape" --tag "$name" >"$dir/round-$shape.log" 2>&1
    grep -E "^$shape" "$dir/round-$shape.log"
    save
  done
done
log "done: $out/compare_builds.tar.gz"
