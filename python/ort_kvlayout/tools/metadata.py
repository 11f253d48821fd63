"""inference_metadata.yaml from a model directory's genai_config.json and its GQA nodes.

    from ort_kvlayout.tools.metadata import build_metadata, write_metadata
    data = build_metadata("smollm2-seq-major")
    write_metadata(data, "smollm2-seq-major/inference_metadata.yaml")

Schema (the one the onnx-genai engine reads; DESIGN section 5), every value derived from
genai_config.json except model.io.kv_layout and the cache format (kv_dtype, kv_cache_bit_width,
kv_quant_scheme), which come from the model's GroupQueryAttention nodes (all must agree):

    model:
      max_sequence_length: <- model.context_length
      vocab_size:          <- model.vocab_size
      io:
        token_input:          <- model.decoder.inputs.input_ids
        attention_mask_input: <- model.decoder.inputs.attention_mask
        position_ids_input:   <- model.decoder.inputs.position_ids (only when the config has it)
        logits_output:        <- model.decoder.outputs.logits
        kv_inputs:  past key/value templates (%d) over num_hidden_layers: k0, v0, k1, v1, ...
        kv_outputs: present key/value templates, same order
        kv_layout:  head_major_bnsh | seq_major_bsnh
        kv_update:  shared_buffer (search.past_present_share_buffer) | append
        kv_dtype:   the cache element type, from the nodes' past (else present) key port and
                    quant attributes: float16 | float32 | bfloat16 | int8 | uint8_packed_int4
                    | float8e4m3fn (omitted when an unquantized cache's port is untyped)
        kv_cache_bit_width: bits per cached element: 16 | 32 | 8 | 4 (with kv_dtype)
        kv_quant_scheme:    none | per_tensor | per_channel | per_token (k_quant_type =
                            v_quant_type; per_token: patch_kv_layout --kv-quant)
        (kv_dtype, kv_cache_bit_width and kv_quant_scheme must agree over all GQA nodes)
      attention:
        type: group_query_attention
        num_attention_heads / num_kv_heads / head_dim <- model.decoder.*
        sliding_window: decoder.sliding_window.window_size, else the nodes' local_window_size
                        (only when the model has a window)
    tokens: {bos_token_id, eos_token_id: [ids], pad_token_id}
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import onnx
import yaml

from ..model.config import (
    GENAI_CONFIG,
    MAX_INT32,
    MetadataError,
    config_int,
    config_str,
    config_value,
    decoder_files,
    expand_kv,
    json_type,
    load_genai_config,
    model_kv_layout,
    read_graph_checked,
)
from ..model.gqa_schema import PAST_KEY, PRESENT_KEY, QUANT_TYPE_ATTRS, quant_type
from ..model.graph import (
    GraphError,
    PortTypes,
    external_tensors,
    load_model,
    node_attrs,
    node_label,
)
from ..op.layout import LAYOUT_NAMES

ATTENTION_TYPE = "group_query_attention"

# Bounds no real model reaches; values beyond them are refused, never used as sizes or counts.
MAX_LAYERS = 1 << 16
MAX_HEADS = 1 << 16
MAX_HEAD_SIZE = 1 << 16


def _keep_graph_ports(names: list[str], ports: Collection[str], what: str) -> list[str]:
    """Drops expanded KV names of layers without a KV cache (hybrid models: conv / linear layers).

    All present: unchanged. None present: an error, the templates do not match the graph.
    """
    kept = [n for n in names if n in ports]
    if not kept or not names:
        raise MetadataError(
            f"{GENAI_CONFIG}: none of the {what} names ({names[0]}, ...) is a port of the graph"
        )
    for layer, (key, value) in enumerate(zip(names[0::2], names[1::2])):  # k0, v0, k1, v1, ...
        if (key in ports) != (value in ports):  # a layer keeps both caches or neither
            have, lack = (key, value) if key in ports else (value, key)
            raise MetadataError(
                f"{GENAI_CONFIG}: layer {layer}'s {what} name {lack!r} is not a port of the "
                f"graph, while {have!r} is (a mistyped template, or a graph missing a cache)"
            )
    return kept


def _sliding_window(
    config: dict[str, Any], nodes: list[onnx.NodeProto], context: int
) -> int | None:
    key = "model.decoder.sliding_window"  # null: absent
    if (
        config_value(config, key, None) is not None
        and config_value(config, f"{key}.window_size", None) is not None
    ):
        return config_int(config, f"{key}.window_size", 1, context)
    sizes = set()
    for node in nodes:
        for attr in node.attribute:
            if attr.name == "local_window_size" and attr.i > 0:
                sizes.add(int(attr.i))
    if len(sizes) > 1:
        raise MetadataError(
            f"GroupQueryAttention nodes use several local_window_size values: {sorted(sizes)}"
        )
    return sizes.pop() if sizes else None


GraphReader = Callable[[Path], tuple[list[onnx.NodeProto], PortTypes, PortTypes]]

# Unquantized cache element types: (kv_dtype, bits per element).
_FLOAT_CACHES = {
    onnx.TensorProto.FLOAT16: ("float16", 16),
    onnx.TensorProto.FLOAT: ("float32", 32),
    onnx.TensorProto.BFLOAT16: ("bfloat16", 16),
}
_QUANT_CACHES = {8: "int8", 4: "uint8_packed_int4"}  # kv_cache_bit_width -> kv_dtype


def _node_cache(
    node: onnx.NodeProto, inputs: PortTypes, outputs: PortTypes
) -> tuple[str | None, int | None, str]:
    """(kv_dtype, bits, scheme) of one GQA node: the quant attributes, else its cache port's type.
    An fp8 or unknown cache type is reported by its ONNX name; an untyped one as None."""
    attrs = node_attrs(node)  # build_metadata's model_kv_layout checked their types first
    kq, vq = (quant_type(attrs, n) for n in QUANT_TYPE_ATTRS)
    port = node.input[PAST_KEY] if len(node.input) > PAST_KEY else ""
    elem = inputs.get(port, 0) if port else 0
    if not elem and len(node.output) > PRESENT_KEY and node.output[PRESENT_KEY]:
        elem = outputs.get(node.output[PRESENT_KEY], 0)
    if kq != "NONE" or vq != "NONE":
        scheme = kq.lower() if kq == vq else f"k_{kq.lower()}_v_{vq.lower()}"
        bits = int(attrs.get("kv_cache_bit_width", 0))  # type: ignore[call-overload]
        if elem == onnx.TensorProto.FLOAT8E4M3FN:
            return "float8e4m3fn", 8, scheme
        return _QUANT_CACHES.get(bits, f"kv_cache_bit_width={bits}"), bits, scheme
    if elem in _FLOAT_CACHES:
        dtype, bits = _FLOAT_CACHES[elem]
        return dtype, bits, "none"
    if elem:
        return onnx.TensorProto.DataType.Name(elem).lower(), None, "none"
    return None, None, "none"


def _kv_cache_format(
    labelled: list[tuple[str, onnx.NodeProto]], inputs: PortTypes, outputs: PortTypes
) -> dict[str, Any]:
    """kv_dtype / kv_cache_bit_width / kv_quant_scheme, which every GQA node must share."""
    by_format: dict[tuple, list[str]] = {}
    for label, node in labelled:
        by_format.setdefault(_node_cache(node, inputs, outputs), []).append(label)
    if len(by_format) > 1:
        lines = [
            f"  kv_dtype={d}, kv_cache_bit_width={b}, kv_quant_scheme={q} ({len(names)} node(s)): "
            + ", ".join(names)
            for (d, b, q), names in by_format.items()
        ]
        raise MetadataError(
            "GroupQueryAttention nodes disagree on the KV cache format:\n" + "\n".join(lines)
        )
    dtype, bits, scheme = next(iter(by_format))
    out: dict[str, Any] = {}
    if dtype is not None:
        out["kv_dtype"] = dtype
    if bits is not None:
        out["kv_cache_bit_width"] = bits
    out["kv_quant_scheme"] = scheme
    return out


def _token_id(config: dict[str, Any], dotted: str, vocab: int) -> int | None:
    """A token id in [0, vocab), or null: a model may have no BOS or no padding token (the key
    itself stays required, as before)."""
    if config_value(config, dotted) is None:
        return None
    return config_int(config, dotted, 0, vocab - 1)


def _check_heads_agree(nodes: list[tuple[str, onnx.NodeProto]], heads: int, kv_heads: int) -> None:
    """Every GQA node's num_heads / kv_num_heads must be the config's (the graph decides)."""
    for label, node in nodes:
        attrs = {a.name: a.i for a in node.attribute if a.name in ("num_heads", "kv_num_heads")}
        got = (attrs.get("num_heads"), attrs.get("kv_num_heads"))
        if got != (heads, kv_heads):
            raise MetadataError(
                f"{GENAI_CONFIG}: num_attention_heads={heads}, num_key_value_heads={kv_heads} "
                f"disagree with node {label} (num_heads={got[0]}, kv_num_heads={got[1]})"
            )


def _check_layers_agree(template: str, ports: Collection[str], layers: int, what: str) -> None:
    """A graph port matching the %d template with a layer index >= num_hidden_layers means the
    config has fewer layers than the graph."""
    head, _, tail = template.partition("%d")
    for port in ports:
        index = port[len(head) : len(port) - len(tail)] if tail else port[len(head) :]
        if (port.startswith(head) and port.endswith(tail) and index.isdigit()
                and int(index) >= layers):  # fmt: skip
            raise MetadataError(
                f"{GENAI_CONFIG}: 'model.decoder.num_hidden_layers' is {layers} but the graph "
                f"has {what} {port}"
            )


def build_metadata(model_dir: str | os.PathLike, read: GraphReader | None = None) -> dict[str, Any]:
    """The inference_metadata.yaml content of `model_dir` (see the module docstring).

    Every value read from genai_config.json is checked before use: its type, its range (values
    no model can have are refused) and its agreement with the graph. `read(path)` gives a
    decoder file's (GQA nodes, inputs, outputs); the patcher passes its rewritten graphs.
    """
    model_dir = Path(model_dir)
    read = read or read_graph_checked
    config = load_genai_config(model_dir)
    layers = config_int(config, "model.decoder.num_hidden_layers", 1, MAX_LAYERS)
    heads = config_int(config, "model.decoder.num_attention_heads", 1, MAX_HEADS)
    kv_heads = config_int(config, "model.decoder.num_key_value_heads", 1, heads)
    if heads % kv_heads:
        raise MetadataError(
            f"{GENAI_CONFIG}: 'model.decoder.num_attention_heads' ({heads}) must be a multiple "
            f"of 'model.decoder.num_key_value_heads' ({kv_heads})"
        )
    head_dim = config_int(config, "model.decoder.head_size", 1, MAX_HEAD_SIZE)
    context = config_int(config, "model.context_length", 1, MAX_INT32)
    vocab = config_int(config, "model.vocab_size", 1, MAX_INT32)

    nodes_by_file: dict[str, list[onnx.NodeProto]] = {}
    graph_inputs: PortTypes = {}
    graph_outputs: PortTypes = {}
    for file in decoder_files(config):
        path = model_dir / file
        if not path.is_file():
            raise MetadataError(
                f"{file} (named by {GENAI_CONFIG} model.decoder) not found in {model_dir}"
            )
        nodes_by_file[file], file_inputs, file_outputs = read(path)
        graph_inputs |= file_inputs
        graph_outputs |= file_outputs
    kv_layout = model_kv_layout(nodes_by_file)
    all_nodes = [n for nodes in nodes_by_file.values() for n in nodes]
    labelled = [
        (f"{file}: {node_label(n, i)}" if len(nodes_by_file) > 1 else node_label(n, i), n)
        for file, nodes in nodes_by_file.items()
        for i, n in enumerate(nodes)
    ]
    _check_heads_agree(labelled, heads, kv_heads)
    kv_format = _kv_cache_format(labelled, graph_inputs, graph_outputs)

    io: dict[str, Any] = {
        "token_input": config_str(config, "model.decoder.inputs.input_ids"),
        "attention_mask_input": config_str(config, "model.decoder.inputs.attention_mask"),
    }
    if config_value(config, "model.decoder.inputs.position_ids", None) is not None:
        io["position_ids_input"] = config_str(config, "model.decoder.inputs.position_ids")
    io["logits_output"] = config_str(config, "model.decoder.outputs.logits")
    for key, name in io.items():  # the names genai feeds and reads: ports of the graph
        ports = graph_outputs if key == "logits_output" else graph_inputs
        if name not in ports:
            kind = "output" if key == "logits_output" else "input"
            raise MetadataError(
                f"{GENAI_CONFIG}: {key.replace('_', ' ')} {name!r} is not an {kind} of the graph"
            )
    templates = {
        key: config_str(config, f"model.decoder.{key}")
        for key in (
            "inputs.past_key_names", "inputs.past_value_names",
            "outputs.present_key_names", "outputs.present_value_names",
        )
    }  # fmt: skip
    io["kv_inputs"] = expand_kv(
        templates["inputs.past_key_names"], templates["inputs.past_value_names"], layers
    )
    io["kv_outputs"] = expand_kv(
        templates["outputs.present_key_names"], templates["outputs.present_value_names"], layers
    )
    for key, template in templates.items():
        ports = graph_inputs if key.startswith("inputs") else graph_outputs
        _check_layers_agree(template, ports, layers, "port")
    io["kv_inputs"] = _keep_graph_ports(io["kv_inputs"], graph_inputs, "past key/value")
    io["kv_outputs"] = _keep_graph_ports(io["kv_outputs"], graph_outputs, "present key/value")
    io["kv_layout"] = LAYOUT_NAMES[kv_layout]
    shared = config_value(config, "search.past_present_share_buffer", False)
    if not isinstance(shared, bool):
        raise MetadataError(
            f"{GENAI_CONFIG}: 'search.past_present_share_buffer' must be true or false, got "
            f"{json_type(shared)}"
        )
    io["kv_update"] = "shared_buffer" if shared else "append"
    io.update(kv_format)

    attention: dict[str, Any] = {
        "type": ATTENTION_TYPE,
        "num_attention_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
    }
    window = _sliding_window(config, all_nodes, context)
    if window is not None:
        attention["sliding_window"] = window

    eos = config_value(config, "model.eos_token_id")
    eos_ids = eos if isinstance(eos, list) else [eos]
    if not eos_ids or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in eos_ids
    ):
        raise MetadataError(
            f"{GENAI_CONFIG}: 'model.eos_token_id' must be an id or a non-empty list of ids in "
            f"[0, {vocab - 1}] (vocab_size {vocab}), got {json_type(eos)}"
        )
    tokens = {
        "bos_token_id": _token_id(config, "model.bos_token_id", vocab),
        "eos_token_id": [int(t) for t in eos_ids],
        "pad_token_id": _token_id(config, "model.pad_token_id", vocab),
    }
    return {
        "model": {
            "max_sequence_length": context,
            "vocab_size": vocab,
            "io": io,
            "attention": attention,
        },
        "tokens": tokens,
    }


def dump_metadata(data: dict[str, Any]) -> str:
    header = "# Generated by ort_kvlayout (gen_inference_metadata) from genai_config.json\n"
    return header + yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def write_metadata(data: dict[str, Any], path: str | os.PathLike, force: bool = False) -> Path:
    """Writes `data` as YAML; refuses an existing file unless force. Returns the path."""
    path = Path(path)
    if path.exists() and not force:
        raise FileExistsError(f"{path} exists; pass --force to overwrite it")
    if path.exists() and not path.is_file():  # a FIFO or a device would be replaced, not written
        raise MetadataError(f"{path} exists and is not a regular file; name a file")
    text = dump_metadata(data)
    if yaml.safe_load(text) != data:  # the file must load back to the same data
        raise MetadataError("inference metadata does not round-trip through YAML")
    # a temporary file of its own (O_EXCL: never through a link or over a file already there)
    fd, name = tempfile.mkstemp(prefix=f".{path.name[:32]}.", suffix=".tmp", dir=path.parent)
    tmp = Path(name)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes it 0600; an ordinary file
        os.replace(tmp, path)
    except BaseException:  # an error or an interrupt leaves no partial file
        tmp.unlink(missing_ok=True)
        raise
    return path


def current_umask() -> int:
    """The process's umask (read by setting it and setting it back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def input_files(model_dir: str | os.PathLike) -> set[Path]:
    """The files build_metadata reads or relies on (genai_config.json, the decoder graphs and
    their external data), resolved: a tool must never write over one of them."""
    model_dir = Path(model_dir)
    files = {(model_dir / GENAI_CONFIG).resolve()}
    try:
        decoders = decoder_files(load_genai_config(model_dir))
    except MetadataError:
        return files
    for file in decoders:
        path = (model_dir / file).resolve()
        files.add(path)
        try:
            model = load_model(path)
        except GraphError:
            continue
        for tensor in external_tensors(model):
            location = {e.key: e.value for e in tensor.external_data}.get("location")
            if location:
                files.add((path.parent / location).resolve())
    return files
