"""Static facts of the decode kernel's prologue, read off a cubin's SASS (no GPU needed).

    nvcc -DKVL_WITH_CUDA=1 -O3 -DNDEBUG -std=c++17 -arch=sm_90 -cubin --use_fast_math -Xptxas -v \\
        -Icsrc -I$ORT_INCLUDE -o decode.cubin csrc/cuda/decode_half_hd128.cu > ptxas.log 2>&1
    python tools/perf/sass_prologue.py decode.cubin --ptxas ptxas.log

For each named instance (by default those of the fp16 one-token ones the grid's shapes run, and
the packed one, that the cubin holds: one decode_<dtype>_hd<N>.cu each): its instructions in all; from the working CTAs' path (the target of the kernel's first
branch, which jumps over the checker row's code) the instructions to the lengths load (its first
LDG) and to the first LDGSTS (the first step's copies); and, before that LDGSTS, the reciprocals
(MUFU.RCP: one per integer division or __frcp_rn), conversions and double-precision operations.
With --ptxas, the instance's spill stores and loads from `ptxas -v`. Needs cuobjdump on PATH.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

# fp16 instances (kvl::cu::DecodeTcKernel<__half, HD, DecodeForm, W, C>): head tile, form (2:
# plain one token, 3: packed heads), warps; an int8 cache's instances end their warps with "aE".
DEFAULT = [
    "I6__halfLi64ELNS0_10DecodeFormE2ELi4E",
    "I6__halfLi64ELNS0_10DecodeFormE2ELi8E",
    "I6__halfLi128ELNS0_10DecodeFormE2ELi4E",
    "I6__halfLi128ELNS0_10DecodeFormE2ELi8E",
    "I6__halfLi256ELNS0_10DecodeFormE2ELi4E",
    "I6__halfLi192ELNS0_10DecodeFormE3ELi8E",
]
INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
COUNTED = {
    "MUFU.RCP": r"MUFU\.RCP",
    "I2F": r"\bI2F",
    "F2I": r"\bF2I",
    "DADD/DMUL/DFMA": r"\bD(ADD|MUL|FMA)\b",
    "CALL": r"\bCALL\b",
}


def functions(cubin: Path) -> dict[str, list[tuple[int, str]]]:
    sass = subprocess.run(
        ["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True, check=True
    ).stdout
    out: dict[str, list[tuple[int, str]]] = {}
    for part in re.split(r"\n\s*Function : ", sass)[1:]:
        name = part.split("\n", 1)[0].strip()
        out[name] = [(int(a, 16), op.strip()) for a, op in INSTR.findall(part)]
    return out


def spills(ptxas_log: Path) -> dict[str, str]:
    """Instance name -> 'S stores / L loads' bytes, from ptxas -v."""
    out: dict[str, str] = {}
    name = None
    for line in ptxas_log.read_text().splitlines():
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            name = m.group(1)
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and name is not None:
            out[name] = f"{m.group(1)} / {m.group(2)}"
    return out


def prologue(instrs: list[tuple[int, str]]) -> dict[str, int]:
    """The facts of one instance's SASS; ValueError where it lacks the decode kernel's shape (a
    first branch with a target, then a load and a copy)."""
    addrs = [a for a, _ in instrs]
    ops = [op for _, op in instrs]

    def first(pattern: str, start: int, what: str) -> int:
        found = next((i for i in range(start, len(ops)) if re.search(pattern, ops[i])), None)
        if found is None:
            raise ValueError(f"no {what} in the instance's SASS: not a decode kernel?")
        return found

    branch = first(r"\bBRA\b.*0x[0-9a-f]+", 0, "branch")
    target = addrs.index(int(re.search(r"0x([0-9a-f]+)", ops[branch]).group(1), 16))
    lengths = first(r"\bLDG\b", target, "LDG after the first branch's target")
    copies = first(r"\bLDGSTS\b", target, "LDGSTS after the first branch's target")
    facts = {"instructions": len(ops), "to lengths": lengths - target, "to LDGSTS": copies - target}
    for key, pattern in COUNTED.items():
        facts[key] = sum(1 for op in ops[target:copies] if re.search(pattern, op))
    return facts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("cubin", type=Path)
    p.add_argument("instances", nargs="*", help="substrings of mangled names (default: DEFAULT's)")
    p.add_argument("--ptxas", type=Path, default=None, help="the compile's ptxas -v output")
    args = p.parse_args(argv)
    funcs = functions(args.cubin)
    spilled = spills(args.ptxas) if args.ptxas else {}
    cols = ["instructions", "to lengths", "to LDGSTS", *COUNTED]
    print("| instance | " + " | ".join(cols) + (" | spill bytes st / ld |" if spilled else " |"))
    print("|---" * (len(cols) + 1 + bool(spilled)) + "|")
    # A named instance must be in the cubin; of the defaults, those it holds.
    named = args.instances or [d for d in DEFAULT if any(d in n for n in funcs)]
    if not named:
        print(f"sass_prologue.py: {args.cubin} holds none of the default instances; name some",
              file=sys.stderr)  # fmt: skip
        return 1
    for pattern in named:
        name = next((n for n in funcs if pattern in n), None)
        if name is None:
            print(f"sass_prologue.py: no instance matches {pattern}", file=sys.stderr)
            return 1
        try:
            facts = prologue(funcs[name])
        except ValueError as e:
            print(f"sass_prologue.py: {name}: {e}", file=sys.stderr)
            return 1
        # The instance's template arguments (a pattern may match a longer name: an int8 one's).
        args_at = re.search(r"DecodeTcKernelI(.*?)EEv", name)
        row = [args_at.group(1) if args_at else name] + [str(facts[c]) for c in cols]
        if spilled:
            row.append(spilled.get(name, "0 / 0"))
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
