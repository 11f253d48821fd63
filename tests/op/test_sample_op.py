"""ai.kvlayout::SampleTokens against the numpy oracle (tests/helpers/reference_sampling.py), on the
CPU op and, where onnxruntime-gpu and a CUDA build exist, the CUDA op (every input on the device,
CPU fallback disabled: gpu_util's conventions; GQA_GPU_EMULATE_CPU=1 runs the CUDA tests on the
CPU op to check the harness).

Sampled rows are compared where the uniform number and top_p lie away from the points where
the token changes (the oracle sums float32 weights in float64, the kernels in fixed point);
``test_cuda_equals_cpu`` compares the two kernels everywhere, boundaries included: they compute
the same integers (core/sample_rule.h).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnxruntime as ort
import pytest
import reference_sampling as rs
from gpu_util import GPU_MARKS, device_empty, from_device, new_cuda_session, to_device, update
from onnx import TensorProto, helper

DOMAIN = "ai.kvlayout"
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16), "bf16": BF16}
_ONNX = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    BF16: TensorProto.BFLOAT16,
    np.dtype(np.int32): TensorProto.INT32,
    np.dtype(np.int64): TensorProto.INT64,
}
PARAMS = ("temperature", "top_k", "top_p", "uniform")
PARAM_TYPES = {
    "temperature": np.float32, "top_k": np.int32, "top_p": np.float32, "uniform": np.float32,
}  # fmt: skip


# --------------------------------------------------------------------------------------------
# The model and the two runners
# --------------------------------------------------------------------------------------------
def sample_model(logits_dtype, rank: int, types: dict | None = None) -> bytes:
    """One SampleTokens node: logits of `rank` symbolic dimensions, parameters of any shape."""
    types = {**PARAM_TYPES, **(types or {})}
    dims = [f"d{i}" for i in range(rank - 1)] + ["vocab"]
    inputs = [helper.make_tensor_value_info("logits", _ONNX[np.dtype(logits_dtype)], dims)]
    inputs += [helper.make_tensor_value_info(n, _ONNX[np.dtype(types[n])], None) for n in PARAMS]
    out = helper.make_tensor_value_info("token_ids", TensorProto.INT64, None)
    node = helper.make_node("SampleTokens", ["logits", *PARAMS], ["token_ids"], domain=DOMAIN)
    graph = helper.make_graph([node], "sample_tokens", inputs, [out])
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10).SerializeToString()


def _ortvalue(arr: np.ndarray) -> ort.OrtValue:
    arr = np.ascontiguousarray(arr)
    if arr.dtype == BF16:
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
            arr.view(np.uint16), TensorProto.BFLOAT16
        )
    return ort.OrtValue.ortvalue_from_numpy(arr)


class CpuRunner:
    name = "cpu"

    def __init__(self):
        self._sessions = {}

    def session(self, model: bytes, threads: int = 0) -> ort.InferenceSession:
        key = (model, threads)
        if key not in self._sessions:
            import ort_kvlayout

            so = ort.SessionOptions()
            so.log_severity_level = 3
            so.intra_op_num_threads = threads
            ort_kvlayout.register(so)
            self._sessions[key] = ort.InferenceSession(
                model, so, providers=["CPUExecutionProvider"]
            )
        return self._sessions[key]

    def run(self, model: bytes, feeds: dict, threads: int = 0) -> np.ndarray:
        sess = self.session(model, threads)
        out = sess.run_with_ort_values(["token_ids"], {k: _ortvalue(v) for k, v in feeds.items()})
        return out[0].numpy()


class CudaRunner:
    """Every input a device OrtValue, the output bound on the device (gpu_util)."""

    name = "cuda"

    def __init__(self):
        self._sessions = {}

    def session(self, model: bytes) -> ort.InferenceSession:
        if model not in self._sessions:
            self._sessions[model] = new_cuda_session(model, DOMAIN)
        return self._sessions[model]

    def run(self, model: bytes, feeds: dict, threads: int = 0) -> np.ndarray:
        del threads
        sess = self.session(model)
        io = sess.io_binding()
        dev = {k: to_device(v) for k, v in feeds.items()}
        for k, v in dev.items():
            io.bind_ortvalue_input(k, v)
        shape = np.asarray(feeds["logits"]).shape[:-1]
        if all(d >= 0 for d in shape) and len(np.asarray(feeds["logits"]).shape) >= 2:
            out = device_empty(shape, np.int64)
            io.bind_ortvalue_output("token_ids", out)
        else:
            io.bind_output("token_ids", "cuda")
            out = None
        sess.run_with_iobinding(io)
        return from_device(out if out is not None else io.get_outputs()[0])


_RUNNERS = {"cpu": CpuRunner(), "cuda": CudaRunner()}


def gpu_test(fn):
    """gpu_util's marks on one test: "gpu", skipped without the CUDA EP and a CUDA build."""
    for mark in GPU_MARKS:
        fn = mark(fn)
    return fn


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=GPU_MARKS)])
def runner(request):
    return _RUNNERS[request.param]


def feeds_of(logits, temperature, top_k, top_p, uniform, param_shape=None) -> dict:
    logits = np.asarray(logits)
    shape = logits.shape[:-1] if param_shape is None else param_shape
    f = {"logits": logits}
    for name, val in zip(PARAMS, (temperature, top_k, top_p, uniform), strict=True):
        f[name] = np.asarray(val, PARAM_TYPES[name]).reshape(shape)
    return f


def run_op(runner, logits, temperature, top_k, top_p, uniform, param_shape=None, threads=0):
    logits = np.asarray(logits)
    model = sample_model(logits.dtype, logits.ndim)
    feeds = feeds_of(logits, temperature, top_k, top_p, uniform, param_shape)
    return runner.run(model, feeds, threads)


def expected(logits, temperature, top_k, top_p, uniform) -> np.ndarray:
    return rs.sample_tokens(logits, temperature, top_k, top_p, uniform)


def assert_ids(got, want, what=""):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == np.int64, f"{what}token_ids dtype {got.dtype}, expected int64"
    assert got.shape == want.shape, f"{what}token_ids shape {got.shape}, expected {want.shape}"
    bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
    assert bad.size == 0, (
        f"{what}{bad.size}/{want.size} rows differ; first (row, got, want): "
        f"{[(int(r), int(got.reshape(-1)[r]), int(want.reshape(-1)[r])) for r in bad[:6]]}"
    )


def random_logits(rng, rows, vocab, dtype, scale=3.0):
    return (rng.standard_normal((rows, vocab)) * scale).astype(dtype)


def sampled_params(rng, logits, temps, top_ks, top_ps, margin=1e-5):
    """Per-row parameters drawn from the given choices, with top_p moved off the cut's
    boundaries and uniform numbers away from the token boundaries (the oracle's float sums)."""
    rows = logits.shape[0]
    t = rng.choice(np.asarray(temps, np.float32), rows)
    k = rng.choice(np.asarray(top_ks, np.int32), rows)
    p = rng.choice(np.asarray(top_ps, np.float32), rows)
    u = np.zeros(rows, np.float32)
    for r in range(rows):
        plan = rs.row_plan(logits[r], t[r], k[r], p[r])
        while plan.top_p_slack < margin:
            p[r] = np.float32(p[r] * 0.97)
            plan = rs.row_plan(logits[r], t[r], k[r], p[r])
        u[r] = plan.safe_uniform(rng, margin)
    return t, k, p, u


# --------------------------------------------------------------------------------------------
# Greedy
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_greedy_matches_argmax(runner, dtype):
    """temperature 0 (+0 or -0): np.argmax of the row, whatever top_k, top_p and uniform."""
    rng = np.random.default_rng(1)
    dt = DTYPES[dtype]
    x = random_logits(rng, 24, 1000, dt)
    x[3] = np.round(x[3].astype(np.float32))  # many ties, the maximum among them
    x[4, [5, 500, 999]] = x[4].max() + 1  # a tie at the top, scattered
    x[5, :] = 0  # every token tied
    x[6, :4] = np.array([-1.0, -0.0, 0.0, -2.0]).astype(dt)  # -0 == +0: the lower index
    x[6, 4:] = -3
    t = np.where(rng.random(24) < 0.5, np.float32(0.0), np.float32(-0.0))
    k = rng.integers(0, 1200, 24).astype(np.int32)
    p = rng.uniform(0.01, 1.0, 24).astype(np.float32)
    u = rng.random(24).astype(np.float32)
    got = run_op(runner, x, t, k, p, u)
    want = np.argmax(x.astype(np.float32), axis=-1)
    assert_ids(got, want, f"{dtype} greedy: ")
    assert got[4] == 5 and got[5] == 0 and got[6] == 1


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_top_k_one_is_greedy(runner, dtype):
    rng = np.random.default_rng(2)
    x = random_logits(rng, 16, 333, DTYPES[dtype], scale=0.5)
    x[0, [7, 70]] = x[0].max() + 1
    t = rng.uniform(0.1, 3.0, 16).astype(np.float32)
    got = run_op(runner, x, t, np.ones(16), rng.uniform(0.1, 1, 16), rng.random(16))
    assert_ids(got, np.argmax(x.astype(np.float32), axis=-1), f"{dtype} top_k=1: ")
    assert got[0] == 7


def test_subnormal_logits_order_exactly(runner):
    """float32 subnormals are distinct logits (integer keys: no flush to zero on the device)."""
    x = np.array([[1e-45, 3e-45, 2e-45, 0.0, -1e-45]], np.float32)
    assert run_op(runner, x, [0.0], [0], [1.0], [0.5])[0] == 1
    x = np.array([[-3e-45, -1e-45, -2e-45, -1e-44]], np.float32)
    assert run_op(runner, x, [0.0], [0], [1.0], [0.5])[0] == 1


# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("vocab", [50, 1000])
def test_sampling_matches_reference(runner, dtype, vocab):
    rng = np.random.default_rng(1000 + vocab)
    dt = DTYPES[dtype]
    rows = 96
    x = random_logits(rng, rows, vocab, dt, scale=2.5)
    x[::7] = np.round(x[::7].astype(np.float32) * 2).astype(dt) / 2  # ties
    t, k, p, u = sampled_params(
        rng, x,
        temps=[0.3, 0.7, 1.0, 1.6, 5.0],
        top_ks=[0, 2, 5, 40, vocab - 1, vocab, vocab + 7],
        top_ps=[1.0, 0.97, 0.8, 0.5, 0.1],
    )  # fmt: skip
    got = run_op(runner, x, t, k, p, u)
    assert_ids(got, expected(x, t, k, p, u), f"{dtype} V={vocab}: ")
    assert (got >= 0).all()


def test_infinite_temperature_samples_uniformly(runner):
    """temperature +inf: every weight 1, so the token is the kept token at floor(u * K)."""
    x = np.random.default_rng(3).standard_normal((1, 10)).astype(np.float32)
    for u in (0.05, 0.35, 0.95):
        got = run_op(runner, x, [np.inf], [0], [1.0], [u])
        assert got[0] == int(u * 10)


def test_ties_at_the_top_k_cut(runner):
    """Equal logits at the k-th place: the lower indices are kept, whatever u."""
    x = np.full((1, 12), -4.0, np.float32)
    x[0, 4] = 5.0
    x[0, [2, 7, 9, 11]] = 3.0  # top_k = 3 keeps 4, 2, 7: not 9, not 11
    us = np.linspace(0.0, 0.999, 64).astype(np.float32)
    n = us.size
    got = run_op(runner, np.repeat(x, n, 0), np.full(n, 0.8), np.full(n, 3), np.ones(n), us)
    assert set(got.tolist()) == {2, 4, 7}, got
    assert_ids(got, expected(np.repeat(x, n, 0), np.full(n, 0.8), np.full(n, 3), np.ones(n), us))
    # The last kept token in index order takes the top of the unit interval.
    assert got[-1] == 7 and got[0] == 2


def test_ties_at_the_top_p_cut(runner):
    """Ten equal logits, top_p 0.35: the shortest prefix reaching 3.5 holds four tokens, the
    four lowest indices."""
    x = np.zeros((1, 10), np.float16)
    us = np.array([0.0, 0.2, 0.49, 0.51, 0.74, 0.76, 0.99], np.float32)
    n = us.size
    got = run_op(runner, np.repeat(x, n, 0), np.ones(n), np.zeros(n), np.full(n, 0.35), us)
    assert got.tolist() == [0, 0, 1, 2, 2, 3, 3]


@pytest.mark.parametrize("top_p", [1e-6, 1e-30, 1e-45])
def test_tiny_top_p_keeps_the_most_likely_token(runner, top_p):
    rng = np.random.default_rng(4)
    x = random_logits(rng, 20, 500, np.float32)
    x[0, [30, 10, 400]] = 50.0  # tied maxima: the lowest index is first in the order
    u = rng.random(20).astype(np.float32)
    got = run_op(runner, x, np.full(20, 1.3), np.zeros(20), np.full(20, top_p), u)
    assert_ids(got, np.argmax(x, axis=-1), f"top_p={top_p}: ")
    assert got[0] == 10


def test_rank3_logits_and_parameter_shapes(runner):
    """logits (B, 1, V): ids (B, 1); parameters of any shape with B elements."""
    rng = np.random.default_rng(5)
    B, V = 6, 300
    x = random_logits(rng, B, V, np.float16)
    t, k, p, u = sampled_params(rng, x, [0.0, 0.9], [0, 20], [1.0, 0.9])
    x3 = x.reshape(B, 1, V)
    want = expected(x, t, k, p, u).reshape(B, 1)
    for shape in [(B,), (B, 1), (1, B, 1)]:
        got = run_op(runner, x3, t, k, p, u, param_shape=shape)
        assert_ids(got, want, f"params {shape}: ")


def test_non_finite_rows(runner):
    """A NaN or an infinity anywhere in a row: -1 for that row (before the parameter check);
    the other rows are sampled as usual."""
    rng = np.random.default_rng(6)
    rows, V = 12, 257
    x = random_logits(rng, rows, V, np.float32)
    t, k, p, u = sampled_params(rng, x, [0.0, 1.0], [0, 10], [1.0, 0.8])
    bad = {1: np.nan, 4: np.inf, 7: -np.inf, 10: np.nan}
    for r, v in bad.items():
        x[r, rng.integers(V)] = v
    x[10, 0] = np.inf
    t[10] = -1.0  # invalid too: non-finite wins
    got = run_op(runner, x, t, k, p, u)
    want = expected(x, t, k, p, u)
    assert all(want[r] == -1 for r in bad)
    assert_ids(got, want)
    for dt in (np.float16, BF16):  # the half types' inf and NaN
        y = x.astype(dt)
        assert_ids(run_op(runner, y, t, k, p, u)[list(bad)], want[list(bad)], f"{dt}: ")


INVALID_ROWS = [
    (np.nan, 0, 1.0, 0.5),
    (-0.5, 0, 1.0, 0.5),
    (-np.inf, 0, 1.0, 0.5),
    (1.0, -1, 1.0, 0.5),
    (1.0, 0, 0.0, 0.5),
    (1.0, 0, -0.0, 0.5),
    (1.0, 0, -0.1, 0.5),
    (1.0, 0, 1.0000001, 0.5),
    (1.0, 0, np.nan, 0.5),
    (1.0, 0, np.inf, 0.5),
    (1.0, 0, 1.0, 1.0),
    (1.0, 0, 1.0, -1e-45),
    (1.0, 0, 1.0, np.nan),
    (1.0, 0, 1.0, 2.0),
    (0.0, 1, 1.0, 1.0),  # greedy rows check their parameters too
    (0.0, 0, 0.0, 0.5),
]
VALID_EDGE_ROWS = [
    (-0.0, 0, 1.0, 0.5),  # -0 is not < 0, and == 0: greedy
    (1.0, 0, 1.0, -0.0),
    (1.0, 0, 1e-45, 0.5),  # a subnormal top_p is > 0
    (1e-45, 0, 1.0, 0.5),  # a subnormal temperature is > 0: sampled
    (np.inf, 0, 1.0, 0.999),
    (1.0, 10**6, 1.0, 0.5),  # top_k beyond V: off
    (1.0, 0, 1.0, 0.99999994),  # the largest float below 1
]


def test_invalid_parameters_give_minus_two(runner):
    rows = INVALID_ROWS + VALID_EDGE_ROWS
    x = random_logits(np.random.default_rng(7), len(rows), 64, np.float32)
    t, k, p, u = (np.array(c) for c in zip(*rows, strict=True))
    got = run_op(runner, x, t, k, p, u)
    want = expected(x, t, k, p, u)
    assert (want[: len(INVALID_ROWS)] == -2).all() and (want[len(INVALID_ROWS) :] >= 0).all()
    assert_ids(got, want)


def test_vocab_of_one_and_no_rows(runner):
    x = np.array([[0.5], [-3.0]], np.float32)
    assert run_op(runner, x, [1.0, 0.0], [0, 0], [0.5, 1.0], [0.9, 0.1]).tolist() == [0, 0]
    got = run_op(runner, np.zeros((0, 5), np.float32), [], [], [], [])
    assert got.shape == (0,) and got.dtype == np.int64


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_large_vocabulary(runner, dtype):
    """A 128256-token row (Llama 3): greedy, temperature only, top-p, top-k + top-p."""
    rng = np.random.default_rng(8)
    V = 128256
    x = random_logits(rng, 4, V, DTYPES[dtype], scale=2.0)
    t = np.array([0.0, 0.8, 1.0, 0.6], np.float32)
    k = np.array([0, 0, 0, 50], np.int32)
    p = np.array([1.0, 1.0, 0.9, 0.95], np.float32)
    u = np.zeros(4, np.float32)
    for r in range(1, 4):
        u[r] = rs.row_plan(x[r], t[r], k[r], p[r]).safe_uniform(rng)
    assert_ids(run_op(runner, x, t, k, p, u), expected(x, t, k, p, u), f"{dtype} V={V}: ")


def test_deterministic(runner):
    """The same inputs give the same ids, run after run (and, on the CPU, whatever the thread
    count)."""
    rng = np.random.default_rng(9)
    x = random_logits(rng, 40, 5000, np.float16)
    t, k, p, u = (
        rng.uniform(0.2, 2, 40), rng.integers(0, 100, 40), rng.uniform(0.05, 1, 40),
        rng.random(40),
    )  # fmt: skip
    first = run_op(runner, x, t, k, p, u)
    for threads in (1, 4, 0):
        assert_ids(run_op(runner, x, t, k, p, u, threads=threads), first, f"threads={threads}: ")


def test_distribution_matches_the_probabilities(runner):
    """Over many uniform numbers, each token's frequency is its probability under the contract
    (temperature, top-k, top-p): a check of the index-order scan that does not go through the
    oracle's token choice."""
    x = np.array([[2.0, 0.5, 1.5, -1.0, 2.0, 0.0, 1.0, -3.0]], np.float32)
    t, k, p = 0.9, 6, 0.95
    n = 20000
    rng = np.random.default_rng(10)
    u = rng.random(n).astype(np.float32)
    got = run_op(runner, np.repeat(x, n, 0), np.full(n, t), np.full(n, k), np.full(n, p), u)
    prob = rs.row_plan(x[0], t, k, p).probabilities(x.shape[1])
    # By hand: top-6 drops 7 (-3.0) and 3 (-1.0); the weights exp((x - 2) / 0.9) of 0, 4, 2, 6,
    # 1, 5 are 1, 1, .574, .329, .189, .108 (3.201), and 95% of that (3.041) is first reached
    # by the prefix of five (3.092, four give 2.903): 5 is dropped.
    assert set(np.flatnonzero(prob)) == {0, 1, 2, 4, 6}
    freq = np.bincount(got, minlength=x.shape[1]) / n
    sigma = np.sqrt(prob * (1 - prob) / n)
    assert np.all(np.abs(freq - prob) <= 5 * sigma + 1e-12), (freq, prob)
    # Stratified uniforms: the inverse CDF in index order gives each token its share to 1/n.
    us = ((np.arange(n) + 0.5) / n).astype(np.float32)
    got = run_op(runner, np.repeat(x, n, 0), np.full(n, t), np.full(n, k), np.full(n, p), us)
    counts = np.bincount(got, minlength=x.shape[1])
    assert np.all(np.abs(counts - prob * n) <= 1.0), (counts, prob * n)
    assert np.all(np.diff(got) >= 0)  # index order: the token grows with u


@pytest.mark.parametrize("dims,rank", [(["b", 1, "vocab"], 2), ([3, 5], 1), ([None, 4, 2, 9], 3)])
def test_shape_inference_gives_logits_leading_dims(dims, rank):
    """The output's inferred shape is logits.shape[:-1]: a Shape node after it has `rank`
    elements when the session is built (before any run)."""
    import ort_kvlayout

    ins = [helper.make_tensor_value_info("logits", TensorProto.FLOAT16, dims)]
    ins += [helper.make_tensor_value_info(n, _ONNX[np.dtype(PARAM_TYPES[n])], None) for n in PARAMS]
    nodes = [
        helper.make_node("SampleTokens", ["logits", *PARAMS], ["ids"], domain=DOMAIN),
        helper.make_node("Shape", ["ids"], ["shape"]),
    ]
    out = helper.make_tensor_value_info("shape", TensorProto.INT64, None)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, 1)]
    model = helper.make_model(helper.make_graph(nodes, "g", ins, [out]), opset_imports=opsets,
                              ir_version=10)  # fmt: skip
    so = ort.SessionOptions()
    ort_kvlayout.register(so)
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    assert sess.get_outputs()[0].shape == [rank]


# --------------------------------------------------------------------------------------------
# Errors of the call
# --------------------------------------------------------------------------------------------
def _raises(runner, feeds, match, types=None):
    logits = np.asarray(feeds["logits"])
    with pytest.raises(Exception, match=match):
        runner.run(sample_model(logits.dtype, max(logits.ndim, 1), types), feeds)


def test_logits_rank_one(runner):
    f = feeds_of(np.zeros((2, 8), np.float32), [1, 1], [0, 0], [1, 1], [0, 0])
    f["logits"] = np.zeros(8, np.float32)
    f.update({n: f[n][:1] for n in PARAMS})
    _raises(runner, f, r"'logits' must have rank >= 2")


def test_logits_empty_vocabulary(runner):
    f = feeds_of(np.zeros((2, 0), np.float32), [1, 1], [0, 0], [1, 1], [0, 0])
    _raises(runner, f, r"'logits' must have a last dimension \(the vocabulary\) in \[1, ")


@pytest.mark.parametrize("name", PARAMS)
def test_parameter_count(runner, name):
    f = feeds_of(np.zeros((3, 8), np.float32), [1] * 3, [0] * 3, [1] * 3, [0] * 3)
    f[name] = np.concatenate([f[name], f[name][:1]])
    _raises(runner, f, rf"'{name}' must hold one value per row of 'logits' \(3 rows")


def test_logits_type(runner):
    f = feeds_of(np.zeros((2, 8), np.int32), [1, 1], [0, 0], [1, 1], [0, 0])
    _raises(runner, f, r"'logits' must be float32, float16 or bfloat16, got int32")


def test_parameter_types_refused_by_the_schema(runner):
    f = feeds_of(np.zeros((2, 8), np.float32), [1, 1], [0, 0], [1, 1], [0, 0])
    f["top_k"] = f["top_k"].astype(np.int64)
    _raises(runner, f, r"top_k", types={"top_k": np.int64})
    f = feeds_of(np.zeros((2, 8), np.float32), [1, 1], [0, 0], [1, 1], [0, 0])
    f["uniform"] = f["uniform"].astype(np.float16)
    _raises(runner, f, r"uniform", types={"uniform": np.float16})


# --------------------------------------------------------------------------------------------
# CUDA only: the kernels agree exactly; CUDA graph replay reads each call's values
# --------------------------------------------------------------------------------------------
@gpu_test
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("vocab", [7, 1000, 50257, 128256])
def test_cuda_equals_cpu(dtype, vocab):
    """The two kernels compute the same integer weights and sums: the same token for every row,
    uniform numbers on the oracle's boundaries included. Odd vocabularies exercise unaligned
    rows."""
    rng = np.random.default_rng(11 + vocab)
    rows = 64 if vocab < 10000 else 12
    x = random_logits(rng, rows, vocab, DTYPES[dtype], scale=2.0)
    x[::5] = np.round(x[::5].astype(np.float32)).astype(x.dtype)  # ties at the cuts
    t = rng.choice(np.array([0.0, 0.5, 1.0, 2.0], np.float32), rows)
    k = rng.choice(np.array([0, 1, 3, 50, vocab], np.int32), rows)
    p = rng.choice(np.array([1.0, 0.95, 0.6, 0.05], np.float32), rows)
    u = rng.random(rows).astype(np.float32)
    for r in range(0, rows, 3):  # exactly on the oracle's boundaries
        if rs.params_valid(t[r], k[r], p[r], u[r]) and not rs.is_greedy(t[r], k[r]):
            cum = rs.row_plan(x[r], t[r], k[r], p[r]).cum
            u[r] = np.float32(cum[rng.integers(len(cum))]) % np.float32(1.0)
    cpu = run_op(_RUNNERS["cpu"], x, t, k, p, u)
    cuda = run_op(_RUNNERS["cuda"], x, t, k, p, u)
    assert_ids(cuda, cpu, f"{dtype} V={vocab} CUDA vs CPU: ")


@gpu_test
def test_cuda_graph_replay_reads_each_call():
    """Under ONNX Runtime's CUDA graph capture (every input and the output bound once, values
    copied in place): each replay samples from that call's logits and parameters."""
    rng = np.random.default_rng(12)
    B, V = 8, 3000
    model = sample_model(np.float16, 3)
    sess = new_cuda_session(model, DOMAIN, graph=True)
    io = sess.io_binding()

    def step_inputs():
        x = random_logits(rng, B, V, np.float16).reshape(B, 1, V)
        t, k, p, u = sampled_params(rng, x.reshape(B, V), [0.0, 0.7, 1.2], [0, 1, 30], [1.0, 0.8])
        return feeds_of(x, t, k, p, u, param_shape=(B,))

    first = step_inputs()
    dev = {k: to_device(v) for k, v in first.items()}
    for k, v in dev.items():
        io.bind_ortvalue_input(k, v)
    out = device_empty((B, 1), np.int64)
    io.bind_ortvalue_output("token_ids", out)
    feeds = first
    for step in range(6):  # step 0: warm-up and capture; later: replays
        if step:
            feeds = step_inputs()
            for k, v in feeds.items():
                update(dev[k], v)
        sess.run_with_iobinding(io)
        want = expected(feeds["logits"], *(feeds[n] for n in PARAMS))
        assert_ids(from_device(out), want, f"step {step}: ")
