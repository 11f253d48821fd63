"""tools/perf/sass_prologue.py: the static prologue facts (instructions from
the working CTAs' path to the lengths load and the first copy, the reciprocals before it, ptxas's
spills), read from cuobjdump's and ptxas's text."""

from __future__ import annotations

import pytest
from bench_util import load_perf

sass_prologue = load_perf("sass_prologue")


def _sass(ops: list[str]) -> list[tuple[int, str]]:
    return [(16 * i, op) for i, op in enumerate(ops)]


def test_prologue_counts_from_the_first_branch_target():
    # The checker row's code sits between the branch and its target (0x60): its reciprocal and
    # load are not the working CTAs'.
    ops = [
        "S2R R0, SR_CTAID.Y",
        "ISETP.GE.AND P0, PT, R0, 0x3, PT",
        "@P0 BRA 0x60",
        "MUFU.RCP R3, R3",
        "LDG.E R2, desc[UR4][R2.64]",
        "EXIT",
        "I2F.U32.RP R4, R5",  # the target: index 6
        "MUFU.RCP R4, R4",
        "LDG.E R6, desc[UR4][R6.64]",  # the lengths load: 2 after the target
        "DMUL R8, R8, R10",
        "F2I.U32.F64.TRUNC R8, R8",
        "LDGSTS.E.BYPASS.LTC128B.128 [R9], desc[UR4][R12.64]",  # 5 after the target
        "MUFU.RCP R1, R1",  # after the first copy: not counted
    ]
    facts = sass_prologue.prologue(_sass(ops))
    assert facts["instructions"] == len(ops)
    assert facts["to lengths"] == 2
    assert facts["to LDGSTS"] == 5
    assert facts["MUFU.RCP"] == 1
    assert facts["I2F"] == 1 and facts["F2I"] == 1
    assert facts["DADD/DMUL/DFMA"] == 1
    assert facts["CALL"] == 0


def test_an_instance_without_the_decode_shape_is_named():
    # A kernel with no copy after its first branch's target (not a decode instance).
    ops = ["@P0 BRA 0x20", "EXIT", "LDG.E R2, desc[UR4][R2.64]", "EXIT"]
    with pytest.raises(ValueError, match="no LDGSTS after the first branch's target"):
        sass_prologue.prologue(_sass(ops))


def test_spills_per_instance(tmp_path):
    log = tmp_path / "ptxas.log"
    log.write_text(
        "ptxas info    : Function properties for _Z1aILi64EE\n"
        "    16 bytes stack frame, 28 bytes spill stores, 24 bytes spill loads\n"
        "ptxas info    : Function properties for _Z1bILi128EE\n"
        "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
    )
    assert sass_prologue.spills(log) == {"_Z1aILi64EE": "28 / 24", "_Z1bILi128EE": "0 / 0"}


_DECODE = [
    "@P0 BRA 0x20",
    "EXIT",
    "LDG.E R6, desc[UR4][R6.64]",
    "LDGSTS.E.BYPASS.LTC128B.128 [R9], desc[UR4][R12.64]",
]


def _kernel(args: str) -> str:
    return f"_ZN3kvl2cu14DecodeTcKernelI{args}EEvNS_8GqaShapeE"


def test_defaults_are_those_the_cubin_holds_and_rows_name_the_instance(monkeypatch, capsys):
    # One .cu per instantiation: an int8 cubin holds no fp16 instance, and the fp16 patterns
    # (substrings) match its instances, which the rows then name in full.
    int8 = _kernel("6__halfLi64ELNS0_10DecodeFormE2ELi8Ea")
    monkeypatch.setattr(sass_prologue, "functions", lambda cubin: {int8: _sass(_DECODE)})
    assert sass_prologue.main(["x.cubin"]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| 6__half")]
    assert rows == ["| 6__halfLi64ELNS0_10DecodeFormE2ELi8Ea | 4 | 0 | 1 | 0 | 0 | 0 | 0 | 0 |"]


def test_a_named_instance_must_be_in_the_cubin(monkeypatch, capsys):
    monkeypatch.setattr(sass_prologue, "functions", lambda cubin: {_kernel("x"): _sass(_DECODE)})
    assert sass_prologue.main(["x.cubin", "Li128E"]) == 1
    assert "no instance matches Li128E" in capsys.readouterr().err
    assert sass_prologue.main(["x.cubin"]) == 1
    assert "none of the default instances" in capsys.readouterr().err
