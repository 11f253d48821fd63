"""ai.kvlayout::GroupQueryAttention under ONNX Runtime's own CUDA graph capture.

The onnxruntime-genai decode setup: one GQA node (S = 1), past and present bound to one cache
OrtValue of capacity C (the same OrtValue as past_key input and present_key output, likewise
value), total_sequence_length = C constant in CPU memory, seqlens_k (and position_ids) on the
device, every input and output a preallocated OrtValue that stays bound to one IOBinding.  The
first run captures the graph; later runs replay it while seqlens_k grows and new q/k/v are
copied in with ``OrtValue.update_inplace``.  Each step's output, and the cache rows, must equal
an uncaptured session fed identically, and the float64 oracle.

ORT's built-in com.microsoft GQA through the same harness is the harness's own sanity check
(skipped if ORT refuses it).
"""

from __future__ import annotations

import numpy as np
import pytest
import reference as ref
from gpu_util import (
    GPU_MARKS,
    QUICK,
    assert_close,
    case_seed,
    device_empty,
    from_device,
    new_cuda_session,
    seed_note,
    to_device,
    update,
)
from gqa_case import DTYPES, KV_DOMAIN, MS_DOMAIN, as_f64, build_model, rotary_caches

pytestmark = GPU_MARKS

B, N, NKV, C = 3, 8, 2, 64
P0 = np.array([13, 5, 20])  # cached tokens before step 0 (ragged batch)
STEPS = 12 if QUICK else 40  # P0 + STEPS <= C: the last step of entry 2 writes row 59

VARIANTS = {
    # genai's common form: packed QKV, rotary inside the op, position_ids fed each step.
    "packed_rotary_pos": {"dtype": "fp16", "H": 128, "packed": True, "rotary": True, "pos": True,
                          "attrs": {}},
    # separate q/k/v, a sliding window that moves as the length grows, softcap.
    "separate_window_softcap": {"dtype": "bf16", "H": 64, "packed": False, "rotary": False,
                                "pos": False, "attrs": {"local_window_size": 24, "softcap": 30.0}},
    # fp32, interleaved rotary, attention sink.
    "fp32_interleaved_sink": {"dtype": "fp32", "H": 64, "packed": True, "rotary": True,
                              "pos": False, "sink": True, "attrs": {"rotary_interleaved": 1}},
    # A sliding-window layer (Gemma 2/3 through onnxruntime-genai): a window-sized cache of
    # capacity 24 (window 16) that shifts every 9 tokens once full, while replays move the
    # lengths past it; rotary positions stay absolute.
    "sliding_window_cache": {"dtype": "fp16", "H": 64, "packed": True, "rotary": True,
                             "pos": False, "cap": 24,
                             "attrs": {"local_window_size": 16, "sliding_window_cache": 1}},
}  # fmt: skip


def _cap(v) -> int:
    """The cache capacity of a variant (total_sequence_length stays C: the longest sequence)."""
    return v.get("cap", C)


def _attrs(v):
    a = {"num_heads": N, "kv_num_heads": NKV, **v["attrs"]}
    if v["rotary"]:
        a["do_rotary"] = 1
    return a


def _static_feeds(v, rng):
    """Inputs that do not change between steps (besides the cache)."""
    dt = DTYPES[v["dtype"]][0]
    H = v["H"]
    f = {"total_sequence_length": np.array(C, np.int32)}
    if v["rotary"]:
        f["cos_cache"], f["sin_cache"] = rotary_caches(H, C + 16, dt)
    if v.get("sink"):
        f["head_sink"] = rng.standard_normal(N).astype(dt)
    return f


def _step_feeds(v, rng, step):
    """Inputs of one decode step: new q/k/v, seqlens_k = P0 + step, position_ids."""
    dt = DTYPES[v["dtype"]][0]
    H = v["H"]
    f = {}
    if v["packed"]:
        f["query"] = rng.standard_normal((B, 1, (N + 2 * NKV) * H)).astype(dt)
    else:
        f["query"] = rng.standard_normal((B, 1, N * H)).astype(dt)
        f["key"] = rng.standard_normal((B, 1, NKV * H)).astype(dt)
        f["value"] = rng.standard_normal((B, 1, NKV * H)).astype(dt)
    T = P0 + step + 1
    f["seqlens_k"] = (T - 1).astype(np.int32)
    if v["pos"]:
        f["position_ids"] = (T - 1).reshape(B, 1).astype(np.int64)
    return f


def _model_feeds(v, static, step0, cache):
    f = dict(static, **step0)
    f["past_key"], f["past_value"] = cache
    return f


class DecodeRig:
    """One session and its fixed bindings: every input and output a preallocated OrtValue (the
    cache bound as past and present), total_sequence_length a CPU array, one IOBinding."""

    def __init__(self, model, domain, graph, static, step0, cache_k, cache_v, dtype):
        self.sess = new_cuda_session(model, domain, graph=graph)
        self.io = self.sess.io_binding()
        self.dev = {}
        self.total = np.array(C, np.int32)
        self.io.bind_cpu_input("total_sequence_length", self.total)
        for k, val in {**static, **step0}.items():
            if k == "total_sequence_length":
                continue
            self.dev[k] = to_device(val)
            self.io.bind_ortvalue_input(k, self.dev[k])
        self.k, self.v = to_device(cache_k), to_device(cache_v)
        self.io.bind_ortvalue_input("past_key", self.k)
        self.io.bind_ortvalue_input("past_value", self.v)
        self.io.bind_ortvalue_output("present_key", self.k)
        self.io.bind_ortvalue_output("present_value", self.v)
        H = cache_k.shape[3]
        self.out = device_empty((B, 1, N * H), np.dtype(dtype))
        self.io.bind_ortvalue_output("output", self.out)

    def step(self, feeds):
        for k, val in feeds.items():
            update(self.dev[k], val)
        self.sess.run_with_iobinding(self.io)
        return from_device(self.out), from_device(self.k), from_device(self.v)


def _run_graph_vs_eager(domain, layout, vname, seed):
    v = VARIANTS[vname]
    dt = DTYPES[v["dtype"]][0]
    H = v["H"]
    rng = np.random.default_rng(seed)
    attrs = _attrs(v)
    static = _static_feeds(v, rng)
    # The cache before step 0: random valid rows, garbage beyond (must never be attended).
    ck = rng.standard_normal((B, NKV, _cap(v), H)).astype(dt)
    cv = rng.standard_normal((B, NKV, _cap(v), H)).astype(dt)
    for b in range(B):
        ck[b, :, P0[b] :] = 11.0
        cv[b, :, P0[b] :] = -11.0
    cache = (ref.to_layout(ck, layout), ref.to_layout(cv, layout))
    steps = [_step_feeds(v, rng, s) for s in range(STEPS)]
    lay = layout if domain == KV_DOMAIN else None
    model = build_model(_model_feeds(v, static, steps[0], cache), attrs, domain, lay)
    eager = DecodeRig(model, domain, False, static, steps[0], *cache, dt)
    graph = DecodeRig(model, domain, True, static, steps[0], *cache, dt)
    prev = cache  # the cache before the step (host copy, the oracle's past)
    exact_out = True
    for s, f in enumerate(steps):
        og, kg, vg = graph.step(f)  # step 0: ORT's warm-up + capture; later: replay
        oe, ke, ve = eager.step(f)
        where = f"{domain} layout {layout} {vname} step {s} (T={(P0 + s + 1).tolist()})"
        feeds = _model_feeds(v, static, f, prev)
        want = ref.gqa_reference(feeds, attrs, layout)
        masks = ref.defined_masks(feeds, attrs, layout)
        assert_close((oe, ke, ve), want, masks, v["dtype"], f"uncaptured vs oracle, {where}: ")
        assert_close((og, kg, vg), want, masks, v["dtype"], f"captured vs oracle, {where}: ")
        # Captured vs uncaptured: the cache rows exactly, the output within one ulp.
        pm = masks[1]
        for name, a, b in (("present_key", kg, ke), ("present_value", vg, ve)):
            assert np.array_equal(as_f64(a)[pm], as_f64(b)[pm]), (
                f"captured vs uncaptured {name} differ (max "
                f"{np.nanmax(np.abs(as_f64(a)[pm] - as_f64(b)[pm])):.3g}), {where} {seed_note()}"
            )
        d = np.abs(as_f64(og) - as_f64(oe))
        eps = {"fp32": 2.0**-23, "fp16": 2.0**-10, "bf16": 2.0**-7}[v["dtype"]]
        assert np.all(d <= 1e-6 + eps * np.abs(as_f64(oe))), (
            f"captured vs uncaptured output differ by up to {d.max():.3g}, {where} {seed_note()}"
        )
        exact_out &= bool(np.array_equal(og.view(np.uint8), oe.view(np.uint8)))
        prev = (kg, vg)
    print(f"{domain} layout {layout} {vname}: {STEPS} steps, captured == uncaptured bit-exact: "
          f"{exact_out}")  # fmt: skip


@pytest.mark.parametrize("vname", list(VARIANTS))
@pytest.mark.parametrize("layout", [0, 1])
def test_cuda_graph_replay_matches_uncaptured(layout, vname):
    _run_graph_vs_eager(KV_DOMAIN, layout, vname, case_seed(70_000 + layout))


def test_cuda_graph_harness_with_ort_builtin():
    """The same harness on ORT's com.microsoft GQA (head-major): checks the harness itself."""
    v = "packed_rotary_pos"
    try:
        _probe_ms(v)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"ORT's com.microsoft GQA refuses CUDA graph capture here: {str(e)[-400:]}")
    _run_graph_vs_eager(MS_DOMAIN, 0, v, case_seed(71_000))


def _probe_ms(vname):
    """Creates and runs (capture) ORT's builtin once; raises what ORT raises."""
    v = VARIANTS[vname]
    dt = DTYPES[v["dtype"]][0]
    rng = np.random.default_rng(0)
    static = _static_feeds(v, rng)
    step0 = _step_feeds(v, rng, 0)
    cache = [np.zeros((B, NKV, _cap(v), v["H"]), dt) for _ in range(2)]
    model = build_model(_model_feeds(v, static, step0, cache), _attrs(v), MS_DOMAIN, None)
    DecodeRig(model, MS_DOMAIN, True, static, step0, *cache, dt).step(step0)
