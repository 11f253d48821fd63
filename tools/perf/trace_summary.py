"""Medians of the decode kernel's KVL_DECODE_TRACE marks, per case and line kind.

    python bench/bench_cuda.py --runs 4 --prefill= --heads 28/4/128 --decode 1x1024,1x4096 \\
        --library /tmp/trace/libort_kvlayout.so > trace.out
    python tools/perf/trace_summary.py trace.out

A trace build (tools/perf/README.md) prints one line per CTA that traces, per launch:
`KVL_TRACE <kind> hd=.. rows=.. bg=.. keys=.. <k1>=.. live=.. <k3>=.. cycles c1 .. c9 start_ns=..`
(-1 for marks not taken). Lines are grouped by case (head size, query rows per CTA, B x Nkv,
live keys) and by kind: a merge (`cluster`, `cluster-tree`, `flat`, `tree`) or a prologue line,
whose role is split 0, the CTA that appends the new row, or the last live split. Each column is
the median, over the group's lines, of the clock64 cycles from the CTA's start to that mark
(cumulative, not per phase). The warm-up launches count too: their marks differ from the timed
ones' by less than the spread between CTAs. A printf costs the printing CTA about 100k cycles
(measured on an H200): a CTA's marks after its own earlier line (split 0's merge after its
prologue line) include it, and a trace build's kernel times are not the normal build's.

A KVL_DECODE_TRACE=2 build prints instead one `KVL_TRACE cta ...` line per CTA of row 0 with the
%globaltimer at which its partial was written (`end_ns`): the first table then gives, per case,
the launches' median start spread of the CTAs and when the first partial, split 0's, the
appender's and the last one were written (ns from the launch's first CTA start), and which split
wrote the last partial in how many launches.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

LINE = re.compile(
    r"KVL_TRACE (?P<kind>[\w-]+) hd=(?P<hd>\d+) rows=(?P<rows>\d+) bg=(?P<bg>\d+) keys=(?P<keys>\d+) "
    r"(?P<k1>\w+)=(?P<v1>\d+) live=(?P<live>\d+) (?P<k3>\w+)=(?P<v3>\d+) "
    r"cycles (?P<cycles>(?:-?\d+ )+)start_ns=(?P<start>\d+)"
    r"(?: end_ns=(?P<end>\d+) partial=(?P<partial>-?\d+))?"
)
# Lines of one launch start within microseconds of each other; launches are further apart.
LAUNCH_GAP_NS = 50_000
# What each mark of a line kind is (decode_instrument.cuh, DecTrace and its Mark calls); `cta` lines
# (KVL_DECODE_TRACE=2) go to the arrivals table instead.
MARKS = {
    "prologue": ["lengths", "partition", "issued", "q frags", "first landed"],
    "cluster": ["partial", "barrier", "values", "values warm", "last barrier"],
    # One cluster's merge by pushes (branch decode-cluster-push), printed by split 0: its
    # partial, the members' pushes all landed (its mbarrier), its values.
    "cluster-push": ["partial", "mbarrier", "values"],
    "flat": ["partial", "arrival", "weights", "values", "weights warm", "values warm"],
    "tree": ["partial", "arrival", "weights", "values", "top arrival", "top weights", "top values"],
    # Group clusters, printed by the row's last arrival: its own cluster's merge, then its merge
    # of the groups, a few-partial merge whose "weights" mark comes after its values (it has no
    # weights pass) and "values" after the CTA's barrier.
    "cluster-tree": [
        "partial",
        "barrier",
        "values",
        "values warm",
        "last barrier",
        "top arrival",
        "top weights",
        "top values",
    ],
}


def role(m: re.Match) -> str:
    """The line's kind, with a prologue's role: split 0, appender or last live split."""
    if m["kind"] != "prologue":
        return f"{m['kind']} ({m['v1']} splits, {m['live']} live, {m['v3']} groups)"
    if m["v3"] == "1":
        return f"prologue appender (split {m['v1']} of {m['live']})"
    return f"prologue split {m['v1']} of {m['live']}"


def arrivals(lines: list[re.Match]) -> list[str]:
    """KVL_DECODE_TRACE=2's per-CTA lines of one case, by launch: when each split's partial was
    written (ns from the launch's first CTA start), and which split's came last."""
    launches: list[list[re.Match]] = []
    for m in sorted(lines, key=lambda m: int(m["start"])):
        if not launches or int(m["start"]) - int(launches[-1][0]["start"]) > LAUNCH_GAP_NS:
            launches.append([])
        launches[-1].append(m)
    last_split: dict[str, int] = defaultdict(int)
    firsts, lasts, spreads, split0, appender = [], [], [], [], []
    for ctas in launches:
        t0 = min(int(m["start"]) for m in ctas)
        done = {int(m["v1"]): int(m["end"]) - t0 for m in ctas}
        spreads.append(max(int(m["start"]) for m in ctas) - t0)
        firsts.append(min(done.values()))
        lasts.append(max(done.values()))
        last = max(ctas, key=lambda m: int(m["end"]))
        last_split[f"{last['v1']}{' (appends)' if last['v3'] == '1' else ''}"] += 1
        split0 += [v for k, v in done.items() if k == 0]
        appender += [int(m["end"]) - t0 for m in ctas if m["v3"] == "1"]

    def med(v: list[int]) -> str:
        return f"{statistics.median(v):.0f}" if v else "-"

    most = ", ".join(f"{k}: {n}" for k, n in sorted(last_split.items(), key=lambda kv: -kv[1])[:3])
    m = lines[0]
    row = (
        f"| {m['hd']} | {m['rows']} | {m['bg']} | {m['keys']} | {m['live']} | {len(launches)} | "
        f"{med(spreads)} | {med(firsts)} | {med(split0)} | {med(appender)} | {med(lasts)} | {most} |"
    )
    return [row]


def summarize(text: str) -> str:
    groups: dict[tuple, list[list[int]]] = defaultdict(list)
    kinds: dict[tuple, str] = {}
    ctas: dict[tuple, list[re.Match]] = defaultdict(list)
    for m in LINE.finditer(text):
        if m["kind"] == "cta":  # one line per CTA: the arrivals table, not the marks table
            ctas[(int(m["hd"]), int(m["rows"]), int(m["bg"]), int(m["keys"]))].append(m)
            continue
        key = (int(m["hd"]), int(m["rows"]), int(m["bg"]), int(m["keys"]), role(m))
        cycles = [int(c) for c in m["cycles"].split()]
        groups[key].append([c for c in cycles if c >= 0])
        kinds[key] = m["kind"]
    if not groups and not ctas:
        raise ValueError("no KVL_TRACE lines (is the library a KVL_DECODE_TRACE=1 or 2 build?)")
    out = []
    if ctas:
        out += [
            (
                "Partials written, ns from the launch's first CTA start (KVL_DECODE_TRACE=2, row 0 "
                "of each launch; medians over launches):"
            ),
            "",
            (
                "| head size | rows | B x Nkv | live keys | splits | launches | start spread | "
                "first | split 0 | appender | last | last split (launches) |"
            ),
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for key in sorted(ctas):
            out += arrivals(ctas[key])
        out.append("")
    if not groups:
        return "\n".join(out).rstrip()
    out += [
        "| head size | rows | B x Nkv | live keys | line | n | marks: median cycles from the CTA's start |",
        "|---:|---:|---:|---:|---|---:|---|",
    ]
    for key in sorted(groups):
        lines = groups[key]
        width = min(len(c) for c in lines)
        names = MARKS.get(kinds[key], [])
        cells = []
        for i in range(width):
            name = names[i] if i < len(names) else f"c{i + 1}"
            cells.append(f"{name} {statistics.median(c[i] for c in lines):.0f}")
        hd, rows, bg, keys, what = key
        out.append(
            f"| {hd} | {rows} | {bg} | {keys} | {what} | {len(lines)} | {', '.join(cells)} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace", type=Path, nargs="+", help="stdout of bench_cuda.py on a trace build")
    args = p.parse_args(argv)
    try:
        print(summarize("\n".join(t.read_text() for t in args.trace)))
    except ValueError as e:
        print(f"trace_summary.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
