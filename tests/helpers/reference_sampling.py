"""Numpy oracle of ai.kvlayout::SampleTokens, written from its contract (docs/CONTRACT.md
section 15), not from either kernel.

Per row, x = the row's logits as float32:
  1. a NaN or an infinity in the row: -1;
  2. invalid parameters (temperature NaN or < 0, top_k < 0, top_p NaN or outside (0, 1],
     uniform NaN or outside [0, 1)): -2;
  3. temperature == 0 or top_k == 1: np.argmax(x) (the lowest index among the maxima);
  4. else the order (x descending, index ascending), its first K tokens (K = top_k when
     0 < top_k < V, else V), weights w = exp((x - x_max) / temperature) in float32, the shortest
     prefix of the order whose weight reaches top_p * Z (Z the weight of the K), and the first
     token of that prefix, scanned in index order, at which the running weight exceeds
     uniform * Z' (Z' the weight of the prefix); the last one if rounding leaves none.

Weights are float32 as the contract says; sums are float64 here. The kernels sum the weights in
fixed point, so a test compares with them only where ``uniform`` and ``top_p`` stay away from
the boundaries (``RowPlan.safe_uniform``, ``RowPlan.top_p_slack``).

Entry points: ``sample_tokens`` (the op on numpy arrays), ``row_token``, ``row_plan``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NON_FINITE = -1
INVALID = -2


def params_valid(temperature, top_k, top_p, uniform) -> bool:
    t, p, u = np.float32(temperature), np.float32(top_p), np.float32(uniform)
    return bool(
        not np.isnan(t) and t >= 0
        and int(top_k) >= 0
        and not np.isnan(p) and 0 < p <= 1
        and not np.isnan(u) and 0 <= u < 1
    )  # fmt: skip


def is_greedy(temperature, top_k) -> bool:
    return bool(np.float32(temperature) == 0 or int(top_k) == 1)


@dataclass
class RowPlan:
    """A sampled row: what the contract keeps and how ``uniform`` maps to a token."""

    order: np.ndarray  # token ids in the contract's order
    weights: np.ndarray  # float32 weight of every token of the row
    kept: np.ndarray  # the kept token ids, ascending (the scan order)
    running: np.ndarray  # running kept weight in index order (float64); running[-1] = Z'
    top_p_slack: float  # |top_p * Z - nearest prefix weight| / Z: how safe the top-p cut is

    @property
    def cum(self) -> np.ndarray:
        """The running weight as a fraction of Z': uniform's boundaries."""
        return self.running / self.running[-1]

    def probabilities(self, vocab: int) -> np.ndarray:
        """The probability of each token (0 outside the kept set)."""
        prob = np.zeros(vocab)
        w = self.weights[self.kept].astype(np.float64)
        prob[self.kept] = w / w.sum()
        return prob

    def token(self, uniform: float) -> int:
        """The first kept token whose running weight exceeds uniform * Z' (else the last)."""
        r = float(np.float32(uniform)) * self.running[-1]
        i = int(np.searchsorted(self.running, r, "right"))
        return int(self.kept[min(i, len(self.kept) - 1)])

    def boundary_distance(self, uniform: float) -> float:
        """How far ``uniform`` lies from the nearest point where the token changes."""
        return float(np.min(np.abs(self.cum[:-1] - uniform))) if len(self.cum) > 1 else 1.0

    def safe_uniform(self, rng: np.random.Generator, margin: float = 1e-5) -> np.float32:
        """A uniform number in [0, 1) at least ``margin`` from every boundary: drawn, or the
        middle of the widest kept token's interval."""
        for _ in range(100):
            u = np.float32(rng.random())
            if u < 1 and self.boundary_distance(float(u)) > margin:
                return u
        edges = np.concatenate([[0.0], self.cum])
        i = int(np.argmax(np.diff(edges)))
        return np.float32((edges[i] + edges[i + 1]) / 2)


def row_plan(x, temperature, top_k, top_p) -> RowPlan:
    """The contract's step 4 for one row of finite logits and valid, non-greedy parameters."""
    x = np.asarray(x).astype(np.float32).reshape(-1)
    vocab = x.size
    order = np.lexsort((np.arange(vocab), -x.astype(np.float64)))
    k = int(top_k) if 0 < int(top_k) < vocab else vocab
    with np.errstate(all="ignore"):
        w = np.exp((x - x.max()) / np.float32(temperature)).astype(np.float32)
    prefix = np.cumsum(w[order[:k]].astype(np.float64))
    z = prefix[-1]
    p = float(np.float32(top_p))
    if p >= 1:
        j, slack = k, 1.0
    else:
        target = p * z
        j = int(np.searchsorted(prefix, target, "left")) + 1  # shortest prefix reaching target
        below = prefix[j - 2] if j >= 2 else 0.0
        slack = min(prefix[j - 1] - target, target - below) / z
    kept = np.sort(order[:j])
    running = np.cumsum(w[kept].astype(np.float64))
    return RowPlan(order=order, weights=w, kept=kept, running=running, top_p_slack=slack)


def row_token(x, temperature, top_k, top_p, uniform) -> int:
    x = np.asarray(x).reshape(-1)
    if not np.isfinite(x.astype(np.float32)).all():
        return NON_FINITE
    if not params_valid(temperature, top_k, top_p, uniform):
        return INVALID
    if is_greedy(temperature, top_k):
        return int(np.argmax(x))
    return row_plan(x, temperature, top_k, top_p).token(uniform)


def sample_tokens(logits, temperature, top_k, top_p, uniform) -> np.ndarray:
    """The op: int64 token ids of shape logits.shape[:-1]; each parameter one value per row."""
    logits = np.asarray(logits)
    rows = logits.reshape(-1, logits.shape[-1])
    params = [np.asarray(a).reshape(-1) for a in (temperature, top_k, top_p, uniform)]
    out = np.array(
        [row_token(rows[r], *(a[r] for a in params)) for r in range(rows.shape[0])], np.int64
    )
    return out.reshape(logits.shape[:-1])
