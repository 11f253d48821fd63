"""The serving engine on CUDA (fp16 synthetic model, growable VMM cache): the same tokens as
`Runtime.generate` alone, slot ranges bound at an offset in device memory, pages unmapped when
requests end. Skips without a GPU (tests/helpers/gpu_util.py says why); GQA_GPU_EMULATE_CPU=1 runs
it on the CPU (a check of the test, not of CUDA)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from gpu_util import DEVICE, SKIP_REASON
from serve_util import ENGINE_GRAPHS
from synthetic_models import Variant, make_model_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(SKIP_REASON is not None, reason=f"GPU tests: {SKIP_REASON}"),
]

PROMPTS = [[1, 5, 7, 9, 11, 13, 17, 19, 23], [4, 8, 15, 16], [30 + i % 30 for i in range(70)], [6]]
LENGTHS = [40, 25, 33, 12]
TIE = 2e-2  # a top-2 logit gap below this (fp16) may flip with the batch's composition
# Emulated on the CPU, the host cache commits CUDA's granule (2 MiB) instead of a page.
GRANULE = 2 << 20 if DEVICE == "cpu" else None


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


def _assert_ended_whole(stats: dict) -> None:
    """Every request ran to its length, no step failed, no KV byte moved, every granule back."""
    assert stats["kv_bytes_moved"] == 0 and stats["kv_committed_bytes"] == 0
    assert stats["step_errors"] == 0 and stats["finished_length"] == len(PROMPTS)


def _burst_equals_alone(model, config, alone, on_idle=None) -> dict:
    """Every prompt queued before the loop's first step, then the loop started: each request's
    tokens against Runtime alone (_same_or_tie); the engine's counters once it went idle.
    on_idle(engine), if given, is called then, before the engine closes."""
    from ort_kvlayout.serve.engine import Engine, RequestParams

    with Engine(model, config, start=False) as engine:
        handles = [
            engine.submit(p, RequestParams(max_tokens=n, ignore_eos=True))
            for p, n in zip(PROMPTS, LENGTHS)
        ]
        engine.start()
        got = [h.result() for h in handles]
        stats = _idle_stats(engine)
        if on_idle is not None:
            on_idle(engine)
    for g, (tokens, logits) in zip(got, alone):
        _same_or_tie(g, tokens, logits)
    return stats


@pytest.mark.parametrize("graph", list(ENGINE_GRAPHS))
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("chunk", [8, 256])
def test_engine_on_cuda_equals_runtime_alone(model, chunk, graphs, graph):
    """The graphs: the served one (lengths, logits at the sampled rows, SampleTokens inside the
    captured decode graph), packed (a step's chunks in one call; mixed: its decode rows too) or
    not, and the model's own (logits copied back, sampled on the host)."""
    from ort_kvlayout.runtime.kv_memory import allocator_stats
    from ort_kvlayout.serve.engine import EngineConfig

    alone = _alone(model)
    before = allocator_stats()[DEVICE]["committed_bytes"]
    config = EngineConfig(
        max_batch=3, prefill_chunk=chunk, provider=DEVICE, granule=GRANULE,
        **ENGINE_GRAPHS[graph], **_graph_config(graphs),
    )  # fmt: skip
    # Every request is queued before the loop's first step, so the first step admits three
    # (however fast the device) and none can finish in it: peak_running is 3 by construction
    # unless the budget refuses them. The three slots (64 KiB per buffer each) share one 2 MiB
    # VMM granule per buffer, the whole reservation (the default budget): counted once per slot,
    # the requests ran one at a time. The fourth request reuses the slot of the first to end.
    stats = _burst_equals_alone(model, config, alone)
    assert stats["sample_on_device"] is (graph != "own-graph")
    assert stats["packed"] is graph.startswith("packed")
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


@pytest.mark.parametrize("graph", ["packed", "served", "own-graph"])
def test_eager_calls_upload_once_and_read_by_pointer_on_cuda(model, graph):
    """Every call eager (no graphs, no buckets): each one's device inputs go up in one copy
    (CallUpload), its tokens or logits come back into a host array bound by pointer, and every
    request gets Runtime's tokens alone."""
    if DEVICE != "cuda":
        pytest.skip("CallUpload is the CUDA path; on the CPU host arrays are bound as they are")
    from ort_kvlayout.serve.engine import EngineConfig

    config = EngineConfig(
        max_batch=3, provider="cuda", cuda_graph=False, decode_buckets=(), **ENGINE_GRAPHS[graph]
    )
    seen = {}
    stats = _burst_equals_alone(
        model, config, _alone(model), lambda e: seen.update(uploads=e.executor._upload.uploads)
    )
    uploads = seen["uploads"]
    calls = stats["prefill_calls"] + stats["decode_calls"]
    assert stats["prefill_calls"] > 0 and stats["graph_replays"] == 0
    assert uploads == calls  # one copy a call, every call eager


@pytest.mark.parametrize("graph", ["packed", "served"])
@pytest.mark.parametrize("chunk", [8, 256])
def test_pipelined_engine_on_cuda_equals_runtime_alone(model, chunk, graph):
    """EngineConfig.pipeline with CUDA graphs: each decode step is planned on the helper thread
    while the last one's graph replays, and launched once its tokens are read. The same tokens,
    no capture spoiled (one per bucket), every granule back."""
    from ort_kvlayout.serve.engine import EngineConfig

    alone = _alone(model)
    config = EngineConfig(
        max_batch=3, prefill_chunk=chunk, provider=DEVICE, granule=GRANULE, pipeline=True,
        **ENGINE_GRAPHS[graph], **_graph_config(True),
    )  # fmt: skip
    stats = _burst_equals_alone(model, config, alone)
    assert stats["pipelined_steps"] > max(LENGTHS) // 2
    _assert_ended_whole(stats)
    if DEVICE == "cuda":
        _check_graph_counters(stats)
        assert stats["graph_replays"] > 0


@pytest.mark.parametrize("graph_chunk", [8, 64])
def test_graphed_prefill_on_cuda_equals_runtime_alone(model, graph_chunk):
    """EngineConfig.graph_chunk with CUDA graphs: a step that prefills replays the graph of its
    (bucket, tokens) shape, its decode rows beside each prompt's chunk. The same tokens as
    Runtime alone (or a near-tie), one capture a shape that ran past its warm-up and a replay
    every later call, decode buckets' and graphed shapes' alike, every granule back."""
    from ort_kvlayout.serve.engine import EngineConfig

    config = EngineConfig(
        max_batch=3, prefill_chunk=64, graph_chunk=graph_chunk, provider=DEVICE, granule=GRANULE,
        **ENGINE_GRAPHS["packed"], **_graph_config(True),
    )  # fmt: skip
    seen = {}
    stats = _burst_equals_alone(
        model, config, _alone(model),
        lambda e: seen.update(graphed=dict(e.executor.graphed_calls)),
    )  # fmt: skip
    assert stats["graphed_calls"] == stats["prefill_calls"] > 0
    _assert_ended_whole(stats)
    if DEVICE == "cuda":
        _check_graph_runs(
            stats, [*stats["decode_bucket_calls"].values(), *seen["graphed"].values()]
        )


@pytest.mark.parametrize("graph", ["packed", "served"])
def test_device_fed_pipeline_on_cuda_equals_runtime_alone(model, graph):
    """EngineConfig.device_ids with CUDA graphs: a bucket's two bindings, each a graph of its
    own, feed each other's ids on the device, and the helper reads each call's tokens during
    the next (a copy beside the graph's replay). The same tokens as Runtime alone (or a
    near-tie), one capture per binding that ran past its warm-up, every granule back."""
    from ort_kvlayout.serve.engine import EngineConfig

    config = EngineConfig(
        max_batch=3, prefill_chunk=8, provider=DEVICE, granule=GRANULE, pipeline=True,
        device_ids=True, **ENGINE_GRAPHS[graph], **_graph_config(True),
    )  # fmt: skip
    seen = {}
    stats = _burst_equals_alone(
        model, config, _alone(model),
        lambda e: seen.update(runs=dict(e.executor._graph_runs)),
    )  # fmt: skip
    assert stats["device_ids"] is True and stats["pipelined_steps"] > max(LENGTHS) // 2
    _assert_ended_whole(stats)
    if DEVICE == "cuda":
        _check_graph_runs(stats, list(seen["runs"].values()))
        assert stats["graph_replays"] > 0


@pytest.mark.parametrize("quant", ["int8-per-channel", "int8-per-token", "fp8-per-token"])
def test_quantized_caches_on_cuda_equal_runtime_alone(tmp_path, quant):
    """Quantized caches served on CUDA with graphs and the pipeline: a builder-style int8 per-
    channel cache (static scales, initializers of the graph) and PER_TOKEN int8 and fp8 caches
    (a float32 scale cache beside each KV cache, committed and bound with it). The same tokens
    as Runtime alone on the same model (or a near-tie), the budget's bytes a token those of the
    codes and the scales, every granule back."""
    from ort_kvlayout.serve.engine import EngineConfig
    from ort_kvlayout.tools.patch import patch_model_dir

    base = {"layers": 2, "float16": True, "head_size": 64, "seed": 3}
    if quant == "int8-per-channel":
        variant, kv_quant = Variant(**base, kv_bits=8, kv_scheme="PER_CHANNEL"), None
    else:
        variant, kv_quant = Variant(**base), quant
    src = make_model_dir(tmp_path / "original", variant)
    model = patch_model_dir(src, tmp_path / "seq", layout="seq-major", kv_quant=kv_quant).out_dir
    config = EngineConfig(
        max_batch=3, prefill_chunk=8, provider=DEVICE, granule=GRANULE, pipeline=True,
        **ENGINE_GRAPHS["packed"], **_graph_config(True),
    )  # fmt: skip
    seen = {}
    stats = _burst_equals_alone(model, config, _alone(model), lambda e: seen.update(kv=e.spec.kv))
    _assert_ended_whole(stats)
    kv = seen["kv"]
    assert kv.bits == 8 and kv.quant == quant.split("-", 1)[1].replace("-", "_")
    codes = kv.kv_heads * kv.head_dim * kv.buffers  # one byte a value
    scales = 4 * kv.kv_heads * kv.buffers if kv.quant == "per_token" else 0
    assert stats["kv_bytes_per_token"] == codes + scales
    if DEVICE == "cuda":
        _check_graph_counters(stats)
        assert stats["graph_replays"] > 0


def _check_graph_counters(stats: dict, logged: int | None = None) -> None:
    """ORT runs a graph id CUDA_GRAPH_WARMUP_RUNS times, captures it on the next run and
    replays it from then on: one capture per bucket that ran past its warm-up, never a second
    (`logged`: the captures ORT's INFO log says it began), every later call a replay."""
    from ort_kvlayout.runtime.generation import CUDA_GRAPH_WARMUP_RUNS as WARM

    calls = stats["decode_bucket_calls"]
    assert set(calls) <= set(stats["decode_buckets"]) and len(calls) == stats["decode_buckets_used"]
    _check_graph_runs(stats, list(calls.values()))
    if logged is not None:
        assert logged == sum(n > WARM for n in calls.values())


def _check_graph_runs(stats: dict, runs: list[int]) -> None:
    """The captures and replays of graph ids that ran `runs` times each: one capture an id that
    ran past ORT's warm-up, never a second, every later run a replay."""
    from ort_kvlayout.runtime.generation import CUDA_GRAPH_WARMUP_RUNS as WARM

    assert stats["graph_captures"] == sum(n > WARM for n in runs)
    assert stats["graph_replays"] == sum(n - WARM - 1 for n in runs if n > WARM)
    assert stats["graph_recaptures"] == 0


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


def _run_recorded(model_dir, config, prompts, lengths, session_options=None):
    """Runs the requests (all queued before the first step) and returns their tokens, for each
    token the batch of the call that produced it (0: a prefill call, which gives a request's
    first token), and the engine's idle counters. Overlap off: the events' callbacks then run on
    the engine thread right after their step's calls, where the counters are that step's (with
    overlap the publisher runs them during the next step's calls, and a call could go unseen)."""
    import dataclasses
    import threading

    from ort_kvlayout.serve.engine import Engine, RequestParams

    config = dataclasses.replace(config, overlap=False)  # tokens are the same either way

    rows_after: dict[int, int] = {0: 0}  # decode call -> decode rows run up to and with it
    calls: list[list[int]] = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]
    with Engine(model_dir, config, session_options=session_options, start=False) as engine:
        counters = engine._counters  # read in the engine thread, inside the step

        def recorder(i: int):
            def on_event(event) -> None:
                if event.token_id is not None:
                    call = counters["decode_calls"]
                    rows_after[call] = counters["decode_rows"]
                    calls[i].append(0 if event.completion_tokens == 1 else call)
                if event.finished:
                    done[i].set()

            return on_event

        handles = [
            engine.submit(p, RequestParams(max_tokens=n, ignore_eos=True), on_event=recorder(i))
            for i, (p, n) in enumerate(zip(prompts, lengths))
        ]
        engine.start()
        for d in done:
            assert d.wait(300), "a request did not finish"
        got = [h.tokens for h in handles]
        stats = _idle_stats(engine)
    batches = [[c and rows_after[c] - rows_after[c - 1] for c in cs] for cs in calls]
    return got, batches, stats


def _first(a: list, b: list) -> int | None:
    """The first index where a and b differ (None where equal)."""
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return k
    return None if len(a) == len(b) else min(len(a), len(b))


def _token_diffs(got, want, got_batches=None, want_batches=None) -> list[str]:
    """Per request that differs: the first differing token, both values, and (given the
    batches) the first token whose call ran a different batch in the two runs."""
    out = []
    for i, (a, b) in enumerate(zip(got, want)):
        k = _first(a, b)
        if k is None:
            continue
        line = f"request {i}: token {k} of {len(b)} differs ({a[k : k + 1]} vs {b[k : k + 1]})"
        if got_batches is not None:
            j = _first(got_batches[i], want_batches[i])
            line += (
                f"; its calls' batches first differ at token {j} "
                f"({got_batches[i][j:j + 1]} vs {want_batches[i][j:j + 1]})"
                if j is not None else "; every token's call ran the same batch in both runs"
            )  # fmt: skip
        out.append(line)
    return out


def _wide_config(graphs: bool, buckets: tuple[int, ...]):
    from ort_kvlayout.serve.engine import EngineConfig

    return EngineConfig(max_batch=2, prefill_chunk=64, provider=DEVICE, cuda_graph=graphs,
                        decode_buckets=buckets)  # fmt: skip


def test_graphs_survive_growth_and_slot_reuse(wide_model, capfd):
    """Two slots; the third request takes slot 1, freed by the first to end (its 70-token prompt
    prefilled in chunks of 64 while slot 0 decodes in bucket 1), and decodes alone in bucket 2
    (slot 0 a padded free row) once the other ends.
    Each slot grows past its first 2 MiB granule while the decode graphs replay: no graph is
    captured twice (ORT's INFO log counts the captures it began), nothing is moved, and the
    tokens are those of the same padded decode calls run uncaptured, bit for bit (fp32 argmax):
    a replay runs the captured kernels on the same shapes. The CPU emulation captures nothing:
    there the reference is the dense eager run (the CPU's dense layers are batch-invariant)."""
    import onnxruntime as ort

    cuda = DEVICE == "cuda"
    want, want_batches, _ = _run_recorded(
        wide_model, _wide_config(False, (1, 2) if cuda else ()), WIDE_PROMPTS, WIDE_LENGTHS
    )
    so = ort.SessionOptions()
    so.log_severity_level = 1  # INFO: ORT's "Capturing the cuda graph for this model"
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    capfd.readouterr()
    got, got_batches, stats = _run_recorded(
        wide_model, _wide_config(cuda, (1, 2)), WIDE_PROMPTS, WIDE_LENGTHS, so
    )
    logged = capfd.readouterr().err.count("Capturing the cuda graph for this model")
    if cuda:
        assert got_batches == want_batches, "the two runs scheduled different decode calls"
    diffs = _token_diffs(got, want, got_batches, want_batches)
    what = "graph replays vs the same calls uncaptured" if cuda else "padded vs dense eager"
    assert not diffs, f"{what}: " + "; ".join(diffs)
    assert stats["kv_growth_events"] >= 3 and stats["kv_bytes_moved"] == 0
    assert stats["peak_running"] == 2
    assert stats["decode_buckets"] == [1, 2] and stats["decode_bucket_calls"][2] > 900
    if cuda:
        _check_graph_counters(stats, logged)
        assert stats["graph_captures"] >= 1


def test_padded_decode_equals_eager_until_a_call_batch_differs(wide_model):
    """Padding changes the batch a row's decode call runs in (eager: the span of the decoding
    slots; padded: [0, bucket)): here the third request decodes alone once the first ends,
    batch 1 eager, 2 padded. On the CPU the dense layers compute each row alike at any batch:
    the same tokens. On CUDA the library GEMMs of the dense layers (cuBLAS; TF32 for fp32 by
    ORT's default) choose their kernel by the batch, so a row's logits may differ in the low
    bits once its call's batch differs, and greedy tokens may part at a near-tie, but never
    before that: every token up to the first call of a different batch is the same. The
    message says where each request parts (the padded rows themselves change nothing)."""
    eager, eager_batches, _ = _run_recorded(
        wide_model, _wide_config(False, ()), WIDE_PROMPTS, WIDE_LENGTHS
    )
    padded, padded_batches, _ = _run_recorded(
        wide_model, _wide_config(False, (1, 2)), WIDE_PROMPTS, WIDE_LENGTHS
    )
    diffs = _token_diffs(padded, eager, padded_batches, eager_batches)
    if DEVICE != "cuda":
        assert not diffs, "padded vs dense eager: " + "; ".join(diffs)
        return
    for i, (a, b) in enumerate(zip(padded, eager)):
        k = _first(a, b)
        j = _first(padded_batches[i], eager_batches[i])
        assert k is None or (j is not None and k >= j), (
            "padded vs dense eager, a token differs before any call batch does: " + "; ".join(diffs)
        )
    if diffs:  # allowed (near-ties after a batch change): say where, for the record
        print("padded vs dense eager on CUDA: " + "; ".join(diffs))


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


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_seeded_sampling_on_the_device_is_reproducible(model, graphs):
    """Sampled on the device (in the captured graph with graphs on): the same seed gives the
    same tokens alone, beside other requests and in a new engine; another seed others."""
    from ort_kvlayout.runtime.sampling import SamplingParams
    from ort_kvlayout.serve.engine import Engine, EngineConfig, RequestParams

    def params(seed: int) -> RequestParams:
        # logits of this model differ by ~100 between the top tokens: a hot temperature
        sampling = SamplingParams(temperature=200.0, top_k=40, top_p=0.98, seed=seed)
        return RequestParams(max_tokens=24, ignore_eos=True, sampling=sampling)

    config = EngineConfig(max_batch=3, provider=DEVICE, **_graph_config(graphs))
    with Engine(model, config) as engine:
        solo = engine.generate(PROMPTS[0], params(7))
        handles = [engine.submit(PROMPTS[0], params(7)) for _ in range(2)]
        handles.append(engine.submit(PROMPTS[1], RequestParams(max_tokens=30, ignore_eos=True)))
        mixed = [h.result() for h in handles]
        other = engine.generate(PROMPTS[0], params(8))
        stats = engine.stats()
    with Engine(model, config) as engine:
        again = engine.generate(PROMPTS[0], params(7))
    assert stats["sample_on_device"]
    assert mixed[:2] == [solo, solo] and again == solo
    assert other != solo
