#!/usr/bin/env bash
# Built libraries against each other on the GPU machine, in one call, with nothing to build there:
# each variant is NAME=DIR (DIR holds a libort_kvlayout.so, e.g. a cmake build carried to the
# machine) or NAME=DIR:VAR=VALUE (that variant's runs also set one environment variable, e.g. a
# plan knob, so one library runs twice). The same bench_cuda.py command for each, in ROUNDS
# rounds (default 2) with the variants interleaved in each, ORT's op in every run; then one
# table (compare_cuda.py: each round's variants in order, the first as the base).
#
#   bash tools/perf/ab_libs.sh /tmp/ab base=.device/base new=.device/new \
#       base_flat=.device/base:ORT_KVLAYOUT_DECODE_CLUSTERS=0 -- --runs 10 --prefill= \
#       --heads 9/3/64 --decode 1x1024
#
# Writes OUT/NAME_ROUND.json (and .err), OUT/compare.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
source tools/perf/ab_common.sh
ab_parse ab_libs.sh "NAME=DIR[:VAR=VALUE]" "$@"
names=() dirs=() envs=()
for v in "${variants[@]}"; do
  if [[ "$v" != *=* ]]; then
    echo "ab_libs.sh: variant '$v' needs NAME=DIR" >&2
    exit 2
  fi
  name="${v%%=*}"
  rest="${v#*=}"
  ab_add_name ab_libs.sh "$v" "$name"
  dir="${rest%%:*}"
  env=""
  if [ "$dir" != "$rest" ]; then
    env="${rest#*:}"
    if [[ ! "$env" =~ ^[A-Za-z_][A-Za-z0-9_]*=.*$ ]]; then
      echo "ab_libs.sh: variant '$v': after ':' a VAR=VALUE setting" >&2
      exit 2
    fi
  fi
  if [ ! -f "$dir/libort_kvlayout.so" ]; then
    echo "ab_libs.sh: variant '$name': no $dir/libort_kvlayout.so" >&2
    exit 2
  fi
  dirs+=("$dir")
  envs+=("$env")
done
rounds="${ROUNDS:-2}"
mkdir -p "$out"
jsons=() cols=()
for r in $(seq 1 "$rounds"); do
  for i in "${!names[@]}"; do
    json="$out/${names[$i]}_$r.json"
    settings=()
    if [ -n "${envs[$i]}" ]; then settings=("${envs[$i]}"); fi
    if ! env "${settings[@]}" python3 bench/bench_cuda.py "${bench_args[@]}" \
      --library "${dirs[$i]}/libort_kvlayout.so" --json "$json" >/dev/null \
      2>"$out/${names[$i]}_$r.err"; then
      echo "ab_libs.sh: bench_cuda.py on '${names[$i]}' (round $r) failed: $out/${names[$i]}_$r.err" >&2
      tail -n 5 "$out/${names[$i]}_$r.err" >&2
      exit 1
    fi
    jsons+=("$json")
    cols+=("${names[$i]}")
  done
  echo "round $r of $rounds measured" >&2
done
ab_table "$out" "${jsons[@]}"
