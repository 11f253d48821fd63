"""Float64 oracle of GroupQueryAttention with a quantized KV cache (ORT 1.32's contract,
docs/CONTRACT.md section 13), written from the contract and built on ``reference.py``.

The contract in short: the cache holds codes; a value x is stored as
``q = clamp(rint(x32 * (1 / scale)))`` (x32: x rounded to the op's type T, then float32;
round-half-even; int8 in [-128, 127], int4 in [-8, 7]; NaN saturates to the top), read back as
``q * scale``.  int4 codes are stored biased (q + 8), two per uint8, even channel in the low
nibble, rows of (H + 1) // 2 bytes.  Scales: one (PER_TENSOR) or one per (kv head, channel)
(PER_CHANNEL, flat index h * H + d).  The attention reads every key and value, the new ones
included, through the cache: dequantized.

Entry points:
  * ``quantize(x, scale, bits)`` / ``dequantize(codes, scale, bits, H)``: the code rule.
  * ``gqa_quant_reference(inputs, attrs, kv_layout) -> (output, present_key, present_value,
    present_levels)``: output in float64; presents as stored codes (int8 or uint8) in
    ``kv_layout`` byte order, undefined rows 0; present_levels: the signed codes, H wide, of
    both presents (logical BNSH, float64, NaN where undefined).
  * ``quant_masks(inputs, attrs, kv_layout)``: output rows and the defined present elements
    (stored elements, ``kv_layout`` byte order).
"""

from __future__ import annotations

import numpy as np
import reference as ref

QUANT_ATTRS = ("k_quant_type", "v_quant_type", "kv_cache_bit_width")


def row_elements(head_size: int, bits: int) -> int:
    """Stored elements of a cache row: H, or (H + 1) // 2 bytes for int4 (KvRowElements)."""
    return (head_size + 1) // 2 if bits == 4 else head_size


def quant_type(attrs: dict, which: str = "k") -> str:
    return str(attrs.get(f"{which}_quant_type", "NONE") or "NONE").upper()


def scale_array(scale, quant: str, kv_heads: int, head_size: int) -> np.ndarray:
    """float32 scales broadcastable to logical (B, Nkv, S, H)."""
    s = np.asarray(scale, np.float32).reshape(-1)
    if quant.upper() == "PER_CHANNEL":
        return s.reshape(1, kv_heads, 1, head_size)
    return s.reshape(1, 1, 1, 1)


def levels(x, scale, bits: int) -> np.ndarray:
    """Signed codes (int64) of float32 values ``x`` under ``scale`` (broadcast)."""
    x = np.asarray(x, np.float32)
    scale = np.asarray(scale, np.float32)
    safe = np.where(scale != 0, scale, np.float32(1))
    inv = np.where(scale != 0, np.float32(1) / safe, np.float32(1)).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        q = np.rint((x * inv).astype(np.float32))
    lo, hi = (-128, 127) if bits == 8 else (-8, 7)
    q = np.where(np.isnan(q), hi, q)
    return np.clip(q, lo, hi).astype(np.int64)


def pack(lv: np.ndarray, bits: int) -> np.ndarray:
    """Signed codes (.., H) -> stored codes: int8 (.., H) or uint8 (.., (H + 1) // 2)."""
    lv = np.asarray(lv, np.int64)
    if bits == 8:
        return lv.astype(np.int8)
    if lv.shape[-1] % 2:
        lv = np.concatenate([lv, np.zeros(lv.shape[:-1] + (1,), np.int64)], axis=-1)
    lo = (lv[..., 0::2] + 8) & 0x0F
    hi = (lv[..., 1::2] + 8) & 0x0F
    return (lo | (hi << 4)).astype(np.uint8)


def unpack(codes: np.ndarray, bits: int, head_size: int) -> np.ndarray:
    """Stored codes -> signed codes (.., H) as int64."""
    c = np.asarray(codes)
    if bits == 8:
        return c.astype(np.int8).astype(np.int64)
    c = c.astype(np.uint8).astype(np.int64)
    both = np.stack([(c & 0x0F) - 8, (c >> 4) - 8], axis=-1).reshape(c.shape[:-1] + (-1,))
    return both[..., :head_size]


def quantize(x, scale, bits: int) -> np.ndarray:
    return pack(levels(x, scale, bits), bits)


def dequantize(codes, scale, bits: int, head_size: int) -> np.ndarray:
    """Stored codes -> float64 values q * scale (the product in float32, as the kernels)."""
    lv = unpack(codes, bits, head_size).astype(np.float32)
    return (lv * np.asarray(scale, np.float32)).astype(np.float64)


def _new_rows(inputs: dict, attrs: dict, plan):
    """(q (B,S,N,H), k, v (B,S,Nkv,H)) in float64 after the q/k norm and rotary."""
    B, S, N, Nkv, H = plan.batch, plan.seq, plan.num_heads, plan.kv_heads, plan.head_size
    query = np.asarray(inputs["query"]).astype(np.float64)
    if ref._get(inputs, "key") is None:
        q = query[..., : N * H]
        k = query[..., N * H : (N + Nkv) * H]
        v = query[..., (N + Nkv) * H :]
    else:
        q = query
        k = np.asarray(inputs["key"]).astype(np.float64)
        v = np.asarray(inputs["value"]).astype(np.float64)
    q, k, v = q.reshape(B, S, N, H), k.reshape(B, S, Nkv, H), v.reshape(B, S, Nkv, H)
    qn = ref._get(inputs, "q_norm_weight")
    if qn is not None:
        eps = float(ref._attr(attrs, "qk_norm_epsilon", 1e-6))
        kn = np.asarray(inputs["k_norm_weight"]).astype(np.float64)
        q = ref.rms_norm(
            q, np.asarray(qn).astype(np.float64), float(ref._attr(attrs, "q_norm_epsilon", eps))
        )
        k = ref.rms_norm(k, kn, float(ref._attr(attrs, "k_norm_epsilon", eps)))
    if int(ref._attr(attrs, "do_rotary", 0)) == 1:
        pos = ref.query_positions(inputs, plan)
        cos = np.asarray(inputs["cos_cache"]).astype(np.float64)
        sin = np.asarray(inputs["sin_cache"]).astype(np.float64)
        inter = int(ref._attr(attrs, "rotary_interleaved", 0)) == 1
        q = ref.apply_rotary(q, pos, cos, sin, inter)
        k = ref.apply_rotary(k, pos, cos, sin, inter)
    return q, k, v


def _stored(x: np.ndarray, dtype) -> np.ndarray:
    """float64 -> the op's type T -> float32: the value the kernel quantizes."""
    return np.asarray(x).astype(dtype).astype(np.float32)


_LAYOUT_FREE = ("num_heads", "kv_num_heads", "sliding_window_cache", "local_window_size", "causal")
_PLUMBING = ("seqlens_k", "total_sequence_length", "query_seqlens")


def gqa_quant_reference(inputs: dict, attrs: dict, kv_layout: int = 0):
    plan = ref.plan_step(inputs, attrs)
    B, S, N, Nkv, H = plan.batch, plan.seq, plan.num_heads, plan.kv_heads, plan.head_size
    bits = int(attrs["kv_cache_bit_width"])
    kq, vq = quant_type(attrs, "k"), quant_type(attrs, "v")
    ks = scale_array(inputs["k_scale"], kq, Nkv, H)
    vs = scale_array(inputs["v_scale"], vq, Nkv, H)
    dtype = np.asarray(inputs["query"]).dtype

    # New rows: normed, rotated, rounded to T, quantized.
    q, k, v = _new_rows(inputs, attrs, plan)
    per_row = (0, 2, 1, 3)  # (B, S, Nkv, H) <-> (B, Nkv, S, H) for the scale broadcast
    k_lv = levels(_stored(k, dtype).transpose(per_row), ks, bits).transpose(per_row)
    v_lv = levels(_stored(v, dtype).transpose(per_row), vs, bits).transpose(per_row)

    # Past codes (stored, kv_layout) -> signed codes, logical.
    past_k, past_v = ref._get(inputs, "past_key"), ref._get(inputs, "past_value")
    R = row_elements(H, bits)
    if past_k is not None:
        past_k_lv = unpack(ref.from_layout(np.asarray(past_k), kv_layout), bits, H)
        past_v_lv = unpack(ref.from_layout(np.asarray(past_v), kv_layout), bits, H)
    assert past_k is None or np.asarray(past_k).shape[3] == R

    # Which code lands in which present row: the float reference moves rows as values, so run
    # it on the codes themselves (no rotary, no norm: a pure arrangement).
    plumb = {n: inputs.get(n) for n in _PLUMBING}
    layout_attrs = {n: attrs[n] for n in _LAYOUT_FREE if n in attrs}
    arrange = dict(plumb, query=np.zeros((B, S, N * H)))
    arrange["key"] = k_lv.reshape(B, S, Nkv * H).astype(np.float64)
    arrange["value"] = v_lv.reshape(B, S, Nkv * H).astype(np.float64)
    if past_k is not None:
        arrange["past_key"] = ref.to_layout(past_k_lv.astype(np.float64), kv_layout)
        arrange["past_value"] = ref.to_layout(past_v_lv.astype(np.float64), kv_layout)
    _, pk_lv, pv_lv = ref.gqa_reference(arrange, layout_attrs, kv_layout)

    # The attention on dequantized keys and values: q already normed and rotated.
    attend = {n: inputs.get(n) for n in _PLUMBING + ("attention_bias", "head_sink")}
    attend["query"] = q.reshape(B, S, N * H)
    attend["key"] = (k_lv.transpose(per_row).astype(np.float32) * ks).transpose(per_row)
    attend["value"] = (v_lv.transpose(per_row).astype(np.float32) * vs).transpose(per_row)
    attend["key"] = attend["key"].astype(np.float64).reshape(B, S, Nkv * H)
    attend["value"] = attend["value"].astype(np.float64).reshape(B, S, Nkv * H)
    if past_k is not None:
        attend["past_key"] = ref.to_layout(
            (past_k_lv.astype(np.float32) * ks).astype(np.float64), kv_layout
        )
        attend["past_value"] = ref.to_layout(
            (past_v_lv.astype(np.float32) * vs).astype(np.float64), kv_layout
        )
    attend_attrs = {
        n: a for n, a in attrs.items() if n not in QUANT_ATTRS + ("do_rotary", "rotary_interleaved")
    }
    out, _, _ = ref.gqa_reference(attend, attend_attrs, kv_layout)

    def stored(lv_layout):
        lv = ref.from_layout(lv_layout, kv_layout)
        return ref.to_layout(pack(np.nan_to_num(lv, nan=0.0).astype(np.int64), bits), kv_layout)

    pk_log = ref.from_layout(pk_lv, kv_layout)
    pv_log = ref.from_layout(pv_lv, kv_layout)
    return out, stored(pk_lv), stored(pv_lv), (pk_log, pv_log)


def quant_masks(inputs: dict, attrs: dict, kv_layout: int = 0):
    """(output rows (B, S), defined present elements (B, Nkv, C', row) in kv_layout order)."""
    rows, pm = ref.defined_masks(inputs, attrs, 0)
    plan = ref.plan_step(inputs, attrs)
    R = row_elements(plan.head_size, int(attrs["kv_cache_bit_width"]))
    return rows, ref.to_layout(np.ascontiguousarray(pm[..., :R]), kv_layout)
