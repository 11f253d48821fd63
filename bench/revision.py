"""The checkout's commit and the machine, recorded with every benchmark result so its table
names its code and device. Imported by the bench/ scripts as a sibling module (and by
tools/perf/step_profile.py)."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def git_revision(mark_dirty: bool = True) -> str:
    """The short commit of this checkout, with "+dirty" when tracked files differ from it (and
    `mark_dirty`); "unknown" outside a git checkout."""
    git = ["git", "-C", str(ROOT)]
    try:
        head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
        if not mark_dirty:
            return head
        dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def device_name(provider: str) -> str:
    """ "cpu (<arch>, N cores)", or with provider "cuda" "cuda (<GPU>; host <arch>, N cores)"
    (the GPU as nvidia-smi names it; "unknown GPU" without it)."""
    host = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    if provider == "cuda":
        try:
            gpu = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True, text=True, check=True,
            ).stdout.splitlines()[0]  # fmt: skip
        except (OSError, subprocess.CalledProcessError, IndexError):
            gpu = "unknown GPU"
        return f"cuda ({gpu}; host {host})"
    return f"cpu ({host})"
