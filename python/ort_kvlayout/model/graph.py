"""Reading GroupQueryAttention nodes out of ONNX graphs (shared by the tools and the runtime).

Graphs are loaded without their external data (a 14B model's weights are never read): only the
protobuf with the nodes, the opset imports and the graph's input/output names. The op's schema
(input/output indices, attribute table) is gqa_schema's.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import onnx

from ..op.layout import layout_id
from ..op.library import DOMAIN, OP_TYPE
from .gqa_schema import gqa_attribute_types

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


class GraphError(ValueError):
    """A GQA node's attributes do not fit the op's table (the message names the node)."""


def attr_type_name(attr: onnx.AttributeProto) -> str:
    """ "INT", "FLOAT", "STRING", "INTS", ... (the names the op's errors use)."""
    return onnx.AttributeProto.AttributeType.Name(attr.type)


def attribute_problems(node: onnx.NodeProto) -> list[str]:
    """What the op would refuse or ignore in this node's attributes, read as the op reads them
    (with its attribute table, gqa_schema.gqa_attribute_types): an attribute outside its table
    (a custom op cannot list a node's attributes, so the op itself cannot see one: CONTRACT.md
    section 11), one of the wrong type, kv_layout other than INT 0 or 1, or kv_layout on a
    com.microsoft node."""
    table = gqa_attribute_types()
    problems = []
    for attr in node.attribute:
        want = table.get(attr.name)
        got = attr_type_name(attr)
        if want is None:
            problems.append(f"attribute '{attr.name}' is not in the ai.kvlayout contract")
        elif got != want:
            problems.append(f"attribute '{attr.name}' must be of type {want}, got {got}")
        elif attr.name == KV_LAYOUT_ATTR and node.domain == MS_DOMAIN:
            problems.append("kv_layout on a com.microsoft node (ORT rejects it)")
        elif attr.name == KV_LAYOUT_ATTR and attr.i not in (0, 1):
            problems.append(f"attribute 'kv_layout' must be 0 or 1, got {attr.i}")
    return problems


def node_attrs(node: onnx.NodeProto) -> dict[str, object]:
    """{name: value}; read after attribute_problems() found none, so the types are the table's."""
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def node_kv_layout(node: onnx.NodeProto, label: str | None = None) -> int:
    """The KV layout a GQA node runs with: com.microsoft is always head-major (0).

    Read as the op reads it: kv_layout must be an INT 0 or 1, else GraphError naming the node
    (a FLOAT 1.0 is refused by the op at session creation, never taken as seq-major).
    """
    if node.domain == MS_DOMAIN:
        return 0
    attr = next((a for a in node.attribute if a.name == KV_LAYOUT_ATTR), None)
    if attr is None:
        return 0
    if attr.type != onnx.AttributeProto.INT or attr.i not in (0, 1):
        got = attr_type_name(attr) if attr.type != onnx.AttributeProto.INT else str(attr.i)
        raise GraphError(
            f"{label or node_label(node)}: attribute 'kv_layout' must be INT 0 or 1, got {got}"
        )
    return layout_id(int(attr.i))


# A protobuf message cannot exceed 2 GiB: a larger .onnx file is not a model (weights of large
# models are external data), and reading it would only cost memory.
MAX_ONNX_BYTES = (2 << 30) - 1


def load_model(model_path: str | os.PathLike) -> onnx.ModelProto:
    """The graph of one ONNX file without its external data; GraphError (one line naming the
    file and the problem) when it is missing, too large or not an ONNX model."""
    path = Path(model_path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise GraphError(f"{path}: cannot be read ({exc.strerror})") from exc
    if size > MAX_ONNX_BYTES:
        raise GraphError(f"{path}: {size} bytes, more than an ONNX protobuf can hold (2 GiB)")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except OSError as exc:
        raise GraphError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    except Exception as exc:  # DecodeError, ValueError...: whatever it is, not a model
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise GraphError(f"{path}: not a valid ONNX model ({first})") from exc
    if not model.HasField("graph"):
        raise GraphError(f"{path}: not a valid ONNX model (no graph)")
    return model


def _iter_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Initializers and tensor attributes of every graph (subgraphs too)."""
    for graph in iter_graphs(model.graph):
        yield from graph.initializer
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    yield attr.t
                elif attr.type == onnx.AttributeProto.TENSORS:
                    yield from attr.tensors


def external_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """The tensors of `model` whose data lives in an external file."""
    return (t for t in _iter_tensors(model) if t.data_location == onnx.TensorProto.EXTERNAL)


def check_external_data(model: onnx.ModelProto, model_path: str | os.PathLike) -> None:
    """GraphError naming the file when an external-data reference of `model` cannot be served:
    the file is missing, lies outside the model's directory, or is shorter than offset+length.
    Only stat() is used: the data is never read."""
    path = Path(model_path)
    base = path.parent.resolve()
    sizes: dict[str, int] = {}
    for tensor in external_tensors(model):
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        where = f"{path}: tensor '{tensor.name}'"
        target = (base / location).resolve()
        if not location or Path(location).is_absolute() or not target.is_relative_to(base):
            raise GraphError(
                f"{where}: external data location {location!r} is not a file "
                "inside the model's directory"
            )
        if location not in sizes:
            try:
                sizes[location] = target.stat().st_size
            except OSError:
                raise GraphError(f"{where}: external data file {location} not found") from None
        try:
            offset, length = int(info.get("offset", 0)), int(info.get("length", 0))
        except ValueError:
            raise GraphError(f"{where}: external data offset/length are not integers") from None
        if offset < 0 or length < 0:
            raise GraphError(
                f"{where}: external data offset {offset} and length {length} must be >= 0"
            )
        end = offset + length
        if end > sizes[location]:
            raise GraphError(
                f"{where}: external data {location} has {sizes[location]} bytes, the tensor "
                f"needs {end} (truncated file?)"
            )


# Graph port name -> ONNX element type (0 when the port is not a typed tensor).
PortTypes = dict[str, int]


def read_graph(model_path: str | os.PathLike) -> tuple[list[onnx.NodeProto], PortTypes, PortTypes]:
    """(GQA nodes, graph inputs, graph outputs) of one ONNX file, no external data."""
    return graph_facts(load_model(model_path))


def _port_types(values) -> PortTypes:
    return {
        v.name: v.type.tensor_type.elem_type if v.type.HasField("tensor_type") else 0
        for v in values
    }


def graph_facts(model: onnx.ModelProto) -> tuple[list[onnx.NodeProto], PortTypes, PortTypes]:
    """(GQA nodes, graph inputs, graph outputs) of a loaded model; the ports map each name to its
    element type (used like sets of names, and for the KV cache's type)."""
    return (
        list(iter_gqa_nodes(model)),
        _port_types(model.graph.input),
        _port_types(model.graph.output),
    )
