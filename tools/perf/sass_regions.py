"""How much code one kernel launch runs, and where its warps wait, from Nsight Compute's SASS page.

    ncu --section SourceCounters --section WarpStateStats --warp-sampling-interval 0 \\
        -k regex:DecodeTc --launch-skip 4 --launch-count 1 -o decode python bench/bench_cuda.py ...
    ncu -i decode.ncu-rep --page source --csv --print-source sass > decode.csv
    python tools/perf/sass_regions.py decode.csv --split 0xe990,0x14250,0x2f030,0x31400

The CSV lists every SASS instruction of the kernel (its address, text, counters): the first
table gives how many the launch executed (distinct addresses, and their bytes at 16 per
instruction) against the kernel's size, and the warp samples by stall reason (`no_inst`: the
warp waited for its next instruction to be fetched). `--split` cuts the kernel into regions at
these offsets from its first instruction (read them off `nvdisasm`'s listing) and gives each
region's executed instructions, samples and instruction waits.

`--lines FILE` adds the executed instructions and samples per source line, from `nvdisasm -c -gi`
of the kernel's cubin (a `-lineinfo` build: `cuobjdump -xelf decode.sm_90.cubin LIB`, then
`nvdisasm -c -gi decode.sm_90.cubin > decode.sass`): each instruction counts for the outermost
line of its inlining chain in the file given by `--file` (decode_kernel.cuh or a phase header), the kernel body's line.
The listing must be of the profiled build and name the kernel with `--kernel` (a substring of its
mangled name), as it holds every kernel of the file.

Samples are warp time: a phase that few warps run weighs little even where it is long.

Without the CSV, `--lines` alone counts every instruction of the kernel per line of its body, run
or not: the code each phase holds, with no GPU (nvcc's `-cubin -lineinfo` of one instantiation
file and `nvdisasm -c -gi`; both tools are also on PyPI as nvidia-cuda-nvdisasm):

    nvcc -std=c++17 --use_fast_math -lineinfo -arch=sm_90a -cubin -Icsrc -I$ORT_INCLUDE_DIR \
        -DKVL_WITH_CUDA=1 -o int8.cubin csrc/cuda/decode_half_int8.cu
    nvdisasm -c -gi int8.cubin > int8.sass
    python tools/perf/sass_regions.py --lines int8.sass --kernel DecodeFormE2ELi8EaEE
"""

from __future__ import annotations

import argparse
import csv
import gzip
import itertools
import re
import sys
from collections import Counter
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
BYTES_PER_INSTRUCTION = 16


def _num(text: str | None) -> float:
    try:
        return float(text) if text else 0.0
    except ValueError:  # "-" where ncu has no value
        return 0.0


def read_sass(path: Path) -> tuple[list[str], list[dict]]:
    """The SASS rows of a `--page source --csv --print-source sass` export (gzip or not)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    try:
        at = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    except StopIteration:
        raise ValueError(f"{path}: no 'Address' header (was it --print-source sass?)") from None
    header = rows[at]
    for need in (SAMPLES, EXECUTED):
        if need not in header:
            raise ValueError(f"{path}: no column {need!r} (SourceCounters section?)")
    data = [dict(zip(header, r)) for r in rows[at + 1 :] if len(r) >= len(header) - 1]
    if not data:
        raise ValueError(f"{path}: no SASS rows")
    return header, data


def offsets(data: list[dict]) -> list[int]:
    """Each row's offset from the kernel's first instruction."""
    base = int(data[0]["Address"], 16)
    return [int(d["Address"], 16) - base for d in data]


def line_table(listing: str, kernel: str, file: str) -> dict[int, int]:
    """Offset -> the outermost line in `file` of the instruction's inlining chain, for the
    kernel whose mangled name contains `kernel`, from `nvdisasm -c -gi` output."""
    table: dict[int, int] = {}
    inside, line = False, None
    for text in listing.splitlines():
        if re.match(r"^[^.\s]\S*:\s*$", text):  # a function's label (local ones start with .)
            inside = kernel in text
            line = None
            continue
        if not inside:
            continue
        m = re.search(r'//## File "([^"]+)", line (\d+)(.*)', text)
        if m:
            chain = [(m.group(1), int(m.group(2)))]
            chain += [(f, int(n)) for f, n in re.findall(r'inlined at "([^"]+)", line (\d+)', m[3])]
            ours = [n for f, n in chain if Path(f).name == file]
            line = ours[-1] if ours else None
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/", text)
        if m and line is not None:
            table[int(m.group(1), 16)] = line
    return table


def summarize(data: list[dict], header: list[str], split: list[int]) -> list[str]:
    reasons = [c for c in header if c.startswith("stall_") and "Not Issued" not in c]
    offs = offsets(data)
    total = sum(_num(d[SAMPLES]) for d in data) or 1.0
    executed = [d for d in data if _num(d[EXECUTED]) > 0]
    by_reason = Counter({c[6:]: sum(_num(d[c]) for d in data) for c in reasons})
    out = [
        f"{len(data)} SASS instructions, {len(executed)} executed "
        f"({len(executed) * BYTES_PER_INSTRUCTION / 1024:.1f} KB); {total:.0f} warp samples: "
        + ", ".join(f"{r} {100 * n / total:.0f}%" for r, n in by_reason.most_common(6) if n),
        "",
        "| region (offsets) | executed | samples | waiting for instructions |",
        "|---|---:|---:|---:|",
    ]
    cuts = [0, *sorted(split), max(offs) + 1]
    for lo, hi in itertools.pairwise(cuts):
        rows = [d for d, o in zip(data, offs) if lo <= o < hi]
        n_exec = sum(1 for d in rows if _num(d[EXECUTED]) > 0)
        samples = sum(_num(d[SAMPLES]) for d in rows)
        no_inst = sum(_num(d.get("stall_no_inst")) for d in rows)
        out.append(
            f"| 0x{lo:x} to 0x{hi:x} | {n_exec} ({n_exec * BYTES_PER_INSTRUCTION / 1024:.1f} KB) "
            f"| {samples:.0f} | {no_inst:.0f} |"
        )
    return out


def by_line(data: list[dict], table: dict[int, int], top: int) -> list[str]:
    executed: Counter = Counter()
    samples: Counter = Counter()
    no_inst: Counter = Counter()
    for d, o in zip(data, offsets(data)):
        if _num(d[EXECUTED]) <= 0 or o not in table:
            continue
        executed[table[o]] += 1
        samples[table[o]] += _num(d[SAMPLES])
        no_inst[table[o]] += _num(d.get("stall_no_inst"))
    out = ["", "| line | executed | samples | waiting for instructions |", "|---:|---:|---:|---:|"]
    for line, n in executed.most_common(top):
        out.append(f"| {line} | {n} | {samples[line]:.0f} | {no_inst[line]:.0f} |")
    return out


def static_lines(table: dict[int, int]) -> list[str]:
    """The kernel's instructions per line of its body, from the listing alone (no profile): what
    each phase costs in code, every instruction of it, run or not."""
    counts = Counter(table.values())
    total = sum(counts.values())
    out = [
        f"{total} SASS instructions ({total * BYTES_PER_INSTRUCTION / 1024:.1f} KB) with line info",
        "",
        "| line | instructions | KB |",
        "|---:|---:|---:|",
    ]
    for line in sorted(counts):
        n = counts[line]
        out.append(f"| {line} | {n} | {n * BYTES_PER_INSTRUCTION / 1024:.1f} |")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "csv", type=Path, nargs="?",
        help="ncu --page source --csv --print-source sass (or .gz); without it, --lines alone "
        "gives the kernel's instructions per line of its body (static: a listing needs no GPU)",
    )  # fmt: skip
    p.add_argument("--split", default="", help="region boundaries, offsets: 0xe990,0x14250")
    p.add_argument("--lines", type=Path, help="nvdisasm -c -gi listing of the profiled build")
    p.add_argument("--kernel", default="DecodeTcKernelI6__halfLi128ELb1E", help="with --lines")
    p.add_argument(
        "--file", default="decode_kernel.cuh", help="with --lines: the kernel's source file"
    )
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args(argv)
    if args.csv is None:
        if not args.lines:
            p.error("give the profile's CSV, or --lines LISTING for the static count")
        table = line_table(args.lines.read_text(), args.kernel, args.file)
        if not table:
            print(f"{args.lines}: no line info for a kernel named like {args.kernel!r}",
                  file=sys.stderr)  # fmt: skip
            return 1
        print("\n".join(static_lines(table)))
        return 0
    try:
        header, data = read_sass(args.csv)
    except (OSError, ValueError) as e:
        print(e, file=sys.stderr)
        return 1
    split = [int(x, 16) for x in filter(None, args.split.split(","))]
    out = summarize(data, header, split)
    if args.lines:
        table = line_table(args.lines.read_text(), args.kernel, args.file)
        if not table:
            print(f"{args.lines}: no line info for a kernel named like {args.kernel!r}",
                  file=sys.stderr)  # fmt: skip
            return 1
        out += by_line(data, table, args.top)
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
