"""Test setup: the tests directory on sys.path (for ``reference`` and ``gqa_case``), and a skip
for every test of our op (test_gqa_*.py) while ``ort_kvlayout`` cannot be imported or cannot
register its library.  test_reference.py needs only onnxruntime and always runs."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gqa_case import op_available

_NEEDS_OP = ("test_gqa_cpu", "test_gqa_errors", "test_gqa_properties", "test_gqa_nonfinite")


@pytest.fixture
def fake_library(tmp_path):
    """Stands in for libort_kvlayout.so where only the files matter (no session is created):
    tmp_path / "lib" / "libfake.so"."""
    path = tmp_path / "lib" / "libfake.so"
    path.parent.mkdir()
    path.write_bytes(b"\x7fELF not really a library")
    return path


def pytest_report_header(config):
    ok, reason = op_available()
    return f"ort_kvlayout op: {'available' if ok else 'NOT available (' + reason + ')'}"


def pytest_collection_modifyitems(config, items):
    ok, reason = op_available()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"ort_kvlayout is not usable: {reason}")
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in _NEEDS_OP:
            item.add_marker(skip)
