"""tools/perf/trace_summary.py: the medians of the decode kernel's trace marks, grouped by case and line (the lines' format is DecTrace::Line in csrc/cuda/decode_instrument.cuh)."""

from __future__ import annotations

import pytest
from bench_util import load_perf

trace_summary = load_perf("trace_summary")


def _line(
    kind,
    keys,
    k1,
    v1,
    live,
    k3,
    v3,
    cycles,
    hd=128,
    rows=7,
    bg=4,
    start=1796181606812526592,
    end=None,
):
    marks = " ".join(str(c) for c in cycles + [-1] * (9 - len(cycles)))
    tail = f" end_ns={end} partial=5000" if end is not None else ""
    return (
        f"KVL_TRACE {kind} hd={hd} rows={rows} bg={bg} keys={keys} {k1}={v1} live={live} "
        f"{k3}={v3} cycles {marks} start_ns={start}{tail}"
    )


def test_groups_by_case_and_role_and_takes_medians():
    text = "\n".join(
        [
            "| decode B=1 L=1024 | 28/4/128 | ... |",  # bench_cuda.py's own lines are skipped
            _line("prologue", 1024, "split", 0, 8, "appends", 0, [900, 4700, 7800, 10100, 11000]),
            _line("prologue", 1024, "split", 7, 8, "appends", 1, [880, 4680, 9700, 11700, 12600]),
            _line("prologue", 1024, "split", 0, 8, "appends", 0, [1100, 4900, 8000, 10300, 11400]),
            _line("prologue", 1024, "split", 0, 8, "appends", 0, [1000, 4800, 7900, 10200, 11200]),
            _line(
                "flat",
                4096,
                "splits",
                32,
                18,
                "groups",
                1,
                [9000, 11000, 13000, 15000, 17000, 19000],
            ),
        ]
    )
    out = trace_summary.summarize(text).splitlines()
    rows = [r for r in out[2:]]
    assert len(rows) == 3  # split 0 at 1k, the appender at 1k, the flat merge at 4k
    split0 = next(r for r in rows if "prologue split 0 of 8" in r)
    assert "| 128 | 7 | 4 | 1024 |" in split0 and "| 3 |" in split0
    assert "lengths 1000, partition 4800, issued 7900, q frags 10200, first landed 11200" in split0
    appender = next(r for r in rows if "appender" in r)
    assert "split 7 of 8" in appender and "issued 9700" in appender
    flat = next(r for r in rows if "flat" in r)
    assert "18 live" in flat and "arrival 11000" in flat and "values warm 19000" in flat


def test_pushed_cluster_merge_lines_name_their_marks():
    # decode-cluster-push's split 0: its partial, the members' pushes landed, its values.
    text = "\n".join(
        _line("cluster-push", 1024, "splits", 8, 8, "groups", 1, [c, c + 300, c + 900])
        for c in (5000, 5200, 5100)
    )
    rows = trace_summary.summarize(text).splitlines()[2:]
    assert len(rows) == 1
    assert "cluster-push (8 splits, 8 live, 1 groups)" in rows[0] and "| 3 |" in rows[0]
    assert "partial 5100, mbarrier 5400, values 6000" in rows[0]


def test_interleaved_output_of_the_old_format_is_refused():
    # An older trace format printed the marks were printed one printf each, and two CTAs' lines
    # interleaved: such output has no line the parser accepts.
    old = (
        "KVL_TRACE prologue split=7 live=8 appends=1 cyclesKVL_TRACE prologue split=0 live=8 "
        "appends=0 cycles 5386 5748 8580 start_ns=1\n start_ns=2\n"
    )
    with pytest.raises(ValueError, match="no KVL_TRACE lines"):
        trace_summary.summarize(old)


def test_main_reports_a_file_without_trace_lines(tmp_path, capsys):
    f = tmp_path / "plain.out"
    f.write_text("| decode B=1 L=1024 | 28/4/128 | ... |\n")
    assert trace_summary.main([str(f)]) == 1
    assert "KVL_DECODE_TRACE=1 or 2 build" in capsys.readouterr().err


def test_arrivals_name_the_split_whose_partial_came_last():
    # Two launches of 3 splits (KVL_DECODE_TRACE=2), 1 ms apart; split 2 appends. In the first
    # launch split 1's partial comes last, in the second the appender's.
    t = 1_000_000_000
    lines = []
    for launch, ends in enumerate([(4000, 9000, 7000), (4200, 6000, 8000)]):
        t0 = t + launch * 1_000_000
        for split, end in enumerate(ends):
            lines.append(_line("cta", 1024, "split", split, 3, "appends", int(split == 2),
                               [400, 2400, 4400, 6500, 9000], start=t0 + 100 * split,
                               end=t0 + end))  # fmt: skip
    out = trace_summary.summarize("\n".join(lines))
    row = next(r for r in out.splitlines() if r.startswith("| 128 | 7 | 4 | 1024 | 3 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # launches, start spread, first, split 0, appender, last, last split
    assert cells[5:] == ["2", "200", "4100", "4100", "7500", "8500", "1: 1, 2 (appends): 1"]
    assert "| line |" not in out  # no marks table without other lines


def test_cluster_tree_lines_are_read_with_their_marks():
    """Group clusters print `cluster-tree` (a hyphen in the kind): its eight marks are named."""
    cycles = [900, 1800, 3900, 6100, 7000, 8000, 10200, 10300]
    text = _line("cluster-tree", 4096, "splits", 24, 24, "groups", 3, cycles)
    rows = trace_summary.summarize(text).splitlines()[2:]
    assert len(rows) == 1
    assert "cluster-tree (24 splits, 24 live, 3 groups)" in rows[0]
    assert "last barrier 7000, top arrival 8000, top weights 10200, top values 10300" in rows[0]
