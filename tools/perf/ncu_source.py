"""Warp stall samples per source line of one kernel, from Nsight Compute's source page.

    ncu --section SourceCounters --warp-sampling-interval 0 -k regex:DecodeTc \\
        --launch-skip 4 --launch-count 1 -o decode python bench/bench_cuda.py ...
    ncu -i decode.ncu-rep --page source --csv --print-source cuda,sass > decode.csv
    python tools/perf/ncu_source.py decode.csv --top 40

Build with `-lineinfo` (CMAKE_CUDA_FLAGS) so SASS maps to lines. The CSV holds one section per
source file (a "File Path" row), each line's row (line number, text, "-" as its address) and then
its SASS rows. Code inlined from a header is listed under the header's line and again under its
caller's, so the per-file sums overlap (percentages are of the sum over lines). Samples are warp-time, not
wall time: with one CTA per SM, a phase that few CTAs run (a merge by the last CTA of a row)
weighs little here even where it is long.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"


@dataclass(frozen=True)
class Line:
    file: str
    number: int
    text: str
    samples: int
    calls: int  # SASS CALLs under the line (e.g. the 64-bit division routine)


def _count(text: str | None) -> int:
    """A counter cell: digits, or "-" / empty where ncu has no value (a line without SASS)."""
    return int(text) if text and text.isdigit() else 0


def read_lines(path: Path, column: str = SAMPLES) -> list[Line]:
    """The source lines of a `--print-source cuda,sass` CSV with their `column` counts (the warp
    stall samples unless another counter of the source page is named)."""
    lines: list[Line] = []
    current_file = "?"
    header: list[str] | None = None
    pending: dict | None = None

    def flush() -> None:
        if pending is not None:
            lines.append(Line(**pending))

    with path.open(newline="") as f:
        for row in csv.reader(f):
            if len(row) >= 2 and row[0] == "File Path":
                flush()
                pending = None
                current_file = Path(row[1]).name
                continue
            if row and row[0] == "Line No":
                header = row
                if column not in header:
                    raise KeyError(f"no column {column!r}; the page has: {', '.join(header[4:])}")
                continue
            if header is None or len(row) < len(header) - 1:
                continue
            rec = dict(zip(header, row))
            # The header names "Source" twice (the line's text, then the SASS text).
            line_text, sass_text = row[1], row[3] if len(row) > 3 else ""
            if row[0]:  # a source line: its own row carries the line's total
                flush()
                pending = {
                    "file": current_file,
                    "number": int(row[0]),
                    "text": line_text.strip(),
                    "samples": _count(rec.get(column)),
                    "calls": 0,
                }
            elif pending is not None and "CALL" in sass_text:
                pending["calls"] += 1
    flush()
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv", type=Path, help="ncu --page source --csv --print-source cuda,sass output")
    p.add_argument("--top", type=int, default=30, help="lines to list (most samples first)")
    p.add_argument(
        "--column",
        default=SAMPLES,
        help="the source page's counter to rank by, e.g. 'L2 Theoretical Sectors Global Excessive'",
    )
    args = p.parse_args(argv)
    try:
        lines = read_lines(args.csv, args.column)
    except KeyError as e:
        print(f"{args.csv}: {e.args[0]}", file=sys.stderr)
        return 1
    if not lines:
        print(f"{args.csv}: no source lines (was it printed with --print-source cuda,sass?)",
              file=sys.stderr)  # fmt: skip
        return 1
    total = sum(x.samples for x in lines) or 1
    by_file = Counter()
    for x in lines:
        by_file[x.file] += x.samples
    what = "samples" if args.column == SAMPLES else repr(args.column)
    print(f"{total} {what} over lines (inlined code counted under header and caller); by file: "
          + ", ".join(f"{f} {n}" for f, n in by_file.most_common(8)))  # fmt: skip
    label = "samples" if args.column == SAMPLES else args.column.replace("|", "\\|")
    print(f"| {label} | % | line | SASS calls | source |")
    print("|---:|---:|---|---:|---|")
    for x in sorted(lines, key=lambda x: -x.samples)[: args.top]:
        text = x.text.replace("|", "\\|")[:90]
        print(
            f"| {x.samples} | {100 * x.samples / total:.1f} | {x.file}:{x.number} | {x.calls} | `{text}` |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
