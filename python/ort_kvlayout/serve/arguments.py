"""The serving options' values as text: bytes (2GiB, 1e9), a KV budget (bytes or a share of free
memory), decode buckets (1,2,4,8), the packing of a step's calls (auto, off, on, mixed). Shared
by the CLI and the cluster's Serve config."""

from __future__ import annotations

import argparse
import re

__all__ = ["PACKING", "packing_fields", "parse_buckets", "parse_budget", "parse_bytes"]

# --packing: EngineConfig's (packed, mixed). auto: packed where the graph allows it; off: one
# call per prefill chunk; on: packed or an error; mixed: packed, decode rows in the prefill call.
PACKING = {
    "auto": {"packed": None, "mixed": False},
    "off": {"packed": False, "mixed": False},
    "on": {"packed": True, "mixed": False},
    "mixed": {"packed": True, "mixed": True},
}

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40, "kb": 1000, "mb": 10**6,
          "gb": 10**9, "tb": 10**12}  # fmt: skip
_WHOLE_BYTES = "bytes are a whole number such as 2GiB or 1e9"


def parse_bytes(text: str) -> int:
    """Bytes: a whole number (1000, 1e9) or a number with a unit (512MiB, 1.5GiB, 2TB: rounded
    down to whole bytes). A plain number with a fractional part (1.5) is refused."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:[eE][+]?\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected bytes such as 512MiB, 2GiB, 1TiB, 1e9"
        )
    value, unit = float(match.group(1)), _UNITS[match.group(2).lower()]
    if unit == 1 and not value.is_integer():
        raise argparse.ArgumentTypeError(f"{text!r}: {_WHOLE_BYTES}")
    return int(value * unit)


def parse_budget(text: str) -> tuple[int | None, float | None]:
    """--kv-budget: (bytes, None) for 512MiB, 2GiB, 1e9, 1000; (None, fraction) for a number in
    (0, 1] or a percentage (0.9, 90%): that share of the memory free at start. A plain number
    above 1 with a fractional part (1.5) is neither: refused, never read as 1 byte."""
    t = text.strip()
    try:
        value = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        return parse_bytes(text), None
    if t.endswith("%") or value <= 1:
        if not 0 < value <= 1:
            raise argparse.ArgumentTypeError(f"{text!r}: a fraction of free memory is in (0, 1]")
        return None, value
    if not value.is_integer():  # 1.5, inf: neither a fraction nor whole bytes
        raise argparse.ArgumentTypeError(
            f"{text!r}: a fraction of free memory is in (0, 1]; {_WHOLE_BYTES}"
        )
    return parse_bytes(text), None


def packing_fields(text: str) -> dict:
    """EngineConfig's packed and mixed for a --packing value."""
    try:
        return dict(PACKING[text])
    except KeyError:
        raise ValueError(f"packing {text!r}: expected one of {', '.join(PACKING)}") from None


def parse_buckets(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(b) for b in text.split(",") if b.strip())
    except ValueError:
        sizes = (0,)
    if any(b < 1 for b in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: expected batch sizes such as 1,2,4,8")
    return sizes
