"""bench/bar.py: the grid's standing against issue 8's bar, as docs/BENCHMARKS.md reports it."""

from __future__ import annotations

import json

import pytest
from bench_util import load_bench

bar = load_bench("bar")


def _row(kind: str, heads: str, batch: int, length: int, ort: float, kv0: float, kv1: float):
    """A bench_cuda.py row from kernel microseconds, its TB/s and ratios as bench_cuda.py has them."""
    row = {"kind": kind, "heads": heads, "batch": batch, "length": length, "capacity": length}
    _, nkv, h = (int(x) for x in heads.split("/"))
    for name, t in (("ort", ort), ("kv0", kv0), ("kv1", kv1)):
        cell = {"kernel_ms": t / 1e3}
        if kind == "decode":
            cell["TB/s"] = 2 * batch * nkv * length * h * 2 / (t * 1e-6) / 1e12
        row[name] = cell
    row["ratio0"], row["ratio1"] = ort / kv0, ort / kv1
    return row


def _grid() -> list[dict]:
    return [
        # B=1: ORT at 1.29 and 0.32 TB/s, below half the copy bandwidth; 1.3x in kv0 only, then both.
        _row("decode", "32/8/128", 1, 4096, 13.0, 10.0, 11.0),
        _row("decode", "32/8/128", 1, 1024, 13.0, 10.0, 9.9),
        # One point below ORT in kv1 only, and its kv1/kv0 at 1.05.
        _row("decode", "28/4/128", 8, 4096, 26.0, 25.0, 26.25),
        # 1 GiB of KV (2 x 64 x 8 x 16384 x 128 x 2 = 4.3 GB): 4.57 and 4.28 TB/s.
        _row("decode", "32/8/128", 64, 16384, 950.0, 940.0, 1003.0),
        _row("prefill", "32/8/128", 1, 2048, 100.0, 90.0, 91.0),
    ]


def test_the_bar_counts_a_point_only_where_both_layouts_pass():
    s = bar.summary(_grid(), copy_tbs=4.24)
    assert s["decode >= 1.0x, both layouts"] == "2 / 4"
    assert s["lowest decode ratio"] == "0.947 (32/8/128 B=64 L=16384 kv1)"
    assert s["1.3x where ORT < 2.12 TB/s"] == "1 / 2"
    assert s[">= 1 GiB KV: TB/s kv0 / kv1"] == "4.57-4.57 / 4.28-4.28"
    assert s["... at 4.3 TB/s in both layouts"] == "0 / 1"
    assert s["prefill >= 1.0x, both layouts"] == "1 / 1 (lowest 1.099)"
    assert s["kv1/kv0 outside 0.97-1.03"] == "3 / 5"
    assert s["median decode ratio, kv0"] == "B=1 1.300, B=8 1.040, B=64 1.011"


def test_table_has_a_column_per_run(tmp_path, capsys):
    rows = _grid()
    better = [dict(r, kv1=r["kv0"], ratio1=r["ratio0"]) for r in rows]
    files = []
    for name, grid in (("a", rows), ("b", better)):
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps({"rows": grid}))
    assert bar.main([str(f) for f in files] + ["--names", "before,after"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| | before | after |"
    assert "| decode >= 1.0x, both layouts | 2 / 4 | 4 / 4 |" in lines
    assert "| kv1/kv0 outside 0.97-1.03 | 3 / 5 | 0 / 5 |" in lines


def test_names_must_match_the_runs(tmp_path):
    f = tmp_path / "a.json"
    f.write_text(json.dumps({"rows": _grid()}))
    with pytest.raises(SystemExit):
        bar.main([str(f), "--names", "one,two"])
