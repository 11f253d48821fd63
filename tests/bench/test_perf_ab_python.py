"""tools/perf/ab_python.py on the CPU: two revisions of this checkout, each cloned with the
built library linked in, the same step_profile.py command from each, one JSON with every run
labelled that bench/report.py renders; runs that fail are left out and said."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from bench_util import load_bench, load_perf
from serve_util import library_or_skip, make_served_model

ab_python = load_perf("ab_python")
report = load_bench("report")
ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    shutil.which("git") is None
    or subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD~1"], check=False, capture_output=True
    ).returncode,
    reason="needs git and a checkout with history",
)


def test_two_revisions_interleaved_in_one_labelled_json(tmp_path):
    library_or_skip()
    model = make_served_model(tmp_path / "model")
    out = tmp_path / "ab"
    args = ["--out", str(out), "--rounds", "1", "HEAD", "HEAD~1", "--", str(model), "--batch",
            "2", "--prompt", "4", "--output", "3", "--capacity", "64", "--modes", "packed"]  # fmt: skip
    assert ab_python.main(args) == 0
    data = json.loads((out / "ab.json").read_text())
    assert data["commit"] == "HEAD against HEAD~1"
    assert [r["label"] for r in data["results"]] == ["HEAD, run 1", "HEAD~1, run 1"]
    assert data["command"].startswith("python tools/perf/step_profile.py ")
    for name in ("HEAD_1.json", "HEAD~1_1.json"):
        assert json.loads((out / name).read_text())["results"]
    libs = sorted(p.name for p in (out / "src-HEAD" / "python" / "ort_kvlayout").glob("*.so"))
    assert libs and all(
        (out / "src-HEAD" / "python" / "ort_kvlayout" / n).is_symlink() for n in libs
    )
    block = "\n".join(report.step_profile(data, "step-profile-cpu-ab.json"))
    assert "(HEAD~1, run 1)" in block and "(HEAD, run 1)" in block


def test_failed_runs_are_left_out_and_bad_arguments_refused(tmp_path, capsys):
    library_or_skip()
    out = tmp_path / "ab"
    assert ab_python.main(["--out", str(out), "--rounds", "1", "HEAD", "--", "/no/model"]) == 1
    assert "left out" in capsys.readouterr().err
    assert ab_python.main(["--out", str(out), "HEAD"]) == 2  # no '--'
    for bad in (["HEAD", "HEAD"], ["--rounds", "0", "HEAD"]):
        with pytest.raises(SystemExit) as exc:
            ab_python.main(["--out", str(out), *bad, "--", "m"])
        assert exc.value.code == 2
    with pytest.raises(SystemExit):
        ab_python.main(["--out", str(out), "HEAD", "--", "m", "--json", "x.json"])
