"""Reading GroupQueryAttention nodes out of ONNX graphs (shared by the patcher and the metadata).

Graphs are loaded without their external data (a 14B model's weights are never read): only the
protobuf with the nodes, the opset imports and the graph's input/output names.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import onnx

from . import DOMAIN, OP_TYPE
from .layout import layout_id

MS_DOMAIN = "com.microsoft"
GQA_DOMAINS = (MS_DOMAIN, DOMAIN)
KV_LAYOUT_ATTR = "kv_layout"


def is_gqa(node: onnx.NodeProto) -> bool:
    return node.op_type == OP_TYPE and node.domain in GQA_DOMAINS


def iter_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """The graph and every subgraph (If/Loop/Scan bodies), depth first."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from iter_graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from iter_graphs(g)


def iter_gqa_nodes(model: onnx.ModelProto) -> Iterator[onnx.NodeProto]:
    """Every GroupQueryAttention node (either domain) in the model, subgraphs and functions too."""
    for graph in iter_graphs(model.graph):
        yield from (n for n in graph.node if is_gqa(n))
    for function in model.functions:
        yield from (n for n in function.node if is_gqa(n))


def node_label(node: onnx.NodeProto, index: int | None = None) -> str:
    if node.name:
        return node.name
    return f"<unnamed {node.domain}::{node.op_type} #{index}>" if index is not None else "<unnamed>"


def node_attrs(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def node_kv_layout(node: onnx.NodeProto) -> int:
    """The KV layout a GQA node runs with: com.microsoft is always head-major (0)."""
    if node.domain == MS_DOMAIN:
        return 0
    value = node_attrs(node).get(KV_LAYOUT_ATTR, 0)
    return layout_id(int(value))  # type: ignore[arg-type]


def read_graph(model_path: str | os.PathLike) -> tuple[list[onnx.NodeProto], set[str], set[str]]:
    """(GQA nodes, graph input names, graph output names) of one ONNX file, no external data."""
    model = onnx.load(str(model_path), load_external_data=False)
    inputs = {i.name for i in model.graph.input}
    outputs = {o.name for o in model.graph.output}
    return list(iter_gqa_nodes(model)), inputs, outputs
