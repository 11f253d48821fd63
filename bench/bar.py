"""Where a bench_cuda.py grid stands against issue 8's bar, one column per run.

    python bench/bar.py bench/results/cuda-h200.json [other.json ...] [--names a,b,...]

Each JSON is bench_cuda.py's `--json` output (the whole grid: `python bench/bench_cuda.py
--json F`). Rows of the table, each counted over the grid's points (a point passes only where
both layouts do):

- decode at or above 1.0x ORT, the lowest ratio and where, the median ratio per batch size;
- decode at or above 1.3x where ORT reads below half the copy bandwidth (`--copy-tbs`, 4.24
  TB/s: the H200's device-to-device copy, measured with the issue's first grid);
- where the KV cache read is at least 1 GiB: the TB/s of each layout, and the points at or
  above 4.3 TB/s;
- prefill at or above 1.0x ORT, its lowest ratio;
- kv_layout=1 / kv_layout=0 time outside 0.97 to 1.03 (decode and prefill).

The summaries of docs/BENCHMARKS.md and README.md come from this script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import bench_cuda  # a sibling: the bytes a decode point reads

GIB = 1 << 30
LAYOUTS = ("kv0", "kv1")


def kv_bytes(row: dict) -> int:
    """Bytes of K and V a decode point reads, as bench_cuda.py counts them for its TB/s."""
    _, nkv, h = (int(x) for x in row["heads"].split("/"))
    return bench_cuda.kv_read_bytes(row["batch"], nkv, row["length"], h)


def point(row: dict) -> str:
    letter = "L" if row["kind"] == "decode" else "S"
    return f"{row['heads']} B={row['batch']} {letter}={row['length']}"


def low(row: dict) -> float:
    return min(row[f"ratio{i}"] for i in range(len(LAYOUTS)))


def summary(rows: list[dict], copy_tbs: float) -> dict[str, str]:
    """The bar's rows for one grid, as table cells."""
    dec = [r for r in rows if r["kind"] == "decode"]
    pre = [r for r in rows if r["kind"] == "prefill"]
    out: dict[str, str] = {}
    if dec:
        out["decode >= 1.0x, both layouts"] = f"{sum(low(r) >= 1.0 for r in dec)} / {len(dec)}"
        worst = min(dec, key=low)
        layout = min(range(len(LAYOUTS)), key=lambda i: worst[f"ratio{i}"])
        out["lowest decode ratio"] = f"{low(worst):.3f} ({point(worst)} {LAYOUTS[layout]})"
        for i, name in enumerate(LAYOUTS):
            medians = []
            for b in sorted({r["batch"] for r in dec}):
                med = statistics.median(r[f"ratio{i}"] for r in dec if r["batch"] == b)
                medians.append(f"B={b} {med:.3f}")
            out[f"median decode ratio, {name}"] = ", ".join(medians)
        slow = [r for r in dec if r["ort"]["TB/s"] < 0.5 * copy_tbs]
        out[f"1.3x where ORT < {0.5 * copy_tbs:.2f} TB/s"] = (
            f"{sum(low(r) >= 1.3 for r in slow)} / {len(slow)}"
        )
        big = [r for r in dec if kv_bytes(r) >= GIB]
        if big:
            spans = [
                f"{min(r[v]['TB/s'] for r in big):.2f}-{max(r[v]['TB/s'] for r in big):.2f}"
                for v in LAYOUTS
            ]
            out[">= 1 GiB KV: TB/s kv0 / kv1"] = " / ".join(spans)
            at = sum(min(r[v]["TB/s"] for v in LAYOUTS) >= 4.3 for r in big)
            out["... at 4.3 TB/s in both layouts"] = f"{at} / {len(big)}"
    if pre:
        out["prefill >= 1.0x, both layouts"] = (
            f"{sum(low(r) >= 1.0 for r in pre)} / {len(pre)} (lowest {min(map(low, pre)):.3f})"
        )
    both = dec + pre
    if both:
        off = [r for r in both if not 0.97 <= r["kv1"]["kernel_ms"] / r["kv0"]["kernel_ms"] <= 1.03]
        out["kv1/kv0 outside 0.97-1.03"] = f"{len(off)} / {len(both)}"
    return out


def table(summaries: list[dict[str, str]], names: list[str]) -> list[str]:
    keys = list(dict.fromkeys(k for s in summaries for k in s))
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines += ["| " + k + " | " + " | ".join(s.get(k, "-") for s in summaries) + " |" for k in keys]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="bench_cuda.py --json files")
    p.add_argument("--names", help="column names (default: the file names)")
    p.add_argument(
        "--copy-tbs",
        type=float,
        default=4.24,
        help="the device's copy bandwidth, TB/s (the H200's by default)",
    )
    args = p.parse_args(argv)
    names = args.names.split(",") if args.names else [f.name for f in args.runs]
    if len(names) != len(args.runs):
        p.error(f"--names gives {len(names)} names for {len(args.runs)} runs")
    summaries = [summary(json.loads(f.read_text())["rows"], args.copy_tbs) for f in args.runs]
    print("\n".join(table(summaries, names)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
