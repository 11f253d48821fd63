#!/usr/bin/env bash
# The GPU test suite of ort-kvlayout, run from anywhere on the GPU machine (H200).
#
#   bash scripts/run_gpu_tests.sh                      # the GPU suite (target: < 3 min)
#   SANITIZER=memcheck  bash scripts/run_gpu_tests.sh  # + compute-sanitizer memcheck (small subset)
#   SANITIZER=racecheck bash scripts/run_gpu_tests.sh  # + racecheck (same subset)
#   SANITIZER=all SUITE=0 bash scripts/run_gpu_tests.sh  # both sanitizers, without the full suite
#
# Environment:
#   GQA_GPU_SEED   data seed (default: drawn here and printed; rerun with it to reproduce)
#   SUITE=0        skip the full suite        SANITIZER=none|memcheck|racecheck|all (default none)
#   ALLOW_SKIP=1   do not fail when no GPU test ran (e.g. no CUDAExecutionProvider)
#   LOG_DIR        where logs go (default: $OUT when set, else /tmp/ort_kvlayout_gpu_tests)
#   PYTEST_ARGS    extra pytest arguments (e.g. "-k graph")
#   SAN_EXTRA_K    a -k expression that narrows the sanitizer subset (split a pass over calls)
#   SAN_SHARDS=N   each sanitizer pass as N processes at once (default 1; see sanitize below)
#   SAN_KERNEL_EXCLUDE  kernels whose names hold this substring are not checked (e.g. "cudnn":
#                  racecheck reports hazards inside cuDNN's wgmma kernels, not in ours)
#   ALONE=N        + each GPU test file alone, and N tests drawn at random (from the seed), each
#                  alone in a fresh process (cold: new CUDA context, first session)
#   WARM=1         + the suite twice in one process (warm: sessions, context and caches reused)
# Exit status: 0 when every selected pass succeeded, else the first failing pass's status
# (sanitizer errors give 3; "no test ran" gives 4).
set -u
cd "$(dirname "$0")/.."

# onnxruntime-gpu lives in /opt/devwheels on the GPU machine (see shared/GPU.md).
if [ -d /opt/devwheels ] && ! python3 -c 'import onnxruntime as o, sys; sys.exit("CUDAExecutionProvider" not in o.get_available_providers())' 2>/dev/null; then
  export PYTHONPATH="/opt/devwheels${PYTHONPATH:+:$PYTHONPATH}"
fi
export GQA_GPU_SEED="${GQA_GPU_SEED:-$(python3 -c 'import random; print(random.randrange(1, 10**9))')}"
LOG_DIR="${LOG_DIR:-${OUT:-/tmp/ort_kvlayout_gpu_tests}}"
mkdir -p "$LOG_DIR"
SANITIZER="${SANITIZER:-none}"
SUITE="${SUITE:-1}"
PYTEST_ARGS="${PYTEST_ARGS:-}"
# Every file with GPU tests: the op (and its quantized caches and their plan), graph capture, a quiet log, the KV cache and runtime on the
# device, device-side length errors, a sliding-window model through onnxruntime-genai, SampleTokens. The
# sanitizer passes take the op's own files (SAN_FILES): the others add runtime code
# (CUDA virtual memory, sessions) but no kernel of ours that the op files do not reach.
FILES="tests/op/test_gqa_cuda.py tests/op/test_gqa_cuda_quant.py tests/op/test_cuda_graph.py
  tests/op/test_quiet_log.py tests/runtime/test_kv_cache_gpu.py tests/op/test_cuda_length_errors.py
  tests/tools/test_genai_sliding_window.py tests/op/test_gqa_nonfinite.py
  tests/serve/test_engine_gpu.py tests/op/test_sample_op.py tests/op/test_decode_plan_quant.py"
SAN_FILES="tests/op/test_gqa_cuda.py tests/op/test_gqa_cuda_quant.py tests/op/test_cuda_graph.py
  tests/op/test_cuda_length_errors.py"

echo "== preflight (GQA_GPU_SEED=$GQA_GPU_SEED, logs in $LOG_DIR)"
python3 - <<'EOF'
import sys
import onnxruntime as ort
print("python", sys.version.split()[0], "| onnxruntime", ort.__version__, ort.__file__)
print("providers:", ort.get_available_providers())
try:
    import ort_kvlayout
    print("ort_kvlayout", ort_kvlayout.__file__)
    print("library:", ort_kvlayout.library_path())
    print("build_info:", ort_kvlayout.build_info())
    print("cuda_available:", ort_kvlayout.cuda_available())
except Exception as e:
    print("ort_kvlayout NOT usable:", type(e).__name__, e)
EOF
command -v nvidia-smi >/dev/null && nvidia-smi -L

declare -a SUMMARY=()
STATUS=0

# One line of the summary; the first non-zero status becomes the script's.
record_pass() {  # name, rc, seconds, what it said
  SUMMARY+=("$(printf '%-22s rc=%-3s %4ss  %s' "$1" "$2" "$3" "$4")")
  if [ "$2" -ne 0 ] && [ "$STATUS" -eq 0 ]; then STATUS=$2; fi
}

# A pass that ended with status `rc` after `seconds`, its output in `log`.
finish_pass() {  # name, log file, rc, seconds
  local name="$1" log="$2" rc="$3" seconds="$4"
  local line
  # pytest's closing line ("... N passed ... in 12.3s"), not compute-sanitizer's "0 errors".
  line=$(grep -E "[0-9]+ (passed|failed|skipped|errors?).* in [0-9.]+s" "$log" | tail -1)
  if [ "$rc" -eq 0 ] && [ "${ALLOW_SKIP:-0}" != "1" ] && ! grep -qE "[0-9]+ passed" <<<"$line"; then
    echo "!! $name: no test passed (all skipped?): see the skip reasons in $log; ALLOW_SKIP=1 to accept"
    rc=4
  fi
  record_pass "$name" "$rc" "$seconds" "${line:-no pytest summary}"
}

run_pass() {  # name, log file, command...
  local name="$1" log="$2"
  shift 2
  echo
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$log"
  finish_pass "$name" "$log" "${PIPESTATUS[0]}" "$((SECONDS - t0))"
}

if [ "$SUITE" != "0" ]; then
  # shellcheck disable=SC2086
  run_pass "gpu suite" "$LOG_DIR/gpu_suite.log" \
    python3 -m pytest -q -m gpu -rs -p no:cacheprovider --durations=15 $FILES $PYTEST_ARGS
fi

# The sanitizer subset: GQA_GPU_QUICK=1 thins every grid (core cases, features, errors,
# out-of-range lengths in child processes, a 12-step graph replay); ORT's own kernels are left
# out (-k) so reports are about ours.  Child processes are followed (--target-processes all).
# The decode kernel's packed heads (eight warps) serve the shapes of their rule by default, and
# the subset checks them in test_decode_packed_heads_vs_oracle's 64 entries of 9/3/64 (packed on
# GPUs of 128 to 142 SMs with 200 KB of shared memory per block, the H200 among them); no other
# case of the subset has that many rows of 3 kv heads.
SAN_K="not vs_ort_cuda and not ort_builtin and not deterministic"
# SAN_EXTRA_K narrows the subset further, to split a slow sanitizer pass over several calls of
# the GPU machine (each call is limited to 10 min), e.g.
#   SAN_EXTRA_K="vs_oracle or features"          then   SAN_EXTRA_K="not vs_oracle and not features"
if [ -n "${SAN_EXTRA_K:-}" ]; then SAN_K="$SAN_K and ($SAN_EXTRA_K)"; fi
# SAN_SHARDS=N (default 1) runs each sanitizer pass as N processes at once, over a round-robin
# deal of the subset's test ids: under a sanitizer the small tests are bound by the host (its
# start-up and instrumentation, sessions), not by the GPU. Each shard is a pass of its own in the
# summary (logs sanitizer_TOOL.shardK.log).
sanitize() {  # tool
  local tool="$1"
  local exclude=()
  if [ -n "${SAN_KERNEL_EXCLUDE:-}" ]; then exclude=(--kernel-name-exclude "kns=$SAN_KERNEL_EXCLUDE"); fi
  local san=(env GQA_GPU_QUICK=1
             compute-sanitizer --tool "$tool" --error-exitcode 3
             --target-processes all --report-api-errors no --print-limit 20 "${exclude[@]}")
  local shards="${SAN_SHARDS:-1}"
  if [[ ! "$shards" =~ ^[1-9][0-9]*$ ]]; then
    echo "!! SAN_SHARDS must be a positive integer, got '$shards'"
    record_pass "sanitizer $tool" 2 0 "SAN_SHARDS='$shards' refused"
    return
  fi
  if [ "$shards" -le 1 ]; then
    # shellcheck disable=SC2086
    run_pass "sanitizer $tool" "$LOG_DIR/sanitizer_$tool.log" \
      "${san[@]}" python3 -m pytest -q -x -m gpu -rs -p no:cacheprovider $SAN_FILES -k "$SAN_K" $PYTEST_ARGS
    return
  fi
  local ids=()
  # shellcheck disable=SC2086
  mapfile -t ids < <(GQA_GPU_QUICK=1 python3 -m pytest -q -m gpu -p no:cacheprovider --collect-only \
    $SAN_FILES -k "$SAN_K" $PYTEST_ARGS 2>/dev/null | grep '::')
  echo
  echo "== sanitizer $tool: ${#ids[@]} tests in $shards shards at once"
  if [ "${#ids[@]}" -eq 0 ]; then
    record_pass "sanitizer $tool" 4 0 "no test collected"
    return
  fi
  local t0=$SECONDS k i
  local pids=() names=()
  for ((k = 0; k < shards && k < ${#ids[@]}; k++)); do
    local mine=()
    for ((i = k; i < ${#ids[@]}; i += shards)); do mine+=("${ids[$i]}"); done
    local log="$LOG_DIR/sanitizer_$tool.shard$k.log"
    # shellcheck disable=SC2086
    ("${san[@]}" python3 -m pytest -q -x -m gpu -rs -p no:cacheprovider "${mine[@]}" $PYTEST_ARGS \
      >"$log" 2>&1; echo $? >"$log.rc") &
    pids+=($!)
    names+=("$k")
  done
  wait "${pids[@]}"
  for k in "${names[@]}"; do
    local log="$LOG_DIR/sanitizer_$tool.shard$k.log"
    tail -n 3 "$log"
    finish_pass "sanitizer $tool $((k + 1))/${#names[@]}" "$log" "$(cat "$log.rc")" "$((SECONDS - t0))"
  done
}
case "$SANITIZER" in
  none | "") ;;
  memcheck | racecheck) sanitize "$SANITIZER" ;;
  all) sanitize memcheck; sanitize racecheck ;;
  *) echo "unknown SANITIZER=$SANITIZER (none|memcheck|racecheck|all)"; STATUS=2 ;;
esac

if [ "${ALONE:-0}" != "0" ]; then
  for f in $FILES; do  # the whole file (PYTEST_ARGS does not narrow it)
    run_pass "alone $(basename "$f" .py)" "$LOG_DIR/alone_$(basename "$f" .py).log" \
      python3 -m pytest -q -m gpu -rs -p no:cacheprovider "$f"
  done
  # shellcheck disable=SC2086
  mapfile -t PICKED < <(python3 -m pytest -q -m gpu -p no:cacheprovider --collect-only $FILES 2>/dev/null |
    grep '::' | ALONE="$ALONE" python3 -c "import random, sys, os; ids = sys.stdin.read().split(); random.Random(int(os.environ['GQA_GPU_SEED'])).shuffle(ids); print('\n'.join(ids[:int(os.environ['ALONE'])]))")
  for t in "${PICKED[@]}"; do
    # One test may be an allowed refusal (a visible skip): that is not a failure here.
    ALLOW_SKIP=1 run_pass "alone (cold) ${t##*::}" "$LOG_DIR/alone_one.log" \
      python3 -m pytest -q -m gpu -rs -p no:cacheprovider "$t"
  done
fi
if [ "${WARM:-0}" != "0" ]; then
  # shellcheck disable=SC2086
  run_pass "suite twice (warm)" "$LOG_DIR/gpu_suite_warm.log" python3 - $FILES $PYTEST_ARGS <<'EOF'
import sys
import pytest
args = ["-q", "-m", "gpu", "-rs", "-p", "no:cacheprovider", *sys.argv[1:]]
first = pytest.main(args)
second = pytest.main(args)  # same process: sessions, CUDA context and caches are warm
print(f"warm pass: first run exit {int(first)}, second run exit {int(second)}")
sys.exit(int(first) or int(second))
EOF
fi

echo
echo "== summary (GQA_GPU_SEED=$GQA_GPU_SEED; logs in $LOG_DIR)"
for s in "${SUMMARY[@]}"; do echo "  $s"; done
echo "exit $STATUS"
exit "$STATUS"
