"""bench/compare_cuda.py: one row per case, kernel microseconds of each run against the first."""

from __future__ import annotations

import json

import pytest
from bench_util import load_bench

compare_cuda = load_bench("compare_cuda")


def _row(heads: str, batch: int, length: int, ort: float, kv0: float, kv1: float, cap: int = 0):
    ms = {"ort": ort, "kv0": kv0, "kv1": kv1}
    return {"kind": "decode", "heads": heads, "batch": batch, "length": length,
            "capacity": cap or length, **{k: {"kernel_ms": v / 1e3} for k, v in ms.items()}}  # fmt: skip


def test_table_gives_each_runs_times_and_the_ratio(tmp_path, capsys):
    base = [
        _row("9/3/64", 1, 1024, 8.0, 10.0, 11.0),
        _row("28/4/128", 1, 256, 9.3, 16.6, 16.7, 1024),
    ]
    other = [
        _row("9/3/64", 1, 1024, 8.1, 12.5, 12.0),
        _row("28/4/128", 1, 256, 9.2, 13.2, 13.3, 1024),
    ]
    files = []
    for name, rows in (("off", base), ("on", other)):
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps({"rows": rows}))
    assert compare_cuda.main([str(f) for f in files]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| case | heads | ORT (off) | off | on | on / off |"
    assert lines[2] == "| decode B=1 L=1024 | 9/3/64 | 8.0 | 10.0 / 11.0 | 12.5 / 12.0 | 1.250 |"
    assert (
        lines[3]
        == "| decode B=1 L=256 C=1024 | 28/4/128 | 9.3 | 16.6 / 16.7 | 13.2 / 13.3 | 0.795 |"
    )


def test_runs_of_different_cases_are_refused(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"rows": [_row("9/3/64", 1, 1024, 8.0, 10.0, 10.0)]}))
    b.write_text(json.dumps({"rows": [_row("9/3/64", 8, 1024, 8.0, 10.0, 10.0)]}))
    with pytest.raises(SystemExit, match="not the cases of a"):
        compare_cuda.main([str(a), str(b)])
