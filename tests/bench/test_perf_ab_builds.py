"""tools/perf/ab_builds.sh: a bad variant list is refused by name before anything is built."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "perf" / "ab_builds.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(tmp_path: Path, *variants: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), str(tmp_path / "ab"), *variants, "--", "--runs", "2"],
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip


@pytest.mark.parametrize(
    ("variants", "message"),
    [
        ((), "no variant given"),
        (("a b:-DX=1",), "variant 'a b:-DX=1' needs a name"),
        ((":-DX=1",), "variant ':-DX=1' needs a name"),
        (("base:", "base:-DX=1"), "variant name 'base' given twice"),
    ],
)
def test_bad_variants_refused_before_any_build(tmp_path, variants, message):
    p = _run(tmp_path, *variants)
    assert p.returncode == 2, p.stderr
    assert message in p.stderr
    assert not list((tmp_path / "ab").glob("build_*"))  # nothing was configured or built
