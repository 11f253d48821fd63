"""CPU kernel levels (portable, AVX2+FMA, AVX-512): each one the machine supports, forced through
ORT_KVLAYOUT_CPU_ISA in a child process (the level is chosen once per process), against the
float64 oracle; the level chosen when nothing is forced; a refused level; and that no AVX
instruction sits outside the per-level kernels in the library ORT loads."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import ort_kvlayout
import pytest

LEVELS = ("portable", "avx2", "avx512")
ENV = "ORT_KVLAYOUT_CPU_ISA"
TESTS = Path(__file__).resolve().parent
HELPERS = TESTS.parent / "helpers"


def _info() -> dict:
    return ort_kvlayout.build_info()


def _supported() -> list[str]:
    """Built levels up to the best this CPU supports."""
    info = _info()
    best = LEVELS.index(info["cpu_isa_best"])
    return [lv for lv in info["cpu_isas"] if LEVELS.index(lv) <= best]


def _child(code: str, level: str | None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop(ENV, None)
    if level is not None:
        env[ENV] = level
    env["PYTHONPATH"] = os.pathsep.join(
        [
            str(Path(ort_kvlayout.__file__).parent.parent),
            str(TESTS),
            str(HELPERS),
            env.get("PYTHONPATH", ""),
        ]
    )
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _require(level: str) -> None:
    if level not in _info()["cpu_isas"]:
        pytest.skip(f"level {level} is not built for this architecture")
    if level not in _supported():
        pytest.skip(f"this CPU does not support {level} (best: {_info()['cpu_isa_best']})")


# Prompt, decode and chunk steps in both layouts, fp32 and fp16, with softcap, a local window,
# rotary, GQA and MQA, head sizes that leave vector tails (80) and ones that do not.
_CASES = """
from gqa_case import GqaCase, check_vs_reference

cases = []
for layout in (0, 1):
    cases += [
        GqaCase(kind="prompt", seq=70, batch=2, pad=3, num_heads=8, kv_num_heads=2,
                head_size=64, kv_layout=layout, do_rotary=True, seed=1),
        GqaCase(kind="prompt", seq=33, num_heads=4, kv_num_heads=1, head_size=80,
                kv_layout=layout, softcap=5.0, seed=2),
        GqaCase(kind="prompt", seq=300, num_heads=4, kv_num_heads=2, head_size=128,
                kv_layout=layout, local_window_size=100, seed=3),
        GqaCase(kind="decode", past_len=200, batch=2, pad=1, num_heads=8, kv_num_heads=2,
                head_size=128, kv_layout=layout, shared=True, seed=4),
        GqaCase(kind="decode", past_len=37, num_heads=9, kv_num_heads=3, head_size=64,
                kv_layout=layout, dtype="fp16", softcap=30.0, seed=5),
        GqaCase(kind="chunk", seq=7, past_len=129, num_heads=8, kv_num_heads=2, head_size=64,
                kv_layout=layout, dtype="bf16", do_rotary=True, seed=6),
        GqaCase(kind="chunk", seq=40, past_len=90, num_heads=4, kv_num_heads=4, head_size=96,
                kv_layout=layout, attention_bias="bn", seed=7),
    ]
for case in cases:
    check_vs_reference(case, case.run_ours(threads=2), what=f"{level}: ")
print("checked", len(cases))
"""


@pytest.mark.parametrize("level", LEVELS)
def test_forced_level_matches_reference(level):
    _require(level)
    code = (
        textwrap.dedent(f"""
        import ort_kvlayout
        level = {level!r}
        info = ort_kvlayout.build_info()
        assert info["cpu_isa"] == level and info["cpu_isa_error"] == "", info
    """)
        + _CASES
    )
    r = _child(code, level)
    assert r.returncode == 0, f"level {level}:\n{r.stdout}\n{r.stderr}"
    assert "checked 14" in r.stdout


@pytest.mark.parametrize("level", LEVELS)
def test_forced_level_passes_cpu_suites(level):
    """The CPU and non-finite suites (NaN/Inf rules, softcap) at every level other than the one
    this process runs them at already."""
    _require(level)
    if level == _info()["cpu_isa"]:
        pytest.skip(f"{level} is this process's level: the suites run here directly")
    code = f"""
        import sys, pytest, ort_kvlayout
        assert ort_kvlayout.build_info()["cpu_isa"] == {level!r}
        sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", {str(TESTS / "test_gqa_cpu.py")!r},
                              {str(TESTS / "test_gqa_nonfinite.py")!r}]))
    """
    r = _child(code, level, timeout=600)
    assert r.returncode == 0, f"level {level}:\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}"


def test_default_level_is_best_supported():
    code = """
        import ort_kvlayout
        info = ort_kvlayout.build_info()
        print(info["cpu_isa"], info["cpu_isa_best"], info["cpu_isa_error"] or "-")
    """
    for forced in (None, "auto", ""):
        r = _child(code, forced)
        assert r.returncode == 0, r.stderr
        chosen, best, error = r.stdout.split()
        assert chosen == best == _info()["cpu_isa_best"] and error == "-", (forced, r.stdout)
    assert _info()["cpu_isas"][0] == "portable"
    if os.uname().machine in ("x86_64", "AMD64"):
        assert _info()["cpu_isas"] == list(LEVELS)


_REFUSED = """
    import numpy as np
    import ort_kvlayout
    from gqa_case import GqaCase
    info = ort_kvlayout.build_info()
    assert info["cpu_isa"] is None, info
    print("ERROR:", info["cpu_isa_error"])
    try:
        GqaCase(kind="prompt", seq=4).run_ours()
    except Exception as e:
        print("RUN:", e)
    else:
        raise SystemExit("the op ran although the forced level was refused")
"""


def test_unknown_level_is_refused():
    r = _child(_REFUSED, "sse9")
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    lines = r.stdout.splitlines()
    assert "ORT_KVLAYOUT_CPU_ISA='sse9' is not a CPU level: use auto, portable" in lines[0]
    assert "ORT_KVLAYOUT_CPU_ISA='sse9' is not a CPU level" in lines[1]


def test_level_above_cpu_is_refused():
    info = _info()
    above = [lv for lv in info["cpu_isas"] if LEVELS.index(lv) > LEVELS.index(info["cpu_isa_best"])]
    if not above:
        pytest.skip(f"this CPU supports every level built ({info['cpu_isas']})")
    r = _child(_REFUSED, above[-1])
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    want = (
        f"ORT_KVLAYOUT_CPU_ISA={above[-1]}: this CPU (or its OS) does not support it; the highest"
        f" level it supports is {info['cpu_isa_best']}"
    )
    lines = r.stdout.splitlines()
    assert want in lines[0] and want in lines[1], r.stdout


def test_no_avx_outside_level_kernels():
    """Only the AVX2 and AVX-512 copies of the kernels may hold AVX instructions: anything else
    (validation, dispatch, header inline functions and std templates the linker keeps one copy
    of) can run on a CPU without AVX before or regardless of the level chosen."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) is not installed")
    lib = ort_kvlayout.library_path()
    text = subprocess.run(
        [objdump, "-d", "--no-show-raw-insn", "-C", lib], capture_output=True, text=True, check=True
    ).stdout
    if "isa_avx2::" not in text:
        pytest.skip(f"{lib} is stripped: functions cannot be told apart")
    func = "?"
    offenders: dict[str, int] = {}
    vex = re.compile(r"\t(v[a-z0-9]+\s|.*%[yz]mm\d|.*%k[0-7])")
    for line in text.splitlines():
        m = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if m:
            func = m.group(1)
            continue
        if vex.search(line) and "isa_avx2::" not in func and "isa_avx512::" not in func:
            offenders[func] = offenders.get(func, 0) + 1
    assert not offenders, f"AVX instructions outside the level kernels: {offenders}"
    assert "isa_avx512::" in text or "avx512" not in _info()["cpu_isas"]
