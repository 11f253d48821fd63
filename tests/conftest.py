"""Test setup: tests/helpers on sys.path (the shared builders and oracles, imported by name:
``reference``, ``gqa_case``, ``serve_util``...), and a skip for the op's CPU suites
(_NEEDS_OP, in op/) while ``ort_kvlayout`` cannot be imported or cannot register its
library. op/test_reference.py needs only onnxruntime and always runs.

The folders mirror the source: op/ (the op library: csrc, ort_kvlayout.op, its build), model/,
tools/, runtime/, serve/ (the package's subpackages), bench/ (bench/ and tools/perf/); tests of
the package as a whole and of the GPU test script stay here."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers"))

from gqa_case import op_available

_NEEDS_OP = (
    "test_gqa_cpu",
    "test_gqa_direct",
    "test_gqa_errors",
    "test_gqa_properties",
    "test_gqa_nonfinite",
)


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
