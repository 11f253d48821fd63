"""Checks decode-fast-div's split share (DecodeIndex::SplitShare, csrc/cuda/decode.cu): for every
target t <= 256 and live key counts up to 2^31, floor((keys + t - 1 + 1/2) x fl(1 / t)) in IEEE
double (round to nearest, as __dadd_rn / __dmul_rn) equals the integer ceil(keys / t) that
SplitChunk computes. Keys: 0 to 19999, two either side of 20000 random multiples of t, the top
3 t + 5 counts up to 2^31, and 50000 random counts.

    python bench/results/exp-fast-index/check_split_share.py
"""

from __future__ import annotations

import numpy as np


def main() -> int:
    rng = np.random.default_rng(0)
    bad = total = 0
    for t in range(1, 257):
        inv = np.float64(1.0) / np.float64(t)
        mult = rng.integers(0, (2**31) // t + 1, size=20000, dtype=np.uint64) * np.uint64(t)
        keys = np.concatenate(
            [np.arange(0, 20000, dtype=np.uint64)]
            + [
                (mult.astype(np.int64) + d).clip(0, 2**31).astype(np.uint64)
                for d in (-2, -1, 0, 1, 2)
            ]
            + [np.arange(2**31 - 3 * t - 5, 2**31 + 1, dtype=np.uint64)]
            + [rng.integers(0, 2**31 + 1, size=50000, dtype=np.uint64)]
        )
        n = keys + np.uint64(t - 1)
        assert int(n.max()) < 2**32
        share = np.trunc((n.astype(np.float64) + 0.5) * inv).astype(np.uint64)
        bad += int((share != n // np.uint64(t)).sum())
        total += keys.size
    print(f"targets 1..256: {total} key counts, {bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
