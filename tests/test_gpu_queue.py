"""scripts/gpu_queue.sh on the CPU, with stages of our own (GPU_QUEUE_STAGES): the order, the
time budget, done and failed markers, prerequisites and the timeout a stage runs under."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_queue.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def queue(tmp_path: Path, stages: list[str], *args: str, **env: str) -> str:
    run_env = {**os.environ, "STATE": str(tmp_path / "state"), "OUT": str(tmp_path / "out"),
               "GPU_QUEUE_STAGES": "\n".join(stages), **env}  # fmt: skip
    done = subprocess.run(["bash", str(SCRIPT), *args], env=run_env, capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def state(tmp_path: Path) -> dict[str, str]:
    return {p.stem: p.suffix[1:] for p in (tmp_path / "state").glob("*.*")}


def test_stages_run_in_order_and_are_marked(tmp_path):
    stages = ["a|1||echo ran-a", "b|1|a|exit 3", "c|1|b|echo ran-c", "d|1|a|echo ran-d"]
    out = queue(tmp_path, stages)
    assert "ran-a" in out and "ran-d" in out and "ran-c" not in out
    assert "b: FAILED (exit 3)" in out and "c: waits for b" in out
    assert state(tmp_path) == {"a": "done", "b": "failed", "d": "done"}
    assert (tmp_path / "out" / "a.log").read_text() == "ran-a\n"
    # a second call runs only what is left: b again (last), c still waits
    out = queue(tmp_path, stages)
    assert "ran-a" not in out and "b: FAILED" in out and "c: waits for b" in out
    listing = queue(tmp_path, stages, "--list")
    assert [line.split()[:3] for line in listing.splitlines()] == [
        ["a", "1", "s"], ["b", "1", "s"], ["c", "1", "s"], ["d", "1", "s"]
    ]  # fmt: skip
    assert "failed" in listing.splitlines()[1] and "pending" in listing.splitlines()[2]


def test_the_budget_defers_what_does_not_fit_and_times_out_what_overruns(tmp_path):
    stages = ["long|100||echo never", "slow|1||sleep 30", "after|1||echo after"]
    out = queue(tmp_path, stages, BUDGET="3")
    assert "long: needs ~100 s, 3 s left: next call" in out and "never" not in out
    assert "slow: FAILED" in out  # killed at the 3 s left, not after its 30 s
    assert state(tmp_path)["slow"] == "failed" and "long" not in state(tmp_path)


def test_dry_run_and_only_select_without_running(tmp_path):
    stages = ["a|1||echo ran-a", "b|1||echo ran-b", "c|1||echo ran-c"]
    out = queue(tmp_path, stages, DRY_RUN="1", ONLY="c a")
    assert "== a (" in out and "== c (" in out and "== b" not in out
    assert state(tmp_path) == {} and not list((tmp_path / "out").glob("*.log"))  # nothing ran
    queue(tmp_path, stages)
    out = queue(tmp_path, stages, FORCE="1", ONLY="b")
    assert "ran-b" in out and "ran-a" not in out


def test_the_real_queue_lists_every_issue_stage():
    listing = subprocess.run(["bash", str(SCRIPT), "--list"], capture_output=True, text=True,
                             env={**os.environ, "STATE": "/nonexistent-gpu-queue"},
                             timeout=30, check=True).stdout  # fmt: skip
    names = [line.split()[0] for line in listing.splitlines()]
    assert names[0] == "setup" and {"suite", "profile-chat", "prealloc-8b"} <= set(names)
