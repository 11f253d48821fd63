"""tools/perf/ncu_source.py: samples per source line from Nsight Compute's source page."""

from __future__ import annotations

from pathlib import Path

from bench_util import load_perf

ncu_source = load_perf("ncu_source", register=True)  # its dataclass looks its module up

HEADER = ('"Line No","Source","Address","Source","Warp Stall Sampling (All Samples)",'
          '"Warp Stall Sampling (Not-issued Samples)","# Samples"')  # fmt: skip


def _csv(tmp_path: Path) -> Path:
    rows = [
        '"File Path","/src/csrc/core/gqa_types.h"',
        '"Function Name","void k()"',
        HEADER,
        '"123","int64_t group_size() const { return a / b; }","-","-","700","650","700"',
        '"","","0x10","CALL.REL.NOINC 0x200","690","640","690"',
        '"","","0x20","MOV R1, R2","10","10","10"',
        '"File Path","/src/csrc/cuda/decode.cu"',
        '"Function Name","void k()"',
        HEADER,
        '"128","const int64_t G = s.group_size();","-","-","700","650","700"',
        '"","","0x10","CALL.REL.NOINC 0x200","690","640","690"',
        '"","","0x20","MOV R1, R2","10","10","10"',
        '"400","acc += x | y;","-","-","300","200","300"',
        '"","","0x90","FFMA R1, R2, R3, R1","300","200","300"',
        '"401","// no SASS","-","-","-","-","-"',
    ]
    path = tmp_path / "src.csv"
    path.write_text("\n".join(rows) + "\n")
    return path


def test_lines_carry_their_samples_and_calls(tmp_path):
    lines = ncu_source.read_lines(_csv(tmp_path))
    got = {(x.file, x.number): (x.samples, x.calls) for x in lines}
    assert got == {
        ("gqa_types.h", 123): (700, 1),
        ("decode.cu", 128): (700, 1),
        ("decode.cu", 400): (300, 0),
        ("decode.cu", 401): (0, 0),
    }


def test_table_lists_lines_by_samples(tmp_path, capsys):
    assert ncu_source.main([str(_csv(tmp_path)), "--top", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("1700 samples over lines")
    assert "decode.cu 1000" in out[0] and "gqa_types.h 700" in out[0]
    table = out[3:]
    assert len(table) == 2
    assert table[0].startswith("| 700 | 41.2 | ")
    assert "| 1 |" in table[0]


def test_a_csv_without_source_lines_is_an_error(tmp_path, capsys):
    path = tmp_path / "sass_only.csv"
    path.write_text('"Kernel Name","k"\n"Address","Source","Warp Stall Sampling (All Samples)"\n'
                    '"0x10","MOV R1, R2","5"\n')  # fmt: skip
    assert ncu_source.main([str(path)]) == 1
    assert "--print-source cuda,sass" in capsys.readouterr().err


def test_another_counter_ranks_the_lines(tmp_path, capsys):
    header = '"Line No","Source","Address","Source","Warp Stall Sampling (All Samples)","L2 Excess"'
    path = tmp_path / "mem.csv"
    rows = [
        '"File Path","/src/csrc/cuda/decode.cu"',
        header,
        '"10","load_k();","-","-","5","900"',
        '"11","math();","-","-","50","0"',
    ]
    path.write_text("\n".join(rows) + "\n")
    assert ncu_source.main([str(path), "--column", "L2 Excess", "--top", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("900 'L2 Excess' over lines")
    assert out[1].startswith("| L2 Excess | % |")
    assert out[3].startswith("| 900 | 100.0 | decode.cu:10 |")


def test_an_unknown_counter_names_the_columns(tmp_path, capsys):
    assert ncu_source.main([str(_csv(tmp_path)), "--column", "Nope"]) == 1
    err = capsys.readouterr().err
    assert "no column 'Nope'" in err and "Warp Stall Sampling (All Samples)" in err
