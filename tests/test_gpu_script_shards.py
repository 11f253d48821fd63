"""scripts/run_gpu_tests.sh SAN_SHARDS=N: every test of the sanitizer subset runs in exactly one
shard, each shard is a pass of its own, and a shard that fails fails the run. Checked without a
GPU through a stand-in compute-sanitizer that runs the command it is given (the GPU tests then
skip, so ALLOW_SKIP=1)."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

# Runs the command after the sanitizer's options; exits 3 (the script's --error-exitcode) where
# FAIL_ON names one of the shard's test ids, as a sanitizer that found an error would.
FAKE = """#!/usr/bin/env bash
while [ $# -gt 0 ] && [ "$1" != "python3" ]; do shift; done
"$@"
rc=$?
if [ -n "${FAIL_ON:-}" ]; then
  for a in "$@"; do case "$a" in *"$FAIL_ON"*) exit 3 ;; esac; done
fi
exit $rc
"""


def _run(
    tmp_path: Path, shards: int | str, fail_on: str = ""
) -> tuple[subprocess.CompletedProcess, Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "compute-sanitizer"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    # python3 in the script must be this interpreter (the one with the package and pytest); a
    # wrapper, not a link: a venv's interpreter finds its venv from the path it is started by.
    py = bin_dir / "python3"
    py.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    py.chmod(0o755)
    logs = tmp_path / f"logs{shards}{fail_on and '-fail'}"
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SUITE="0",
               SANITIZER="memcheck", SAN_SHARDS=str(shards), SAN_EXTRA_K="graph", ALLOW_SKIP="1",
               LOG_DIR=str(logs), FAIL_ON=fail_on, GQA_GPU_SEED="1")  # fmt: skip
    p = subprocess.run(["bash", str(ROOT / "scripts" / "run_gpu_tests.sh")], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    return p, logs


@functools.lru_cache(maxsize=1)
def _collected() -> tuple[str, ...]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
         "--collect-only", "tests/op/test_gqa_cuda.py", "tests/op/test_gqa_cuda_quant.py",
        "tests/op/test_cuda_graph.py",
         "tests/op/test_cuda_length_errors.py", "-k",
         "not vs_ort_cuda and not ort_builtin and not deterministic and (graph)"],
        env=dict(os.environ, GQA_GPU_QUICK="1"), cwd=ROOT, capture_output=True, text=True,
        check=True,
    ).stdout  # fmt: skip
    return tuple(line for line in out.splitlines() if "::" in line)


def test_shards_split_the_subset_and_each_is_a_pass(tmp_path):
    p, logs = _run(tmp_path, 3)
    assert p.returncode == 0, p.stdout + p.stderr
    passes = re.findall(r"sanitizer memcheck (\d)/3 rc=0 .* (\d+) skipped", p.stdout)
    assert sorted(k for k, _ in passes) == ["1", "2", "3"], p.stdout
    # Every collected test ran once: the shards' counts add up to the subset.
    assert sum(int(n) for _, n in passes) == len(_collected()) > 3
    assert len(list(logs.glob("sanitizer_memcheck.shard*.log"))) == 3


def test_a_failing_shard_fails_the_run(tmp_path):
    victim = _collected()[1]
    p, _ = _run(tmp_path, 3, fail_on=victim.split("::")[-1])
    assert p.returncode == 3, p.stdout + p.stderr
    assert len(re.findall(r"sanitizer memcheck \d/3 rc=3 ", p.stdout)) == 1, p.stdout


def test_shard_count_that_is_not_a_positive_integer_is_refused(tmp_path):
    p, logs = _run(tmp_path, "two")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "SAN_SHARDS must be a positive integer, got 'two'" in p.stdout
    assert not list(logs.glob("sanitizer_*"))
