"""The checkout's commit, recorded with every benchmark result so its table names its code.
Imported by the bench/ scripts as a sibling module."""

from __future__ import annotations

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
