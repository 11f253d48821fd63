"""The serving engine on CUDA (fp16 synthetic model, growable VMM cache): the same tokens as
`Runtime.generate` alone, slot ranges bound at an offset in device memory, pages unmapped when
requests end. Skips without a GPU (tests/gpu_util.py says why); GQA_GPU_EMULATE_CPU=1 runs it
on the CPU (a check of the test, not of CUDA)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from gpu_util import DEVICE, SKIP_REASON
from synthetic_models import Variant, make_model_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(SKIP_REASON is not None, reason=f"GPU tests: {SKIP_REASON}"),
]

PROMPTS = [[1, 5, 7, 9, 11, 13, 17, 19, 23], [4, 8, 15, 16], [30 + i % 30 for i in range(70)], [6]]
LENGTHS = [40, 25, 33, 12]
TIE = 2e-2  # a top-2 logit gap below this (fp16) may flip with the batch's composition


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from ort_kvlayout.tools.patch import patch_model_dir

    root = tmp_path_factory.mktemp("engine_gpu")
    src = make_model_dir(root / "original", Variant(layers=2, float16=True, head_size=64, seed=3))
    return patch_model_dir(src, root / "seq", layout="seq-major").out_dir


def _alone(model):
    from ort_kvlayout.runtime.generation import Runtime

    out = []
    with Runtime(model, provider=DEVICE, cuda_graph=False) as rt:
        for p, n in zip(PROMPTS, LENGTHS):
            g = rt.generate(p, n, eos_token_ids=[], keep_logits=True)
            out.append((g.tokens[0], [step[0] for step in g.logits]))
    return out


def _same_or_tie(got: list[int], tokens: list[int], logits: list[np.ndarray]) -> None:
    for k, (a, b) in enumerate(zip(got, tokens)):
        if a != b:
            top = np.sort(logits[k].astype(np.float32))[-2:]
            assert top[1] - top[0] < TIE, f"token {k}: {a} != {b}, top-2 gap {top[1] - top[0]}"
            return
    assert len(got) == len(tokens)


def _graph_config(graphs: bool) -> dict:
    """CUDA graphs on or off; emulated on the CPU, the same padded decode calls uncaptured."""
    if DEVICE == "cuda":
        return {"cuda_graph": graphs, "decode_buckets": None if graphs else ()}
    return {"decode_buckets": (1, 2) if graphs else ()}


def _idle_stats(engine, timeout: float = 30.0) -> dict:
    """The counters once the loop went idle (it frees the scratch rows after the last event)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        if stats["kv_committed_bytes"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.01)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("chunk", [8, 256])
def test_engine_on_cuda_equals_runtime_alone(model, chunk, graphs):
    from ort_kvlayout.runtime.kv_memory import allocator_stats
    from ort_kvlayout.serve.engine import Engine, EngineConfig, RequestParams

    alone = _alone(model)
    before = allocator_stats()[DEVICE]["committed_bytes"]
    # Emulated on the CPU, the host cache commits CUDA's granule (2 MiB) instead of a page.
    granule = 2 << 20 if DEVICE == "cpu" else None
    config = EngineConfig(
        max_batch=3, prefill_chunk=chunk, provider=DEVICE, granule=granule,
        **_graph_config(graphs),
    )  # fmt: skip
    # Every request is queued before the loop's first step, so the first step admits three
    # (however fast the device) and none can finish in it: peak_running is 3 by construction
    # unless the budget refuses them. The three slots (64 KiB per buffer each) share one 2 MiB
    # VMM granule per buffer, the whole reservation (the default budget): counted once per slot,
    # the requests ran one at a time. The fourth request reuses the slot of the first to end.
    with Engine(model, config, start=False) as engine:
        handles = [
            engine.submit(p, RequestParams(max_tokens=n, ignore_eos=True))
            for p, n in zip(PROMPTS, LENGTHS)
        ]
        engine.start()
        got = [h.result() for h in handles]
        stats = _idle_stats(engine)
    for g, (tokens, logits) in zip(got, alone):
        _same_or_tie(g, tokens, logits)
    assert stats["kv_bytes_moved"] == 0
    assert stats["kv_committed_bytes"] == 0  # every slot's granules unmapped
    assert stats["peak_running"] == 3
    assert stats["preemptions"] == 0
    assert stats["kv_peak_committed_bytes"] <= stats["kv_budget_bytes"]
    assert allocator_stats()[DEVICE]["committed_bytes"] == before
    if graphs and DEVICE == "cuda":
        _check_graph_counters(stats)
        assert stats["graph_captures"] >= 1 and stats["graph_replays"] > 0
        assert stats["decode_eager_fallbacks"] == 0
    else:
        assert stats["graph_captures"] == stats["graph_replays"] == 0


def _check_graph_counters(stats: dict, logged: int | None = None) -> None:
    """ORT runs a graph id CUDA_GRAPH_WARMUP_RUNS times, captures it on the next run and
    replays it from then on: one capture per bucket that ran past its warm-up, never a second
    (`logged`: the captures ORT's INFO log says it began), every later call a replay."""
    from ort_kvlayout.runtime.generation import CUDA_GRAPH_WARMUP_RUNS as WARM

    calls = stats["decode_bucket_calls"]
    assert set(calls) <= set(stats["decode_buckets"]) and len(calls) == stats["decode_buckets_used"]
    captured = [b for b, n in calls.items() if n > WARM]
    assert stats["graph_captures"] == len(captured)
    assert stats["graph_replays"] == sum(n - WARM - 1 for n in calls.values() if n > WARM)
    assert stats["graph_recaptures"] == 0
    if logged is not None:
        assert logged == len(captured)


# ---------------------------------------------------------------------------------------------
# Growth across granules and slot reuse under CUDA graphs (fp32, 8 x 128 heads: 4 KiB a token
# per buffer, a 2 MiB granule holds 512 rows of one slot)

WIDE_PROMPTS = [[(7 * i + 3) % 64 for i in range(100)], [(5 * i + 1) % 64 for i in range(40)],
                [(3 * i + 2) % 64 for i in range(70)]]  # fmt: skip
WIDE_LENGTHS = [600, 450, 500]  # rows 100 -> 699 etc.: each slot grows into its second granule


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    import synthetic_models
    from ort_kvlayout.tools.patch import patch_model_dir

    saved = synthetic_models.MAX_POS
    synthetic_models.MAX_POS = 1024
    try:
        root = tmp_path_factory.mktemp("engine_wide")
        variant = Variant(layers=2, num_heads=8, kv_heads=8, head_size=128)
        src = make_model_dir(root / "original", variant)
    finally:
        synthetic_models.MAX_POS = saved
    return patch_model_dir(src, root / "seq", layout="seq-major").out_dir


def test_graphs_survive_growth_and_slot_reuse(wide_model, capfd):
    """Two slots; the third request takes the slot of the first to end. Each slot grows past its
    first 2 MiB granule while the decode graphs replay: no graph is captured twice (ORT's INFO
    log counts the captures it began), nothing is moved, and the tokens are the eager ones."""
    import onnxruntime as ort
    from ort_kvlayout.serve.engine import Engine, EngineConfig, RequestParams

    def run(graphs: bool, session_options=None):
        config = EngineConfig(max_batch=2, prefill_chunk=64, provider=DEVICE,
                              **_graph_config(graphs))  # fmt: skip
        with Engine(wide_model, config, session_options=session_options, start=False) as engine:
            handles = [
                engine.submit(p, RequestParams(max_tokens=n, ignore_eos=True))
                for p, n in zip(WIDE_PROMPTS, WIDE_LENGTHS)
            ]
            engine.start()
            got = [h.result() for h in handles]
            return got, _idle_stats(engine)

    eager, _ = run(False)
    so = ort.SessionOptions()
    so.log_severity_level = 1  # INFO: ORT's "Capturing the cuda graph for this model"
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    capfd.readouterr()
    got, stats = run(True, so)
    logged = capfd.readouterr().err.count("Capturing the cuda graph for this model")
    assert got == eager  # fp32: the same argmax with and without graphs
    assert stats["kv_growth_events"] >= 3 and stats["kv_bytes_moved"] == 0
    assert stats["peak_running"] == 2
    assert stats["decode_buckets"] == [1, 2] and stats["decode_bucket_calls"][2] > 900
    if DEVICE == "cuda":
        _check_graph_counters(stats, logged)
        assert stats["graph_captures"] >= 1


def test_a_budget_larger_than_the_device_is_refused_up_front(model):
    from ort_kvlayout.runtime.kv_memory import allocator_stats
    from ort_kvlayout.serve import memory
    from ort_kvlayout.serve.engine import Engine, EngineConfig

    free, total = memory.device_memory(DEVICE)
    assert total and free and 0 < free <= total
    before = allocator_stats()[DEVICE]["committed_bytes"]
    where = "cuda:0's memory" if DEVICE == "cuda" else "this machine's memory"
    with pytest.raises(ValueError, match=f"more than {where}"):
        Engine(model, EngineConfig(provider=DEVICE, kv_budget_bytes=total + 1), start=False)
    assert allocator_stats()[DEVICE]["committed_bytes"] == before
    with Engine(model, EngineConfig(provider=DEVICE, kv_budget_fraction=0.5), start=False) as eng:
        # half of what was free once the model loaded, at most the reservation
        assert 0 < eng.budget <= min(free // 2, eng.stats()["kv_reserved_bytes"])
    if DEVICE == "cuda":
        with Engine(model, EngineConfig(provider=DEVICE), start=False) as eng:  # 0.9 of free
            assert eng.budget == min(
                int(memory.DEFAULT_CUDA_FRACTION * eng.device_free_bytes),
                eng.stats()["kv_reserved_bytes"],
            )
