"""Compare bench_cuda.py runs: one markdown row per case, kernel microseconds of each run.

    python bench/compare_cuda.py base.json other.json [more.json ...] [--names a,b,...]

Each JSON is bench_cuda.py's `--json` output; the runs must cover the same cases (same --heads,
--decode, --prefill, --capacity), as when two builds (`--library`) or two settings (an
environment variable) run the same command in one call. Columns: ORT's time in the first run,
then `kv_layout=0 / kv_layout=1` time in each run, then the last run's time over the first's
(kv_layout=0). tools/perf/ab_libs.sh and ab_builds.sh print their tables with it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def case_key(row: dict) -> tuple:
    return (row["kind"], row["heads"], row["batch"], row["length"], row["capacity"])


def case_name(row: dict) -> str:
    letter = "L" if row["kind"] == "decode" else "S"
    name = f"{row['kind']} B={row['batch']} {letter}={row['length']}"
    if row["capacity"] != row["length"]:
        name += f" C={row['capacity']}"
    return name


def us(row: dict, variant: str) -> float:
    return row[variant]["kernel_ms"] * 1e3


def compare(runs: list[list[dict]], names: list[str]) -> list[str]:
    keys = [case_key(r) for r in runs[0]]
    for name, rows in zip(names[1:], runs[1:], strict=True):
        if [case_key(r) for r in rows] != keys:
            raise SystemExit(f"{name}: not the cases of {names[0]} (run the same command)")
    head = ["case", "heads", f"ORT ({names[0]})", *names, f"{names[-1]} / {names[0]}"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for i, first in enumerate(runs[0]):
        cells = [f"{us(rows[i], 'kv0'):.1f} / {us(rows[i], 'kv1'):.1f}" for rows in runs]
        ratio = us(runs[-1][i], "kv0") / us(first, "kv0")
        row = [case_name(first), first["heads"], f"{us(first, 'ort'):.1f}", *cells, f"{ratio:.3f}"]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="bench_cuda.py --json files, base first")
    p.add_argument("--names", default="", help="column names (default: the file names)")
    args = p.parse_args(argv)
    if len(args.runs) < 2:
        p.error("give at least two runs")
    names = args.names.split(",") if args.names else [f.stem for f in args.runs]
    if len(names) != len(args.runs):
        p.error(f"{len(names)} names for {len(args.runs)} runs")
    runs = [json.loads(f.read_text())["rows"] for f in args.runs]
    print("\n".join(compare(runs, names)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
