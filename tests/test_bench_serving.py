"""bench/bench_serving.py without a GPU: the named workloads' distributions, the paged model's
block pool at an equal budget, and one small end-to-end run (a tiny random-weight Llama shape
built by the builder, through the engine and og.Engine on the CPU)."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from bench_util import load_bench

bench = load_bench("bench_serving", register=True)


def args_for(*argv: str) -> argparse.Namespace:
    ns = argparse.Namespace(
        seed=0, num_requests=200, dataset="random", input_len=128, output_len=64,
        range_ratio=0.5, request_rate=float("inf"), input_range=None, output_range=None,
    )  # fmt: skip
    for flag, value in zip(argv[::2], argv[1::2]):
        setattr(ns, flag.removeprefix("--").replace("-", "_"), value)
    return ns


def test_the_long_context_mix():
    items = bench.workload(args_for("--dataset", "long"), vocab=128256, context=33792)
    ins = np.array([len(i.prompt) for i in items])
    outs = np.array([i.output_len for i in items])
    assert ins.min() >= 8192 and ins.max() <= 32768 and ins.max() > 30000 and ins.min() < 10000
    assert outs.min() >= 128 and outs.max() <= 512
    assert all(len(i.prompt) + i.output_len <= 33792 for i in items)
    again = bench.workload(args_for("--dataset", "long"), vocab=128256, context=33792)
    assert [i.prompt[:4] for i in again] == [i.prompt[:4] for i in items]  # seeded
    # Clipped to a smaller context (SmolLM2's 8k): prompt + output stays inside it.
    small = bench.workload(args_for("--dataset", "long"), vocab=49152, context=8192)
    assert all(len(i.prompt) + i.output_len <= 8192 for i in small)


def test_ranges_override_a_named_workload_and_poisson_arrivals():
    ns = args_for("--dataset", "chat", "--input-range", (10, 20), "--request-rate", 4.0)
    items = bench.workload(ns, vocab=1000, context=4096)
    assert all(10 <= len(i.prompt) <= 20 and 64 <= i.output_len <= 512 for i in items)
    gaps = np.diff([i.arrival for i in items])
    assert items[0].arrival == 0 and (gaps >= 0).all() and 0.15 < gaps.mean() < 0.35
    with pytest.raises(argparse.ArgumentTypeError):
        bench.int_pair("20,10")


def test_the_paged_pool_is_pinned_to_the_budget(tmp_path):
    model = tmp_path / "paged"
    model.mkdir()
    config = {
        "model": {"decoder": {"num_hidden_layers": 16, "num_key_value_heads": 8, "head_size": 64}},
        "engine": {"dynamic_batching": {"block_size": 256, "max_batch_size": 256,
                                        "gpu_utilization_factor": 0.6}},
    }  # fmt: skip
    (model / "genai_config.json").write_text(json.dumps(config))
    (model / "model.onnx").write_bytes(b"onnx")
    token = 16 * 2 * 8 * 64 * 2  # 32 KiB a token, fp16
    assert bench.genai_kv_token_bytes(model) == token
    out, pool = bench.paged_with_budget(model, 10 << 30, 64, tmp_path / "run")
    batching = json.loads((out / "genai_config.json").read_text())["engine"]["dynamic_batching"]
    assert batching["num_blocks"] == (10 << 30) // (256 * token) == 1280
    assert "gpu_utilization_factor" not in batching and batching["max_batch_size"] == 64
    assert pool == 1280 * 256 * token <= 10 << 30
    assert (out / "model.onnx").resolve() == (model / "model.onnx").resolve()
    out, pool = bench.paged_with_budget(model, None, 8, tmp_path / "run2")
    assert pool is None
    batching = json.loads((out / "genai_config.json").read_text())["engine"]["dynamic_batching"]
    assert "num_blocks" not in batching and batching["gpu_utilization_factor"] == 0.6


def test_shapes():
    for name in ("llama-3.2-1b", "llama-3.1-8b"):
        shape = bench.SHAPES[name]
        assert shape["hidden_size"] == shape["num_attention_heads"] * shape["head_dim"]
        assert shape["max_position_embeddings"] >= 32768 + 512  # the long mix fits
    assert bench.SHAPES["llama-3.1-8b"]["num_hidden_layers"] == 32


def test_end_to_end_on_a_tiny_random_llama(tmp_path, capsys):
    """The whole path on the CPU: the builder makes the model from random weights, the
    patcher its seq-major copy, and the workload runs through the engine and og.Engine."""
    pytest.importorskip("onnxruntime_genai")
    pytest.importorskip("transformers")
    from serve_util import library_or_skip

    library_or_skip()
    out = tmp_path / "result.json"
    argv = ["--model-shape", "tiny-llama", "--build-dir", str(tmp_path / "models"),
            "--dataset", "long", "--input-range", "16,48", "--output-range", "3,6",
            "--num-requests", "5", "--max-batch", "2", "--systems", "engine,genai",
            "--json", str(out)]  # fmt: skip
    assert bench.main([*argv, "--dry-run"]) == 0
    assert "workload long: 5 requests" in capsys.readouterr().out
    assert bench.main(argv) == 0
    record = json.loads(out.read_text())
    assert record["model_shape"] == "tiny-llama" and record["weights"].startswith("random")
    assert record["workload"]["input_range"] == [16, 48]
    for system in ("engine", "genai"):
        r = record["results"][system]
        assert r["completed"] == 5 and 15 <= r["output_tokens"] <= 30
    assert record["results"]["engine"]["output_throughput_vs_genai"] > 0
