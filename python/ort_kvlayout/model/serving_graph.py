"""The served graph: a decoder rewritten so that one step's host traffic is token ids and lengths.

    served = serving_graph(onnx.load(path, load_external_data=False), "attention_mask", "logits")
    served.model            # the rewritten ModelProto (weights still external)
    served.inputs.seqlens   # names of the graph inputs the engine binds

Four rewrites (the fourth where asked), each applied to the graph alone (external weights are
never read; the model folder is never written):

1. **Lengths, not a mask.** The builder derives GQA's seqlens_k from ReduceSum(attention_mask) - 1
   and total_sequence_length from its width. A served step feeds both directly: `kvl_seqlens_k`
   (int32, one per row) and `kvl_total_sequence_length` (int32 scalar, in CPU memory as the op
   declares it). A decode step padded to the cache's capacity then uploads 4 bytes a row instead
   of a capacity-wide int64 mask row (264 KB a row at 33,792 tokens). Applied only when the
   mask feeds nothing but those two values; otherwise the graph is refused (ServingGraphError).
2. **Logits only where sampled** (vLLM's `logits_indices`). The LM head (the MatMul that ends in
   `logits`, through position-wise Cast/Add/Mul/Div/Tanh) reads the hidden state of one position
   per row, `kvl_logits_positions` (int64, (B,)): the last token of a prefill chunk, 0 in a
   decode row. `logits` becomes (B, 1, vocab): a 4,096-token chunk of a 128k vocabulary
   computes and holds 256 KB of logits instead of 1 GB.
3. **Sampling on the device.** `ai.kvlayout::SampleTokens` turns the logits into
   `kvl_next_token_ids` (int64, (B, 1)) from per-row `kvl_temperature`, `kvl_top_k`,
   `kvl_top_p` and `kvl_uniform` (docs/CONTRACT.md): greedy rows are np.argmax of the logits,
   sampled rows are reproducible from the uniform numbers the host draws from each request's
   seeded generator. Only the ids cross to the host; `logits` stays an output, bound to the
   device.

Position ids (a model with that input) are still fed by the caller.

4. **Packed tokens** (`packed=True`; vLLM's flattened batch). Every node outside attention acts
   on each token alone, so the dense layers need no padding: `input_ids` is (1, T), the T new
   tokens of all rows one after the other, and only attention sees rows. Around each GQA node
   the token inputs (query, key, value) are gathered into the right-padded (B, S) shape by
   `kvl_unpack_index` ((B, S) int64: the packed index of row b's token s; any valid index past
   the row's tokens), the node reads `kvl_query_seqlens` ((B,) int32, its input 16: the tokens
   of each row, 0 for a row with none, whose cache stays untouched), and its output is gathered
   back by `kvl_pack_index` ((1, T) int64: b * S + s of each packed token). The logits
   positions are then packed indices. One call prefills the chunks of several requests (and
   may carry decode rows) while its MatMuls compute T rows, not B x S. Refused (naming the
   node) when a node outside attention could mix tokens, or a GQA node reads position_ids or
   an attention bias (shaped by rows) or has query_seqlens already.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import onnx
from onnx import TensorProto, helper

from ..op.library import DOMAIN
from .graph import is_gqa, node_label

__all__ = ["SAMPLE_OP", "ServedInputs", "ServingGraph", "ServingGraphError", "serving_graph"]

SAMPLE_OP = "SampleTokens"
SEQLENS_INPUT, TOTAL_INPUT = 5, 6  # GroupQueryAttention's seqlens_k and total_sequence_length
# Ops between the LM head's MatMul and `logits` that act on each position alone (a softcap is
# Div, Tanh, Mul; a bias Add; an fp32 Cast): the gather may move before them.
_POSITIONWISE = {"Cast", "Add", "Sub", "Mul", "Div", "Tanh", "Identity"}
_LM_HEADS = {"MatMul", "MatMulNBits", "Gemm"}


class ServingGraphError(ValueError):
    """The graph cannot be served this way (the message names the node or input and why)."""


@dataclass(frozen=True)
class ServedInputs:
    """Names of the inputs and output the rewrite added."""

    seqlens: str = "kvl_seqlens_k"
    total: str = "kvl_total_sequence_length"
    logits_positions: str = "kvl_logits_positions"
    temperature: str = "kvl_temperature"
    top_k: str = "kvl_top_k"
    top_p: str = "kvl_top_p"
    uniform: str = "kvl_uniform"
    token_ids: str = "kvl_next_token_ids"
    unpack_index: str = "kvl_unpack_index"
    pack_index: str = "kvl_pack_index"
    query_seqlens: str = "kvl_query_seqlens"


@dataclass(frozen=True)
class ServingGraph:
    model: onnx.ModelProto
    inputs: ServedInputs
    packed: bool = False


def serving_graph(
    model: onnx.ModelProto,
    attention_mask: str,
    logits: str,
    names: ServedInputs | None = None,
    sample: bool = True,
    packed: bool = False,
    input_ids: str = "input_ids",
) -> ServingGraph:
    """The served form of `model` (a copy; the argument is not changed); without `sample`, the
    first two rewrites only (the host samples from `logits`); with `packed`, the fourth too
    (`input_ids` names the ids input, whose shape becomes (1, T)). Raises ServingGraphError
    naming what does not fit."""
    names = names or ServedInputs()
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    taken = _names(graph)
    clash = [n for n in vars(names).values() if n in taken]
    if clash:
        raise ServingGraphError(f"the graph already has values named {clash}: cannot add them")
    _lengths_not_mask(graph, attention_mask, names)
    if packed:
        _packed_tokens(graph, names, input_ids)
    _logits_at_positions(graph, logits, names, packed)
    if sample:
        _sample_on_device(graph, logits, names)
    if not any(o.domain == DOMAIN for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    _drop_unused_initializers(graph)
    return ServingGraph(out, names, packed)


# --- 1. lengths ------------------------------------------------------------------------------
def _lengths_not_mask(graph: onnx.GraphProto, mask: str, names: ServedInputs) -> None:
    if mask not in {i.name for i in graph.input}:
        raise ServingGraphError(f"the graph has no input {mask!r} (genai_config's attention_mask)")
    consumers = _consumers(graph)
    gqa = [n for n in graph.node if is_gqa(n)]
    if not gqa:
        raise ServingGraphError("the graph has no GroupQueryAttention node")
    # Nodes computed from the mask, up to the GQA nodes.
    derived: list[onnx.NodeProto] = []
    seen: set[int] = set()
    frontier = [mask]
    while frontier:
        value = frontier.pop()
        for node, index in consumers.get(value, []):
            if is_gqa(node):
                if index not in (SEQLENS_INPUT, TOTAL_INPUT):
                    raise ServingGraphError(
                        f"{node_label(node)} reads the attention mask at input {index}; only "
                        "seqlens_k (5) and total_sequence_length (6) can be fed as lengths"
                    )
                continue
            if id(node) not in seen:
                seen.add(id(node))
                derived.append(node)
                frontier.extend(o for o in node.output if o)
    outputs = {o.name for o in graph.output}
    for node in derived:
        for value in node.output:
            if value in outputs:
                raise ServingGraphError(f"graph output {value!r} is computed from the mask")
            for user, index in consumers.get(value, []):
                if id(user) not in seen and not (is_gqa(user) and index in (5, 6)):
                    raise ServingGraphError(
                        f"{node_label(user)} ({user.op_type}) uses {value!r}, computed from the "
                        "attention mask: only GQA's seqlens_k and total_sequence_length may be"
                    )
    from_mask = {mask} | {o for n in derived for o in n.output if o}
    for node in gqa:
        for index in (SEQLENS_INPUT, TOTAL_INPUT):
            if len(node.input) <= index or not node.input[index]:
                raise ServingGraphError(f"{node_label(node)} has no input {index}")
            if node.input[index] not in from_mask:
                # Fed otherwise (another input, a constant): its meaning is not the mask's.
                raise ServingGraphError(
                    f"{node_label(node)} input {index} ({node.input[index]!r}) is not computed "
                    "from the attention mask"
                )
    dead = {id(n) for n in derived}
    kept = [n for n in graph.node if id(n) not in dead]
    for node in kept:
        if is_gqa(node):
            node.input[SEQLENS_INPUT] = names.seqlens
            node.input[TOTAL_INPUT] = names.total
    _replace_nodes(graph, kept)
    inputs = [i for i in graph.input if i.name != mask]
    inputs += [
        helper.make_tensor_value_info(names.seqlens, TensorProto.INT32, ["batch_size"]),
        helper.make_tensor_value_info(names.total, TensorProto.INT32, []),
    ]
    del graph.input[:]
    graph.input.extend(inputs)


# --- 2. logits at sampled positions -----------------------------------------------------------
def _logits_at_positions(
    graph: onnx.GraphProto, logits: str, names: ServedInputs, packed: bool
) -> None:
    producers = {o: n for n in graph.node for o in n.output if o}
    constant = _constant_values(graph)
    node = producers.get(logits)
    while node is not None and node.op_type in _POSITIONWISE:
        activations = [i for i in node.input if i and i not in constant]
        if len(activations) != 1:
            raise ServingGraphError(
                f"{node_label(node)} ({node.op_type}) between the LM head and {logits!r} takes "
                f"{len(activations)} computed inputs; expected one"
            )
        node = producers.get(activations[0])
    if node is None or node.op_type not in _LM_HEADS:
        raise ServingGraphError(
            f"no LM head (MatMul, MatMulNBits or Gemm) found above {logits!r}"
            + (f": {node_label(node)} is {node.op_type}" if node is not None else "")
        )
    hidden = node.input[0]
    base = names.logits_positions
    shape, index, picked, flat = (f"{base}/{s}" for s in ("shape", "index", "hidden", "flat"))
    if packed:
        graph.initializer.append(helper.make_tensor(shape, TensorProto.INT64, [2], [-1, 1]))
        gather = [
            helper.make_node("Reshape", [base, shape], [index], name=f"/{base}/Reshape"),
            # (1, T, hidden) -> (T, hidden), at one packed index per row -> (B, 1, hidden)
            helper.make_node("Flatten", [hidden], [flat], axis=2, name=f"/{base}/Flatten"),
            helper.make_node("Gather", [flat, index], [picked], axis=0, name=f"/{base}/Gather"),
        ]  # fmt: skip
    else:
        graph.initializer.append(helper.make_tensor(shape, TensorProto.INT64, [3], [-1, 1, 1]))
        gather = [
            helper.make_node("Reshape", [base, shape], [index], name=f"/{base}/Reshape"),
            # (B, S, hidden) at one S index per row -> (B, 1, hidden)
            helper.make_node("GatherND", [hidden, index], [picked], batch_dims=1,
                             name=f"/{base}/GatherND"),
        ]  # fmt: skip
    node.input[0] = picked
    nodes = list(graph.node)
    at = next(i for i, n in enumerate(nodes) if n is node)
    _replace_nodes(graph, nodes[:at] + gather + nodes[at:])
    graph.input.append(
        helper.make_tensor_value_info(names.logits_positions, TensorProto.INT64, ["batch_size"])
    )
    for out in graph.output:
        if out.name == logits:
            dims = out.type.tensor_type.shape.dim
            if len(dims) == 3:
                dims[1].Clear()
                dims[1].dim_value = 1


# --- 3. sampling -------------------------------------------------------------------------------
def _sample_on_device(graph: onnx.GraphProto, logits: str, names: ServedInputs) -> None:
    params = [
        (names.temperature, TensorProto.FLOAT),
        (names.top_k, TensorProto.INT32),
        (names.top_p, TensorProto.FLOAT),
        (names.uniform, TensorProto.FLOAT),
    ]
    graph.input.extend(helper.make_tensor_value_info(n, t, ["batch_size"]) for n, t in params)
    graph.node.append(
        helper.make_node(SAMPLE_OP, [logits, *(n for n, _ in params)], [names.token_ids],
                         domain=DOMAIN, name=f"/{SAMPLE_OP}")
    )  # fmt: skip
    graph.output.append(
        helper.make_tensor_value_info(names.token_ids, TensorProto.INT64, ["batch_size", 1])
    )


# --- 4. packed tokens --------------------------------------------------------------------------
# Ops that compute each token's values from that token's alone (with constant weights): the
# dense layers of a decoder. A graph with any other op outside attention is refused.
_TOKENWISE = {
    "Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Reciprocal", "Neg", "Cast", "Identity",
    "Sigmoid", "Tanh", "Relu", "Erf", "Gelu", "FastGelu", "QuickGelu", "BiasGelu", "Softplus",
    "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "LayerNormalization",
    "SkipLayerNormalization", "RMSNormalization", "MatMul", "MatMulNBits",
}  # fmt: skip
_EMBEDDINGS = {"Gather", "GatherBlockQuantized"}  # a constant table at computed ids, axis 0
_GQA_TOKEN_INPUTS = (0, 1, 2)  # query, key, value: (B, S, width)
_GQA_ROW_INPUTS = {9: "position_ids", 10: "attention_bias", 16: "query_seqlens"}
QUERY_SEQLENS_INPUT = 16


def _packed_tokens(graph: onnx.GraphProto, names: ServedInputs, input_ids: str) -> None:
    _check_tokenwise(graph)
    if input_ids not in {i.name for i in graph.input}:
        raise ServingGraphError(f"the graph has no input {input_ids!r} (the token ids)")
    nodes: list[onnx.NodeProto] = []
    for at, node in enumerate(graph.node):
        if not is_gqa(node):
            nodes.append(node)
            continue
        base = f"/kvl_packed/{at}"
        for index in _GQA_TOKEN_INPUTS:
            if len(node.input) > index and node.input[index]:
                flat, rows = f"{base}/in{index}/flat", f"{base}/in{index}/rows"
                nodes += [
                    # (1, T, width) -> (T, width) -> (B, S, width)
                    helper.make_node("Flatten", [node.input[index]], [flat], axis=2,
                                     name=f"{base}/in{index}/Flatten"),
                    helper.make_node("Gather", [flat, names.unpack_index], [rows], axis=0,
                                     name=f"{base}/in{index}/Gather"),
                ]  # fmt: skip
                node.input[index] = rows
        while len(node.input) <= QUERY_SEQLENS_INPUT:
            node.input.append("")
        node.input[QUERY_SEQLENS_INPUT] = names.query_seqlens
        packed_out, padded, flat = node.output[0], f"{base}/out/rows", f"{base}/out/flat"
        node.output[0] = padded
        nodes += [
            node,
            # (B, S, width) -> (B * S, width) -> (1, T, width)
            helper.make_node("Flatten", [padded], [flat], axis=2, name=f"{base}/out/Flatten"),
            helper.make_node("Gather", [flat, names.pack_index], [packed_out], axis=0,
                             name=f"{base}/out/Gather"),
        ]  # fmt: skip
    _replace_nodes(graph, nodes)
    for value in graph.input:
        if value.name == input_ids:
            dims = value.type.tensor_type.shape.dim
            if len(dims) != 2:
                raise ServingGraphError(f"input {input_ids!r} has rank {len(dims)}; expected 2")
            dims[0].Clear()
            dims[0].dim_value = 1
            dims[1].Clear()
            dims[1].dim_param = "packed_tokens"
    graph.input.extend([
        helper.make_tensor_value_info(names.unpack_index, TensorProto.INT64,
                                      ["batch_size", "sequence_length"]),
        helper.make_tensor_value_info(names.pack_index, TensorProto.INT64, [1, "packed_tokens"]),
        helper.make_tensor_value_info(names.query_seqlens, TensorProto.INT32, ["batch_size"]),
    ])  # fmt: skip


def _check_tokenwise(graph: onnx.GraphProto) -> None:
    """Raises unless every node that reads a computed value acts on each token alone (or is GQA
    without inputs shaped by rows)."""
    constant = _constant_values(graph)
    for node in graph.node:
        computed = [i for i in node.input if i and i not in constant]
        if not computed:
            constant.update(o for o in node.output if o)  # folded: weights, a tied LM head
            continue
        if is_gqa(node):
            for index, what in _GQA_ROW_INPUTS.items():
                if len(node.input) > index and node.input[index]:
                    raise ServingGraphError(
                        f"{node_label(node)} reads {what} (input {index}): packed tokens cannot "
                        "feed an input shaped by rows"
                    )
            continue
        if node.op_type in _EMBEDDINGS:
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            if node.input[0] in constant and axis == 0:
                continue
        elif node.op_type in _TOKENWISE and (
            node.op_type not in {"MatMul", "MatMulNBits"} or node.input[1] in constant
        ):
            continue
        raise ServingGraphError(
            f"{node_label(node)} ({node.op_type}) may mix tokens: packed tokens need every node "
            "outside attention to act on each token alone"
        )


# --- helpers -----------------------------------------------------------------------------------
def _names(graph: onnx.GraphProto) -> set[str]:
    names = {i.name for i in graph.input} | {o.name for o in graph.output}
    names |= {t.name for t in graph.initializer}
    for node in graph.node:
        names.update(node.output)
    return names


def _consumers(graph: onnx.GraphProto) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
    users: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for index, value in enumerate(node.input):
            if value:
                users.setdefault(value, []).append((node, index))
    return users


def _constant_values(graph: onnx.GraphProto) -> set[str]:
    values = {t.name for t in graph.initializer}
    values.update(o for n in graph.node if n.op_type == "Constant" for o in n.output)
    return values


def _replace_nodes(graph: onnx.GraphProto, nodes: Iterable[onnx.NodeProto]) -> None:
    kept = []
    for node in nodes:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        kept.append(copy)
    del graph.node[:]
    graph.node.extend(kept)


def _drop_unused_initializers(graph: onnx.GraphProto) -> None:
    """Initializers and Constant nodes only the removed mask nodes read (ORT would warn about
    each one)."""
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    nodes = [n for n in graph.node if n.op_type != "Constant" or n.output[0] in used]
    if len(nodes) != len(graph.node):
        _replace_nodes(graph, nodes)
    kept = [t for t in graph.initializer if t.name in used]
    if len(kept) != len(graph.initializer):
        copies = []
        for t in kept:
            c = TensorProto()
            c.CopyFrom(t)
            copies.append(c)
        del graph.initializer[:]
        graph.initializer.extend(copies)
