#!/usr/bin/env bash
# The A/B of the prepared decode branches against main on the H200, in one call of the GPU
# machine (12 bench_cuda.py runs, about 5 minutes): BASE, FI and DIV are folders holding each
# build's libort_kvlayout.so (cmake for sm_90 without cuDNN: bench/README.md; main, branch
# decode-fast-index, branch decode-fast-div), OUT a folder for the JSON. Two rounds, the variants
# interleaved in each, ORT's op in every run; then one table per case set (compare_cuda.py, the
# first column the base).
#
#   bash bench/results/exp-fast-index/run_ab.sh .device/v4 .device/fi .device/div $OUT/ab
set -euo pipefail
cd "$(dirname "$0")/../../.."
base=${1:?usage: run_ab.sh BASE_DIR FI_DIR DIV_DIR OUT}
fi_dir=${2:?} div_dir=${3:?} out=${4:?}
mkdir -p "$out"
heads=28/4/128,32/8/128,9/3/64,4/1/256
sets=("1x1024,1x4096,8x1024,8x4096" "1x16384,1x32768,8x16384,32x4096")
for r in a b; do
  for i in 0 1; do
    for v in base fi div; do
      case $v in base) d=$base ;; fi) d=$fi_dir ;; div) d=$div_dir ;; esac
      python3 bench/bench_cuda.py --runs 10 --prefill= --heads "$heads" --decode "${sets[$i]}" \
        --library "$d/libort_kvlayout.so" --json "$out/s${i}_${v}_$r.json" > /dev/null
    done
  done
  date -u +%H:%M:%S
done
for i in 0 1; do
  python3 bench/compare_cuda.py "$out/s${i}_base_a.json" "$out/s${i}_fi_a.json" \
    "$out/s${i}_div_a.json" "$out/s${i}_base_b.json" "$out/s${i}_fi_b.json" \
    "$out/s${i}_div_b.json" --names base,fi,div,base,fi,div
done
