#!/usr/bin/env bash
# One bench_cuda.py case under Nsight Compute: our decode kernel and ORT's (ORT 1.31 runs cuDNN's
# generated SDPA kernel, matched by "flash"), one launch each, the sections that say where a
# decode call's time goes (throughput, L2 hit rate, occupancy, issue rate). Full reports go to
# $OUT_DIR/ncu_<heads>_<case>_<kernel>.txt; a summary of each goes to stdout.
#
#   bash tools/perf/ncu_decode.sh 9/3/64 64x16384            # heads N/Nkv/H, decode BxL
#   KERNELS=DecodeTc bash tools/perf/ncu_decode.sh 28/4/128 1x4096
#   LIBRARY=/tmp/bv/libort_kvlayout.so bash tools/perf/ncu_decode.sh 28/4/128 64x16384   # a build
#   L2=1 bash tools/perf/ncu_decode.sh 28/4/128 64x16384   # what the L2 serves (clock left free)
#   SKIP=13 KERNELS=DecodeTc bash tools/perf/ncu_decode.sh 9/3/64 64x16384  # kv_layout=1's launch
#   BENCH_ARGS="--kv-quant int8-per-channel" KERNELS=DecodeTc bash tools/perf/ncu_decode.sh \
#       32/8/128 1x16384   # more bench_cuda.py flags (quantized variants launch too: count SKIP
#                          # from the report's launch list, or profile them all: SKIP=0 COUNT=64)
#
# L2=1 measures instead the traffic between the SMs, the L2 and DRAM (bytes, requests, sectors,
# hits), with the SM clock left free
# (--clock-control none), so its durations are the benchmark's.
# ncu flushes the caches before each profiled launch; CACHE=none keeps them (--cache-control
# none), so the L2 holds what the previous launches left, as in bench_cuda.py's back-to-back runs:
#   L2=1 CACHE=none bash tools/perf/ncu_decode.sh 28/4/128 1x16384   # what a warm L2 serves
# ncu locks the SM clock near its base (1.33 GHz on the H200): compare kernels within one run,
# not with bench_cuda.py's times. Needs ncu, a GPU and the packages bench_cuda.py needs.
#
# SOURCE=1 adds the source counters (every SASS instruction's executions and warp samples) and
# prints, per profiled kernel, how much of its code the launch executed and where its warps
# waited for instructions, per line of decode_kernel.cuh (its phases) where nvdisasm and
# cuobjdump are found (tools/perf/sass_regions.py; the library must be a -lineinfo build, as
# the package's is). KERNELS entries are then substrings of mangled names, one instance each
# (the head tile too: a file's cubin holds the instances of both tiles):
#   SOURCE=1 SKIP=2 BENCH_ARGS='--kv-quant int8-per-channel' \
#     KERNELS="Li128ELNS0_10DecodeFormE2ELi8EaEE Li128ELNS0_10DecodeFormE2ELi4ES2_EE" \
#     bash tools/perf/ncu_decode.sh 32/8/128 1x16384
set -euo pipefail
cd "$(dirname "$0")/../.."
heads="${1:?heads N/Nkv/H}" case="${2:?decode BxL}"
OUT_DIR="${OUT_DIR:-/tmp/ort_kvlayout_ncu}"
mkdir -p "$OUT_DIR"
SECTIONS=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy
          --section WarpStateStats --section LaunchStats --section SchedulerStats)
NAME_BASE=()
if [ "${SOURCE:-0}" = 1 ]; then
  SECTIONS+=(--section SourceCounters --warp-sampling-interval 0)
  NAME_BASE=(--kernel-name-base mangled)
fi
if [ "${L2:-0}" = 1 ]; then
  SECTIONS=(--clock-control none --metrics "gpu__time_duration.sum,dram__bytes_read.sum,\
dram__bytes_read.sum.per_second,l1tex__m_xbar2l1tex_read_bytes.sum,\
lts__t_requests_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,\
lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,lts__t_sectors_srcunit_tex_op_read_lookup_miss.sum,\
sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum")
fi
for kernel in ${KERNELS:-DecodeTc flash}; do
  report="$OUT_DIR/ncu_${heads//\//-}_${case}_${kernel}.txt"
  # The fifth launch (SKIP=4): after bench_cuda.py's warm-ups, so caches and plans are those of a
  # timed run. Under ncu each layout launches our kernel 9 times (3 warm-ups, 2 untimed runs, 2
  # runs in the profiler, which sees no CUPTI records, then 2 wall-time runs), kv0 first: SKIP=13
  # is kv1's fifth.
  rep="${report%.txt}" save=()
  [ "${SOURCE:-0}" = 1 ] && save=(-f -o "$rep")
  ncu "${SECTIONS[@]}" "${NAME_BASE[@]}" --cache-control "${CACHE:-all}" -k "regex:$kernel" \
    --launch-skip "${SKIP:-4}" --launch-count "${COUNT:-1}" "${save[@]}" \
    python3 bench/bench_cuda.py --runs 2 --heads "$heads" --decode "$case" --prefill= \
    ${LIBRARY:+--library "$LIBRARY"} ${BENCH_ARGS:-} >"$report" 2>&1 || true
  if [ "${SOURCE:-0}" = 1 ] && [ -f "$rep.ncu-rep" ]; then
    ncu -i "$rep.ncu-rep" >>"$report" 2>&1 || true
    ncu -i "$rep.ncu-rep" --page source --csv --print-source sass >"$rep.sass.csv" 2>&1 || true
    lines=()
    lib="${LIBRARY:-$(python3 -c 'import ort_kvlayout as k, pathlib; print(next(pathlib.Path(k.__file__).parent.glob("libort_kvlayout*.so")))' 2>/dev/null || true)}"
    if [ -n "$lib" ] && command -v cuobjdump >/dev/null && command -v nvdisasm >/dev/null; then
      elf="$(mktemp -d)"  # every cubin of the library: not beside the reports
      (cd "$elf" && cuobjdump -xelf all "$lib" >/dev/null 2>&1) || true
      cubin="$(grep -l "$kernel" "$elf"/*.cubin 2>/dev/null | head -1 || true)"
      if [ -n "$cubin" ] && nvdisasm -c -gi "$cubin" >"$rep.sass" 2>/dev/null; then
        lines=(--lines "$rep.sass" --kernel "$kernel")
      fi
      rm -rf "$elf"
    fi
    echo "== $heads $case $kernel: executed code ($rep.sass.csv)"
    python3 tools/perf/sass_regions.py "$rep.sass.csv" "${lines[@]}" --top 12 || true
  fi
  echo "== $heads $case kernel ~ $kernel ($report)"
  grep -E "^  [a-z_].*\(|^    [a-z0-9_]+__[a-z0-9_.]+ |Duration|DRAM Throughput|L2 Hit Rate|Registers Per|Grid Size|Block Size|Dynamic Shared|Issued Warp|Achieved Active Warps|Theoretical Occupancy" \
    "$report" | awk '!seen[$0]++' | cut -c1-120 || echo "   no profile (see $report)"
done
