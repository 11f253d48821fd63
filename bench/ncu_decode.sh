#!/usr/bin/env bash
# One bench_cuda.py case under Nsight Compute: our decode kernel and ORT's (ORT 1.31 runs cuDNN's
# generated SDPA kernel, matched by "flash"), one launch each, the sections that say where a
# decode call's time goes (throughput, L2 hit rate, occupancy, issue rate). Full reports go to
# $OUT_DIR/ncu_<heads>_<case>_<kernel>.txt; a summary of each goes to stdout.
#
#   bash bench/ncu_decode.sh 9/3/64 64x16384            # heads N/Nkv/H, decode BxL
#   KERNELS=DecodeTc bash bench/ncu_decode.sh 28/4/128 1x4096
#   LIBRARY=/tmp/bv/libort_kvlayout.so bash bench/ncu_decode.sh 28/4/128 64x16384   # a build
#
# ncu locks the SM clock near its base (1.33 GHz on the H200): compare kernels within one run,
# not with bench_cuda.py's times. Needs ncu, a GPU and the packages bench_cuda.py needs.
set -euo pipefail
cd "$(dirname "$0")/.."
heads="${1:?heads N/Nkv/H}" case="${2:?decode BxL}"
OUT_DIR="${OUT_DIR:-/tmp/ort_kvlayout_ncu}"
mkdir -p "$OUT_DIR"
SECTIONS=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy
          --section WarpStateStats --section LaunchStats --section SchedulerStats)
for kernel in ${KERNELS:-DecodeTc flash}; do
  report="$OUT_DIR/ncu_${heads//\//-}_${case}_${kernel}.txt"
  # The fifth launch: after bench_cuda.py's warm-ups, so caches and plans are those of a timed run.
  ncu "${SECTIONS[@]}" -k "regex:$kernel" --launch-skip 4 --launch-count 1 \
    python3 bench/bench_cuda.py --runs 2 --heads "$heads" --decode "$case" --prefill= \
    ${LIBRARY:+--library "$LIBRARY"} >"$report" 2>&1 || true
  echo "== $heads $case kernel ~ $kernel ($report)"
  grep -E "^  [a-z_].*\(|Duration|DRAM Throughput|L2 Hit Rate|Registers Per|Grid Size|Block Size|Dynamic Shared|Issued Warp|Achieved Active Warps|Theoretical Occupancy" \
    "$report" | awk '!seen[$0]++' | cut -c1-120 || echo "   no profile (see $report)"
done
