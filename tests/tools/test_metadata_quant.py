"""inference_metadata.yaml's KV cache format: kv_dtype, kv_cache_bit_width, kv_quant_scheme."""

from __future__ import annotations

import onnx
import pytest
from ort_kvlayout.model.config import MetadataError, load_metadata
from ort_kvlayout.tools.metadata import build_metadata, write_metadata
from ort_kvlayout.tools.patch import patch_model_dir
from synthetic_models import Variant, make_model_dir

CASES = {
    "float32": (Variant(), ("float32", 32, "none")),
    "float16": (Variant(float16=True), ("float16", 16, "none")),
    "int8_per_tensor": (Variant(kv_bits=8), ("int8", 8, "per_tensor")),
    "int8_per_channel": (Variant(kv_bits=8, kv_scheme="PER_CHANNEL"), ("int8", 8, "per_channel")),
    "int4_per_tensor": (Variant(kv_bits=4), ("uint8_packed_int4", 4, "per_tensor")),
    "int4_per_channel": (
        Variant(kv_bits=4, kv_scheme="per_channel"),  # read case-insensitively, as the op does
        ("uint8_packed_int4", 4, "per_channel"),
    ),
}


def _format(data: dict) -> tuple:
    io = data["model"]["io"]
    return io["kv_dtype"], io["kv_cache_bit_width"], io["kv_quant_scheme"]


@pytest.mark.parametrize("name", CASES)
def test_cache_format_reported_and_round_trips(tmp_path, name):
    variant, expected = CASES[name]
    src = make_model_dir(tmp_path / "model", variant)
    data = build_metadata(src)
    assert _format(data) == expected
    assert data["model"]["io"]["kv_update"] == ("append" if variant.kv_bits else "shared_buffer")
    path = write_metadata(data, tmp_path / "inference_metadata.yaml")
    assert load_metadata(path) == data


@pytest.mark.parametrize("name", ["int8_per_channel", "int4_per_tensor"])
def test_patched_quantized_model_metadata(tmp_path, name):
    variant, expected = CASES[name]
    src = make_model_dir(tmp_path / "model", variant)
    out = patch_model_dir(src, tmp_path / "out", layout=1, library=None).out_dir
    data = load_metadata(out / "inference_metadata.yaml")
    assert _format(data) == expected and data["model"]["io"]["kv_layout"] == "seq_major_bsnh"
    assert data == build_metadata(out)


def test_disagreeing_cache_formats_listed(tmp_path):
    src = make_model_dir(tmp_path / "model", Variant(layers=3, kv_bits=8))
    path = src / "model.onnx"
    model = onnx.load(str(path))
    gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    for attr in gqa[1].attribute:
        if attr.name in ("k_quant_type", "v_quant_type"):
            attr.s = b"PER_CHANNEL"
    onnx.save(model, str(path))
    with pytest.raises(MetadataError) as err:
        build_metadata(src)
    text = str(err.value)
    assert "disagree on the KV cache format" in text
    assert (
        "kv_quant_scheme=per_channel (1 node(s)): /model/layers.1/attn/GroupQueryAttention" in text
    )
    assert "/model/layers.0/attn/GroupQueryAttention, /model/layers.2/attn/" in text
