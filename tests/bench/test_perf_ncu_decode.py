"""tools/perf/ncu_decode.sh SOURCE=1: each kernel profiled with the source counters under its
mangled name, its report saved, and the executed code summarized by sass_regions.py (an `ncu`
stub on PATH stands for Nsight Compute)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "perf" / "ncu_decode.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

# A profile run writes REPORT.ncu-rep (-o REPORT); `ncu -i REPORT --page source` prints the SASS
# rows of a kernel; `ncu -i REPORT` alone prints the details page. Every call is logged.
NCU = """#!/usr/bin/env bash
echo "$*" >>"$NCU_LOG"
out="" import="" source=0
while [ $# -gt 0 ]; do
  case "$1" in
    -o) out="$2"; shift ;;
    -i) import="$2"; shift ;;
    --page) [ "$2" = source ] && source=1; shift ;;
  esac
  shift
done
if [ -n "$out" ]; then echo profile >"$out.ncu-rep"; exit 0; fi
if [ "$source" = 1 ]; then
  echo '"Kernel Name","k"'
  echo '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_no_inst"'
  echo '"0x7f0000001000","LDC R1","10","96","8"'
  echo '"0x7f0000001010","HMMA","30","384","20"'
  echo '"0x7f0000001020","EXIT","0","0","0"'
  exit 0
fi
[ -n "$import" ] && echo "    Duration                         us        43.42"
"""


def _run(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ncu").write_text(NCU)
    (bin_dir / "ncu").chmod(0o755)
    log = tmp_path / "ncu.log"
    full = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "NCU_LOG": str(log),
            "OUT_DIR": str(tmp_path / "out"), **env}  # fmt: skip
    done = subprocess.run(["bash", str(SCRIPT), "32/8/128", "1x16384"], env=full,
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    return done, log.read_text().splitlines()


def test_source_mode_profiles_each_instance_and_summarizes_its_executed_code(tmp_path):
    done, calls = _run(tmp_path, SOURCE="1", KERNELS="DecodeFormE2ELi8EaEE DecodeFormE2ELi4ES2_EE")
    assert done.returncode == 0, done.stderr
    profiles = [c for c in calls if "--section SourceCounters" in c]
    assert len(profiles) == 2
    for c, kernel in zip(profiles, ("DecodeFormE2ELi8EaEE", "DecodeFormE2ELi4ES2_EE")):
        assert "--kernel-name-base mangled" in c and f"regex:{kernel}" in c and " -o " in c
    exported = [c for c in calls if c.startswith("-i ") and "--page source" in c]
    assert len(exported) == 2
    # sass_regions.py's table of the stub's rows: 2 of 3 instructions executed (0.0 KB: 32 bytes)
    assert done.stdout.count("executed code") == 2
    assert "3 SASS instructions, 2 executed" in done.stdout
    report = tmp_path / "out" / "ncu_32-8-128_1x16384_DecodeFormE2ELi8EaEE.txt"
    assert "Duration" in report.read_text()  # the details page of the saved report


def test_default_mode_saves_no_report_and_reads_no_source(tmp_path):
    done, calls = _run(tmp_path, KERNELS="DecodeTc")
    assert done.returncode == 0, done.stderr
    assert len(calls) == 1 and " -o " not in calls[0] and "SourceCounters" not in calls[0]
    assert "--kernel-name-base" not in calls[0] and "executed code" not in done.stdout
