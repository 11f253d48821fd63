"""tools/perf/sass_regions.py: executed instructions and instruction waits per region and per source
line of one profiled kernel."""

from __future__ import annotations

import pytest
from bench_util import load_perf

sass_regions = load_perf("sass_regions")

HEADER = [
    "Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
    "stall_no_inst", "stall_barrier", "stall_no_inst (Not Issued)",
]  # fmt: skip


def _csv(tmp_path, rows):
    lines = ['"Kernel Name","k"', ",".join(f'"{h}"' for h in HEADER)]
    lines += [",".join(f'"{c}"' for c in r) for r in rows]
    path = tmp_path / "k.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


ROWS = [  # address, text, samples, executed, no_inst, barrier, no_inst (not issued)
    ("0x7f0000001000", "LDC R1", "10", "96", "8", "0", "8"),
    ("0x7f0000001010", "BRA", "0", "96", "0", "0", "0"),
    ("0x7f0000001020", "EXIT", "0", "0", "0", "0", "0"),  # never run
    ("0x7f0000001030", "HMMA", "30", "384", "20", "0", "20"),
    ("0x7f0000001040", "BAR", "60", "384", "0", "60", "0"),
]


LISTING = [  # nvdisasm -c -gi: two kernels, a local label, an inlined chain
    "_Zother_kernel:",
    '\t//## File "/src/decode.cu", line 5',
    "        /*0000*/                   NOP ;",
    "_Z14DecodeTcKernelI6__halfLi128ELb1E:",
    '\t//## File "/src/decode.cu", line 10',
    "        /*0000*/                   LDC R1, c[0x0][0x28] ;",
    "        /*0010*/                   BRA `(.L_x_1) ;",
    ".L_x_1:",
    '\t//## File "/src/common.cuh", line 3 inlined at "/src/decode.cu", line 20',
    "        /*0030*/                   HMMA.16816.F32 R0, R4, R8, R0 ;",
    '\t//## File "/src/decode.cu", line 30',
    "        /*0040*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;",
]


def test_counts_executed_instructions_and_waits_per_region(tmp_path):
    header, data = sass_regions.read_sass(_csv(tmp_path, ROWS))
    out = sass_regions.summarize(data, header, [0x30])
    assert out[0].startswith("5 SASS instructions, 4 executed (0.1 KB); 100 warp samples")
    assert "barrier 60%" in out[0] and "no_inst 28%" in out[0]
    assert out[4] == "| 0x0 to 0x30 | 2 (0.0 KB) | 10 | 8 |"
    assert out[5] == "| 0x30 to 0x41 | 2 (0.0 KB) | 90 | 20 |"


def test_lines_take_the_kernel_bodys_line_of_an_inlined_chain(tmp_path):
    listing = "\n".join(LISTING)
    table = sass_regions.line_table(listing, "DecodeTcKernelI6__halfLi128ELb1E", "decode.cu")
    assert table == {0x0: 10, 0x10: 10, 0x30: 20, 0x40: 30}  # the local label kept the kernel
    _header, data = sass_regions.read_sass(_csv(tmp_path, ROWS))
    out = sass_regions.by_line(data, table, top=5)
    assert out[3:] == ["| 10 | 2 | 10 | 8 |", "| 20 | 1 | 30 | 20 |", "| 30 | 1 | 60 | 0 |"]


def test_the_listing_alone_counts_every_instruction_per_body_line(tmp_path, capsys):
    listing = tmp_path / "k.sass"
    listing.write_text("\n".join(LISTING))
    args = ["--lines", str(listing), "--kernel", "DecodeTcKernelI6__halfLi128ELb1E", "--file",
            "decode.cu"]  # fmt: skip
    assert sass_regions.main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "4 SASS instructions (0.1 KB) with line info"
    assert out[4:] == ["| 10 | 2 | 0.0 |", "| 20 | 1 | 0.0 |", "| 30 | 1 | 0.0 |"]
    assert sass_regions.main(["--lines", str(listing), "--kernel", "Absent"]) == 1
    assert "no line info for a kernel named like 'Absent'" in capsys.readouterr().err


def test_neither_csv_nor_listing_is_refused(capsys):
    with pytest.raises(SystemExit):
        sass_regions.main([])
    assert "--lines LISTING for the static count" in capsys.readouterr().err


def test_a_csv_without_sass_rows_is_refused(tmp_path, capsys):
    path = tmp_path / "empty.csv"
    path.write_text('"Kernel Name","k"\n')
    assert sass_regions.main([str(path)]) == 1
    assert "no 'Address' header" in capsys.readouterr().err
