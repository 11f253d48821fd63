"""Float64 numpy oracle of GroupQueryAttention (ORT 1.32 contract plus ``kv_layout``).

Written from the contract (docs/CONTRACT.md, DESIGN.md section 2), not from any kernel.

Entry points:
  * ``kv_strides`` / ``from_layout`` / ``to_layout``: the single place where the KV layout
    arithmetic lives (mirrors the C++ ``KvStrides``).
  * ``gqa_reference(inputs, attrs, kv_layout) -> (output, present_key, present_value)``.
  * ``defined_masks(inputs, attrs, kv_layout)``: which output rows and present rows the contract
    defines (everything else is unspecified and must not be compared).
  * ``sliding_window_resident(T, C, W)``: L(T) of the windowed cache.

``inputs`` maps ONNX input names (query, key, value, past_key, past_value, seqlens_k,
total_sequence_length, cos_cache, sin_cache, position_ids, attention_bias, head_sink,
q_norm_weight, k_norm_weight, query_seqlens) to numpy arrays or None (absent).  Arrays of a
low-precision dtype are upcast to float64 as they are: pass the rounded values that the kernel
sees.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

HEAD_MAJOR_BNSH = 0
SEQ_MAJOR_BSNH = 1


# --------------------------------------------------------------------------------------------
# KV layout: declared shape (B, Nkv, C, H) for both layouts; kv_layout decides the byte order.
# --------------------------------------------------------------------------------------------
def kv_strides(layout: int, batch: int, kv_heads: int, capacity: int, head_dim: int):
    """Element strides (batch, head, seq, dim) of logical element (b, h, s, d)."""
    del batch
    if layout == HEAD_MAJOR_BNSH:
        return (kv_heads * capacity * head_dim, capacity * head_dim, head_dim, 1)
    if layout == SEQ_MAJOR_BSNH:
        return (capacity * kv_heads * head_dim, head_dim, kv_heads * head_dim, 1)
    raise ValueError(f"kv_layout must be 0 or 1, got {layout}")


def _logical_view(flat: np.ndarray, shape, layout: int) -> np.ndarray:
    st = kv_strides(layout, *shape)
    return np.lib.stride_tricks.as_strided(
        flat, shape=tuple(shape), strides=tuple(s * flat.itemsize for s in st), writeable=True
    )


def from_layout(buf: np.ndarray, layout: int) -> np.ndarray:
    """Declared (B, Nkv, C, H) buffer in ``layout`` byte order -> logical BNSH array (copy)."""
    flat = np.ascontiguousarray(buf).reshape(-1)
    return _logical_view(flat, buf.shape, layout).copy()


def to_layout(bnsh: np.ndarray, layout: int) -> np.ndarray:
    """Logical BNSH array -> declared (B, Nkv, C, H) buffer in ``layout`` byte order."""
    flat = np.empty(bnsh.size, dtype=bnsh.dtype)
    _logical_view(flat, bnsh.shape, layout)[...] = bnsh
    return flat.reshape(bnsh.shape)


def sliding_window_resident(total: int, capacity: int, window: int) -> int:
    """L(T): rows [0, L) of a window-sized cache hold positions T-L .. T-1."""
    if total <= capacity:
        return total
    g = capacity - window + 1
    return total - g * math.ceil((total - capacity) / g)


# --------------------------------------------------------------------------------------------
# The step plan: per batch entry, how many tokens were cached before (P), how many valid new
# rows (Q), the total after (T), and the absolute position of every query row.
# --------------------------------------------------------------------------------------------
@dataclass
class StepPlan:
    batch: int
    seq: int
    num_heads: int
    kv_heads: int
    head_size: int
    first_prompt: bool
    total: int  # total_sequence_length scalar
    T: np.ndarray  # (B,) tokens in cache after the step (seqlens_k + 1)
    P: np.ndarray  # (B,) tokens cached before the step
    Q: np.ndarray  # (B,) valid new rows
    present_capacity: int
    past_capacity: int  # 0 without past


def _attr(attrs: dict, name: str, default):
    v = attrs.get(name, default)
    return default if v is None else v


def _get(inputs: dict, name: str):
    v = inputs.get(name)
    if v is None or (isinstance(v, np.ndarray) and v.size == 0 and name not in ("query",)):
        return None
    return v


def plan_step(inputs: dict, attrs: dict) -> StepPlan:
    q = inputs["query"]
    B, S, D = q.shape
    N = int(attrs["num_heads"])
    Nkv = int(attrs["kv_num_heads"])
    packed = _get(inputs, "key") is None
    H = D // (N + 2 * Nkv) if packed else D // N
    seqlens_k = np.asarray(inputs["seqlens_k"]).astype(np.int64).reshape(B)
    total = int(np.asarray(inputs["total_sequence_length"]).reshape(()))
    T = seqlens_k + 1
    past = _get(inputs, "past_key")
    past_cap = 0 if past is None else past.shape[2]
    qsl = _get(inputs, "query_seqlens")
    swc = int(_attr(attrs, "sliding_window_cache", 0))
    if qsl is not None:
        Q = np.asarray(qsl).astype(np.int64).reshape(B)
        first = False
        P = T - Q
    else:
        first = S == total
        if first:
            P = np.zeros(B, np.int64)
            Q = np.minimum(T, S)
        else:
            P = T - S
            Q = np.full(B, S, np.int64)
    if swc:
        present_cap = past_cap if past is not None else total
    else:
        present_cap = max(total, past_cap)
    return StepPlan(B, S, N, Nkv, H, first, total, T, P, Q, present_cap, past_cap)


# --------------------------------------------------------------------------------------------
# Pieces of the computation
# --------------------------------------------------------------------------------------------
def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Per-head RMS norm over the last axis."""
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(ms + eps) * weight


def apply_rotary(
    x: np.ndarray, pos: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool
) -> np.ndarray:
    """x (B, S, heads, H); pos (B, S) absolute positions; cos/sin (max_pos, rotary_dim/2)."""
    half = cos.shape[1]
    rd = 2 * half
    c = cos[pos][:, :, None, :]  # (B, S, 1, half)
    s = sin[pos][:, :, None, :]
    out = x.copy()
    if interleaved:
        x1 = x[..., 0:rd:2]
        x2 = x[..., 1:rd:2]
        out[..., 0:rd:2] = x1 * c - x2 * s
        out[..., 1:rd:2] = x2 * c + x1 * s
    else:
        x1 = x[..., :half]
        x2 = x[..., half:rd]
        out[..., :half] = x1 * c - x2 * s
        out[..., half:rd] = x2 * c + x1 * s
    return out


def _f64(a):
    return None if a is None else np.asarray(a).astype(np.float64)


def query_positions(inputs: dict, plan: StepPlan, variant=frozenset()) -> np.ndarray:
    """(B, S) absolute position of each query row (used by rotary)."""
    B, S = plan.batch, plan.seq
    s = np.arange(S)[None, :]
    pid = _get(inputs, "position_ids")
    if pid is None:
        return plan.P[:, None] + s
    pid = np.asarray(pid).astype(np.int64)
    if plan.first_prompt and "position_ids_per_entry" not in variant:
        # ORT uses only the first element on a first prompt.
        return np.broadcast_to(pid.reshape(-1)[0] + s, (B, S)).copy()
    return pid.reshape(B, S).copy()


# --------------------------------------------------------------------------------------------
# The oracle
# --------------------------------------------------------------------------------------------
def gqa_reference(inputs: dict, attrs: dict, kv_layout: int = 0, variant=frozenset()):
    """Returns (output (B,S,N*H), present_key, present_value) in float64.

    Presents have the declared shape (B, Nkv, C', H) and ``kv_layout`` byte order.  Rows the
    contract leaves unspecified are filled with NaN (see ``defined_masks``).

    ``variant`` names rejected alternative readings of the contract, used only by the
    experiments that show ORT distinguishes them: "bias_before_softcap", "window_plus_one"
    (W+1 keys), "position_ids_per_entry" (first prompt reads every position_ids row),
    "rotary_before_norm".
    """
    plan = plan_step(inputs, attrs)
    B, S, N, Nkv, H = plan.batch, plan.seq, plan.num_heads, plan.kv_heads, plan.head_size
    G = N // Nkv
    query = _f64(inputs["query"])
    if _get(inputs, "key") is None:
        q = query[..., : N * H]
        k = query[..., N * H : (N + Nkv) * H]
        v = query[..., (N + Nkv) * H :]
    else:
        q, k, v = query, _f64(inputs["key"]), _f64(inputs["value"])
    q = q.reshape(B, S, N, H)
    k = k.reshape(B, S, Nkv, H)
    v = v.reshape(B, S, Nkv, H)

    qn, kn = _f64(_get(inputs, "q_norm_weight")), _f64(_get(inputs, "k_norm_weight"))

    def norm(q, k):
        if qn is None:
            return q, k
        eps = float(_attr(attrs, "qk_norm_epsilon", 1e-6))
        q = rms_norm(q, qn, float(_attr(attrs, "q_norm_epsilon", eps)))
        k = rms_norm(k, kn, float(_attr(attrs, "k_norm_epsilon", eps)))
        return q, k

    if "rotary_before_norm" not in variant:
        q, k = norm(q, k)
    if int(_attr(attrs, "do_rotary", 0)):
        pos = query_positions(inputs, plan, variant)
        cos, sin = _f64(inputs["cos_cache"]), _f64(inputs["sin_cache"])
        inter = bool(int(_attr(attrs, "rotary_interleaved", 0)))
        q = apply_rotary(q, pos, cos, sin, inter)
        k = apply_rotary(k, pos, cos, sin, inter)
    if "rotary_before_norm" in variant:
        q, k = norm(q, k)

    scale = float(_attr(attrs, "scale", 0.0)) or 1.0 / math.sqrt(H)
    softcap = float(_attr(attrs, "softcap", 0.0))
    W = int(_attr(attrs, "local_window_size", -1))
    causal = int(_attr(attrs, "causal", 1))
    smooth = int(_attr(attrs, "smooth_softmax", -1)) == 1
    swc = int(_attr(attrs, "sliding_window_cache", 0))
    sink = _f64(_get(inputs, "head_sink"))
    bias = _f64(_get(inputs, "attention_bias"))

    past_k = _get(inputs, "past_key")
    past_v = _get(inputs, "past_value")
    past_k = None if past_k is None else from_layout(_f64(past_k), kv_layout)
    past_v = None if past_v is None else from_layout(_f64(past_v), kv_layout)

    Cp = plan.present_capacity
    pres_k = np.full((B, Nkv, Cp, H), np.nan)
    pres_v = np.full((B, Nkv, Cp, H), np.nan)
    out = np.full((B, S, N, H), np.nan)

    for b in range(B):
        P, Qb, T = int(plan.P[b]), int(plan.Q[b]), int(plan.T[b])
        # Logical keys/values of absolute positions [lo, T).
        if swc and not plan.first_prompt and past_k is not None:
            lp = sliding_window_resident(P, plan.past_capacity, W) if P > 0 else 0
            lo = P - lp
            keys = np.concatenate([past_k[b, :, :lp], k[b, :Qb].transpose(1, 0, 2)], axis=1)
            vals = np.concatenate([past_v[b, :, :lp], v[b, :Qb].transpose(1, 0, 2)], axis=1)
        else:
            lo = 0
            if plan.first_prompt or P == 0:
                keys = k[b, :Qb].transpose(1, 0, 2)
                vals = v[b, :Qb].transpose(1, 0, 2)
            else:
                keys = np.concatenate([past_k[b, :, :P], k[b, :Qb].transpose(1, 0, 2)], axis=1)
                vals = np.concatenate([past_v[b, :, :P], v[b, :Qb].transpose(1, 0, 2)], axis=1)
        kpos = np.arange(lo, T)
        for s in range(Qb):
            p = P + s
            allowed = kpos < T
            if causal:
                allowed &= kpos <= p
            if W >= 0:
                allowed &= kpos > p - W - ("window_plus_one" in variant)
            for n in range(N):
                h = n // G
                sc = keys[h] @ q[b, s, n] * scale
                bb = 0.0
                if bias is not None:
                    bb = bias[b if bias.shape[0] > 1 else 0, n if bias.shape[1] > 1 else 0, s]
                    bb = bb[kpos]
                if "bias_before_softcap" in variant:
                    sc = sc + bb
                if softcap > 0:
                    sc = softcap * np.tanh(sc / softcap)
                if "bias_before_softcap" not in variant:
                    sc = sc + bb
                sc = np.where(allowed, sc, -np.inf)
                if not allowed.any():  # nothing visible (local_window_size 0): ORT gives 0
                    out[b, s, n] = 0.0
                    continue
                extra = None
                if sink is not None:
                    extra = sink[n]
                elif smooth:
                    extra = 0.0
                m = sc.max()
                if extra is not None:
                    m = max(m, extra)
                e = np.exp(sc - m)
                den = e.sum() + (np.exp(extra - m) if extra is not None else 0.0)
                out[b, s, n] = (e / den) @ vals[h]
        # Present rows.
        if swc:
            L = sliding_window_resident(T, Cp, W)
            pres_k[b, :, :L] = keys[:, T - L - lo : T - lo]
            pres_v[b, :, :L] = vals[:, T - L - lo : T - lo]
        else:
            pres_k[b, :, :T] = keys[:, :T]
            pres_v[b, :, :T] = vals[:, :T]
    return (
        out.reshape(B, S, N * H),
        to_layout(pres_k, kv_layout),
        to_layout(pres_v, kv_layout),
    )


def defined_masks(inputs: dict, attrs: dict, kv_layout: int = 0):
    """(output_rows (B,S) bool, present_mask (B,Nkv,C',H) bool in ``kv_layout`` byte order)."""
    plan = plan_step(inputs, attrs)
    B, S, Nkv, H = plan.batch, plan.seq, plan.kv_heads, plan.head_size
    rows = np.arange(S)[None, :] < plan.Q[:, None]
    Cp = plan.present_capacity
    pm = np.zeros((B, Nkv, Cp, H), bool)
    swc = int(_attr(attrs, "sliding_window_cache", 0))
    W = int(_attr(attrs, "local_window_size", -1))
    for b in range(B):
        T = int(plan.T[b])
        n = sliding_window_resident(T, Cp, W) if swc else T
        pm[b, :, :n] = True
    return rows, to_layout(pm, kv_layout)
