"""inference_metadata.yaml from a model directory's genai_config.json and its GQA nodes.

    from ort_kvlayout.metadata import build_metadata, write_metadata
    data = build_metadata("smollm2-seq-major")
    write_metadata(data, "smollm2-seq-major/inference_metadata.yaml")

Schema (the one the onnx-genai engine reads; DESIGN section 5), every value derived from
genai_config.json except model.io.kv_layout, which comes from the model's GroupQueryAttention
nodes (all must agree):

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
      attention:
        type: group_query_attention
        num_attention_heads / num_kv_heads / head_dim <- model.decoder.*
        sliding_window: decoder.sliding_window.window_size, else the nodes' local_window_size
                        (only when the model has a window)
    tokens: {bos_token_id, eos_token_id: [ids], pad_token_id}
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import onnx
import yaml

from .graph import attribute_problems, node_kv_layout, node_label, read_graph
from .layout import LAYOUT_NAMES

GENAI_CONFIG = "genai_config.json"
METADATA_FILE = "inference_metadata.yaml"
ATTENTION_TYPE = "group_query_attention"
_MISSING = object()


class MetadataError(ValueError):
    """genai_config.json or the model does not determine the metadata; names what is missing."""


def load_genai_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(model_dir) / GENAI_CONFIG
    if not path.is_file():
        raise MetadataError(f"{GENAI_CONFIG} not found in {Path(model_dir)}")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise MetadataError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise MetadataError(f"{path}: expected a JSON object at the top level")
    return config


def _get(config: dict[str, Any], dotted: str, default: Any = _MISSING) -> Any:
    """config["a"]["b"]... for "a.b..."; a missing key raises MetadataError naming key and place."""
    node: Any = config
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, dict) or part not in node:
            if default is not _MISSING:
                return default
            where = ".".join(parts[:i]) or "the top level"
            raise MetadataError(
                f"{GENAI_CONFIG}: required key '{dotted}' is missing "
                f"(expected '{part}' under {where})"
            )
        node = node[part]
    return node


def _int(config: dict[str, Any], dotted: str) -> int:
    value = _get(config, dotted)
    if isinstance(value, bool) or not isinstance(value, int):
        raise MetadataError(f"{GENAI_CONFIG}: '{dotted}' must be an integer, got {value!r}")
    return value


def _str(config: dict[str, Any], dotted: str) -> str:
    value = _get(config, dotted)
    if not isinstance(value, str) or not value:
        raise MetadataError(f"{GENAI_CONFIG}: '{dotted}' must be a non-empty string, got {value!r}")
    return value


def expand_kv(key_template: str, value_template: str, layers: int) -> list[str]:
    """[k0, v0, k1, v1, ...] from two %d templates."""
    for template in (key_template, value_template):
        if "%d" not in template:
            raise MetadataError(f"{GENAI_CONFIG}: KV name template {template!r} has no %d")
    names = []
    for layer in range(layers):
        names += [key_template.replace("%d", str(layer)), value_template.replace("%d", str(layer))]
    return names


def decoder_files(config: dict[str, Any]) -> list[str]:
    """The ONNX files of the decoder: decoder.filename, or every decoder.pipeline stage's file."""
    decoder = _get(config, "model.decoder")
    files = []
    if isinstance(decoder.get("filename"), str):
        files.append(decoder["filename"])
    for stage in decoder.get("pipeline", []) or []:
        for spec in stage.values() if isinstance(stage, dict) else []:
            if isinstance(spec, dict) and isinstance(spec.get("filename"), str):
                files.append(spec["filename"])
    if not files:
        raise MetadataError(f"{GENAI_CONFIG}: required key 'model.decoder.filename' is missing")
    return files


def read_gqa_nodes(model_path: str | os.PathLike) -> list[onnx.NodeProto]:
    """The GroupQueryAttention nodes of one ONNX file, read without its external data."""
    return read_graph(model_path)[0]


def _keep_graph_ports(names: list[str], ports: set[str], what: str) -> list[str]:
    """Drops expanded KV names of layers without a KV cache (hybrid models: conv / linear layers).

    All present: unchanged. None present: an error, the templates do not match the graph.
    """
    kept = [n for n in names if n in ports]
    if not kept:
        raise MetadataError(
            f"{GENAI_CONFIG}: none of the {what} names ({names[0]}, ...) is a port of the graph"
        )
    return kept


def model_kv_layout(nodes_by_file: dict[str, list[onnx.NodeProto]]) -> int:
    """The one KV layout all GQA nodes use; an error listing the nodes when they disagree."""
    by_layout: dict[int, list[str]] = {}
    refused: list[str] = []
    for file, nodes in nodes_by_file.items():
        for i, node in enumerate(nodes):
            label = node_label(node, i)
            if len(nodes_by_file) > 1:
                label = f"{file}: {label}"
            problems = attribute_problems(node)  # read as the op reads them
            if problems:
                refused.append(f"  {label}: " + "; ".join(problems))
                continue
            by_layout.setdefault(node_kv_layout(node, label), []).append(label)
    if refused:
        raise MetadataError(
            f"{len(refused)} GroupQueryAttention node(s) have attributes the op refuses:\n"
            + "\n".join(refused)
        )
    if not by_layout:
        files = ", ".join(nodes_by_file)
        raise MetadataError(f"no GroupQueryAttention node in {files}: kv_layout cannot be read")
    if len(by_layout) > 1:
        lines = [
            f"  {LAYOUT_NAMES[layout]} ({len(names)} node(s)): " + ", ".join(names)
            for layout, names in sorted(by_layout.items())
        ]
        raise MetadataError("GroupQueryAttention nodes disagree on kv_layout:\n" + "\n".join(lines))
    return next(iter(by_layout))


def _sliding_window(config: dict[str, Any], nodes: list[onnx.NodeProto]) -> int | None:
    window = _get(config, "model.decoder.sliding_window.window_size", None)
    if window is not None:
        return int(window)
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


def build_metadata(model_dir: str | os.PathLike) -> dict[str, Any]:
    """The inference_metadata.yaml content of `model_dir` (see the module docstring)."""
    model_dir = Path(model_dir)
    config = load_genai_config(model_dir)
    layers = _int(config, "model.decoder.num_hidden_layers")

    nodes_by_file: dict[str, list[onnx.NodeProto]] = {}
    graph_inputs: set[str] = set()
    graph_outputs: set[str] = set()
    for file in decoder_files(config):
        path = model_dir / file
        if not path.is_file():
            raise MetadataError(
                f"{file} (named by {GENAI_CONFIG} model.decoder) not found in {model_dir}"
            )
        nodes_by_file[file], file_inputs, file_outputs = read_graph(path)
        graph_inputs |= file_inputs
        graph_outputs |= file_outputs
    kv_layout = model_kv_layout(nodes_by_file)
    all_nodes = [n for nodes in nodes_by_file.values() for n in nodes]

    io: dict[str, Any] = {
        "token_input": _str(config, "model.decoder.inputs.input_ids"),
        "attention_mask_input": _str(config, "model.decoder.inputs.attention_mask"),
    }
    position_ids = _get(config, "model.decoder.inputs.position_ids", None)
    if position_ids:
        io["position_ids_input"] = position_ids
    io["logits_output"] = _str(config, "model.decoder.outputs.logits")
    io["kv_inputs"] = expand_kv(
        _str(config, "model.decoder.inputs.past_key_names"),
        _str(config, "model.decoder.inputs.past_value_names"),
        layers,
    )
    io["kv_outputs"] = expand_kv(
        _str(config, "model.decoder.outputs.present_key_names"),
        _str(config, "model.decoder.outputs.present_value_names"),
        layers,
    )
    io["kv_inputs"] = _keep_graph_ports(io["kv_inputs"], graph_inputs, "past key/value")
    io["kv_outputs"] = _keep_graph_ports(io["kv_outputs"], graph_outputs, "present key/value")
    io["kv_layout"] = LAYOUT_NAMES[kv_layout]
    shared = _get(config, "search.past_present_share_buffer", False)
    io["kv_update"] = "shared_buffer" if shared else "append"

    attention: dict[str, Any] = {
        "type": ATTENTION_TYPE,
        "num_attention_heads": _int(config, "model.decoder.num_attention_heads"),
        "num_kv_heads": _int(config, "model.decoder.num_key_value_heads"),
        "head_dim": _int(config, "model.decoder.head_size"),
    }
    window = _sliding_window(config, all_nodes)
    if window is not None:
        attention["sliding_window"] = window

    eos = _get(config, "model.eos_token_id")
    eos_ids = eos if isinstance(eos, list) else [eos]
    if not eos_ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in eos_ids):
        raise MetadataError(f"{GENAI_CONFIG}: 'model.eos_token_id' must be an id or a list of ids")
    tokens = {
        "bos_token_id": _get(config, "model.bos_token_id"),
        "eos_token_id": [int(t) for t in eos_ids],
        "pad_token_id": _get(config, "model.pad_token_id"),
    }
    return {
        "model": {
            "max_sequence_length": _int(config, "model.context_length"),
            "vocab_size": _int(config, "model.vocab_size"),
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
    text = dump_metadata(data)
    if yaml.safe_load(text) != data:  # the file must load back to the same data
        raise MetadataError("inference metadata does not round-trip through YAML")
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def load_metadata(path: str | os.PathLike) -> dict[str, Any]:
    return yaml.safe_load(Path(path).read_text())
