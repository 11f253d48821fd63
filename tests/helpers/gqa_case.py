"""GqaCase: one GroupQueryAttention call (sizes, options, dtype, layout) with seeded inputs, the
single-node ONNX model for either domain, and the onnxruntime run (plain or shared buffer)."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import reference as ref
from hypothesis import strategies as st
from onnx import TensorProto, helper

INPUT_NAMES = (
    "query",
    "key",
    "value",
    "past_key",
    "past_value",
    "seqlens_k",
    "total_sequence_length",
    "cos_cache",
    "sin_cache",
    "position_ids",
    "attention_bias",
    "head_sink",
    "k_scale",
    "v_scale",
    "q_norm_weight",
    "k_norm_weight",
    "query_seqlens",
    "past_key_scale",  # ai.kvlayout, PER_TOKEN (docs/CONTRACT.md section 14)
    "past_value_scale",
)
OUTPUT_NAMES = ("output", "present_key", "present_value", "output_qk")

MS_DOMAIN = "com.microsoft"
KV_DOMAIN = "ai.kvlayout"

DTYPES = {
    "fp32": (np.float32, TensorProto.FLOAT),
    "fp16": (np.float16, TensorProto.FLOAT16),
    "bf16": (ml_dtypes.bfloat16, TensorProto.BFLOAT16),
}
_FLOAT_DTYPES = {np.dtype(d[0]) for d in DTYPES.values()}
_NP_TO_ONNX = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(ml_dtypes.bfloat16): TensorProto.BFLOAT16,
    np.dtype(np.int32): TensorProto.INT32,
    np.dtype(np.int64): TensorProto.INT64,
    np.dtype(np.uint8): TensorProto.UINT8,
    np.dtype(np.int8): TensorProto.INT8,
}


# --------------------------------------------------------------------------------------------
# Is our op usable?
# --------------------------------------------------------------------------------------------
_OP_STATE: tuple[bool, str] | None = None


def op_available() -> tuple[bool, str]:
    """(True, "") when ``import ort_kvlayout`` works and ``register(so)`` loads the library."""
    global _OP_STATE
    if _OP_STATE is None:
        try:
            import ort_kvlayout

            so = ort.SessionOptions()
            dom = ort_kvlayout.register(so)
            _OP_STATE = (True, "") if dom == KV_DOMAIN else (False, f"register returned {dom!r}")
        except Exception as e:  # noqa: BLE001 - any failure means: skip with the reason
            _OP_STATE = (False, f"{type(e).__name__}: {e}")
    return _OP_STATE


# Features the contract lets our op refuse by name (DESIGN: "support it, or refuse it by name
# with a reason").  A refusal must name the feature; anything else is a failure.
REFUSABLE = {
    "query_seqlens": r"query_seqlens.*not supported",
    "sliding_window_cache": r"sliding_window_cache.*not supported",
    "causal": r"causal.*not supported",
    "norm_weight": r"norm_weight.*not supported",
}


class Refused(Exception):
    """Our op refused a feature it may refuse (the message names it)."""

    def __init__(self, feature: str, message: str):
        super().__init__(f"ai.kvlayout refuses {feature}: {message}")
        self.feature = feature


def refusal(features, exc: Exception) -> Refused | None:
    import re

    for feat in features:
        if re.search(REFUSABLE[feat], str(exc), re.DOTALL):
            return Refused(feat, str(exc).split("Status Message:")[-1].strip()[:300])
    return None


# --------------------------------------------------------------------------------------------
# Model building and running (usable on their own by the error tests and the experiments)
# --------------------------------------------------------------------------------------------
def build_model(
    feeds: dict,
    attrs: dict,
    domain: str = MS_DOMAIN,
    kv_layout: int | None = None,
    n_outputs: int = 3,
    input_types: dict | None = None,
) -> bytes:
    """A single-node model whose present inputs are ``feeds`` entries that are not None.

    ``input_types`` may override an input's elem type (e.g. to declare a mismatching dtype).
    Input shapes are left symbolic (dynamic) so ORT checks them at run time, in the kernel.
    """
    input_types = input_types or {}
    last = max(i for i, n in enumerate(INPUT_NAMES) if feeds.get(n) is not None)
    node_inputs, graph_inputs = [], []
    for name in INPUT_NAMES[: last + 1]:
        arr = feeds.get(name)
        if arr is None:
            node_inputs.append("")
            continue
        node_inputs.append(name)
        et = input_types.get(name, _NP_TO_ONNX[np.asarray(arr).dtype])
        rank = np.asarray(arr).ndim
        graph_inputs.append(
            helper.make_tensor_value_info(name, et, [f"{name}_d{i}" for i in range(rank)])
        )
    node_attrs = {k: v for k, v in attrs.items() if v is not None}
    if kv_layout is not None:
        node_attrs["kv_layout"] = kv_layout
    outs = list(OUTPUT_NAMES[:n_outputs])
    node = helper.make_node(
        "GroupQueryAttention", node_inputs, outs, domain=domain, name="gqa", **node_attrs
    )
    q_type = input_types.get("query", _NP_TO_ONNX[np.asarray(feeds["query"]).dtype])
    kv_src = feeds.get("past_key")
    kv_type = input_types.get(
        "past_key", _NP_TO_ONNX[np.asarray(kv_src).dtype] if kv_src is not None else q_type
    )
    out_types = [q_type, kv_type, kv_type, q_type]
    graph_outputs = [
        helper.make_tensor_value_info(o, t, None) for o, t in zip(outs, out_types, strict=False)
    ]
    graph = helper.make_graph([node], "gqa", graph_inputs, graph_outputs)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(domain, 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    return model.SerializeToString()


def with_attribute(model: bytes, name: str, value) -> bytes:
    """``model`` (one node) with the node's attribute ``name`` set to ``value`` (any type,
    unchecked), or removed where ``value`` is None."""
    m = onnx.load_from_string(model)
    node = m.graph.node[0]
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(kept)
    if value is not None:
        node.attribute.append(helper.make_attribute(name, value))
    return m.SerializeToString()


def make_session(model: bytes, domain: str = MS_DOMAIN, threads: int = 1) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    if domain == KV_DOMAIN:
        import ort_kvlayout

        ort_kvlayout.register(so)
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def _ortvalue(arr: np.ndarray):
    """An OrtValue over ``arr``'s memory (bf16 through a uint16 view: ORT's numpy bridge does
    not know ml_dtypes.bfloat16)."""
    if arr.dtype == _BF16:
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
            arr.view(np.uint16), TensorProto.BFLOAT16
        )
    return ort.OrtValue.ortvalue_from_numpy(arr)


_BF16 = np.dtype(ml_dtypes.bfloat16)


def next_token_feeds(feeds: dict, rng: np.random.Generator, total: int) -> dict:
    """A decode step after ``feeds`` (batch 1): one new random query/key/value row in the dtype
    of the query, total length ``total``; the other inputs (past caches included) as given."""
    dtype = np.asarray(feeds["query"]).dtype

    def row(name: str) -> np.ndarray:
        width = np.asarray(feeds[name]).shape[-1]
        return rng.standard_normal((1, 1, width)).astype(dtype)

    return dict(
        feeds,
        query=row("query"),
        key=row("key"),
        value=row("value"),
        seqlens_k=np.array([total - 1], np.int32),
        total_sequence_length=np.array(total, np.int32),
    )


def run_session(sess: ort.InferenceSession, feeds: dict, shared: bool = False, attrs=None):
    """Runs and returns (output, present_key, present_value) as numpy arrays.

    ``shared``: bind one OrtValue as past_key and present_key (likewise value), as
    onnxruntime-genai does; the returned presents are those buffers after the run.
    bf16 runs go through IO binding with preallocated outputs (shapes from ``attrs`` and the
    contract), since ORT's python bridge cannot convert bf16 arrays.
    """
    present = {i.name for i in sess.get_inputs()}
    inputs = {k: np.asarray(v) for k, v in feeds.items() if v is not None and k in present}
    bf16 = inputs["query"].dtype == _BF16
    if not shared and not bf16:
        res = sess.run(["output", "present_key", "present_value"], inputs)
        return tuple(res)
    io = sess.io_binding()
    keep = []  # the OrtValues do not own their memory: keep the buffers alive

    def bind_in(name, arr):
        arr = np.array(arr, copy=True)
        keep.append(arr)
        ov = _ortvalue(arr)
        io.bind_ortvalue_input(name, ov)
        return arr, ov

    bufs = {}
    for k, v in inputs.items():
        bufs[k] = bind_in(k, v)
    if bf16:
        assert attrs is not None, "bf16 runs need attrs to size the outputs"
        plan = ref.plan_step({**inputs, "key": inputs.get("key")}, attrs)
        q = inputs["query"]
        out_buf = np.zeros((q.shape[0], q.shape[1], plan.num_heads * plan.head_size), _BF16)
        io.bind_ortvalue_output("output", _ortvalue(out_buf))
        if not shared:  # bf16 presents: preallocated
            pshape = (plan.batch, plan.kv_heads, plan.present_capacity, plan.head_size)
            pk_buf, pv_buf = np.zeros(pshape, _BF16), np.zeros(pshape, _BF16)
            io.bind_ortvalue_output("present_key", _ortvalue(pk_buf))
            io.bind_ortvalue_output("present_value", _ortvalue(pv_buf))
    else:
        io.bind_output("output")  # bound first: get_outputs()[0]
    if shared:
        pk_buf, pk = bufs["past_key"]
        pv_buf, pv = bufs["past_value"]
        io.bind_ortvalue_output("present_key", pk)
        io.bind_ortvalue_output("present_value", pv)
    sess.run_with_iobinding(io)
    if bf16:
        return out_buf, pk_buf.copy(), pv_buf.copy()
    out = io.get_outputs()[0].numpy()
    return out, pk.numpy().copy(), pv.numpy().copy()


def run_model(feeds, attrs, domain=MS_DOMAIN, kv_layout=None, shared=False, threads=1):
    model = build_model(feeds, attrs, domain, kv_layout)
    return run_session(make_session(model, domain, threads), feeds, shared, attrs)


def rotary_caches(dim: int, positions: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(cos_cache, sin_cache): ``positions`` rows of ``dim // 2`` angles (base 10000), in
    ``dtype``."""
    inv = 1.0 / (10000.0 ** (np.arange(0, dim, 2) / dim))
    ang = np.arange(positions)[:, None] * inv[None, :]
    return np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)


# --------------------------------------------------------------------------------------------
# GqaCase
# --------------------------------------------------------------------------------------------
@dataclass
class GqaCase:
    """One GQA call.  ``kind``: "prompt" (first prompt, S == total), "decode" (S == 1 with
    past) or "chunk" (S > 1 with past, chunked prefill).  ``past_lens`` gives per batch entry
    the tokens already cached (ignored for "prompt"); ``pad`` right-pads a prompt by making
    later batch entries shorter (prompt) or ragged past lengths (decode/chunk)."""

    batch: int = 1
    seq: int = 1
    num_heads: int = 4
    kv_num_heads: int = 2
    head_size: int = 64
    kind: str = "prompt"
    past_len: int = 0  # longest past (decode/chunk)
    pad: int = 0  # right padding of the shorter batch entries
    extra_capacity: int = 0  # past buffer capacity beyond what is needed
    dtype: str = "fp32"
    kv_layout: int = 0
    packed: bool = False
    shared: bool = False
    do_rotary: bool = False
    rotary_interleaved: bool = False
    rotary_dim: int = 0  # 0: head_size
    position_ids: bool = False
    scale: float = 0.0
    softcap: float = 0.0
    local_window_size: int = -1
    smooth_softmax: int = -1
    head_sink: bool = False
    attention_bias: str = ""  # "", "b1n1", "bn", "1n", "b1"
    query_seqlens: bool = False
    sliding_window_cache: bool = False
    qk_norm: bool = False  # q_norm_weight / k_norm_weight (RMS norm before rotary)
    seed: int = 0
    _feeds: dict = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        assert self.kind in ("prompt", "decode", "chunk"), self.kind
        if self.kind == "decode":
            self.seq = 1
        if self.kind == "prompt":
            self.past_len = 0

    def replace(self, **kw) -> GqaCase:
        kw.setdefault("_feeds", None)
        return dataclasses.replace(self, **kw)

    # ---- sizes -------------------------------------------------------------------------
    @property
    def np_dtype(self):
        return DTYPES[self.dtype][0]

    def lengths(self):
        """(P, Q, T) per batch entry, and total_sequence_length."""
        B, S = self.batch, self.seq
        if self.kind == "prompt":
            T = np.array([max(1, S - (self.pad if b % 2 else 0)) for b in range(B)])
            T[0] = S
            return np.zeros(B, np.int64), np.minimum(T, S), T, S
        P = np.array([max(0, self.past_len - (self.pad if b % 2 else 0)) for b in range(B)])
        P[0] = self.past_len
        Q = np.full(B, S)
        T = P + Q
        return P, Q, T, int(T.max())

    def attrs(self) -> dict:
        a = {"num_heads": self.num_heads, "kv_num_heads": self.kv_num_heads}
        if self.scale:
            a["scale"] = float(self.scale)
        if self.softcap:
            a["softcap"] = float(self.softcap)
        if self.local_window_size != -1:
            a["local_window_size"] = self.local_window_size
        if self.do_rotary:
            a["do_rotary"] = 1
            a["rotary_interleaved"] = int(self.rotary_interleaved)
        if self.smooth_softmax != -1:
            a["smooth_softmax"] = self.smooth_softmax
        if self.sliding_window_cache:
            a["sliding_window_cache"] = 1
        return a

    # ---- inputs ------------------------------------------------------------------------
    def feeds(self) -> dict:
        """Inputs in the case's dtype; past buffers in the case's kv_layout byte order.  Past
        rows beyond each entry's valid length hold garbage (they must not matter)."""
        if self._feeds is not None:
            return self._feeds
        rng = np.random.default_rng(self.seed)
        dt = self.np_dtype
        B, S, N, Nkv, H = self.batch, self.seq, self.num_heads, self.kv_num_heads, self.head_size
        P, Q, T, total = self.lengths()

        def rnd(*shape, scale=1.0):
            return (rng.standard_normal(shape) * scale).astype(dt)

        f: dict = {}
        if self.packed:
            f["query"] = rnd(B, S, (N + 2 * Nkv) * H)
        else:
            f["query"] = rnd(B, S, N * H)
            f["key"] = rnd(B, S, Nkv * H)
            f["value"] = rnd(B, S, Nkv * H)
        if self.sliding_window_cache:
            cap = self.local_window_size + self.extra_capacity
        elif self.kind == "prompt":
            cap = total + self.extra_capacity if (self.shared or self.extra_capacity) else 0
        elif self.shared:
            cap = total + self.extra_capacity
        else:
            cap = (total - S) if self.extra_capacity == 0 else total + self.extra_capacity
        if cap > 0 or self.kind != "prompt" or self.shared:
            pk = rnd(B, Nkv, cap, H)
            pv = rnd(B, Nkv, cap, H)
            # Garbage beyond the valid past (large values so leaks show).
            for b in range(B):
                valid = (
                    ref.sliding_window_resident(int(P[b]), cap, self.local_window_size)
                    if self.sliding_window_cache
                    else int(P[b])
                )
                pk[b, :, valid:] = (37.0 + b) if dt != np.float16 else 9.0
                pv[b, :, valid:] = (-41.0 - b) if dt != np.float16 else -9.0
            f["past_key"] = ref.to_layout(pk, self.kv_layout)
            f["past_value"] = ref.to_layout(pv, self.kv_layout)
        f["seqlens_k"] = (T - 1).astype(np.int32)
        f["total_sequence_length"] = np.array(total, np.int32)
        if self.do_rotary:
            f["cos_cache"], f["sin_cache"] = rotary_caches(self.rotary_dim or H, total + 16, dt)
        if self.position_ids:
            if self.kind == "prompt":
                start = int(rng.integers(0, 8))
                pid = np.broadcast_to(start + np.arange(S), (B, S))
            else:
                pid = P[:, None] + np.arange(S)[None, :]
            f["position_ids"] = np.ascontiguousarray(pid).astype(np.int64)
        if self.attention_bias:
            bshape = {
                "bn": (B, N),
                "b1": (B, 1),
                "1n": (1, N),
                "11": (1, 1),
            }[self.attention_bias]
            f["attention_bias"] = rnd(*bshape, S, total)
        if self.head_sink:
            f["head_sink"] = rnd(N)
        if self.qk_norm:
            f["q_norm_weight"] = (0.5 + rng.random(H)).astype(dt)
            f["k_norm_weight"] = (0.5 + rng.random(H)).astype(dt)
        if self.query_seqlens:
            f["query_seqlens"] = Q.astype(np.int32)
        self._feeds = f
        return f

    def ref_inputs(self) -> dict:
        return dict(self.feeds())

    # ---- running -----------------------------------------------------------------------
    def model(self, domain: str) -> bytes:
        lay = self.kv_layout if domain == KV_DOMAIN else None
        return build_model(self.feeds(), self.attrs(), domain, lay)

    def run(self, domain: str = KV_DOMAIN, threads: int = 1):
        """(output, present_key, present_value) from onnxruntime (presents as the op wrote
        them: in the case's layout for ai.kvlayout, head-major for com.microsoft).  Running
        com.microsoft on a layout-1 case is an error."""
        if domain == MS_DOMAIN:
            assert self.kv_layout == 0, "com.microsoft GQA is head-major only"
        sess = make_session(self.model(domain), domain, threads)
        return run_session(sess, self.feeds(), self.shared, self.attrs())

    def refusable_features(self) -> list[str]:
        out = []
        if self.query_seqlens:
            out.append("query_seqlens")
        if self.sliding_window_cache:
            out.append("sliding_window_cache")
        if self.qk_norm:
            out.append("norm_weight")
        return out

    def run_ours(self, threads: int = 1):
        """Runs the ai.kvlayout op; raises Refused when it refuses (by name) a feature of this
        case that the contract allows it to refuse."""
        try:
            return self.run(KV_DOMAIN, threads)
        except Exception as e:
            r = refusal(self.refusable_features(), e)
            if r is None:
                raise
            raise r from e

    def reference(self):
        return ref.gqa_reference(self.ref_inputs(), self.attrs(), self.kv_layout)

    def masks(self):
        return ref.defined_masks(self.ref_inputs(), self.attrs(), self.kv_layout)

    def __repr__(self):
        d = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.repr and getattr(self, f.name) != f.default
        }
        d["seed"] = self.seed
        return "GqaCase(" + ", ".join(f"{k}={v!r}" for k, v in d.items()) + ")"


_AXIS_FIELDS = {
    "layout": ("kv_layout",),
    "heads": ("num_heads", "kv_num_heads"),
    "step": ("kind", "seq", "past_len"),
}


def grid_cases(axes: dict, fields) -> list[GqaCase]:
    """A parametrized grid: one GqaCase per point of the product of ``axes`` (name -> values,
    iterated in the order given, the last axis fastest).  An axis "layout" gives kv_layout,
    "heads" (num_heads, kv_num_heads), "step" (kind, seq, past_len); an axis given as a dict
    (option name -> GqaCase fields) gives the fields of its option; any other name is a GqaCase
    field.  Packed and shared inputs alternate with the point's index i (i % 2, i // 2 % 2);
    ``fields(i, **point_fields)`` returns the other fields (and may override any)."""
    out = []
    for i, point in enumerate(itertools.product(*axes.values())):
        kw = {"packed": bool(i % 2), "shared": bool(i // 2 % 2)}
        for (axis, values), value in zip(axes.items(), point, strict=True):
            if isinstance(values, dict):
                kw.update(values[value])
                continue
            names = _AXIS_FIELDS.get(axis, (axis,))
            kw.update(zip(names, value if len(names) > 1 else (value,), strict=True))
        kw.update(fields(i, **kw))
        out.append(GqaCase(**kw))
    return out


# --------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------
TOLS = {"fp32": (2e-4, 2e-4), "fp16": (2e-3, 2e-3), "bf16": (1.6e-2, 1.6e-2)}


def as_f64(a):
    return np.asarray(a).astype(np.float64)


def compare(case: GqaCase, got, want, masks=None, atol=None, rtol=None, what=""):
    """Asserts got ~ want on the rows the contract defines.  Returns the max abs error."""
    rows, pmask = masks if masks is not None else case.masks()
    a, r = TOLS[case.dtype]
    atol = a if atol is None else atol
    rtol = r if rtol is None else rtol
    names = ("output", "present_key", "present_value")
    worst = 0.0
    for name, g, w in zip(names, got, want, strict=True):
        g, w = as_f64(g), as_f64(w)
        assert g.shape == w.shape, f"{what}{name}: shape {g.shape} != {w.shape} for {case!r}"
        if name == "output":
            sel = np.broadcast_to(rows[:, :, None], g.shape)
        else:
            sel = pmask
        gs, ws = g[sel], w[sel]
        if gs.size == 0:
            continue
        err = np.abs(gs - ws)
        bad = err > atol + rtol * np.abs(ws)
        bad |= ~np.isfinite(gs)
        worst = max(worst, float(np.nanmax(err)))
        if bad.any():
            idx = np.argwhere(sel)[np.flatnonzero(bad)[:5]]
            raise AssertionError(
                f"{what}{name} mismatch for {case!r}: {int(bad.sum())}/{gs.size} elements, "
                f"max err {float(np.nanmax(err)):.3g}; first bad indices {idx.tolist()}"
            )
    return worst


def max_err(got, want, sel) -> float:
    e = np.abs(as_f64(got)[sel] - as_f64(want)[sel])  # unselected rows may hold NaN fill
    return float(e.max()) if e.size else 0.0


def head_major_twin(case: GqaCase, dtype: str | None = None) -> GqaCase:
    """The same logical inputs as ``case`` in layout 0 (and optionally another dtype)."""
    dtype = dtype or case.dtype
    dt = DTYPES[dtype][0]
    f = {}
    for k, v in case.feeds().items():
        if v is not None and np.asarray(v).dtype in _FLOAT_DTYPES:
            v = np.asarray(v)
            if k in ("past_key", "past_value"):
                v = ref.to_layout(ref.from_layout(v, case.kv_layout), 0)
            v = v.astype(dt)
        f[k] = v
    return case.replace(kv_layout=0, dtype=dtype, _feeds=f)


def _prenormed_feeds(case: GqaCase) -> dict:
    f = dict(case.feeds())
    dt = case.np_dtype
    N, Nkv, H = case.num_heads, case.kv_num_heads, case.head_size
    eps = 1e-6
    qw, kw = as_f64(f.pop("q_norm_weight")), as_f64(f.pop("k_norm_weight"))
    q = as_f64(f["query"])
    B, S, _ = q.shape

    def normed(x, heads, w):
        return ref.rms_norm(x.reshape(B, S, heads, H), w, eps).reshape(B, S, heads * H)

    if case.packed:
        q = q.copy()
        q[..., : N * H] = normed(q[..., : N * H], N, qw)
        q[..., N * H : (N + Nkv) * H] = normed(q[..., N * H : (N + Nkv) * H], Nkv, kw)
        f["query"] = q.astype(dt)
    else:
        f["query"] = normed(q, N, qw).astype(dt)
        f["key"] = normed(as_f64(f["key"]), Nkv, kw).astype(dt)
    return f


def ort_builtin_errors(case: GqaCase) -> tuple[float, float, float]:
    """Max abs error of ORT's own com.microsoft kernel vs the oracle on the head-major twin of
    ``case`` (same logical inputs), over the defined rows: the yardstick for low precision.
    ORT's CPU has no bf16 kernel: for bf16 this measures its fp16 kernel on the fp16 twin."""
    twin = head_major_twin(case, "fp16" if case.dtype == "bf16" else case.dtype)
    want = twin.reference()
    rows, pmask = twin.masks()
    if twin.qk_norm:
        # ORT's CPU refuses q/k norm weights: feed it Q and K already RMS-normed (in float64,
        # then rounded to the storage type, as any low-precision pipeline stores them) and
        # measure it against the oracle of the normed case.
        twin = twin.replace(qk_norm=False, _feeds=_prenormed_feeds(twin))
    got = twin.run(MS_DOMAIN)
    osel = np.broadcast_to(rows[:, :, None], got[0].shape)
    return (
        max_err(got[0], want[0], osel),
        max_err(got[1], want[1], pmask),
        max_err(got[2], want[2], pmask),
    )


# FlashAttention's rule: at most 2x the error ORT's own kernel makes, plus a small floor.
# bf16 has 3 fewer mantissa bits than fp16: ORT's fp16 error is scaled by 2**3.
LOWP_SCALE = {"fp16": 2.0, "bf16": 2.0 * 8.0}
LOWP_FLOOR = {"fp16": 2.5e-4, "bf16": 2e-3}
LOWP_EPS = {"fp16": 2.0**-10, "bf16": 2.0**-7}


def check_vs_reference(case: GqaCase, got, what: str = "") -> None:
    """Our op's result vs the float64 oracle (on the same low-precision inputs).  fp32:
    elementwise tolerance.  fp16 / bf16: per tensor, the max error over the defined rows must
    stay within LOWP_SCALE x ORT's own error on the same case + LOWP_FLOOR."""
    want = case.reference()
    masks = case.masks()
    if case.dtype == "fp32":
        compare(case, got, want, masks, what=what)
        return
    ort_errs = ort_builtin_errors(case)
    rows, pmask = masks
    osel = np.broadcast_to(rows[:, :, None], np.shape(got[0]))
    names = ("output", "present_key", "present_value")
    for name, g, w, e_ort, sel in zip(
        names, got, want, ort_errs, (osel, pmask, pmask), strict=True
    ):
        assert np.shape(g) == np.shape(w), f"{what}{name}: shape {np.shape(g)} for {case!r}"
        e = max_err(g, w, sel)
        # + one ulp of the largest value: one rounding of a result to the storage type.
        w_max = float(np.nanmax(np.abs(as_f64(w)[sel]))) if np.any(sel) else 0.0
        bound = (
            LOWP_SCALE[case.dtype] * e_ort + LOWP_FLOOR[case.dtype] + LOWP_EPS[case.dtype] * w_max
        )
        assert np.isfinite(e) and e <= bound, (
            f"{what}{name}: max err {e:.3g} > {LOWP_SCALE[case.dtype]:g} x ORT's "
            f"{e_ort:.3g} + {LOWP_FLOOR[case.dtype]:g} for {case!r}"
        )


# --------------------------------------------------------------------------------------------
# Hypothesis strategy: any valid case of the contract
# --------------------------------------------------------------------------------------------
@st.composite
def gqa_cases(draw, dtypes=("fp32", "fp32", "fp16", "bf16"), layouts=(0, 1), qk_norm=True):
    """A valid GqaCase; constraints follow docs/CONTRACT.md (what ORT accepts)."""
    kv = draw(st.sampled_from([1, 2, 3]))
    group = draw(st.sampled_from([1, 2, 4]))
    rotary = draw(st.booleans())
    if rotary:
        h = draw(st.sampled_from([16, 32, 48, 64, 128]))
    else:
        h = draw(st.sampled_from([8, 16, 24, 40, 64, 128]))
    kind = draw(st.sampled_from(["prompt", "decode", "chunk"]))
    swc = draw(st.booleans()) if draw(st.integers(0, 4)) == 0 else False
    window = draw(st.one_of(st.just(-1), st.integers(1, 20)))
    if swc and window < 1:
        window = draw(st.integers(1, 12))
    qsl = kind != "prompt" and draw(st.booleans())
    batch = draw(st.integers(1, 3)) if (kind != "chunk" or qsl) else 1
    seq = {"prompt": draw(st.integers(1, 40)), "decode": 1, "chunk": draw(st.integers(2, 12))}[kind]
    past = 0 if kind == "prompt" else draw(st.integers(1, 50))
    if kind == "prompt":
        pad = 0 if swc else draw(st.integers(0, seq - 1))
    else:
        pad = draw(st.integers(0, past - 1)) if batch > 1 else 0
    rotary_dim = 0
    if rotary and draw(st.booleans()):
        rotary_dim = draw(st.sampled_from([d for d in (16, 32, 64) if d <= h]))
    sink = draw(st.booleans())
    case = GqaCase(
        batch=batch,
        seq=seq,
        num_heads=kv * group,
        kv_num_heads=kv,
        head_size=h,
        kind=kind,
        past_len=past,
        pad=pad,
        extra_capacity=draw(st.integers(0, 5)),
        dtype=draw(st.sampled_from(dtypes)),
        kv_layout=draw(st.sampled_from(layouts)),
        packed=draw(st.booleans()),
        shared=draw(st.booleans()),
        do_rotary=rotary,
        rotary_interleaved=draw(st.booleans()),
        rotary_dim=rotary_dim,
        position_ids=rotary and draw(st.booleans()),
        scale=draw(st.one_of(st.just(0.0), st.floats(0.02, 1.0))),
        softcap=draw(st.one_of(st.just(0.0), st.floats(0.5, 30.0))),
        local_window_size=window,
        smooth_softmax=draw(st.sampled_from([-1, 0, 1])),
        head_sink=sink,
        attention_bias=draw(st.sampled_from(["", "", "bn", "b1", "1n", "11"])),
        query_seqlens=qsl,
        sliding_window_cache=swc,
        qk_norm=qk_norm and draw(st.integers(0, 5)) == 0,
        seed=draw(st.integers(0, 2**31 - 1)),
    )
    return case
