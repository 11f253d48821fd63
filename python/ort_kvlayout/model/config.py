"""A model directory's genai_config.json and inference_metadata.yaml, read and checked, and the
one KV layout of its GroupQueryAttention nodes: what the tools (metadata, patch) and the runtime
(model_spec) both read.

    from ort_kvlayout.model.config import load_genai_config, decoder_files
    config = load_genai_config("smollm2-seq-major")   # MetadataError names file and key
    decoder_files(config)                             # ["model.onnx"]

Every reader raises MetadataError, one message naming the file and the key or rule.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import onnx
import yaml

from ..op.layout import LAYOUT_NAMES
from .graph import (
    GraphError,
    PortTypes,
    attribute_problems,
    check_external_data,
    graph_facts,
    load_model,
    node_kv_layout,
    node_label,
)

GENAI_CONFIG = "genai_config.json"
METADATA_FILE = "inference_metadata.yaml"
_MISSING = object()

# Bounds no real model reaches; values beyond them are refused, never used as sizes or counts.
MAX_CONFIG_BYTES = 16 << 20  # genai_config.json files are a few KiB
MAX_INT32 = (1 << 31) - 1  # context length, vocabulary: int32 in ORT and onnxruntime-genai


# genai_config.json keys (model.decoder.inputs / .outputs) of a PER_TOKEN model's scale caches,
# onnxruntime-genai 0.18's names, and the templates patch_kv_layout --kv-quant writes.
SCALE_KEYS = {
    "past_key_scale_names": "past_key_scale.%d",
    "past_value_scale_names": "past_value_scale.%d",
    "present_key_scale_names": "present_key_scale.%d",
    "present_value_scale_names": "present_value_scale.%d",
}


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


def config_value(config: dict[str, Any], dotted: str, default: Any = _MISSING) -> Any:
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


def config_int(config: dict[str, Any], dotted: str, lo: int = 0, hi: int = MAX_INT32) -> int:
    """An integer in [lo, hi] (a value outside is one no model has)."""
    value = config_value(config, dotted)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise MetadataError(
            f"{GENAI_CONFIG}: '{dotted}' must be an integer in [{lo}, {hi}], got {json_type(value)}"
        )
    return value


def config_str(config: dict[str, Any], dotted: str) -> str:
    value = config_value(config, dotted)
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
    decoder = config_value(config, "model.decoder")
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
    return read_graph_checked(Path(model_path))[0]


def read_graph_checked(path: Path) -> tuple[list[onnx.NodeProto], PortTypes, PortTypes]:
    """graph_facts of one ONNX file whose external-data references are all servable."""
    try:
        model = load_model(path)
        check_external_data(model, path)
    except GraphError as exc:
        raise MetadataError(str(exc)) from exc
    return graph_facts(model)


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


def load_metadata(path: str | os.PathLike) -> dict[str, Any]:
    return yaml.safe_load(Path(path).read_text())
