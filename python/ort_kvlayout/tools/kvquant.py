"""patch_kv_layout --kv-quant: converts a plain model's KV caches to PER_TOKEN quantization.

    from ort_kvlayout.tools.kvquant import convert_model
    refusals = convert_model(model, "int8-per-token", scale_names)   # in place; [] when done

PER_TOKEN (ai.kvlayout only; docs/CONTRACT.md): one float32 scale per (token, kv head) for K
and for V, computed when the row is written, kept in scale caches beside the KV caches. Per GQA
node the conversion

- sets k_quant_type = v_quant_type = "PER_TOKEN" and kv_cache_bit_width (8 or 4);
- gives past/present key/value (graph inputs/outputs) the narrow element type: int8, uint8
  (packed int4: last dim (H + 1) / 2) or float8e4m3fn;
- adds the scale caches as graph inputs past_key_scale.%d / past_value_scale.%d and outputs
  present_key_scale.%d / present_value_scale.%d (float32, dims (batch, Nkv, seq) copied from the
  cache's first three, symbolic as they are), wired to the node's inputs 17/18 and outputs 4/5.

Refused, by node name, before anything changes: a node that is already quantized or has
k_scale/v_scale, a cache that is not float32/float16/bfloat16, a cache that is not a graph
input/output or that another node reads, and any non-GQA attention node in the model (its cache would stay unconverted).
"""

from __future__ import annotations

import onnx

from ..model.config import expand_kv
from ..model.gqa_schema import (
    GQA_INPUTS,
    GQA_OUTPUTS,
    K_SCALE,
    OUTPUT_QK,
    PAST_K_SCALE,
    PAST_KEY,
    PAST_VALUE,
    PRESENT_K_SCALE,
    PRESENT_KEY,
    PRESENT_VALUE,
    QUANT_TYPE_ATTRS,
    V_SCALE,
    is_quantized,
    quant_type,
)
from ..model.graph import is_gqa, iter_gqa_nodes, iter_graphs, node_attrs, node_label

T = onnx.TensorProto
# --kv-quant value -> (kv_cache_bit_width, cache element type)
KV_QUANT_SCHEMES = {
    "int8-per-token": (8, T.INT8),
    "int4-per-token": (4, T.UINT8),
    "fp8-per-token": (8, T.FLOAT8E4M3FN),
}
_FLOAT_CACHES = (T.FLOAT, T.FLOAT16, T.BFLOAT16)
# Attention ops other than GroupQueryAttention: their caches could not be converted.
OTHER_ATTENTION = (
    "Attention", "MultiHeadAttention", "PagedAttention", "SparseAttention",
    "DecoderMaskedMultiHeadAttention", "DecoderMaskedSelfAttention", "PackedAttention",
    "PackedMultiHeadAttention", "LongformerAttention", "QAttention",
)  # fmt: skip
_QUANT_ATTRS = (*QUANT_TYPE_ATTRS, "kv_cache_bit_width")

# (past input, present output) -> (past scale input, present scale output), for K and for V.
ScaleNames = dict[str, str]


class KvQuantError(ValueError):
    """--kv-quant names an unknown scheme."""


def check_scheme(scheme: str) -> tuple[int, int]:
    if scheme not in KV_QUANT_SCHEMES:
        raise KvQuantError(f"--kv-quant {scheme!r}: expected one of {', '.join(KV_QUANT_SCHEMES)}")
    return KV_QUANT_SCHEMES[scheme]


def _value_infos(graph: onnx.GraphProto, name: str) -> list[onnx.ValueInfoProto]:
    return [v for v in (*graph.input, *graph.output, *graph.value_info) if v.name == name]


def _consumers(model: onnx.ModelProto) -> dict[str, list[str]]:
    """Tensor name -> labels of the nodes that read or write it (every graph and function)."""
    users: dict[str, list[str]] = {}
    nodes = [n for g in iter_graphs(model.graph) for n in g.node]
    nodes += [n for f in model.functions for n in f.node]
    for i, node in enumerate(nodes):
        for name in (*node.input, *node.output):
            if name:
                users.setdefault(name, []).append(node_label(node, i))
    return users


def _node_problems(
    node: onnx.NodeProto, label: str, graph: onnx.GraphProto, users: dict, names: ScaleNames
) -> list[str]:
    reasons = []
    if is_quantized(node):
        attrs = node_attrs(node)
        kq = quant_type(attrs, "k_quant_type")
        reasons.append(f"already quantized (k_quant_type={kq}): --kv-quant converts plain caches")
    scales = [GQA_INPUTS[i] for i in (K_SCALE, V_SCALE) if len(node.input) > i and node.input[i]]
    if scales:
        reasons.append(f"has {'/'.join(scales)}: --kv-quant converts plain caches")
    ports = [(node.input, i, GQA_INPUTS[i]) for i in (PAST_KEY, PAST_VALUE)]
    ports += [(node.output, i, GQA_OUTPUTS[i]) for i in (PRESENT_KEY, PRESENT_VALUE)]
    inputs = {v.name for v in graph.input}
    outputs = {v.name for v in graph.output}
    for names_of, index, what in ports:
        name = names_of[index] if len(names_of) > index else ""
        if not name:
            reasons.append(f"no {what}: --kv-quant needs the KV caches as graph inputs/outputs")
            continue
        is_input = what.startswith("past")
        if name not in (inputs if is_input else outputs):
            reasons.append(f"{what} {name!r} is not a graph {'input' if is_input else 'output'}")
            continue
        others = [u for u in users.get(name, []) if u != label]
        if others:
            reasons.append(f"{what} {name!r} is also used by {', '.join(others[:3])}")
        info = _value_infos(graph, name)[0]
        elem = info.type.tensor_type.elem_type
        if elem not in _FLOAT_CACHES:
            reasons.append(
                f"{what} {name!r} is {T.DataType.Name(elem).lower()}: --kv-quant converts "
                "float32 / float16 / bfloat16 caches"
            )
        if name not in names:
            reasons.append(
                f"{what} {name!r} is not named by genai_config.json's past/present key/value "
                "templates (the scale caches are named after them)"
            )
    return reasons


def _narrow(info: onnx.ValueInfoProto, elem: int, bits: int) -> None:
    """Gives a cache's value info the narrow type; int4: a fixed last dim H becomes the packed
    (H + 1) // 2 (a symbolic one, the builder's kv_cache_dim, stays symbolic)."""
    tensor = info.type.tensor_type
    tensor.elem_type = elem
    if bits == 4 and tensor.HasField("shape") and len(tensor.shape.dim) == 4:
        last = tensor.shape.dim[3]
        if last.HasField("dim_value"):
            last.dim_value = (last.dim_value + 1) // 2


def _scale_info(cache: onnx.ValueInfoProto, name: str) -> onnx.ValueInfoProto:
    """float32 (dims 0..2 of the cache): batch, kv heads, sequence (symbolic as they are)."""
    info = onnx.helper.make_tensor_value_info(name, T.FLOAT, None)
    src = cache.type.tensor_type
    if src.HasField("shape"):
        shape = info.type.tensor_type.shape
        for dim in list(src.shape.dim)[:3]:
            shape.dim.add().CopyFrom(dim)
    return info


def convert_model(
    model: onnx.ModelProto, scheme: str, names: ScaleNames, prefix: str = ""
) -> list[tuple[str, str]]:
    """Converts every GQA node of `model` (main graph) to PER_TOKEN `scheme`, in place.

    names: every past/present KV name -> its scale cache's name (scale_names_for builds it).
    Returns the refusals [(node label, reason)]; when there are any, `model` is unchanged."""
    bits, elem = check_scheme(scheme)
    graph = model.graph
    refusals = []
    for g in iter_graphs(graph):
        for i, node in enumerate(g.node):
            if node.op_type in OTHER_ATTENTION:
                reason = (
                    f"a {node.domain or 'ai.onnx'}::{node.op_type} node: --kv-quant converts "
                    "GroupQueryAttention KV caches only"
                )
                refusals.append((prefix + node_label(node, i), reason))
    users = _consumers(model)
    # GQA nodes of the main graph by index (labels numbered as iter_gqa_nodes numbers them:
    # the main graph's come first), then those of subgraphs and functions.
    main = [i for i, n in enumerate(graph.node) if is_gqa(n)]
    everywhere = list(iter_gqa_nodes(model))
    labels = [node_label(n, i) for i, n in enumerate(everywhere)]
    for i, label in enumerate(labels[len(main) :]):
        reason = "in a subgraph or function: --kv-quant converts the main graph's GQA nodes"
        refusals.append((prefix + label, reason))
    labels = labels[: len(main)]
    nodes = [graph.node[i] for i in main]
    for node, label in zip(nodes, labels):
        refusals += [(prefix + label, r) for r in _node_problems(node, label, graph, users, names)]
    if refusals:
        return refusals

    work = onnx.ModelProto()
    work.CopyFrom(model)  # converted on a copy: a late refusal leaves `model` as it was
    g = work.graph
    for index, label in zip(main, labels):
        node = g.node[index]
        kept = [a for a in node.attribute if a.name not in _QUANT_ATTRS]
        del node.attribute[:]
        node.attribute.extend(kept)
        node.attribute.extend([
            onnx.helper.make_attribute("k_quant_type", "PER_TOKEN"),
            onnx.helper.make_attribute("v_quant_type", "PER_TOKEN"),
            onnx.helper.make_attribute("kv_cache_bit_width", bits),
        ])  # fmt: skip
        caches = [
            node.input[PAST_KEY], node.input[PAST_VALUE],
            node.output[PRESENT_KEY], node.output[PRESENT_VALUE],
        ]  # fmt: skip
        for name in caches:
            for info in _value_infos(g, name):
                _narrow(info, elem, bits)
        while len(node.input) < PAST_K_SCALE:
            node.input.append("")
        node.input.extend([names[caches[0]], names[caches[1]]])
        while len(node.output) < PRESENT_K_SCALE:
            node.output.append("")  # output_qk stays empty (OUTPUT_QK)
        node.output.extend([names[caches[2]], names[caches[3]]])
        inputs = {v.name: v for v in g.input}
        outputs = {v.name: v for v in g.output}
        g.input.extend([_scale_info(inputs[c], names[c]) for c in caches[:2]])
        g.output.extend([_scale_info(outputs[c], names[c]) for c in caches[2:]])
    assert OUTPUT_QK < PRESENT_K_SCALE and len(GQA_OUTPUTS) == PRESENT_K_SCALE + 2
    model.CopyFrom(work)
    return []


def scale_names_for(decoder: dict, layers: int, templates: dict[str, str]) -> ScaleNames:
    """Every past/present KV name of genai_config's decoder -> its scale cache's name, from the
    *_scale_names templates (SCALE_KEYS)."""
    inputs, outputs = decoder["inputs"], decoder["outputs"]
    pairs = [
        (inputs["past_key_names"], templates["past_key_scale_names"]),
        (inputs["past_value_names"], templates["past_value_scale_names"]),
        (outputs["present_key_names"], templates["present_key_scale_names"]),
        (outputs["present_value_names"], templates["present_value_scale_names"]),
    ]
    names: ScaleNames = {}
    for kv, scale in pairs:
        names.update(zip(expand_kv(kv, kv, layers)[::2], expand_kv(scale, scale, layers)[::2]))
    return names
