"""tools/perf/ab_libs.sh: built libraries (and one library under a setting) in interleaved rounds, the
same bench_cuda.py command for each, then one table; a bad variant list is refused by name
before anything runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "perf" / "ab_libs.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

# Stands in for python3 on PATH: bench_cuda.py appends what it was run with to a log and writes
# a one-case JSON whose kernel time tells the runs apart; anything else runs on the real Python.
FAKE = """#!/usr/bin/env bash
if [ "$1" = "bench/bench_cuda.py" ]; then
  shift
  lib="" json=""
  while [ $# -gt 0 ]; do
    case "$1" in --library) lib="$2"; shift ;; --json) json="$2"; shift ;; esac
    shift
  done
  n=$(wc -l < "$AB_LOG" 2>/dev/null || echo 0)
  echo "$lib knob=${AB_KNOB:-unset}" >> "$AB_LOG"
  ms=$(printf '0.0%02d' $((n + 1)))
  cat > "$json" <<EOF
{"rows": [{"kind": "decode", "heads": "9/3/64", "batch": 1, "length": 1024, "capacity": 1024,
  "ort": {"kernel_ms": 0.5}, "kv0": {"kernel_ms": $ms}, "kv1": {"kernel_ms": $ms}}]}
EOF
  exit 0
fi
exec "$REAL_PYTHON" "$@"
"""


def _run(tmp_path: Path, *variants: str, rounds: int = 2) -> subprocess.CompletedProcess:
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir(exist_ok=True)
    fake = fake_bin / "python3"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{fake_bin}{os.pathsep}{os.environ['PATH']}",
               REAL_PYTHON=sys.executable, AB_LOG=str(tmp_path / "runs.log"), ROUNDS=str(rounds))  # fmt: skip
    return subprocess.run(["bash", str(SCRIPT), str(tmp_path / "ab"), *variants, "--", "--runs", "2"],
                          capture_output=True, text=True, timeout=60, check=False, env=env)  # fmt: skip


def _lib(tmp_path: Path, name: str) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "libort_kvlayout.so").write_bytes(b"")
    return str(d)


def test_variants_interleaved_with_their_own_settings(tmp_path):
    base, cp = _lib(tmp_path, "base"), _lib(tmp_path, "cp")
    p = _run(tmp_path, f"base={base}", f"push={cp}", f"pull={cp}:AB_KNOB=0")
    assert p.returncode == 0, p.stderr
    runs = (tmp_path / "runs.log").read_text().splitlines()
    lib = "libort_kvlayout.so"
    assert runs == [f"{base}/{lib} knob=unset", f"{cp}/{lib} knob=unset", f"{cp}/{lib} knob=0"] * 2
    table = (tmp_path / "ab" / "compare.md").read_text()
    assert "| case | heads | ORT (base) | base | push | pull | base | push | pull |" in table
    # Each column is its own run's JSON: the runs' times 1 to 6 us, in order.
    assert "| 1.0 / 1.0 | 2.0 / 2.0 | 3.0 / 3.0 | 4.0 / 4.0 | 5.0 / 5.0 | 6.0 / 6.0 |" in table
    for name in ("base", "push", "pull"):
        for r in (1, 2):
            assert json.loads((tmp_path / "ab" / f"{name}_{r}.json").read_text())["rows"]


@pytest.mark.parametrize(
    ("variants", "message"),
    [
        ((), "no variant given"),
        (("base",), "variant 'base' needs NAME=DIR"),
        (("=DIR",), "needs a name of letters, digits"),
        (("a b=DIR",), "needs a name of letters, digits"),
        (("x=DIR", "x=DIR"), "variant name 'x' given twice"),
        (("x=DIR:notasetting",), "after ':' a VAR=VALUE setting"),
        (("x=/nonexistent",), "no /nonexistent/libort_kvlayout.so"),
    ],
)
def test_bad_variants_refused_before_any_run(tmp_path, variants, message):
    lib = _lib(tmp_path, "lib")
    p = _run(tmp_path, *(v.replace("DIR", lib) for v in variants))
    assert p.returncode == 2, p.stderr
    assert message in p.stderr
    assert not (tmp_path / "runs.log").exists()  # bench_cuda.py never ran
