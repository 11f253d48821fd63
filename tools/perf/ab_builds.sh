#!/usr/bin/env bash
# Builds against builds on the GPU machine, in one call: each variant is a library build with its
# own CUDA flags (a build knob such as KVL_DECODE_FLAT_MERGE_FLOATS) or its own source tree (another
# commit), all built in parallel; then the same bench_cuda.py command for each (ORT's op in every
# run), then one table of kernel times (compare_cuda.py, the first variant as the base).
#
#   bash tools/perf/ab_builds.sh /tmp/ab "base:" "flat64k:-DKVL_DECODE_FLAT_MERGE_FLOATS=65536" \
#       "head::/tmp/src_head" -- --runs 8 --prefill= --heads 28/4/128 --decode 1x4096,1x16384
#
# A variant is NAME:FLAGS (CMAKE_CUDA_FLAGS, may be empty) or NAME:FLAGS:SRC (a source tree, e.g.
# `git archive REV | tar -x -C SRC`). Builds for sm_90 without cuDNN (the decode experiments;
# prefill then runs our own kernels, not cuDNN). Needs cmake, nvcc, the ORT headers
# (ORT_INCLUDE_DIR, else the build fetches them) and what bench_cuda.py needs. Writes
# OUT/build_NAME/ (and its .log), OUT/NAME.json, OUT/NAME.md, OUT/compare.md. Variants run one
# after another in the order given: compare within one call, and repeat the first at the end
# (under another name) to see the drift.
set -euo pipefail
cd "$(dirname "$0")/../.."
source tools/perf/ab_common.sh
ab_parse ab_builds.sh "NAME:FLAGS[:SRC]" "$@"
names=()
for v in "${variants[@]}"; do
  IFS=: read -r name _ _ <<<"$v"
  ab_add_name ab_builds.sh "$v" "$name"
done
mkdir -p "$out"
out="$(cd "$out" && pwd)"

# Every variant's build at once, the cores shared among them.
cores=$(nproc)
jobs=$(((cores + ${#variants[@]} - 1) / ${#variants[@]}))
pids=()
for v in "${variants[@]}"; do
  IFS=: read -r name flags src <<<"$v"
  src="${src:-.}"
  (cmake -S "$src" -B "$out/build_$name" -DORT_KVLAYOUT_CUDA=ON -DORT_KVLAYOUT_CUDNN=OFF \
    -DCMAKE_CUDA_ARCHITECTURES=90-real "-DCMAKE_CUDA_FLAGS=$flags" >"$out/build_$name.log" 2>&1 &&
    cmake --build "$out/build_$name" -j "$jobs" --target ort_kvlayout >>"$out/build_$name.log" 2>&1) &
  pids+=($!)
done
failed=0
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    echo "ab_builds.sh: build of '${variants[$i]}' failed: $out/build_${names[$i]}.log" >&2
    failed=1
  fi
done
if [ "$failed" -ne 0 ]; then exit 1; fi
echo "built ${#variants[@]} variants in $out" >&2

jsons=()
for name in "${names[@]}"; do
  lib="$out/build_$name/libort_kvlayout.so"
  if ! python3 bench/bench_cuda.py "${bench_args[@]}" --library "$lib" --json "$out/$name.json" \
    >"$out/$name.md" 2>"$out/$name.err"; then
    echo "ab_builds.sh: bench_cuda.py on '$name' failed: $out/$name.err" >&2
    tail -n 5 "$out/$name.err" >&2
    exit 1
  fi
  jsons+=("$out/$name.json")
  echo "measured $name" >&2
done
cols=("${names[@]}")
ab_table "$out" "${jsons[@]}"
