"""The knob registry (csrc/core/knobs.h) and docs/KNOBS.md: the doc is what the generator
writes, every knob name the sources use is in one of its tables, and a knob set to a bad value
is an error naming the knob and its rule (in a child process: knobs are parsed once)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ort_kvlayout = pytest.importorskip("ort_kvlayout", reason="ort_kvlayout is not installed")
from ort_kvlayout import _C

ROOT = Path(__file__).resolve().parents[2]
HELPERS = ROOT / "tests" / "helpers"
# A knob name, not a family written as ORT_KVLAYOUT_DECODE_*.
NAME = r"\bORT_KVLAYOUT_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_]*\*)"


def _gen():
    spec = importlib.util.spec_from_file_location(
        "gen_knobs_doc", ROOT / "scripts" / "gen_knobs_doc.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _child(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ORT_KVLAYOUT_")}
    clean["PYTHONPATH"] = os.pathsep.join(
        [str(Path(ort_kvlayout.__file__).parent.parent), str(HELPERS), clean.get("PYTHONPATH", "")]
    )
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**clean, **env},
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip


def test_doc_is_what_the_generator_writes():
    want = _gen().render()
    got = (ROOT / "docs" / "KNOBS.md").read_text(encoding="utf-8")
    assert got == want, "docs/KNOBS.md is out of date: run python scripts/gen_knobs_doc.py"


def test_registry_entries_are_complete():
    knobs = _C.knobs()
    names = [k["name"] for k in knobs]
    assert len(set(names)) == len(names)
    values = _C.knob_values()
    assert set(values) == set(names) | {"error"}
    for k in knobs:
        assert k["name"].startswith("ORT_KVLAYOUT_")
        assert k["class"] in ("product", "diagnostic", "tuning-unstable"), k
        assert k["doc"] and "\n" not in k["doc"] and k["values"], k


def _source_files():
    for folder in ("csrc", "python", "cmake", "scripts"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".h", ".cc", ".cu", ".cuh", ".py", ".sh") and path.is_file():
                yield path


def test_every_knob_name_in_the_sources_is_documented():
    """Every ORT_KVLAYOUT_* name in csrc/, python/, cmake/ and scripts/ is a registry knob or a
    row of the generator's build tables; every CMake cache option and $ENV{} of CMakeLists.txt
    too; and the generator's compile definitions are exactly csrc's overridable KVL_* defaults."""
    gen = _gen()
    documented = {k["name"] for k in _C.knobs()}
    documented |= {row[0] for row in gen.BUILD_KNOBS + gen.BUILD_ENV}
    used: dict[str, str] = {}
    for path in _source_files():
        if path.name == "gen_knobs_doc.py":
            continue
        for name in re.findall(NAME, path.read_text(errors="replace")):
            used.setdefault(name, str(path.relative_to(ROOT)))
    cmake = (ROOT / "CMakeLists.txt").read_text()
    for name in re.findall(r"set\((\w+)\s[^)]*\bCACHE\b", cmake) + re.findall(
        r"option\((\w+)", cmake
    ):
        used.setdefault(name, "CMakeLists.txt")
    for name in re.findall(r"\$ENV\{(\w+)\}", cmake):
        used.setdefault(name, "CMakeLists.txt")
    missing = {n: where for n, where in used.items() if n not in documented}
    assert not missing, f"knobs used but not in the registry or scripts/gen_knobs_doc.py: {missing}"

    defaults = set()
    for path in _source_files():
        defaults |= set(re.findall(r"#ifndef (KVL_\w+)\s*(?://.*)?\n#define \1 ", path.read_text()))
    listed = {row[0] for row in gen.COMPILE_KNOBS}
    assert defaults == listed, (
        f"scripts/gen_knobs_doc.py COMPILE_KNOBS: add {sorted(defaults - listed)}, "
        f"remove {sorted(listed - defaults)}; then run it"
    )


def test_no_raw_getenv_outside_the_registry():
    hits = []
    for path in _source_files():
        native = path.suffix in (".h", ".cc", ".cu", ".cuh") and path.name != "knobs.cc"
        if native and re.search(r"\bgetenv\s*\(", path.read_text()):
            hits.append(str(path.relative_to(ROOT)))
    assert not hits, f"read knobs through kvl::Knobs() (csrc/core/knobs.h), not getenv: {hits}"


def test_values_parse_and_a_bad_value_is_named_with_its_rule():
    p = _child(
        """
        from ort_kvlayout import _C
        v = _C.knob_values()
        print(v["ORT_KVLAYOUT_DECODE_SPLITS"], v["ORT_KVLAYOUT_CUDNN"], v["ORT_KVLAYOUT_CPU_ISA"])
        print(v["error"])
        """,
        {"ORT_KVLAYOUT_DECODE_SPLITS": "12", "ORT_KVLAYOUT_CUDNN": "0",
         "ORT_KVLAYOUT_CPU_ISA": "portable", "ORT_KVLAYOUT_DECODE_PACKED": "3",
         "ORT_KVLAYOUT_STRICT_LENGTHS": "yes"},
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "12 False portable"
    assert lines[1] == (
        "environment variable ORT_KVLAYOUT_STRICT_LENGTHS must be 0 or 1, got 'yes'; "
        "environment variable ORT_KVLAYOUT_DECODE_PACKED must be an integer from 0 to 2, got '3'"
    )


def test_empty_means_default():
    p = _child("from ort_kvlayout import _C; v = _C.knob_values(); print(v['error'] == '', "
               "v['ORT_KVLAYOUT_CUDNN_MIN_ROWS'])", {"ORT_KVLAYOUT_CUDNN_MIN_ROWS": ""})  # fmt: skip
    assert p.stdout.split() == ["True", "64"], p.stderr


@pytest.mark.gpu
def test_cuda_op_creation_names_a_bad_knob():
    from gpu_util import SKIP_REASON

    if SKIP_REASON is not None:
        pytest.skip(f"GPU tests: {SKIP_REASON}")
    p = _child(
        """
        from gqa_case import KV_DOMAIN, GqaCase, build_model
        from gpu_util import new_cuda_session
        case = GqaCase(batch=1, kind="decode", past_len=11, head_size=64, dtype="fp16")
        try:
            new_cuda_session(build_model(case.feeds(), case.attrs(), KV_DOMAIN, 1), KV_DOMAIN)
            print("CREATED")
        except Exception as e:
            print("RAISED", str(e).replace("\\n", " "))
        """,
        {"ORT_KVLAYOUT_DECODE_SPLITS": "many"},
    )
    assert p.stdout.startswith("RAISED"), p.stdout + p.stderr[-2000:]
    assert ("environment variable ORT_KVLAYOUT_DECODE_SPLITS must be an integer from 0 to 256, "
            "got 'many'") in p.stdout  # fmt: skip
