"""tools/perf/step_profile.py on the CPU: each mode's step profile from a real engine (a synthetic
model), and a JSON bench/report.py renders (date, device, commit, command, a row per mode)."""

from __future__ import annotations

import json

from bench_util import load_bench, load_perf
from serve_util import library_or_skip, make_served_model

step_profile = load_perf("step_profile")
report = load_bench("report")


def test_each_mode_profiles_its_graph_and_the_json_renders(tmp_path):
    library_or_skip()
    model = make_served_model(tmp_path / "model")
    out = tmp_path / "step-profile-cpu.json"
    args = [str(model), "--batch", "3", "--prompt", "6", "--output", "4", "--capacity", "64",
            "--modes", "device,packed,host", "--json", str(out)]  # fmt: skip
    assert step_profile.main(args) == 0
    data = json.loads(out.read_text())
    assert {"date", "device", "commit", "command"} <= set(data)
    assert data["command"].startswith("python tools/perf/step_profile.py ")
    modes = {r["mode"]: r for r in data["results"]}
    assert set(modes) == {"device", "packed", "host"}
    assert modes["packed"]["packed"] and not modes["device"]["packed"]
    assert not modes["host"]["sample_on_device"]
    for r in modes.values():
        assert r["steps"] > 0 and r["phase_ms_per_step"]["run"] > 0
        assert "gpu_ms_per_step" not in r  # no CUDA here: no GPU column to claim
    # packed: the three prompts of the first step in one call
    assert modes["packed"]["prefill_calls"] < modes["device"]["prefill_calls"]
    block = "\n".join(report.step_profile(data, out.name))
    for label in ("served (device sampling)", "served, packed", "model's own (host)"):
        assert f"| {label} |" in block
