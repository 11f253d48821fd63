"""The served graph (ort_kvlayout.model.serving_graph): lengths in place of the mask, logits only
at the sampled positions. Oracle: the model's own graph on the same inputs (its logits at those
positions, its present caches), CPU."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from serve_util import library_or_skip, make_served_model
from synthetic_models import VOCAB, Variant, build_model

CAPACITY = 48


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    library_or_skip()
    return make_served_model(tmp_path_factory.mktemp("served"))


def _session(model: onnx.ModelProto | str, folder) -> ort.InferenceSession:
    import ort_kvlayout

    so = ort.SessionOptions()
    ort_kvlayout.register(so)
    if isinstance(model, onnx.ModelProto):
        so.add_session_config_entry(
            "session.model_external_initializers_file_folder_path", str(folder)
        )
        model = model.SerializeToString()
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def _caches(sess, batch: int, rng) -> dict[str, np.ndarray]:
    return {
        i.name: rng.normal(0, 1, (batch, i.shape[1], CAPACITY, i.shape[3])).astype(np.float32)
        for i in sess.get_inputs()
        if i.name.startswith("past")
    }


def _served(model_dir):
    from ort_kvlayout.model.serving_graph import serving_graph

    proto = onnx.load(str(model_dir / "model.onnx"), load_external_data=False)
    return serving_graph(proto, "attention_mask", "logits", sample=False)


@pytest.mark.parametrize(
    "width, totals, last",
    [
        (7, [7, 5], [6, 4]),  # a right-padded first prompt: the last real token of each row
        (1, [20, 9], [0, 0]),  # decode rows over a past of 19 and 8 rows
        (4, [12], [3]),  # a chunk of 4 after 8 cached rows (batch 1: no query_seqlens)
    ],
)
def test_served_logits_and_caches_equal_the_models_own(model_dir, width, totals, last):
    served = _served(model_dir)
    names = served.inputs
    own, new = _session(str(model_dir / "model.onnx"), None), _session(served.model, model_dir)
    rng = np.random.default_rng(1)
    batch = len(totals)
    ids = rng.integers(4, VOCAB, (batch, width))
    caches = _caches(own, batch, rng)
    mask = np.zeros((batch, max(totals)), np.int64)
    for b, n in enumerate(totals):
        mask[b, :n] = 1
    want = own.run(None, {"input_ids": ids, "attention_mask": mask, **caches})
    got = new.run(None, {
        "input_ids": ids, **caches,
        names.seqlens: np.asarray(totals, np.int32) - 1,
        names.total: np.array(max(totals), np.int32),
        names.logits_positions: np.asarray(last, np.int64),
    })  # fmt: skip
    assert got[0].shape == (batch, 1, VOCAB)
    np.testing.assert_array_equal(got[0][:, 0], want[0][np.arange(batch), last])
    for g, w in zip(got[1:], want[1:]):  # the present caches
        np.testing.assert_array_equal(g, w)


def test_the_mask_input_is_gone_and_the_lengths_are_inputs(model_dir):
    served = _served(model_dir)
    inputs = {i.name: i for i in served.model.graph.input}
    assert "attention_mask" not in inputs
    assert inputs[served.inputs.seqlens].type.tensor_type.elem_type == TensorProto.INT32
    assert inputs[served.inputs.logits_positions].type.tensor_type.elem_type == TensorProto.INT64
    assert not any(n.op_type == "ReduceSum" for n in served.model.graph.node)


def test_the_sampler_node_ends_the_graph(model_dir):
    from ort_kvlayout.model.serving_graph import SAMPLE_OP, serving_graph

    proto = onnx.load(str(model_dir / "model.onnx"), load_external_data=False)
    served = serving_graph(proto, "attention_mask", "logits")
    node = served.model.graph.node[-1]
    assert (node.op_type, node.domain) == (SAMPLE_OP, "ai.kvlayout")
    assert node.input[0] == "logits"
    assert served.inputs.token_ids in {o.name for o in served.model.graph.output}
    assert "attention_mask" in {i.name for i in proto.graph.input}  # the argument is kept


def _tiny(mask_also_feeds: str | None = None, head: str = "MatMul") -> onnx.ModelProto:
    """A one-layer synthetic model with a defect grafted on."""
    model = build_model(Variant(layers=1))
    graph = model.graph
    if mask_also_feeds:
        graph.node.append(helper.make_node("Cast", ["mask_sum"], [mask_also_feeds], to=1))
        graph.output.append(
            helper.make_tensor_value_info(mask_also_feeds, TensorProto.FLOAT, ["batch"])
        )
    if head != "MatMul":
        for node in graph.node:
            if node.output and node.output[0] == "logits":
                node.op_type = head
    return model


def test_a_mask_that_feeds_more_than_the_lengths_is_refused():
    from ort_kvlayout.model.serving_graph import ServingGraphError, serving_graph

    with pytest.raises(ServingGraphError, match="computed from the mask"):
        serving_graph(_tiny(mask_also_feeds="mask_out"), "attention_mask", "logits")


def test_a_graph_without_an_lm_head_is_refused():
    from ort_kvlayout.model.serving_graph import ServingGraphError, serving_graph

    with pytest.raises(ServingGraphError, match="no LM head"):
        serving_graph(_tiny(head="Softmax"), "attention_mask", "logits")


def test_names_that_exist_already_are_refused():
    from ort_kvlayout.model.serving_graph import ServedInputs, ServingGraphError, serving_graph

    model = _tiny()
    model.graph.initializer.append(numpy_helper.from_array(np.zeros(1, np.int64), "taken"))
    with pytest.raises(ServingGraphError, match="taken"):
        serving_graph(model, "attention_mask", "logits", ServedInputs(seqlens="taken"))


def test_an_unknown_mask_name_is_refused():
    from ort_kvlayout.model.serving_graph import ServingGraphError, serving_graph

    with pytest.raises(ServingGraphError, match="no input 'mask'"):
        serving_graph(_tiny(), "mask", "logits")


def test_lengths_not_computed_from_the_mask_are_refused():
    from ort_kvlayout.model.serving_graph import ServingGraphError, serving_graph

    model = _tiny()
    gqa = next(n for n in model.graph.node if n.op_type == "GroupQueryAttention")
    gqa.input[5] = "other_seqlens"
    model.graph.input.append(
        helper.make_tensor_value_info("other_seqlens", TensorProto.INT32, ["batch"])
    )
    with pytest.raises(ServingGraphError, match="input 5 .'other_seqlens'. is not computed"):
        serving_graph(model, "attention_mask", "logits")


# --- packed tokens (rewrite 4) ------------------------------------------------------------------
def _packed(model_dir):
    from ort_kvlayout.model.serving_graph import serving_graph

    proto = onnx.load(str(model_dir / "model.onnx"), load_external_data=False)
    return serving_graph(proto, "attention_mask", "logits", sample=False, packed=True)


@pytest.mark.parametrize(
    "rows",
    [
        [(7, 0), (5, 0)],  # two first chunks of different lengths
        [(4, 8), (0, 0), (1, 19), (3, 0)],  # a chunk after 8 rows, an idle row, a decode row
        [(1, 5), (1, 30), (1, 0)],  # decode rows only: S = 1
    ],
)
def test_packed_rows_equal_each_row_run_alone(model_dir, rows):
    """Oracle: the model's own graph, each row alone at batch 1 (a first prompt, a chunk or a
    decode step): the logits of its last token and its present cache's rows [0, past + new)
    (past them a present holds what its buffer held). Equal up to float32 rounding, not bit for
    bit: the CPU attention's task grid (query blocks, key splits, micro-kernel rows) follows the
    call's shape, and on an AVX2 machine a row's sums then round differently in another batch
    (a few millionths of the logits' scale), where AVX-512's happened to agree."""
    from ort_kvlayout.serve.packing import pack_rows

    served = _packed(model_dir)
    names = served.inputs
    own, new = _session(str(model_dir / "model.onnx"), None), _session(served.model, model_dir)
    rng = np.random.default_rng(2)
    tokens = [list(rng.integers(4, VOCAB, count)) for count, _ in rows]
    caches = _caches(own, len(rows), rng)
    call = pack_rows([(t, cached) for t, (_, cached) in zip(tokens, rows)])
    got = new.run(None, {
        "input_ids": call.ids, **caches,
        names.seqlens: call.seqlens_k, names.total: np.array(call.total, np.int32),
        names.logits_positions: call.last, names.unpack_index: call.unpack,
        names.pack_index: call.pack, names.query_seqlens: call.query_seqlens,
    })  # fmt: skip
    assert got[0].shape == (len(rows), 1, VOCAB)
    for b, (count, cached) in enumerate(rows):
        if count == 0:
            continue
        alone = {k: v[b : b + 1] for k, v in caches.items()}
        mask = np.ones((1, cached + count), np.int64)
        ids = np.array([tokens[b]], np.int64)
        want = own.run(None, {"input_ids": ids, "attention_mask": mask, **alone})
        _assert_float32_close(got[0][b, 0], want[0][0, -1], f"row {b}")
        for g, w in zip(got[1:], want[1:]):  # the present caches' rows of this entry
            _assert_float32_close(g[b][:, : cached + count], w[0][:, : cached + count], f"row {b}")


def _assert_float32_close(got, want, what: str) -> None:
    """Equal up to float32 rounding of sums of a few dozen terms, on the values' own scale."""
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()),
                               err_msg=what)  # fmt: skip


def test_the_packed_graph_has_its_inputs_and_query_seqlens(model_dir):
    served = _packed(model_dir)
    names = served.inputs
    inputs = {i.name: i for i in served.model.graph.input}
    assert served.packed
    for name in (names.unpack_index, names.pack_index, names.query_seqlens):
        assert name in inputs
    ids = inputs["input_ids"].type.tensor_type.shape.dim
    assert (ids[0].dim_value, ids[1].dim_param) == (1, "packed_tokens")
    gqa = [n for n in served.model.graph.node if n.op_type == "GroupQueryAttention"]
    assert gqa and all(n.input[16] == names.query_seqlens for n in gqa)


def test_a_node_that_mixes_tokens_refuses_packing():
    from ort_kvlayout.model.serving_graph import ServingGraphError, serving_graph

    model = _tiny()
    graph = model.graph
    head = next(n for n in graph.node if n.output and n.output[0] == "logits")
    # a cumulative sum over the tokens before the LM head: each token then reads the others
    graph.initializer.append(numpy_helper.from_array(np.array(1, np.int64), "token_axis"))
    graph.node.insert(
        list(graph.node).index(head),
        helper.make_node("CumSum", [head.input[0], "token_axis"], ["mixed"], name="/mix"),
    )
    head.input[0] = "mixed"
    serving_graph(model, "attention_mask", "logits")  # unpacked: fine
    with pytest.raises(ServingGraphError, match=r"/mix \(CumSum\) may mix tokens"):
        serving_graph(model, "attention_mask", "logits", packed=True)


def test_a_gqa_node_with_position_ids_refuses_packing():
    from ort_kvlayout.model.serving_graph import ServingGraphError, serving_graph

    model = _tiny()
    gqa = next(n for n in model.graph.node if n.op_type == "GroupQueryAttention")
    while len(gqa.input) < 10:
        gqa.input.append("")
    gqa.input[9] = "position_ids"
    model.graph.input.append(
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"])
    )
    with pytest.raises(ServingGraphError, match=r"position_ids \(input 9\)"):
        serving_graph(model, "attention_mask", "logits", packed=True)
