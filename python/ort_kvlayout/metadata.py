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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx
import yaml

from .graph import (
    GraphError,
    attribute_problems,
    check_external_data,
    external_tensors,
    graph_facts,
    load_model,
    node_kv_layout,
    node_label,
)
from .layout import LAYOUT_NAMES

GENAI_CONFIG = "genai_config.json"
METADATA_FILE = "inference_metadata.yaml"
ATTENTION_TYPE = "group_query_attention"
_MISSING = object()

# Bounds no real model reaches; values beyond them are refused, never used as sizes or counts.
MAX_CONFIG_BYTES = 16 << 20  # genai_config.json files are a few KiB
MAX_LAYERS = 1 << 16
MAX_HEADS = 1 << 16
MAX_HEAD_SIZE = 1 << 16
MAX_INT32 = (1 << 31) - 1  # context length, vocabulary: int32 in ORT and onnxruntime-genai


class MetadataError(ValueError):
    """genai_config.json or the model does not determine the metadata; names what is missing."""


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type (for messages)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {value!r}"
    return "an array" if isinstance(value, list) else "an object"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def load_genai_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    """genai_config.json as a dict; MetadataError (one line naming the file) when it is missing,
    absurdly large, not UTF-8, not JSON (NaN/Infinity included) or not an object."""
    path = Path(model_dir) / GENAI_CONFIG
    if not path.is_file():
        raise MetadataError(f"{GENAI_CONFIG} not found in {Path(model_dir)}")
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise MetadataError(f"{path}: {size} bytes, not a genai_config.json (limit 16 MiB)")
        config = json.loads(path.read_bytes().decode("utf-8"), parse_constant=_no_constant)
    except OSError as exc:
        raise MetadataError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    except UnicodeDecodeError as exc:
        raise MetadataError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from exc
    except json.JSONDecodeError as exc:
        raise MetadataError(
            f"{path}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from exc
    except ValueError as exc:  # NaN / Infinity
        raise MetadataError(f"{path}: not valid JSON ({exc})") from exc
    except RecursionError as exc:
        raise MetadataError(f"{path}: not a genai_config.json (JSON nested too deeply)") from exc
    if not isinstance(config, dict):
        raise MetadataError(f"{path}: the top level must be an object, got {json_type(config)}")
    return config


def _get(config: dict[str, Any], dotted: str, default: Any = _MISSING) -> Any:
    """config["a"]["b"]... for "a.b..."; a missing key raises MetadataError naming key and place,
    a null / array / scalar where an object belongs too (also with a default)."""
    node: Any = config
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, dict):
            where = ".".join(parts[:i])
            raise MetadataError(
                f"{GENAI_CONFIG}: '{where}' must be an object, got {json_type(node)}"
            )
        if part not in node:
            if default is not _MISSING:
                return default
            where = ".".join(parts[:i]) or "the top level"
            raise MetadataError(
                f"{GENAI_CONFIG}: required key '{dotted}' is missing "
                f"(expected '{part}' under {where})"
            )
        node = node[part]
    return node


def _int(config: dict[str, Any], dotted: str, lo: int = 0, hi: int = MAX_INT32) -> int:
    """An integer in [lo, hi] (a value outside is one no model has)."""
    value = _get(config, dotted)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise MetadataError(
            f"{GENAI_CONFIG}: '{dotted}' must be an integer in [{lo}, {hi}], got {json_type(value)}"
        )
    return value


def _str(config: dict[str, Any], dotted: str) -> str:
    value = _get(config, dotted)
    if not isinstance(value, str) or not value:
        raise MetadataError(
            f"{GENAI_CONFIG}: '{dotted}' must be a non-empty string, got {json_type(value)}"
        )
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
    if not isinstance(decoder, dict):
        raise MetadataError(
            f"{GENAI_CONFIG}: 'model.decoder' must be an object, got {json_type(decoder)}"
        )
    files = []
    if isinstance(decoder.get("filename"), str):
        files.append(decoder["filename"])
    pipeline = decoder.get("pipeline") or []
    if not isinstance(pipeline, list):
        raise MetadataError(
            f"{GENAI_CONFIG}: 'model.decoder.pipeline' must be an array, got {json_type(pipeline)}"
        )
    for stage in pipeline:
        for spec in stage.values() if isinstance(stage, dict) else []:
            if isinstance(spec, dict) and isinstance(spec.get("filename"), str):
                files.append(spec["filename"])
    if not files:
        raise MetadataError(f"{GENAI_CONFIG}: required key 'model.decoder.filename' is missing")
    for file in files:
        if not file or Path(file).is_absolute() or ".." in Path(file).parts:
            raise MetadataError(
                f"{GENAI_CONFIG}: decoder file {file!r} must be a relative path inside the "
                "model directory"
            )
    return files


def read_gqa_nodes(model_path: str | os.PathLike) -> list[onnx.NodeProto]:
    """The GroupQueryAttention nodes of one ONNX file, read without its external data."""
    return _read_checked(Path(model_path))[0]


def _read_checked(path: Path) -> tuple[list[onnx.NodeProto], set[str], set[str]]:
    """graph_facts of one ONNX file whose external-data references are all servable."""
    try:
        model = load_model(path)
        check_external_data(model, path)
    except GraphError as exc:
        raise MetadataError(str(exc)) from exc
    return graph_facts(model)


def _keep_graph_ports(names: list[str], ports: set[str], what: str) -> list[str]:
    """Drops expanded KV names of layers without a KV cache (hybrid models: conv / linear layers).

    All present: unchanged. None present: an error, the templates do not match the graph.
    """
    kept = [n for n in names if n in ports]
    if not kept or not names:
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


def _sliding_window(
    config: dict[str, Any], nodes: list[onnx.NodeProto], context: int
) -> int | None:
    key = "model.decoder.sliding_window"  # null: absent
    if _get(config, key, None) is not None and _get(config, f"{key}.window_size", None) is not None:
        return _int(config, f"{key}.window_size", 1, context)
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


GraphReader = Callable[[Path], tuple[list[onnx.NodeProto], set[str], set[str]]]


def _token_id(config: dict[str, Any], dotted: str, vocab: int) -> int | None:
    """A token id in [0, vocab), or null: a model may have no BOS or no padding token (the key
    itself stays required, as before)."""
    if _get(config, dotted) is None:
        return None
    return _int(config, dotted, 0, vocab - 1)


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


def _check_layers_agree(template: str, ports: set[str], layers: int, what: str) -> None:
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
    read = read or _read_checked
    config = load_genai_config(model_dir)
    layers = _int(config, "model.decoder.num_hidden_layers", 1, MAX_LAYERS)
    heads = _int(config, "model.decoder.num_attention_heads", 1, MAX_HEADS)
    kv_heads = _int(config, "model.decoder.num_key_value_heads", 1, heads)
    if heads % kv_heads:
        raise MetadataError(
            f"{GENAI_CONFIG}: 'model.decoder.num_attention_heads' ({heads}) must be a multiple "
            f"of 'model.decoder.num_key_value_heads' ({kv_heads})"
        )
    head_dim = _int(config, "model.decoder.head_size", 1, MAX_HEAD_SIZE)
    context = _int(config, "model.context_length", 1, MAX_INT32)
    vocab = _int(config, "model.vocab_size", 1, MAX_INT32)

    nodes_by_file: dict[str, list[onnx.NodeProto]] = {}
    graph_inputs: set[str] = set()
    graph_outputs: set[str] = set()
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
    _check_heads_agree(
        [(node_label(n, i), n) for nodes in nodes_by_file.values() for i, n in enumerate(nodes)],
        heads,
        kv_heads,
    )

    io: dict[str, Any] = {
        "token_input": _str(config, "model.decoder.inputs.input_ids"),
        "attention_mask_input": _str(config, "model.decoder.inputs.attention_mask"),
    }
    if _get(config, "model.decoder.inputs.position_ids", None) is not None:
        io["position_ids_input"] = _str(config, "model.decoder.inputs.position_ids")
    io["logits_output"] = _str(config, "model.decoder.outputs.logits")
    templates = {
        key: _str(config, f"model.decoder.{key}")
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
    shared = _get(config, "search.past_present_share_buffer", False)
    if not isinstance(shared, bool):
        raise MetadataError(
            f"{GENAI_CONFIG}: 'search.past_present_share_buffer' must be true or false, got "
            f"{json_type(shared)}"
        )
    io["kv_update"] = "shared_buffer" if shared else "append"

    attention: dict[str, Any] = {
        "type": ATTENTION_TYPE,
        "num_attention_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
    }
    window = _sliding_window(config, all_nodes, context)
    if window is not None:
        attention["sliding_window"] = window

    eos = _get(config, "model.eos_token_id")
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
    text = dump_metadata(data)
    if yaml.safe_load(text) != data:  # the file must load back to the same data
        raise MetadataError("inference metadata does not round-trip through YAML")
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:  # an error or an interrupt leaves no partial file
        tmp.unlink(missing_ok=True)
        raise
    return path


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


def load_metadata(path: str | os.PathLike) -> dict[str, Any]:
    return yaml.safe_load(Path(path).read_text())
