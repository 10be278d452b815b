# Shared by the device-run scripts from run 125 on: `source benchmarks/device_runs/lib.sh RUN PHASE` from the
# repository root. Sets the environment every run uses and defines:
#   work                    the run's scratch folder (/tmp/RUN), packed into $OUT/RUN-PHASE.tar.gz by `save`
#   log WHAT                a timestamped progress line
#   lithos                  the CLI, importing the lithos on PYTHONPATH (python -P: not the working directory's)
#   bench_step SHAPE TAG [BENCH ARGS...]
#                           `lithos bench` of SHAPE at 1K on the fused kernels into $work, tagged RUN-TAG, its table
#                           line printed and saved; SOURCES (default: this tree) is the lithos it imports,
#                           STEP_TIMEOUT (default 120 s) its limit
#   bench TAG TIMEOUT [BENCH ARGS...]
#                           `lithos bench` at 1K into $work, tagged RUN-TAG, its table's rows printed and saved
#   traced NAME TIMEOUT [BENCH ARGS...]
#                           `lithos bench` at 1K with LITHOS_MEGAKERNEL_TRACE into $work/trace-NAME.json, the traced
#                           launch (the last: a verification step's where --spec runs rounds) summarised and saved
#   mxfp4_step TILES        the 8B MXFP4 megakernel step with LITHOS_TILES=TILES: timed (bench), then one traced
#                           step summarised (TAG_SUFFIX, if set, ends its tags)
#   spec_round SHAPE TAG [NAMES...]
#                           SHAPE's verification round (8b-mxfp4, 8b-bf16 or 1b-mxfp4: ngram drafts, k = 7 on 8B and
#                           15 on 1B, no acceptance run, megakernel) in the default build ("") and in each build NAMES
#                           name (their defines: the script's `defines` array), tagged RUN-round-SHAPE[-NAME]-TAG;
#                           each within ROUND_LIMIT seconds (default 60 for 8B, 45 for 1B)
#   build_variant NAME [LAYOUTS...]
#                           build_variants.py with NAME's defines (the script's `defines` array; "": none) into
#                           $work/build[-NAME].log: the bf16 build, the MXFP4 default layout (every group tiled, for
#                           steps and rounds since run 143), the one before it (Q/K/V + gate/up) and LAYOUTS,
#                           every token bucket's library, or those of BUILD_TOKENS (e.g. 1: one-token steps alone)
#   build_all [NAMES...]    build_variant for the default build and each of NAMES at once, then the builds' errors
#   run_tests NAME TIMEOUT PYTEST_ARGS...
#                           pytest into $work/NAME.log (a line a test), its summary printed and saved; where TIMEOUT
#                           stops it first, the tests passed and failed until then
#   seconds_left            the seconds of the call's RUN_LIMIT (default 430 s) not yet spent
#   fits SECONDS WHAT       whether SECONDS of them are left for WHAT (else it says so: the part is skipped)
run_name=${1:?usage: source lib.sh RUN PHASE}
run_phase=${2:?usage: source lib.sh RUN PHASE}
# LITHOS_CONFIGS: this tree's shapes and hardware, also for a SOURCES copy that holds only lithos/.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 LITHOS_CACHE_DIR=$PWD/.carry/kcache XLA_PYTHON_CLIENT_PREALLOCATE=false
export LITHOS_CONFIGS=$PWD/configs
work=/tmp/$run_name
mkdir -p "$work"
run_start=$SECONDS
save() { tar -C "$work" -czf "$OUT/$run_name-$run_phase.tar.gz" .; }
log() { echo "== $* at $((SECONDS - run_start)) s"; }
lithos=(python3 -P -c 'import sys; from lithos.cli import main; sys.exit(main())')

bench_step() {
  local shape=$1 tag=$run_name-$2
  shift 2
  PYTHONPATH=${SOURCES:-$PWD} timeout "${STEP_TIMEOUT:-120}" "${lithos[@]}" bench --shape "$shape" --context 1024 \
    --kernels fused "$@" --out "$work" --tag "$tag" >"$work/$tag.log" 2>&1
  grep -E "^$shape" "$work/$tag.log"
  save
}

bench() {
  local tag=$run_name-$1 limit=$2
  shift 2
  timeout "$limit" "${lithos[@]}" bench --context 1024 "$@" --out "$work" --tag "$tag" >"$work/$tag.log" 2>&1
  grep -E "^(llama|shape)" "$work/$tag.log"
  save
}

traced() {
  local name=$1 limit=$2
  shift 2
  LITHOS_MEGAKERNEL_TRACE="$work/trace-$name.json" timeout "$limit" "${lithos[@]}" bench --context 1024 "$@" \
    >"$work/trace-bench-$name.log" 2>&1
  python3 -m lithos.custom_calls.megakernel.trace "$work/trace-$name.json" >"$work/trace-$name.log" 2>&1
  head -9 "$work/trace-$name.log"
  save
}

mxfp4_step() {
  local tiles=$1 name=${1//,/-}${TAG_SUFFIX:-}
  LITHOS_TILES=$tiles bench "mxfp4-$name" 150 --shape llama-3.1-8b --weight-format mxfp4 --kernels megakernel
  LITHOS_TILES=$tiles traced "$name" 150 --shape llama-3.1-8b --weight-format mxfp4 --kernels megakernel --steps 32 \
    --runs 1
}

spec_round() {
  local shape=$1 tag=$2 name
  shift 2
  local args=(--draft-tokens 7 --shape llama-3.1-8b) limit=${ROUND_LIMIT:-60}
  [ "$shape" = 1b-mxfp4 ] && args=(--draft-tokens 15 --shape llama-3.2-1b) && limit=${ROUND_LIMIT:-45}
  [ "${shape#*-}" = mxfp4 ] && args+=(--weight-format mxfp4)
  for name in "$@"; do
    fits "$limit" "the $shape round (${name:-default})" && LITHOS_KERNEL_DEFINES=${name:+${defines[$name]}} bench \
      "round-$shape${name:+-$name}-$tag" "$limit" --spec ngram --no-acceptance --kernels megakernel "${args[@]}"
  done
}

build_variant() {
  local name=$1
  shift
  LITHOS_KERNEL_DEFINES=${name:+${defines[$name]}} python3 benchmarks/build_variants.py ${BUILD_TOKENS:+--tokens \
    "$BUILD_TOKENS"} qkv,gate_up qkv,o,gate_up,down "$@" >"$work/build${name:+-$name}.log" 2>&1
}

build_all() {
  local name
  log build
  build_variant "" &
  for name in "$@"; do build_variant "$name" & done
  wait
  grep -E "FAILED|rror" "$work"/build*.log | cut -c1-300
}

run_tests() {
  local name=$1 limit=$2 log=$work/$1.log
  shift 2
  timeout "$limit" python3 -m pytest -v -p no:cacheprovider "$@" >"$log" 2>&1
  if [ $? = 124 ]; then
    echo "$name: stopped by its $limit s limit: $(grep -c ' PASSED' "$log") passed, $(grep -c ' FAILED' "$log") failed"
    grep ' FAILED' "$log" | cut -c1-200
  else
    grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$log" | tail -8
  fi
  save
}

run_limit=${RUN_LIMIT:-430}
seconds_left() { echo $((run_limit - (SECONDS - run_start))); }
fits() {
  local left
  left=$(seconds_left)
  [ "$left" -ge "$1" ] && return 0
  echo "== skipped $2: ${left} s left"
  return 1
}
