"""inference_metadata.yaml generation (ort_kvlayout.tools.metadata, gen_inference_metadata)."""

from __future__ import annotations

import json
import os

import pytest
import yaml
from ort_kvlayout.model.config import MetadataError, load_metadata
from ort_kvlayout.tools.cli import metadata_main
from ort_kvlayout.tools.metadata import build_metadata, dump_metadata, write_metadata
from synthetic_models import Variant, make_model_dir


def test_values_from_genai_config(tmp_path):
    src = make_model_dir(tmp_path / "model", Variant(layers=3))
    data = build_metadata(src)
    assert data == {
        "model": {
            "max_sequence_length": 256,
            "vocab_size": 64,
            "io": {
                "token_input": "input_ids",
                "attention_mask_input": "attention_mask",
                "logits_output": "logits",
                "kv_inputs": [
                    f"past_key_values.{i}.{kv}" for i in range(3) for kv in ("key", "value")
                ],
                "kv_outputs": [f"present.{i}.{kv}" for i in range(3) for kv in ("key", "value")],
                "kv_layout": "head_major_bnsh",
                "kv_update": "shared_buffer",
                "kv_dtype": "float32",
                "kv_cache_bit_width": 32,
                "kv_quant_scheme": "none",
            },
            "attention": {
                "type": "group_query_attention",
                "num_attention_heads": 4,
                "num_kv_heads": 2,
                "head_dim": 32,
            },
        },
        "tokens": {"bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": 0},
    }
    assert yaml.safe_load(dump_metadata(data)) == data


@pytest.mark.parametrize("layout", [0, 1])
def test_kv_layout_from_our_nodes(tmp_path, layout):
    src = make_model_dir(tmp_path / "m", Variant(per_layer_layout=[layout, layout]))
    expected = ["head_major_bnsh", "seq_major_bsnh"][layout]
    assert build_metadata(src)["model"]["io"]["kv_layout"] == expected


def test_disagreeing_nodes_listed(tmp_path):
    src = make_model_dir(tmp_path / "m", Variant(layers=3, per_layer_layout=[1, 0, 1]))
    with pytest.raises(MetadataError) as err:
        build_metadata(src)
    text = str(err.value)
    assert "disagree" in text
    assert "head_major_bnsh (1 node(s)): /model/layers.1/attn/GroupQueryAttention" in text
    assert "/model/layers.0/attn/GroupQueryAttention" in text
    assert "/model/layers.2/attn/GroupQueryAttention" in text


def test_sliding_window_from_config_and_from_nodes(tmp_path):
    cfg = make_model_dir(tmp_path / "a", Variant(local_window_size=8, sliding_window_cache=1))
    assert build_metadata(cfg)["model"]["attention"]["sliding_window"] == 8
    nodes = make_model_dir(tmp_path / "b", Variant(local_window_size=4))
    assert build_metadata(nodes)["model"]["attention"]["sliding_window"] == 4


def test_append_when_not_shared_and_scalar_eos(tmp_path):
    src = make_model_dir(tmp_path / "m")
    config = json.loads((src / "genai_config.json").read_text())
    config["search"]["past_present_share_buffer"] = False
    config["model"]["eos_token_id"] = 2
    (src / "genai_config.json").write_text(json.dumps(config))
    data = build_metadata(src)
    assert data["model"]["io"]["kv_update"] == "append"
    assert data["tokens"]["eos_token_id"] == [2]


def test_null_bos_and_pad_are_kept_as_null(tmp_path):
    """A model may have no BOS or padding token: null is written as null, not refused."""
    src = make_model_dir(tmp_path / "m")
    config = json.loads((src / "genai_config.json").read_text())
    config["model"]["bos_token_id"] = None
    config["model"]["pad_token_id"] = None
    (src / "genai_config.json").write_text(json.dumps(config))
    tokens = build_metadata(src)["tokens"]
    assert tokens["bos_token_id"] is None and tokens["pad_token_id"] is None


@pytest.mark.parametrize(
    "key",
    [
        "model.context_length",
        "model.vocab_size",
        "model.eos_token_id",
        "model.bos_token_id",
        "model.pad_token_id",
        "model.decoder.num_hidden_layers",
        "model.decoder.num_attention_heads",
        "model.decoder.num_key_value_heads",
        "model.decoder.head_size",
        "model.decoder.inputs.input_ids",
        "model.decoder.inputs.attention_mask",
        "model.decoder.inputs.past_key_names",
        "model.decoder.outputs.logits",
        "model.decoder.outputs.present_value_names",
        "model.decoder.filename",
    ],
)
def test_missing_key_named(tmp_path, key):
    src = make_model_dir(tmp_path / "m", Variant(drop_config_keys=[key]))
    with pytest.raises(MetadataError) as err:
        build_metadata(src)
    assert f"'{key}'" in str(err.value)
    parent, last = key.rsplit(".", 1)
    assert f"'{last}' under {parent}" in str(err.value) or key == "model.decoder.filename"


def test_no_gqa_node(tmp_path):
    src = make_model_dir(tmp_path / "m", Variant(no_gqa=True))
    with pytest.raises(MetadataError, match="no GroupQueryAttention node in model.onnx"):
        build_metadata(src)


def test_no_genai_config(tmp_path):
    src = make_model_dir(tmp_path / "m")
    (src / "genai_config.json").unlink()
    with pytest.raises(MetadataError, match="genai_config.json not found"):
        build_metadata(src)


def test_kv_names_not_in_graph(tmp_path):
    src = make_model_dir(tmp_path / "m")
    config = json.loads((src / "genai_config.json").read_text())
    config["model"]["decoder"]["inputs"]["past_key_names"] = "past.%d.k"
    config["model"]["decoder"]["inputs"]["past_value_names"] = "past.%d.v"
    (src / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(MetadataError, match="past.0.k"):
        build_metadata(src)


def test_a_layer_with_one_of_its_two_caches_is_refused(tmp_path):
    src = make_model_dir(tmp_path / "m")
    config = json.loads((src / "genai_config.json").read_text())
    config["model"]["decoder"]["inputs"]["past_key_names"] = "foo.%d.key"  # a typo: keys lost
    (src / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(MetadataError, match="layer 0's past key/value name 'foo.0.key'"):
        build_metadata(src)


@pytest.mark.parametrize(
    ("where", "key", "message"),
    [
        ("inputs", "input_ids", "token input 'nope' is not an input of the graph"),
        ("inputs", "attention_mask", "attention mask input 'nope' is not an input of the graph"),
        ("outputs", "logits", "logits output 'nope' is not an output of the graph"),
    ],
)
def test_io_names_must_be_ports_of_the_graph(tmp_path, where, key, message):
    src = make_model_dir(tmp_path / "m")
    config = json.loads((src / "genai_config.json").read_text())
    config["model"]["decoder"][where][key] = "nope"
    (src / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(MetadataError, match=message):
        build_metadata(src)


def test_write_refuses_overwrite(tmp_path):
    src = make_model_dir(tmp_path / "m")
    data = build_metadata(src)
    path = write_metadata(data, tmp_path / "meta.yaml")
    assert load_metadata(path) == data
    with pytest.raises(FileExistsError, match="--force"):
        write_metadata(data, path)
    write_metadata(data, path, force=True)
    assert load_metadata(path) == data


def test_write_never_goes_through_a_file_at_a_temporary_name(tmp_path):
    src = make_model_dir(tmp_path / "m")
    data = build_metadata(src)
    victim = tmp_path / "victim.txt"
    victim.write_text("victim")
    (tmp_path / ".meta.yaml.tmp").symlink_to(victim)  # the name an earlier version used
    path = write_metadata(data, tmp_path / "meta.yaml")
    assert victim.read_text() == "victim" and not path.is_symlink()
    assert load_metadata(path) == data
    assert sorted(p.name for p in tmp_path.iterdir()) == [".meta.yaml.tmp", "m", "meta.yaml",
                                                          "victim.txt"]  # fmt: skip


def test_write_refuses_a_target_that_is_not_a_regular_file(tmp_path):
    src = make_model_dir(tmp_path / "m")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(MetadataError, match="not a regular file"):
        write_metadata(build_metadata(src), fifo, force=True)
    assert fifo.is_fifo()


def test_cli(tmp_path, capsys):
    src = make_model_dir(tmp_path / "m")
    assert metadata_main([str(src)]) == 0
    written = src / "inference_metadata.yaml"
    assert load_metadata(written) == build_metadata(src)
    assert metadata_main([str(src)]) == 2
    assert "--force" in capsys.readouterr().err
    assert metadata_main([str(src), "--force"]) == 0
    capsys.readouterr()
    assert metadata_main([str(src), "--stdout"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == build_metadata(src)
    other = tmp_path / "other.yaml"
    assert metadata_main([str(src), "--output", str(other)]) == 0
    assert load_metadata(other) == build_metadata(src)
    with pytest.raises(SystemExit):
        metadata_main([str(src), "--stdout", "--output", str(other)])
    broken = make_model_dir(tmp_path / "b", Variant(drop_config_keys=["model.vocab_size"]))
    assert metadata_main([str(broken)]) == 2
    assert "model.vocab_size" in capsys.readouterr().err
    assert not (broken / "inference_metadata.yaml").exists()
