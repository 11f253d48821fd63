"""Float64 oracle of GroupQueryAttention with a quantized KV cache (ORT 1.32's contract,
docs/CONTRACT.md section 13, plus fp8 caches and ai.kvlayout's PER_TOKEN scales, section 14),
written from the contract and built on ``reference.py``.

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
  * ``fp8_encode(x)`` / ``fp8_decode(codes)``: float8 e4m3fn from its definition (1 sign bit,
    4 exponent bits of bias 7, 3 mantissa bits; no inf; NaN = 0x7F / 0xFF; max 448), round to
    nearest even, saturating to +-448.
  * ``per_token_encode(x, kind)``: PER_TOKEN rows -> (scales, stored elements).
  * ``quant_reference(inputs, attrs, kv_layout, cache)``: every cache kind ("int8", "int4",
    "fp8") and granularity (PER_TENSOR, PER_CHANNEL, PER_TOKEN); a ``QuantResult`` that adds
    the present scale caches (PER_TOKEN).

"Elements" below: what one channel stores before packing: the signed code (int8, int4) or the
byte (fp8, 0..255); ``pack`` / ``unpack`` convert them to and from the stored cache.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import reference as ref

QUANT_ATTRS = ("k_quant_type", "v_quant_type", "kv_cache_bit_width")
QMAX = {"int8": 127.0, "int4": 7.0, "fp8": 448.0}


def cache_kind(bits: int, fp8: bool = False) -> str:
    return "fp8" if fp8 else ("int8" if int(bits) == 8 else "int4")


# --------------------------------------------------------------------------------------------
# float8 e4m3fn
# --------------------------------------------------------------------------------------------
def fp8_decode(codes) -> np.ndarray:
    """Bytes -> float32 values (exact): 2^(e-7) * (1 + m/8), or m * 2^-9 when e == 0."""
    c = np.asarray(codes).astype(np.uint8).astype(np.int64)
    e, m = (c >> 3) & 15, c & 7
    mag = np.where(e == 0, m * 2.0**-9, (1.0 + m / 8.0) * np.exp2(e - 7.0))
    val = np.where(c & 0x80, -mag, mag)
    val = np.where((c & 0x7F) == 0x7F, np.nan, val)
    return val.astype(np.float32)


def fp8_encode(x) -> np.ndarray:
    """float32 values -> bytes: round to nearest even, |x| >= 448 (and +-inf) -> +-448, NaN ->
    0x7F (sign kept); -0 -> 0x80."""
    x = np.asarray(x, np.float32).astype(np.float64)
    sign = np.where(np.signbit(x), 0x80, 0).astype(np.int64)
    a = np.abs(x)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        # Normals: a = f * 2^e, f in [1, 2), e >= -6; 3 mantissa bits, rounded half to even.
        f, e2 = np.frexp(np.where(np.isfinite(a) & (a > 0), a, 1.0))
        e = e2.astype(np.int64) - 1
        m = np.rint((f * 2.0 - 1.0) * 8.0).astype(np.int64)  # 0 .. 8 (8: carry)
        e = np.where(m == 8, e + 1, e)
        m = np.where(m == 8, 0, m)
        normal = ((e + 7) << 3) | m
        # Subnormals: multiples of 2^-9 (8 is the smallest normal).
        sub = np.rint(np.where(a < 2.0**-6, a, 0.0) * 512.0).astype(np.int64)
    code = np.where(a < 2.0**-6, sub, normal)
    code = np.where(a >= 448.0, 0x7E, np.minimum(code, 0x7E))
    code = np.where(np.isnan(a), 0x7F, code)
    return (code | sign).astype(np.uint8)


def fp8_level(codes) -> np.ndarray:
    """Bytes -> signed steps (+-0 -> 0): adjacent fp8 values differ by one."""
    c = np.asarray(codes).astype(np.int64)
    return np.where(c & 0x80, -(c & 0x7F), c & 0x7F)


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


# ---- every cache kind -------------------------------------------------------------------------
def _bits(kind: str) -> int:
    return 4 if kind == "int4" else 8


def inverse(scale) -> np.ndarray:
    """float32(1 / scale), 1 where the scale is 0 (static scales: ORT's guard)."""
    scale = np.asarray(scale, np.float32)
    safe = np.where(scale != 0, scale, np.float32(1))
    return np.where(scale != 0, np.float32(1) / safe, np.float32(1)).astype(np.float32)


def encode(y, kind: str) -> np.ndarray:
    """Scaled float32 values y = x * inv -> elements: rint + clamp (NaN -> top), or fp8 bytes."""
    y = np.asarray(y, np.float32)
    if kind == "fp8":
        return fp8_encode(y).astype(np.int64)
    lo, hi = (-128, 127) if kind == "int8" else (-8, 7)
    with np.errstate(invalid="ignore"):
        q = np.rint(y)
    q = np.where(np.isnan(q), hi, q)
    return np.clip(q, lo, hi).astype(np.int64)


def elements_value(el, kind: str) -> np.ndarray:
    """Elements -> float32 code values (the fp8 byte decoded)."""
    if kind == "fp8":
        return fp8_decode(np.asarray(el))
    return np.asarray(el).astype(np.float32)


def pack_elements(el, kind: str) -> np.ndarray:
    if kind == "fp8":
        return np.asarray(el).astype(np.uint8)
    return pack(el, _bits(kind))


def unpack_elements(codes, kind: str, head_size: int) -> np.ndarray:
    if kind == "fp8":
        return np.asarray(codes).astype(np.uint8).astype(np.int64)
    return unpack(codes, _bits(kind), head_size)


def per_token_encode(x, kind: str):
    """PER_TOKEN rows x (.., H), float32 after rounding to T -> (scale (..) float32, elements):
    scale = amax / qmax, inv = 1 / scale (0 when the scale is 0), codes as the static rule; a row
    with a NaN or Inf: scale NaN, codes 0."""
    x = np.asarray(x, np.float32)
    finite = np.isfinite(x).all(axis=-1)
    amax = np.abs(np.where(np.isfinite(x), x, np.float32(0))).max(axis=-1).astype(np.float32)
    scale = (amax / np.float32(QMAX[kind])).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(scale > 0, np.float32(1) / np.where(scale > 0, scale, 1), 0)
    inv = np.where(finite, inv, 0).astype(np.float32)
    y = (np.where(finite[..., None], x, np.float32(0)) * inv[..., None]).astype(np.float32)
    el = encode(y, kind)
    return np.where(finite, scale, np.float32(np.nan)).astype(np.float32), el


def static_encode(x, scale, kind: str) -> np.ndarray:
    """PER_TENSOR / PER_CHANNEL: elements of float32 x under ``scale`` (broadcast)."""
    x = np.asarray(x, np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        y = (x * inverse(scale)).astype(np.float32)
    return encode(y, kind)


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


class QuantResult(NamedTuple):
    output: np.ndarray  # float64 (B, S, N*H)
    present_key: np.ndarray  # stored codes, kv_layout byte order, undefined rows 0
    present_value: np.ndarray
    elements_key: np.ndarray  # elements (B, Nkv, C', H) logical, float64, NaN where undefined
    elements_value: np.ndarray
    present_key_scale: np.ndarray | None  # PER_TOKEN: float32 (B, Nkv, C'), kv_layout order, 0
    present_value_scale: np.ndarray | None  # where undefined; None otherwise


def _layout_scales(sc, kv_layout: int) -> np.ndarray:
    """Declared (B, Nkv, C) scale cache in kv_layout order <-> logical (B, Nkv, C)."""
    return ref.from_layout(np.asarray(sc)[..., None], kv_layout)[..., 0]


def scales_to_layout(logical, kv_layout: int) -> np.ndarray:
    return ref.to_layout(np.asarray(logical)[..., None], kv_layout)[..., 0]


def quant_reference(inputs: dict, attrs: dict, kv_layout: int = 0, cache: str | None = None):
    """The oracle for any cache kind (``cache``: "int8", "int4" or "fp8"; None: from
    kv_cache_bit_width) and granularity (k_quant_type). Returns a ``QuantResult``."""
    plan = ref.plan_step(inputs, attrs)
    B, S, N, Nkv, H = plan.batch, plan.seq, plan.num_heads, plan.kv_heads, plan.head_size
    bits = int(attrs["kv_cache_bit_width"])
    kind = cache or cache_kind(bits)
    kq, vq = quant_type(attrs, "k"), quant_type(attrs, "v")
    per_token = kq == "PER_TOKEN"
    dtype = np.asarray(inputs["query"]).dtype
    per_row = (0, 2, 1, 3)  # (B, S, Nkv, H) <-> (B, Nkv, S, H)

    # New rows: normed, rotated, rounded to T, quantized; their read-back values.
    q, k, v = _new_rows(inputs, attrs, plan)
    new, new_scales = [], []
    for x, quant, name in ((k, kq, "k_scale"), (v, vq, "v_scale")):
        xs = _stored(x, dtype)  # (B, S, Nkv, H)
        if per_token:
            sc, el = per_token_encode(xs, kind)  # sc (B, S, Nkv)
            val = elements_value(el, kind) * sc[..., None]
        else:
            sc = scale_array(inputs[name], quant, Nkv, H)  # broadcast over (B, Nkv, S, H)
            el = static_encode(xs.transpose(per_row), sc, kind).transpose(per_row)
            val = (elements_value(el, kind).transpose(per_row) * sc).transpose(per_row)
        new.append((el, val.astype(np.float32)))
        new_scales.append(sc if per_token else None)

    # Past elements and values, logical (B, Nkv, C, H).
    past = []
    R = row_elements(H, bits) if kind != "fp8" else H
    for name, sname, quant, scn in (
        ("past_key", "past_key_scale", kq, "k_scale"),
        ("past_value", "past_value_scale", vq, "v_scale"),
    ):
        buf = ref._get(inputs, name)
        if buf is None:
            past.append(None)
            continue
        assert np.asarray(buf).shape[3] == R
        el = unpack_elements(ref.from_layout(np.asarray(buf), kv_layout), kind, H)
        if per_token:
            sc = _layout_scales(inputs[sname], kv_layout).astype(np.float32)  # (B, Nkv, C)
            val = elements_value(el, kind) * sc[..., None]
        else:
            sc = scale_array(inputs[scn], quant, Nkv, H)
            val = elements_value(el, kind) * sc
        past.append((el, val.astype(np.float32), sc if per_token else None))

    # Which element lands in which present row: the float reference moves rows as values, so run
    # it on the elements themselves (no rotary, no norm: a pure arrangement). PER_TOKEN: the
    # scale's float32 bits ride along as an extra channel (exact in float64, never NaN).
    extra = 1 if per_token else 0
    Hx = H + extra

    def with_scale(el, sc):
        if not per_token:
            return el.astype(np.float64)
        bits32 = np.asarray(sc, np.float32).view(np.uint32).astype(np.float64)
        return np.concatenate([el.astype(np.float64), bits32[..., None]], axis=-1)

    plumb = {n: inputs.get(n) for n in _PLUMBING}
    layout_attrs = {n: attrs[n] for n in _LAYOUT_FREE if n in attrs}
    arrange = dict(plumb, query=np.zeros((B, S, N * Hx)))
    for name, (el, _), sc in zip(("key", "value"), new, new_scales, strict=True):
        arrange[name] = with_scale(el, sc).reshape(B, S, Nkv * Hx)
    for name, pst in zip(("past_key", "past_value"), past, strict=True):
        if pst is not None:
            arrange[name] = ref.to_layout(with_scale(pst[0], pst[2]), kv_layout)
    _, pk_x, pv_x = ref.gqa_reference(arrange, layout_attrs, kv_layout)

    # The attention on dequantized keys and values: q already normed and rotated.
    attend = {n: inputs.get(n) for n in _PLUMBING + ("attention_bias", "head_sink")}
    attend["query"] = q.reshape(B, S, N * H)
    attend["key"] = new[0][1].astype(np.float64).reshape(B, S, Nkv * H)
    attend["value"] = new[1][1].astype(np.float64).reshape(B, S, Nkv * H)
    for name, pst in zip(("past_key", "past_value"), past, strict=True):
        if pst is not None:
            attend[name] = ref.to_layout(pst[1].astype(np.float64), kv_layout)
    attend_attrs = {
        n: a for n, a in attrs.items() if n not in QUANT_ATTRS + ("do_rotary", "rotary_interleaved")
    }
    out, _, _ = ref.gqa_reference(attend, attend_attrs, kv_layout)

    results = []
    for x in (pk_x, pv_x):
        log = ref.from_layout(x, kv_layout)  # (B, Nkv, C', Hx), NaN where undefined
        el = log[..., :H]
        stored = pack_elements(np.nan_to_num(el, nan=0.0).astype(np.int64), kind)
        sc_cache = None
        if per_token:
            bits32 = np.nan_to_num(log[..., H], nan=0.0).astype(np.uint32)
            sc_cache = scales_to_layout(bits32.view(np.float32), kv_layout)
        results.append((el, ref.to_layout(stored, kv_layout), sc_cache))
    return QuantResult(
        out,
        results[0][1],
        results[1][1],
        results[0][0],
        results[1][0],
        results[0][2],
        results[1][2],
    )


def gqa_quant_reference(inputs: dict, attrs: dict, kv_layout: int = 0):
    """ORT's contract (int8 / int4, static scales): (output, present_key, present_value,
    (levels of present_key, of present_value))."""
    r = quant_reference(inputs, attrs, kv_layout)
    return r.output, r.present_key, r.present_value, (r.elements_key, r.elements_value)


def quant_masks(inputs: dict, attrs: dict, kv_layout: int = 0):
    """(output rows (B, S), defined present elements (B, Nkv, C', row) in kv_layout order)."""
    rows, pm = ref.defined_masks(inputs, attrs, 0)
    plan = ref.plan_step(inputs, attrs)
    R = row_elements(plan.head_size, int(attrs["kv_cache_bit_width"]))
    return rows, ref.to_layout(np.ascontiguousarray(pm[..., :R]), kv_layout)


def scale_mask(inputs: dict, attrs: dict, kv_layout: int = 0) -> np.ndarray:
    """Defined rows of a present scale cache: (B, Nkv, C') bool in kv_layout order."""
    _, pm = ref.defined_masks(inputs, attrs, 0)
    return scales_to_layout(np.ascontiguousarray(pm[..., 0]), kv_layout)
