# The command line and the table that ab_builds.sh and ab_libs.sh share (sourced by both, never
# run): OUT VARIANT ... [-- bench_cuda.py arguments], each variant named by letters,
# digits, '_', '.' or '-', no name twice; then one compare_cuda.py table of their JSON.

# ab_parse PROG FORM "$@": sets out, variants (as given) and bench_args; exits
# 2 with PROG's message where no variant is given (FORM: how a variant is written).
ab_parse() {
  local prog="$1" form="$2"
  shift 2
  out="${1:?usage: $prog OUT $form ... [-- bench_cuda.py arguments]}"
  shift
  variants=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    variants+=("$1")
    shift
  done
  if [ "${1:-}" = "--" ]; then shift; fi
  bench_args=("$@")
  if [ ${#variants[@]} -eq 0 ]; then
    echo "$prog: no variant given ($form)" >&2
    exit 2
  fi
}

# ab_add_name PROG VARIANT NAME: appends NAME to names, or exits 2 where it is no name or taken.
ab_add_name() {
  local prog="$1" v="$2" name="$3" seen
  if [[ ! "$name" =~ ^[A-Za-z0-9_.-]+$ ]]; then
    echo "$prog: variant '$v' needs a name of letters, digits, '_', '.' or '-'" >&2
    exit 2
  fi
  for seen in "${names[@]}"; do
    if [ "$seen" = "$name" ]; then
      echo "$prog: variant name '$name' given twice" >&2
      exit 2
    fi
  done
  names+=("$name")
}

# ab_table OUT JSON... : one compare_cuda.py table of the runs, columns named by the array cols,
# printed and written to OUT/compare.md.
ab_table() {
  local dir="$1"
  shift
  python3 bench/compare_cuda.py "$@" --names "$(
    IFS=,
    echo "${cols[*]}"
  )" | tee "$dir/compare.md"
}
