"""Choosing the next token from logits: greedy, or sampling with temperature, top-k and top-p.

    sampler = Sampler(SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=7))
    next_ids = sampler(logits)  # (B, V) float -> (B,) int64

Sampling is seeded per Sampler (numpy's PCG64): the same seed and logits give the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral, Real

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (the default) is greedy; top_k 0 and top_p 1.0 keep every token."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):  # a real number (not a bool, a string, None)
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, Real):
                raise TypeError(f"{name} must be a number, got {value!r}")
        for name in ("top_k", "seed"):  # an integer (2.5 or "3" would be truncated or fail late)
            value = getattr(self, name)
            if value is None and name == "seed":
                continue
            if isinstance(value, bool) or not isinstance(value, Integral):
                raise TypeError(f"{name} must be an integer, got {value!r}")
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and self.seed < 0:  # numpy's generator takes none below 0
            raise ValueError(f"seed must be an integer >= 0, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams()


class Sampler:
    def __init__(self, params: SamplingParams = GREEDY):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> np.ndarray:
        logits = np.asarray(logits)
        if logits.ndim != 2:
            raise ValueError(f"logits must be (batch, vocab), got shape {logits.shape}")
        if self.params.greedy and logits.dtype == np.float16:
            return _greedy_half(logits)
        logits = logits.astype(np.float32, copy=False)
        _check_finite(~np.isfinite(logits).all(axis=-1))
        if self.params.greedy:
            return np.argmax(logits, axis=-1).astype(np.int64)
        return np.array([self._sample_row(row) for row in logits], dtype=np.int64)

    def _sample_row(self, row: np.ndarray) -> int:
        p = self.params
        # The maximum subtracted before dividing: a tiny temperature gives -inf for the others
        # (probability 0) instead of inf - inf = NaN.
        row = row.astype(np.float64)
        scaled = (row - row.max()) / p.temperature
        order = np.argsort(-scaled, kind="stable")  # most likely first
        if p.top_k:
            order = order[: p.top_k]
        probs = np.exp(scaled[order])
        probs /= probs.sum()
        if p.top_p < 1:
            # The smallest prefix whose mass reaches top_p (always at least the first token).
            cut = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
            order, probs = order[:cut], probs[:cut] / probs[:cut].sum()
        return int(order[self.rng.choice(len(order), p=probs)])


def _check_finite(bad_rows: np.ndarray) -> None:
    bad = np.flatnonzero(bad_rows)
    if bad.size:  # argmax or probabilities of NaN/inf would be silently wrong tokens
        raise ValueError(
            f"logits of batch entries {bad.tolist()[:8]} contain NaN or infinite values "
            "(the model's output overflowed or is broken)"
        )


def finite_rows(logits: np.ndarray) -> np.ndarray:
    """Per row of (B, V) logits, whether every value is finite (float16 on its bits, as
    _greedy_half reads them)."""
    if logits.dtype == np.float16:
        return (logits.view(np.int16) & 0x7FFF).max(axis=-1) < 0x7C00
    return np.isfinite(logits).all(axis=-1)


def _greedy_half(logits: np.ndarray) -> np.ndarray:
    """Greedy choice over float16 logits (a CUDA model's output) on their bits: numpy converts
    float16 to float32 element by element (SmolLM2's 49152 logits: ~75 us of a ~1.3 ms decode
    step on the H200's host), while int16 passes are vectorized. The same tokens as np.argmax
    over the float32 values: the key orders the bits as their values (a negative value's key is
    minus its magnitude, so -0.0 and +0.0 tie, as the floats do) and np.argmax takes the first
    maximum."""
    bits = logits.view(np.int16)
    magnitude = bits & 0x7FFF
    _check_finite(magnitude.max(axis=-1) >= 0x7C00)  # exponent all ones: inf or NaN
    sign = bits >> 15  # -1 for negative values, else 0
    key = (bits ^ (sign & 0x7FFF)) - sign  # negative: (-1 - magnitude) + 1
    return np.argmax(key, axis=-1).astype(np.int64)
