"""The serving engine (ort_kvlayout.serve.engine) on a tiny synthetic model, CPU.

Reference: `Runtime.generate` on one prompt alone (greedy). The engine mixes requests that join
and leave, chunked prefill, slot ranges bound at an offset, preemption and recompute: every
request must still get the tokens it gets alone.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import ClassVar

import numpy as np
import pytest
from ort_kvlayout.runtime.kv_cache import KvCache
from ort_kvlayout.runtime.kv_memory import allocator_stats
from ort_kvlayout.runtime.model_spec import KvSpec
from ort_kvlayout.runtime.sampling import SamplingParams
from serve_util import ENGINE_GRAPHS, library_or_skip
from synthetic_models import VOCAB, Variant, make_model_dir

PROMPTS = [
    [1, 5, 7, 9, 11, 13, 17, 19, 23],
    [4, 8, 15, 16],
    [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51],
    [6],
    [12, 24, 36, 48, 60, 10, 20],
    [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9],
]
LENGTHS = [40, 25, 33, 12, 50, 20]
PIPELINE = {"decode_buckets": (1, 2), "pipeline": True}  # padded decode, uncaptured on the CPU


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from ort_kvlayout.tools.patch import patch_model_dir

    library_or_skip()
    root = tmp_path_factory.mktemp("engine")
    src = make_model_dir(root / "original", Variant(layers=2))
    return patch_model_dir(src, root / "seq", layout="seq-major").out_dir


@pytest.fixture(scope="module")
def alone(model) -> list[list[int]]:
    from ort_kvlayout.runtime.generation import Runtime

    with Runtime(model) as rt:
        return [rt.generate(p, n, eos_token_ids=[]).tokens[0] for p, n in zip(PROMPTS, LENGTHS)]


@pytest.fixture(autouse=True, params=[False, True], ids=["serial", "overlap"])
def overlap(request, monkeypatch):
    """Every engine test runs both ways: events handed over by the engine thread after each
    step, and by a publisher thread during the next step's calls (the CUDA default)."""
    from ort_kvlayout.serve.engine import EngineConfig

    monkeypatch.setattr(
        EngineConfig, "overlapped",
        property(lambda self: request.param if self.overlap is None else self.overlap),
    )  # fmt: skip
    return request.param


@pytest.fixture(autouse=True)
def no_leaks():
    before = allocator_stats()["cpu"]
    yield
    assert allocator_stats()["cpu"] == before  # every engine closed: accounting back


def engine(model, **kwargs):
    from ort_kvlayout.serve.engine import Engine, EngineConfig

    return Engine(model, EngineConfig(**kwargs))


def params(n, **kwargs):
    from ort_kvlayout.serve.engine import RequestParams

    return RequestParams(max_tokens=n, ignore_eos=True, **kwargs)


@pytest.mark.parametrize("graph", list(ENGINE_GRAPHS))
@pytest.mark.parametrize("chunk", [4, 256])
def test_concurrent_requests_equal_generate_alone(model, alone, chunk, graph):
    """The served graph (lengths, logits at the sampled rows, SampleTokens), packed (a step's
    chunks in one call; mixed: its decode rows too) or not, and the model's own graph sampled
    on the host give every request the greedy tokens it gets alone."""
    with engine(model, max_batch=4, prefill_chunk=chunk, **ENGINE_GRAPHS[graph]) as eng:
        handles = [eng.submit(p, params(n)) for p, n in zip(PROMPTS, LENGTHS)]
        got = [h.result() for h in handles]
        stats = eng.stats()
    assert got == alone
    assert stats["sample_on_device"] is (graph != "own-graph")
    assert stats["packed"] is graph.startswith("packed")
    assert stats["mixed"] is (graph == "packed-mixed")
    if graph.startswith("packed") and chunk == 256:  # the first step prefills 4 prompts at once
        assert stats["prefill_chunks"] > stats["prefill_calls"]
    if graph == "packed-mixed":
        assert stats["mixed_calls"] > 0
    assert all(h.finish_reason == "length" for h in handles)
    assert stats["peak_running"] == 4  # 6 requests through 4 slots: slots were reused
    assert stats["kv_bytes_moved"] == 0
    assert stats["running"] == stats["waiting"] == 0
    assert stats["kv_committed_bytes"] == 0  # every slot's pages went back
    if chunk == 4:
        assert stats["prefill_calls"] > len(PROMPTS)  # long prompts took several chunks


def test_requests_from_many_threads_never_mix(model, alone):
    got: dict[int, list[int]] = {}
    with engine(model, max_batch=3, prefill_chunk=8) as eng:

        def client(i):
            got[i] = eng.generate(PROMPTS[i], params(LENGTHS[i]))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert [got[i] for i in range(len(PROMPTS))] == alone


def test_async_iteration_streams_tokens(model, alone):
    async def main(eng):
        async def one(i):
            handle = eng.submit(PROMPTS[i], params(LENGTHS[i]))
            events = [e async for e in handle]
            assert events[-1].finished and all(not e.finished for e in events[:-1])
            return [e.token_id for e in events]

        return await asyncio.gather(*(one(i) for i in range(3)))

    with engine(model, max_batch=2) as eng:
        assert asyncio.run(main(eng)) == alone[:3]


def test_preemption_under_a_tiny_budget_recomputes_the_same_tokens(model, alone):
    from ort_kvlayout.serve.engine import Engine, EngineConfig

    spec_bytes = None
    with engine(model, max_batch=1) as probe:  # bytes of one request's longest sequence
        spec_bytes = max(
            probe.cache.entry_commit_bytes(len(p) + n) for p, n in zip(PROMPTS, LENGTHS)
        )
    config = EngineConfig(
        max_batch=4, kv_budget_bytes=spec_bytes + spec_bytes // 2, prefill_chunk=8
    )
    with Engine(model, config) as eng:
        handles = [eng.submit(p, params(n)) for p, n in zip(PROMPTS, LENGTHS)]
        got = [h.result() for h in handles]
        stats = eng.stats()
    assert got == alone
    assert stats["preemptions"] > 0
    assert stats["kv_peak_committed_bytes"] <= config.kv_budget_bytes


def test_cancel_frees_the_slot_at_once(model, alone):
    with engine(model, max_batch=1) as eng:
        seen = threading.Event()

        def on_event(event):
            if event.completion_tokens >= 3:
                seen.set()

        first = eng.submit(PROMPTS[0], params(200), on_event=on_event)
        assert seen.wait(30)
        first.cancel()
        second = eng.submit(PROMPTS[1], params(LENGTHS[1]))
        assert second.result() == alone[1]  # it got the only slot
        stats = eng.stats()
    assert stats["finished_cancelled"] == 1
    assert stats["kv_committed_bytes"] == 0


def test_cancel_a_waiting_request(model):
    with engine(model, max_batch=1) as eng:
        a = eng.submit(PROMPTS[0], params(30))
        b = eng.submit(PROMPTS[1], params(30))
        b.cancel()
        assert b.result() == [] or b.finish_reason == "cancelled"
        assert a.result()
        assert b.finish_reason == "cancelled"


@pytest.mark.parametrize("on_device", [True, False], ids=["served", "own-graph"])
def test_sampling_is_per_request_and_seeded(model, on_device):
    sampling = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=3)
    with engine(model, max_batch=4, sample_on_device=on_device) as eng:
        solo = eng.generate(PROMPTS[0], params(20, sampling=sampling))
        handles = [eng.submit(PROMPTS[0], params(20, sampling=sampling)) for _ in range(3)]
        handles.append(eng.submit(PROMPTS[1], params(20)))
        hot = [  # a flat distribution: the seed decides
            eng.generate(PROMPTS[0], params(20, sampling=SamplingParams(5.0, seed=seed)))
            for seed in (3, 4)
        ]
        mixed = [h.result() for h in handles]
    with engine(model, max_batch=2, sample_on_device=on_device) as eng:  # run to run
        again = eng.generate(PROMPTS[0], params(20, sampling=sampling))
    assert mixed[:3] == [solo] * 3  # the same seed, whatever shares the batch
    assert again == solo
    assert hot[0] != hot[1]  # another seed: other tokens (a test that can fail)


def test_stop_token_ids_and_eos(model, alone):
    stop = alone[0][5]
    with engine(model) as eng:
        out = eng.generate(PROMPTS[0], params(40, stop_token_ids=(stop,)))
        assert out == alone[0][: alone[0].index(stop) + 1]
        from ort_kvlayout.serve.engine import RequestParams

        handle = eng.submit(PROMPTS[0], RequestParams(max_tokens=40))  # the model's EOS 2, 3
        tokens = handle.result()
    first_eos = next((i for i, t in enumerate(alone[0]) if t in (2, 3)), None)
    if first_eos is None:
        assert tokens == alone[0] and handle.finish_reason == "length"
    else:
        assert tokens == alone[0][: first_eos + 1] and handle.finish_reason == "stop"


def test_bad_requests(model):
    from ort_kvlayout.serve.engine import EngineOverloaded, RequestParams, RequestTooLarge

    with engine(model, max_batch=1, max_waiting=1) as eng:
        with pytest.raises(ValueError, match="at least one token"):
            eng.submit([], params(4))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            eng.submit([VOCAB], params(4))
        with pytest.raises(RequestTooLarge, match="rows of context"):
            eng.submit([1] * 200, params(100))
        with pytest.raises(ValueError, match="need a tokenizer"):
            eng.submit([1], params(4, stop=("x",)))
        with pytest.raises(ValueError, match="max_tokens"):
            RequestParams(max_tokens=0)
        for bad in (2.5, True, None):
            with pytest.raises(TypeError, match=f"max_tokens must be an integer, got {bad}"):
                RequestParams(max_tokens=bad)
        with pytest.raises(TypeError, match="sampling must be a SamplingParams, got None"):
            RequestParams(sampling=None)
        with pytest.raises(TypeError, match="stop_token_ids must be a sequence of integers"):
            RequestParams(stop_token_ids=7)
        with pytest.raises(TypeError, match="stop must hold strings"):
            RequestParams(stop=(1,))
        assert RequestParams(stop="\n\n").stop == ("\n\n",)  # one string, not its letters
        handles = []
        with pytest.raises(EngineOverloaded):
            for _ in range(10):
                handles.append(eng.submit([1, 2], params(50)))
        for h in handles:
            h.cancel()
            h.result()
        assert eng.stats()["rejected"] == 1


def test_budget_refuses_a_request_that_can_never_fit(model):
    """The smallest budget an engine takes (what its first token commits) refuses a request
    that needs more; a smaller one is refused when the engine is made, naming the bytes."""
    from ort_kvlayout.serve.engine import RequestTooLarge

    with engine(model, max_batch=2) as probe:
        first = probe.cache.entry_commit_bytes(1 + probe._limits.slack)
    with (
        engine(model, max_batch=2, kv_budget_bytes=first) as eng,
        pytest.raises(RequestTooLarge, match="KV budget"),
    ):
        eng.submit(PROMPTS[0], params(first // eng.stats()["kv_bytes_per_token"]))
    with pytest.raises(ValueError, match=f"first token commits {first} KV bytes"):
        engine(model, max_batch=2, kv_budget_bytes=first - 1)


def test_the_default_cpu_budget_is_at_most_the_machines_memory(model, monkeypatch):
    """Without a budget the CPU engine may commit its reservation, but never more than the
    machine has: a reservation past it (here: the machine made small) is capped, and a granule
    whose first commit is beyond the cap is refused when the engine is made."""
    from ort_kvlayout.serve import memory

    with engine(model, max_batch=2) as eng:
        reserved = eng.stats()["kv_reserved_bytes"]
        assert eng.budget == reserved  # this machine holds the tiny model's reservation
    small = reserved // 2
    monkeypatch.setattr(memory, "device_memory", lambda *_args: (small, small))
    with engine(model, max_batch=2) as eng:
        assert eng.budget == small
    with pytest.raises(ValueError, match="first token commits"):
        engine(model, max_batch=2, granule=4 * small)


def test_a_granule_beyond_the_machines_memory_is_refused():
    import os

    from ort_kvlayout.runtime.kv_memory import HostReservation

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with pytest.raises(ValueError, match="more than this machine's memory"):
        HostReservation(4096, granule=(memory // 4096 + 1) * 4096)


def test_misuse_is_a_clear_error_not_a_hang_or_a_different_prompt(model):
    """A float token id is refused (int() would run another prompt), generate() on an engine
    never started raises (nothing would run it), and a closed engine refuses with EngineClosed
    (not the closed cache's error); EngineConfig's integers are integers."""
    from ort_kvlayout.serve.engine import Engine, EngineClosed, EngineConfig

    with engine(model, max_batch=1) as eng:
        with pytest.raises(ValueError, match=r"token ids must be integers, got 1.9"):
            eng.submit([1.9, 2], params(2))
        with pytest.raises(ValueError, match="must be integers, got True"):
            eng.submit([True, 2], params(2))
        assert eng.generate(list(np.array(PROMPTS[0], np.int64)), params(2))  # numpy ints: fine
    with pytest.raises(EngineClosed):
        eng.submit(PROMPTS[0], params(2))
    with pytest.raises(EngineClosed):
        eng.generate(PROMPTS[0], params(2))
    with Engine(model, EngineConfig(max_batch=1), start=False) as idle:
        with pytest.raises(RuntimeError, match="not started"):
            idle.generate(PROMPTS[0], params(2))
        idle.start()
        assert len(idle.generate(PROMPTS[0], params(2))) == 2
    for bad in ({"max_batch": 2.5}, {"capacity": "64"}, {"prefill_chunk": True}, {"granule": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineConfig(**bad)


@pytest.mark.parametrize("pipeline", [{}, PIPELINE], ids=["", "pipelined"])
def test_close_cancels_or_drains(model, pipeline):
    eng = engine(model, max_batch=1, **pipeline)
    a = eng.submit(PROMPTS[0], params(200))
    b = eng.submit(PROMPTS[1], params(5))
    eng.close()
    a.result(), b.result()
    assert a.finish_reason == "cancelled" and b.finish_reason == "cancelled"
    eng = engine(model, max_batch=1, **pipeline)
    a = eng.submit(PROMPTS[1], params(5))
    eng.close(drain=True)
    a.result()
    assert a.finish_reason == "length" and len(a.tokens) == 5


def test_kv_cache_release_returns_an_entrys_granules():
    spec = KvSpec.synthetic(layers=1, kv_heads=2, head_dim=32, dtype=np.float32, context_length=256)
    with KvCache.create(spec, "growable", batch=3, capacity=256) as cache:
        cache.ensure([40, 100, 3])
        before = cache.stats.committed_bytes
        one = cache.entry_commit_bytes(100)
        assert cache.release(1) == one
        assert cache.stats.committed_bytes == before - one
        assert cache.measured_committed_bytes() == cache.stats.committed_bytes
        assert cache.tokens == [40, 0, 3]
        cache.ensure([40, 10, 3])  # the slot is used again in place
        assert cache.stats.committed_bytes == before - one + cache.entry_commit_bytes(10)
        assert cache.stats.bytes_moved == 0
        views = cache.entry_buffers(1, 2)
        assert views[0].ptr == cache.buffers[0].ptr + 256 * spec.token_bytes
        assert views[0].shape[0] == 2


def test_kv_cache_release_can_keep_an_entrys_first_rows():
    """release(keep=1): the granules under row 0 stay committed and counted, and the entry's
    next sequence grows into them without committing anything (no map per request)."""
    spec = KvSpec.synthetic(layers=1, kv_heads=2, head_dim=32, dtype=np.float32, context_length=256)
    with KvCache.create(spec, "growable", batch=3, capacity=256) as cache:
        cache.ensure([40, 100, 3])
        before = cache.stats.committed_bytes
        released = cache.release(1, keep=1)
        assert released == cache.entry_commit_bytes(100) - cache.entry_commit_bytes(1)
        assert cache.tokens == [40, 1, 3]
        assert cache.stats.committed_bytes == before - released
        assert cache.measured_committed_bytes() == cache.stats.committed_bytes
        growth = cache.stats.growth_events
        small = cache.entry_commit_bytes(1) // (spec.buffers * spec.token_bytes)  # rows it holds
        assert not cache.ensure([40, max(small, 1), 3])  # inside the kept granule: no commit
        assert cache.stats.growth_events == growth
        cache.release(1)  # keep=0: everything goes
        assert cache.tokens == [40, 0, 3]
        assert cache.measured_committed_bytes() == cache.stats.committed_bytes


@pytest.mark.parametrize("layout", ["seq-major", "head-major"])
def test_kv_cache_commit_bytes_counts_shared_granules_once(layout):
    """commit_bytes is what ensure() commits; with a 2 MiB granule (CUDA's) small entries share
    one, which the per-entry sum counts once per entry."""
    spec = KvSpec.synthetic(
        layers=2, kv_heads=2, head_dim=64, dtype=np.float16, context_length=256, layout=layout
    )
    for granule in (None, 2 << 20):
        with KvCache.create(spec, "growable", batch=3, capacity=256, granule=granule) as cache:
            for tokens in ([0, 0, 0], [1, 0, 0], [9, 0, 70], [256, 1, 256], [100, 0, 3]):
                for entry in range(3):
                    cache.release(entry)
                cache.ensure(tokens)
                assert cache.commit_bytes(tokens) == cache.stats.committed_bytes
    with KvCache.create(spec, "growable", batch=3, capacity=256, granule=2 << 20) as cache:
        one = cache.entry_commit_bytes(1)
        assert cache.commit_bytes([1, 1, 1]) == one < 3 * one  # one granule per buffer


def test_slots_sharing_a_granule_run_together(model, alone):
    """A 2 MiB granule (CUDA's VMM granularity, emulated on the host) holds every slot of this
    model (64 KiB a slot per buffer): the budget (the reservation, one granule per buffer) must
    count it once, not once per slot, or the requests run one at a time."""
    from ort_kvlayout.serve.engine import Engine, EngineConfig

    config = EngineConfig(max_batch=4, prefill_chunk=8, granule=2 << 20)
    with Engine(model, config, start=False) as eng:
        handles = [eng.submit(p, params(n)) for p, n in zip(PROMPTS, LENGTHS)]
        eng.start()
        got = [h.result() for h in handles]
        stats = eng.stats()
    assert got == alone
    assert stats["peak_running"] == 4
    assert stats["kv_peak_committed_bytes"] <= stats["kv_budget_bytes"]
    assert stats["preemptions"] == 0


def test_runtime_generate_from_two_threads_is_serialized(model, alone):
    from ort_kvlayout.runtime.generation import Runtime

    got: dict[int, list[int]] = {}
    with Runtime(model) as rt:

        def client(i):
            got[i] = rt.generate(PROMPTS[i], LENGTHS[i], eos_token_ids=[]).tokens[0]

        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [got[i] for i in range(4)] == alone[:4]
        with pytest.raises(RuntimeError, match="on_step"):
            rt.generate(PROMPTS[0], 3, on_step=lambda _: rt.generate(PROMPTS[1], 2))


def test_a_failed_commit_preempts_instead_of_crashing(model, alone):
    from ort_kvlayout.runtime.kv_memory import simulate_commit_failure

    with engine(model, max_batch=3, prefill_chunk=8) as eng:
        handles = [eng.submit(p, params(n)) for p, n in zip(PROMPTS[:3], LENGTHS[:3])]
        simulate_commit_failure("cpu", after=6)  # a later granule fails once, as ENOMEM would
        try:
            got = [h.result() for h in handles]
        finally:
            simulate_commit_failure("cpu", -1)
        stats = eng.stats()
    assert got == alone[:3]
    assert stats["preemptions"] >= 1 and stats["step_errors"] == 0


@pytest.mark.parametrize("graph", ["served", "packed"])
def test_commit_ahead_commits_the_next_chunks_during_the_calls(model, alone, graph):
    """EngineConfig.commit_ahead: the next step's prefill rows are committed on a worker while a
    step's calls run; the tokens are those of every request alone, the budget holds, and a
    commit that fails there leaves the next step to meet the error (preempting, not crashing)."""
    from ort_kvlayout.runtime.kv_memory import simulate_commit_failure
    from ort_kvlayout.serve.engine import Engine, EngineConfig

    with engine(
        model, max_batch=4, prefill_chunk=8, commit_ahead=True, **ENGINE_GRAPHS[graph]
    ) as eng:
        handles = [eng.submit(p, params(n)) for p, n in zip(PROMPTS, LENGTHS)]
        got = [h.result() for h in handles]
        stats = eng.stats()
    assert got == alone
    assert stats["kv_ahead_commits"] > 0 and stats["kv_ahead_failures"] == 0
    assert stats["step_profile"]["total_ms"]["kv_ahead"] > 0
    with engine(model, max_batch=4, prefill_chunk=8) as eng:
        assert eng.stats()["kv_ahead_commits"] == 0  # off by default
    budget = None
    with engine(model, max_batch=1) as probe:  # one request's longest sequence, and a half
        budget = max(probe.cache.entry_commit_bytes(len(p) + n) for p, n in zip(PROMPTS, LENGTHS))
    budget += budget // 2
    with engine(
        model, max_batch=4, prefill_chunk=8, kv_budget_bytes=budget, commit_ahead=True
    ) as eng:
        handles = [eng.submit(p, params(n)) for p, n in zip(PROMPTS, LENGTHS)]
        got = [h.result() for h in handles]
        stats = eng.stats()
    assert got == alone
    assert stats["kv_peak_committed_bytes"] <= budget
    failed = 0
    config = EngineConfig(max_batch=3, prefill_chunk=8, commit_ahead=True)
    for after in range(16):  # the (after+1)-th granule commit fails, on the worker or not
        with Engine(model, config, start=False) as eng:
            handles = [eng.submit(p, params(n)) for p, n in zip(PROMPTS[:3], LENGTHS[:3])]
            simulate_commit_failure("cpu", after=after)
            try:
                eng.start()
                got = [h.result() for h in handles]
            finally:
                simulate_commit_failure("cpu", -1)
            stats = eng.stats()
        assert got == alone[:3] and stats["step_errors"] == 0
        failed += stats["kv_ahead_failures"]
    assert failed > 0  # some failure hit the worker, not only a step's own commit


def staggered(eng) -> list[list[int]]:
    """PROMPTS[4] alone, then PROMPTS[0..3] submitted one by one at its 2nd, 4th, 6th and 8th
    tokens (from the thread that hands its events over: each at a step of its own); the tokens
    of the four."""
    handles, done = [], threading.Event()

    def on_event(event) -> None:
        if event.completion_tokens in (2, 4, 6, 8) and not event.finished:
            i = event.completion_tokens // 2 - 1
            handles.append(eng.submit(PROMPTS[i], params(LENGTHS[i])))
        if event.finished:
            done.set()

    eng.submit(PROMPTS[4], params(LENGTHS[4]), on_event=on_event)
    assert done.wait(60)
    return [h.result() for h in handles]


@pytest.mark.parametrize("graph", ["served", "packed"])
def test_prefill_wait_holds_prompts_that_arrive_one_by_one(model, alone, graph):
    """EngineConfig.prefill_wait: prompts arriving while others decode are held up to that many
    steps (scheduler.hold_admissions), then start together; every request still gets its tokens
    alone, and at a tight budget the budget holds (the rule that keeps freed granules for the
    held within it: scheduler.keep_scratch, tests/serve/test_scheduler.py)."""
    with engine(
        model, max_batch=16, prefill_chunk=64, prefill_wait=4, **ENGINE_GRAPHS[graph]
    ) as eng:
        got = staggered(eng)
        stats = idle_stats(eng)
    assert got == alone[:4]
    assert stats["admission_holds"] > 0
    assert stats["admitted"] == 5
    assert stats["kv_committed_bytes"] == 0  # idle: every granule back
    with engine(model, max_batch=16, prefill_chunk=64) as eng:  # off by default
        assert staggered(eng) == alone[:4]
        assert eng.stats()["admission_holds"] == 0
    # At a budget of about three requests (preemptions may come), the budget holds.
    with engine(model, max_batch=1) as probe:
        budget = 3 * max(
            probe.cache.entry_commit_bytes(len(p) + n) for p, n in zip(PROMPTS, LENGTHS)
        )
    with engine(
        model, max_batch=16, prefill_chunk=64, prefill_wait=4, kv_budget_bytes=budget,
        **ENGINE_GRAPHS[graph],
    ) as eng:  # fmt: skip
        got = staggered(eng)
        stats = idle_stats(eng)
    assert got == alone[:4]
    assert stats["kv_peak_committed_bytes"] <= budget


def test_a_relative_model_dir_registers_the_library_by_absolute_path(model, monkeypatch):
    from pathlib import Path

    from ort_kvlayout.runtime.generation import Runtime

    monkeypatch.chdir(model)
    with Runtime(".") as rt:  # dlopen("libort_kvlayout.so") would search the system path
        assert Path(rt.library).is_absolute()
        assert Path(rt.library).parent == model.resolve()


def test_growable_slots_hold_more_requests_than_preallocated_ones_at_equal_budget(model, alone):
    from ort_kvlayout.serve.engine import Engine, EngineConfig

    with engine(model, max_batch=1, cache="preallocated") as probe:
        slot = probe.cache.stats.reserved_bytes  # one whole slot: 256 tokens
    peaks = {}
    for mode in ("preallocated", "growable"):
        config = EngineConfig(max_batch=6, cache=mode, kv_budget_bytes=2 * slot)
        with Engine(model, config) as eng:
            handles = [eng.submit(p, params(n)) for p, n in zip(PROMPTS, LENGTHS)]
            assert [h.result() for h in handles] == alone
            stats = eng.stats()
        assert stats["kv_peak_committed_bytes"] <= 2 * slot
        peaks[mode] = stats["peak_running"]
    assert peaks == {"preallocated": 2, "growable": 6}


def test_a_long_prompt_never_stalls_a_running_request_more_than_one_chunk(model, alone):
    """Every step with a decoding request runs its decode, and prefills at most prefill_chunk
    prompt tokens: the running request's gap is one decode call plus one chunk."""
    steps: list[dict] = []
    with engine(model, max_batch=2, prefill_chunk=4) as eng:
        real_decode, real_prefill, real_step = eng._decode_call, eng._prefill_call, eng._step
        real_packed = eng._packed_call

        def step():
            steps.append({"decode": 0, "prefill": 0})
            real_step()

        def decode(lo, hi, **kwargs):
            steps[-1]["decode"] += 1
            return real_decode(lo, hi, **kwargs)

        def prefill(r, take):
            steps[-1]["prefill"] += take
            return real_prefill(r, take)

        def packed(chunks):
            steps[-1]["prefill"] += sum(take for _, take in chunks)
            return real_packed(chunks)

        eng._step, eng._decode_call, eng._prefill_call = step, decode, prefill
        eng._packed_call = packed
        # a (4 prompt tokens: the first step's whole chunk) decodes while b prefills.
        a = eng.submit(PROMPTS[1], params(240))
        b = eng.submit(PROMPTS[5], params(LENGTHS[5]))  # 30 prompt tokens: 8 chunks
        assert b.result() == alone[5]
        eng.cancel(a.id)
    assert max(s["prefill"] for s in steps) <= 4
    mixed = [s for s in steps if s["prefill"] and s["decode"]]
    assert len(mixed) == 8  # b's chunks ran beside a's decode steps, one chunk per step


def test_a_raising_callback_cancels_only_its_own_request(model, alone):
    def broken(event):
        raise RuntimeError("client bug")

    with engine(model, max_batch=2) as eng:
        bad = eng.submit(PROMPTS[0], params(40), on_event=broken)
        good = eng.submit(PROMPTS[1], params(LENGTHS[1]))
        assert good.result() == alone[1]
        stats = eng.stats()
    assert bad.tokens == alone[0][:1]  # its first event raised: cancelled there
    assert stats["finished_cancelled"] == 1 and stats["step_errors"] == 0


def test_a_tokenizer_that_raises_ends_only_its_own_request(model, alone):
    """Text is decoded off the step (overlap: on the publisher thread): a decode that raises
    ends that request with an error, and the others stream on."""
    poison = PROMPTS[2][-1]
    assert poison not in PROMPTS[1] + alone[1]

    class Tokenizer:
        def encode(self, text):
            return [int(t) for t in text.split()]

        def decode(self, ids):
            if poison in ids:
                raise ValueError(f"cannot decode {poison}")
            return "".join(f" {i}" for i in ids)

    from ort_kvlayout.serve.engine import Engine, EngineConfig

    with Engine(model, EngineConfig(max_batch=2), tokenizer=Tokenizer()) as eng:
        bad = eng.submit(PROMPTS[2], params(LENGTHS[2]))
        good = eng.submit(PROMPTS[1], params(LENGTHS[1]))
        bad_events, good_events = list(bad), list(good)
        stats = eng.stats()
    assert bad.finish_reason == "error" and "cannot decode" in bad_events[-1].error
    assert bad.tokens == alone[2][: len(bad.tokens)] and len(bad.tokens) < LENGTHS[2]
    assert good.tokens == alone[1]
    assert "".join(e.text for e in good_events) == "".join(f" {i}" for i in alone[1])
    assert stats["detokenize_errors"] == 1 and stats["step_errors"] == 0


def test_a_tokenizer_that_raises_with_stop_strings_ends_only_its_own_request(model, alone):
    """Requests with stop strings decode their text on the engine thread, at each token and
    at their end: a decode that raises there ends that request with an error; the thread and
    the other requests go on."""

    poison = PROMPTS[2][-1]
    assert poison not in PROMPTS[1] + alone[1] + PROMPTS[3] + alone[3]

    class Tokenizer:
        def encode(self, text):
            return [int(t) for t in text.split()]

        def decode(self, ids, **_kwargs):
            if poison in ids:
                raise RuntimeError("boom")
            return "".join(f" {i}" for i in ids)

    from ort_kvlayout.serve.engine import Engine, EngineConfig

    with Engine(model, EngineConfig(max_batch=2), tokenizer=Tokenizer()) as eng:
        bad = eng.submit(PROMPTS[2], params(LENGTHS[2], stop=("x",)))
        good = eng.submit(PROMPTS[1], params(LENGTHS[1], stop=("x",)))
        bad_events = list(bad)
        assert good.result() == alone[1]
        later = eng.submit(PROMPTS[3], params(LENGTHS[3]))
        assert later.result() == alone[3]
        stats = eng.stats()
    assert bad.finish_reason == "error" and "decoding the text failed" in bad_events[-1].error
    assert "boom" in bad_events[-1].error and bad.tokens == alone[2][: len(bad.tokens)]
    assert stats["step_errors"] == 0 and stats["detokenize_errors"] == 1


def test_a_callback_that_raises_still_ends_its_handle(model):
    with engine(model, max_batch=2) as eng:
        bad = eng.submit(PROMPTS[0], params(40), on_event=lambda e: 1 / 0)
        assert bad.result() == bad.tokens and bad.finish_reason == "cancelled"


def test_result_of_a_callback_handle_waits_for_its_end(model, alone):
    events = []
    with engine(model) as eng:
        handle = eng.submit(PROMPTS[1], params(LENGTHS[1]), on_event=events.append)
        assert handle.result() == alone[1] and handle.finish_reason == "length"
        with pytest.raises(TypeError, match="read through its callback"):
            next(iter(handle))
    assert [e.token_id for e in events if e.token_id is not None] == alone[1]


def test_generate_from_a_callback_is_refused_not_a_deadlock(model, alone):
    refused: list[BaseException] = []

    def on_event(event):
        if event.finished:
            try:
                eng.generate(PROMPTS[3], params(LENGTHS[3]))
            except RuntimeError as exc:
                refused.append(exc)

    with engine(model) as eng:
        eng.submit(PROMPTS[1], params(LENGTHS[1]), on_event=on_event).result()
        assert eng.generate(PROMPTS[3], params(LENGTHS[3])) == alone[3]  # the loop goes on
    assert refused and "on_event callback" in str(refused[0])


def test_close_ends_requests_submitted_to_an_engine_never_started(model):
    from ort_kvlayout.serve.engine import Engine, EngineConfig

    eng = Engine(model, EngineConfig(), start=False)
    handle = eng.submit(PROMPTS[1], params(5))
    seen = []
    other = eng.submit(PROMPTS[3], params(5), on_event=seen.append)
    eng.close()
    assert handle.result() == [] and handle.finish_reason == "cancelled"
    assert other.finish_reason == "cancelled" and seen[-1].finished


def test_generate_blocks_inside_an_event_loop(model, alone):
    async def main(eng):
        return eng.generate(PROMPTS[3], params(LENGTHS[3]))

    with engine(model) as eng:
        assert asyncio.run(main(eng)) == alone[3]


def idle_stats(eng, timeout: float = 10.0) -> dict:
    """The counters once the loop went idle after the last request (it then frees scratch
    rows; the last event reaches the reader before that)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = eng.stats()
        if stats["kv_committed_bytes"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.01)


@pytest.mark.parametrize("on_device", [True, False], ids=["served", "own-graph"])
@pytest.mark.parametrize("chunk", [4, 256])
def test_padded_decode_buckets_equal_generate_alone(model, alone, chunk, on_device):
    """The decode calls CUDA graphs need (slots [0, bucket), a capacity-wide mask, one fixed
    binding per bucket), run uncaptured on the CPU: joins, leaves and slot reuse give every
    request its tokens alone; padded rows (free slots, prefilling requests) change nothing."""
    with engine(
        model, max_batch=4, prefill_chunk=chunk, decode_buckets=(1, 2), sample_on_device=on_device
    ) as eng:
        handles = [eng.submit(p, params(n)) for p, n in zip(PROMPTS, LENGTHS)]
        got = [h.result() for h in handles]
        stats = idle_stats(eng)
    assert got == alone
    assert stats["decode_buckets"] == [1, 2, 4]
    assert 1 <= stats["decode_buckets_used"] <= 3
    assert stats["decode_padded_rows"] > 0  # free and prefilling slots padded the calls
    assert stats["graph_captures"] == stats["graph_replays"] == 0  # no CUDA: nothing captured
    assert stats["kv_bytes_moved"] == 0 and stats["kv_committed_bytes"] == 0


def test_padded_decode_keeps_one_binding_per_bucket(model, alone):
    """Slot reuse and growth never make a bucket's binding anew (on CUDA: never re-capture)."""
    with engine(model, max_batch=4, prefill_chunk=8, decode_buckets=(2,)) as eng:
        made = []
        real = eng.executor._buckets.__class__.__setitem__

        class Recording(dict):
            def __setitem__(self, key, value):
                made.append(key)
                real(self, key, value)

        eng.executor._buckets = Recording()
        for _ in range(2):  # the second round reuses every slot
            handles = [eng.submit(p, params(n)) for p, n in zip(PROMPTS, LENGTHS)]
            assert [h.result() for h in handles] == alone
        stats = eng.stats()
    assert sorted(made) == sorted(set(made)) and set(made) <= {2, 4}
    assert stats["decode_buckets_used"] == len(made)


def test_padded_decode_under_a_tiny_budget(model, alone):
    """Padding's scratch rows count against the budget: where they do not fit, the step runs
    its decoding span eagerly (or preempts, as without padding); the tokens stay the same and
    the budget holds."""
    from ort_kvlayout.serve.engine import Engine, EngineConfig

    with engine(model, max_batch=1) as probe:
        spec_bytes = max(
            probe.cache.entry_commit_bytes(len(p) + n) for p, n in zip(PROMPTS, LENGTHS)
        )
    config = EngineConfig(
        max_batch=4, kv_budget_bytes=spec_bytes + spec_bytes // 2, prefill_chunk=8,
        decode_buckets=(1, 2),
    )  # fmt: skip
    with Engine(model, config) as eng:
        handles = [eng.submit(p, params(n)) for p, n in zip(PROMPTS, LENGTHS)]
        got = [h.result() for h in handles]
        stats = eng.stats()
    assert got == alone
    assert stats["kv_peak_committed_bytes"] <= config.kv_budget_bytes


def test_cuda_graphs_are_refused_on_the_cpu():
    from ort_kvlayout.serve.engine import EngineConfig

    assert not EngineConfig().graphs and not EngineConfig().padded_decode
    assert EngineConfig(provider="cuda").graphs and EngineConfig(provider="cuda").padded_decode
    with pytest.raises(ValueError, match="cuda_graph=True needs provider='cuda'"):
        EngineConfig(cuda_graph=True)
    with pytest.raises(ValueError, match="CUDA graphs need decode buckets"):
        EngineConfig(provider="cuda", decode_buckets=())
    with pytest.raises(ValueError, match="bucket sizes must be >= 1"):
        EngineConfig(decode_buckets=(0, 2))
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(kv_budget_bytes=1 << 20, kv_budget_fraction=0.5)
    with pytest.raises(ValueError, match=r"kv_budget_fraction must be in \(0, 1\]"):
        EngineConfig(kv_budget_fraction=1.5)


def test_a_graph_that_cannot_be_served_falls_back_or_is_refused(model, alone, monkeypatch):
    from ort_kvlayout.model import serving_graph as sg
    from ort_kvlayout.serve import engine as engine_module

    def refuse(*args, **kwargs):
        raise sg.ServingGraphError("no LM head found above 'logits'")

    monkeypatch.setattr(engine_module, "serving_graph", refuse)
    with engine(model, max_batch=2) as eng:  # None: the model's own graph, and why
        assert eng.generate(PROMPTS[0], params(LENGTHS[0])) == alone[0]
        assert eng.stats()["sample_on_device"] is False
        assert "no LM head" in eng.served_refusal
    with pytest.raises(ValueError, match="sample_on_device=True.*no LM head"):
        engine(model, sample_on_device=True)


def test_a_graph_that_cannot_be_packed_is_served_unpacked_or_refused(model, alone, monkeypatch):
    from ort_kvlayout.model import serving_graph as sg
    from ort_kvlayout.serve import engine as engine_module

    def unpackable(*args, packed=False, **kwargs):
        if packed:
            raise sg.ServingGraphError("/mix (CumSum) may mix tokens")
        return sg.serving_graph(*args, **kwargs)

    monkeypatch.setattr(engine_module, "serving_graph", unpackable)
    with engine(model, max_batch=2) as eng:  # None: served, not packed, and why
        assert eng.generate(PROMPTS[0], params(LENGTHS[0])) == alone[0]
        assert eng.stats()["sample_on_device"] is True and eng.stats()["packed"] is False
        assert "CumSum" in eng.packed_refusal
    for config in ({"packed": True}, {"mixed": True}):
        with pytest.raises(ValueError, match="packed=True, but .*CumSum"):
            engine(model, **config)


def test_packing_defaults_and_refusals():
    from ort_kvlayout.serve.engine import EngineConfig

    assert EngineConfig().packing is None  # where the graph allows it
    assert EngineConfig(provider="cuda").packing is None
    assert EngineConfig(provider="cuda", mixed=True).packing is True
    assert EngineConfig(provider="cuda", packed=True).packing is True
    with pytest.raises(ValueError, match="packed=True needs the served graph"):
        EngineConfig(packed=True, sample_on_device=False)
    with pytest.raises(ValueError, match="mixed=True needs the served graph"):
        EngineConfig(mixed=True, sample_on_device=False)
    with pytest.raises(ValueError, match="mixed=True needs packed calls"):
        EngineConfig(mixed=True, packed=False)


def test_prefill_chunk_defaults_by_provider():
    """No prefill_chunk: 1,024 prompt tokens a step with CUDA (eager prefill calls bound by
    kernel launches below that), 256 on the CPU; a given one is kept, and checked."""
    from ort_kvlayout.serve.engine import EngineConfig
    from ort_kvlayout.serve.engine_config import CPU_PREFILL_CHUNK, CUDA_PREFILL_CHUNK

    assert (CPU_PREFILL_CHUNK, CUDA_PREFILL_CHUNK) == (256, 1024)
    assert EngineConfig().chunk == CPU_PREFILL_CHUNK
    assert EngineConfig(provider="cuda").chunk == CUDA_PREFILL_CHUNK
    assert EngineConfig(provider="cuda", prefill_chunk=64).chunk == 64
    with pytest.raises(ValueError, match="prefill_chunk must be >= 1, got 0"):
        EngineConfig(prefill_chunk=0)


def test_stats_give_the_kv_bytes_of_a_token(model):
    """kv_bytes_per_token: what one token of one slot commits over every buffer (a router's
    estimate of a request's need): the reservation is max_batch x capacity of them."""
    with engine(model, max_batch=2, cache="preallocated") as eng:
        stats = eng.stats()
    per_token = stats["kv_bytes_per_token"]
    assert per_token == eng.spec.kv.entry_bytes(1) > 0
    assert stats["kv_reserved_bytes"] == 2 * eng.capacity * per_token


def test_step_profile_counts_every_step(model):
    with engine(model, max_batch=2) as eng:
        eng.generate(PROMPTS[1], params(6))
        profile = eng.stats()["step_profile"]
    assert profile["steps"] == eng.stats()["steps"] > 0
    assert set(profile["per_step_ms"]) == {
        "schedule",
        "kv",
        "inputs",
        "run",
        "readback",
        "sample",
        "emit",
        "publish",
        "wait",
        "kv_ahead",
    }
    assert profile["total_ms"]["run"] > 0
    assert profile["total_ms"]["kv_ahead"] == 0  # commit_ahead off


@pytest.mark.parametrize("quant", ["int8-per-channel", "int8-per-token"])
def test_quantized_caches_through_both_graphs_equal_generate_alone(tmp_path, quant):
    """A builder-style int8 per-channel cache (static scales) and a PER_TOKEN int8 cache (scale
    caches bound beside the KV caches): the served graph and the model's own, eager and padded
    decode calls, every request its tokens alone."""
    from ort_kvlayout.runtime.generation import Runtime
    from ort_kvlayout.tools.patch import patch_model_dir

    library_or_skip()
    if quant == "int8-per-channel":
        variant, kv_quant = Variant(layers=2, kv_bits=8, kv_scheme="PER_CHANNEL"), {}
    else:
        variant, kv_quant = Variant(layers=2), {"kv_quant": quant}
    src = make_model_dir(tmp_path / "original", variant)
    model = patch_model_dir(src, tmp_path / "seq", layout="seq-major", **kv_quant).out_dir
    prompts = PROMPTS[:3]
    with Runtime(model) as rt:
        want = [rt.generate(p, 12, eos_token_ids=[]).tokens[0] for p in prompts]
    for on_device in (True, False):
        for buckets in (None, (1, 2)):
            with engine(
                model, max_batch=2, sample_on_device=on_device, decode_buckets=buckets
            ) as eng:
                handles = [eng.submit(p, params(12)) for p in prompts]
                assert [h.result() for h in handles] == want, (on_device, buckets)
                assert eng.stats()["sample_on_device"] is on_device


class _Tokens:
    """A tokenizer of space-separated ids: text for the events, and stop strings."""

    def encode(self, text):
        return [int(t) for t in text.split()]

    def decode(self, ids, **_kwargs):
        return "".join(f" {i}" for i in ids)


@pytest.mark.parametrize("chunk", [4, 256])
@pytest.mark.parametrize("packed", [False, True], ids=["served", "packed"])
def test_pipelined_decode_equals_generate_alone(model, alone, chunk, packed):
    """EngineConfig.pipeline: each decode step is launched once the last one's tokens are read,
    having been planned on the helper thread during the last one's Run. Joins, leaves (each
    ending the pipeline), slot reuse and chunked prefill between them: every request its tokens
    alone, no byte left committed."""
    with engine(model, max_batch=4, prefill_chunk=chunk, packed=packed, **PIPELINE) as eng:
        handles = [eng.submit(p, params(n)) for p, n in zip(PROMPTS, LENGTHS)]
        got = [h.result() for h in handles]
        stats = idle_stats(eng)
    assert got == alone
    assert stats["pipeline"] is True
    assert stats["pipelined_steps"] > len(PROMPTS)  # most decode steps ran pipelined
    assert stats["finished_length"] == len(PROMPTS) and stats["tokens"] == sum(LENGTHS)
    assert stats["step_errors"] == 0
    assert stats["steps"] > stats["pipelined_steps"]  # prefill steps and a row's end did not
    assert stats["kv_bytes_moved"] == 0 and stats["kv_committed_bytes"] == 0
    assert all(h.finish_reason == "length" for h in handles)


def test_pipelined_decode_plans_the_next_step_while_a_call_runs(model, alone):
    """The order that takes the host work off the critical path: step n+1 is staged on the
    helper thread while step n's Run is in flight (a Run made slow here, so that the order is
    certain)."""
    events = []
    with engine(model, max_batch=2, **PIPELINE) as eng:
        ex, session = eng.executor, eng.runtime.session
        stage = ex.stage_bucket

        class Slow:
            def __getattr__(self, name):
                return getattr(session, name)

            def run_with_iobinding(self, *args):
                events.append("run")
                time.sleep(0.02)  # releases the GIL, as ORT's Run does
                session.run_with_iobinding(*args)
                events.append("ran")

        def staged(*args, **kwargs):
            events.append("stage@" + threading.current_thread().name.split("_")[0])
            return stage(*args, **kwargs)

        ex.stage_bucket = staged
        eng.runtime.session = Slow()
        assert eng.generate(PROMPTS[0], params(LENGTHS[0])) == alone[0]
        stats = eng.stats()
    inside = ["run", "stage@ort-kvlayout-plan", "ran"]
    overlapped = sum(events[i : i + 3] == inside for i in range(len(events)))
    assert overlapped >= LENGTHS[0] - 3  # every pipelined step but the last was planned so
    assert stats["pipelined_steps"] >= LENGTHS[0] - 3


@pytest.mark.parametrize("on", [False, True], ids=["off", "pipelined"])
def test_pipelined_decode_keeps_seeded_sampling(model, on):
    """A sampling row draws its uniform number when its call is launched, never when it is
    staged: a seed gives the same tokens pipelined or not, whatever shares the calls."""
    sampling = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=3)
    with engine(model, max_batch=4, decode_buckets=(1, 2)) as eng:
        solo = eng.generate(PROMPTS[0], params(20, sampling=sampling))
    with engine(model, max_batch=4, decode_buckets=(1, 2), pipeline=on) as eng:
        handles = [eng.submit(PROMPTS[0], params(20, sampling=sampling)) for _ in range(2)]
        handles.append(eng.submit(PROMPTS[1], params(9)))  # ends first: the pipeline restarts
        got = [h.result() for h in handles]
        stats = eng.stats()
    assert got[:2] == [solo] * 2
    assert (stats["pipelined_steps"] > 0) is on


def test_pipelined_decode_ends_requests_exactly(model, alone):
    """A stop id, max_tokens and a stop string end a request at its token, with no token past
    it (the next step is launched only when no row may end), and the others go on."""
    from ort_kvlayout.serve.engine import Engine, EngineConfig

    stop = alone[0][5]
    text = " " + " ".join(str(t) for t in alone[2][:7])  # the text of its first 7 tokens
    with Engine(model, EngineConfig(max_batch=4, **PIPELINE), tokenizer=_Tokens()) as eng:
        a = eng.submit(PROMPTS[0], params(40, stop_token_ids=(stop,)))
        b = eng.submit(PROMPTS[1], params(LENGTHS[1]))
        c = eng.submit(PROMPTS[2], params(LENGTHS[2], stop=(text[-6:],)))
        d = eng.submit(PROMPTS[4], params(LENGTHS[4]))
        got = [h.result() for h in (a, b, c, d)]
        stats = idle_stats(eng)
    assert got[0] == alone[0][: alone[0].index(stop) + 1] and a.finish_reason == "stop"
    assert got[1] == alone[1] and b.finish_reason == "length"
    assert c.finish_reason == "stop" and alone[2][: len(got[2])] == got[2]
    assert text[-6:] in "".join(f" {t}" for t in got[2]) and len(got[2]) <= 7
    assert got[3] == alone[4]
    assert stats["pipelined_steps"] > 0 and stats["kv_committed_bytes"] == 0
    assert stats["finished_stop"] == stats["finished_length"] == 2 and stats["step_errors"] == 0
    assert stats["tokens"] == sum(len(g) for g in got)  # not one token past an end


def test_pipelined_decode_stops_for_a_cancel_and_a_new_request(model, alone):
    """A cancel or a submit reaches the loop within a step: the pipeline ends with no call in
    flight, the cancelled request's slot goes back, the new one starts."""
    with engine(model, max_batch=2, **PIPELINE) as eng:
        long = eng.submit(PROMPTS[4], params(240))
        first = next(iter(long))  # it decodes
        assert first.token_id == alone[4][0]
        late = eng.submit(PROMPTS[3], params(LENGTHS[3]))
        assert late.result() == alone[3]  # it joined a running pipeline
        eng.cancel(long.id)
        assert long.result()[: len(alone[4])] == alone[4][: len(long.tokens)]
        stats = idle_stats(eng)
    assert long.finish_reason == "cancelled"
    assert stats["kv_committed_bytes"] == 0 and stats["running"] == 0


def test_pipeline_needs_the_served_graph_and_padded_decode(model):
    from ort_kvlayout.serve.engine import EngineConfig

    with pytest.raises(ValueError, match="pipeline=True needs the served graph"):
        EngineConfig(pipeline=True, decode_buckets=(1,), sample_on_device=False)
    with pytest.raises(ValueError, match="pipeline=True needs padded decode"):
        EngineConfig(pipeline=True)  # the CPU decodes eager ranges by default
    # None: on with CUDA where the served graph runs and decode calls are padded (graphs)
    assert EngineConfig().pipelined(served=True) is False  # the CPU's default
    assert EngineConfig(provider="cuda").pipelined(served=True) is True
    assert EngineConfig(provider="cuda").pipelined(served=False) is False
    assert EngineConfig(provider="cuda", pipeline=False).pipelined(served=True) is False
    eager = EngineConfig(provider="cuda", cuda_graph=False, decode_buckets=())
    assert eager.pipelined(served=True) is False
    assert EngineConfig(decode_buckets=(1, 2), pipeline=True).pipelined(served=True) is True


def test_pipelined_decode_runs_while_a_request_waits_for_budget(model, alone):
    """A request that waits for KV budget (a slot free, the budget full) does not stop the
    pipeline: the loop would not admit it either. It starts once a request ends, and every
    request gets its tokens alone within the budget."""
    from ort_kvlayout.serve.engine import Engine, EngineConfig

    with engine(model, max_batch=1) as probe:
        need = probe.cache.entry_commit_bytes(len(PROMPTS[0]) + LENGTHS[0])
    config = EngineConfig(max_batch=4, kv_budget_bytes=2 * need, **PIPELINE)
    planned = []  # (a request waits, a slot is free, the next step was planned)
    with Engine(model, config, start=False) as eng:
        plan = eng._plan_next_decode

        def recorded(*args):
            staged = plan(*args)
            planned.append((bool(eng._waiting), None in eng._slots, staged is not None))
            return staged

        eng._plan_next_decode = recorded
        handles = [eng.submit(PROMPTS[0], params(LENGTHS[0])) for _ in range(6)]
        eng.start()
        got = [h.result() for h in handles]
        stats = eng.stats()
    assert got == [alone[0]] * 6
    assert (True, True, True) in planned  # pipelined while a request waited for budget
    assert stats["kv_peak_committed_bytes"] <= config.kv_budget_bytes


def test_pipelined_decode_under_preemption(model, alone):
    """A budget that makes the running requests preempt each other: the planned step's fit asks
    for a victim, so the pipeline hands the step to the loop, which preempts and recomputes as
    without it; every request still gets its tokens alone and the budget holds."""
    from ort_kvlayout.serve.engine import Engine, EngineConfig

    with engine(model, max_batch=1) as probe:
        need = max(probe.cache.entry_commit_bytes(len(p) + n) for p, n in zip(PROMPTS, LENGTHS))
    config = EngineConfig(max_batch=4, kv_budget_bytes=need + need // 2, prefill_chunk=8,
                          **PIPELINE)  # fmt: skip
    with Engine(model, config) as eng:
        handles = [eng.submit(p, params(n)) for p, n in zip(PROMPTS, LENGTHS)]
        got = [h.result() for h in handles]
        stats = eng.stats()
    assert got == alone
    assert stats["preemptions"] > 0 and stats["pipelined_steps"] > 0
    assert stats["kv_peak_committed_bytes"] <= config.kv_budget_bytes


class _CpuAsCuda:
    """An IOBinding that takes the CUDA binding calls of FixedBinding and CallUpload and makes
    them on the CPU, so that their CUDA paths (inputs in one buffer, bound by pointer at their
    offsets, uploaded in one copy) run a real ORT session here. Names bound from host arrays
    (bind_cpu_input) are recorded in `host_bound`."""

    host_bound: ClassVar[set] = set()

    def __init__(self, real):
        self._real, self._iobinding = real, real._iobinding

    def __getattr__(self, name):
        return getattr(self._real, name)

    def bind_input(self, name, device, device_id, *args):
        self._real.bind_input(name, "cpu", 0, *args)

    def bind_cpu_input(self, name, array):
        _CpuAsCuda.host_bound.add(name)
        self._real.bind_cpu_input(name, array)


def test_fixed_binding_arena_path_gives_every_request_its_tokens(model, alone, monkeypatch):
    """FixedBinding's and CallUpload's CUDA paths on a CPU session: every decode bucket's ids,
    lengths, packing and sampling inputs bound at their arena offsets and uploaded by one copy
    of the arena a call, every eager (prefill) call's inputs likewise through CallUpload, only
    the host input (total_sequence_length) bound from a host array (the "device" buffers
    separate copies, so a missing upload would feed stale values). Every request gets its
    tokens alone, pipelined and not."""
    import onnxruntime as ort
    from ort_kvlayout.serve.engine import Engine, EngineConfig

    made = ort.OrtValue.ortvalue_from_numpy

    def on_the_cpu(array, device="cpu", device_id=0):
        return made(np.array(array, copy=True), "cpu", 0)  # "device" memory of its own

    uploads = []
    update = ort.OrtValue.update_inplace
    monkeypatch.setattr(ort.OrtValue, "ortvalue_from_numpy", staticmethod(on_the_cpu))
    monkeypatch.setattr(
        ort.OrtValue, "update_inplace", lambda self, a: uploads.append(a.nbytes) or update(self, a)
    )
    for pipeline in (False, True):
        uploads.clear()
        _CpuAsCuda.host_bound = set()
        config = EngineConfig(max_batch=4, decode_buckets=(1, 2, 4), pipeline=pipeline)
        with Engine(model, config, start=False) as eng:
            session = eng.runtime.session
            real = session.io_binding
            monkeypatch.setattr(session, "io_binding", lambda real=real: _CpuAsCuda(real()))
            eng.executor.device = "cuda"  # the bucket calls are made at their first step
            handles = [eng.submit(p, params(n)) for p, n in zip(PROMPTS, LENGTHS)]
            eng.start()
            got = [h.result() for h in handles]
            stats = eng.stats()
            calls = [c for pair in eng.executor._buckets.values() for c in pair]
            eager = eng.executor._upload
            served = eng.executor.served
        assert got == alone
        assert calls and all(c._fixed._in_arena for c in calls)
        arenas = {c._fixed._arena_host.nbytes for c in calls}
        sizes = {host.nbytes for host, _ in eager._buffers.values()}
        assert set(uploads) <= arenas | sizes  # every upload a whole buffer's, one a call
        assert stats["prefill_calls"] > 0 and eager.uploads == stats["prefill_calls"]
        assert len(uploads) == stats["decode_calls"] + stats["prefill_calls"]
        assert _CpuAsCuda.host_bound == {served.total}
        assert stats["pipeline"] is pipeline


@pytest.mark.parametrize("multiple", [1, 7, 64])
def test_packed_calls_padded_to_a_multiple_give_every_request_its_tokens(
    model, alone, multiple, monkeypatch
):
    """EngineConfig.packed_multiple: every packed call's tokens padded up to a multiple (7: most
    calls padded; 64: every call mostly padding), and each request still gets its tokens alone:
    no row sees a padding token."""
    from ort_kvlayout.serve import executor

    counts = []

    def packed(rows, asked, pad):
        call = executor_pack(rows, asked, pad)
        prefills = any(len(t) > 1 for t, _ in rows)
        counts.append((sum(len(t) for t, _ in rows), call.tokens, prefills))
        assert asked == (multiple if prefills else 1)  # decode rows alone: not padded
        return call

    executor_pack = executor.pack_rows
    monkeypatch.setattr(executor, "pack_rows", packed)
    with engine(model, max_batch=4, prefill_chunk=4, packed=True, packed_multiple=multiple) as eng:
        handles = [eng.submit(p, params(n)) for p, n in zip(PROMPTS, LENGTHS)]
        got = [h.result() for h in handles]
        stats = idle_stats(eng)
    assert got == alone
    prefilling = [(real, t) for real, t, prefills in counts if prefills]
    assert prefilling and all(
        t % multiple == 0 and real <= t < real + multiple for real, t in prefilling
    )
    assert all(t == real for real, t, prefills in counts if not prefills)
    if multiple > 1:
        assert any(t > real for real, t in prefilling)  # padding ran
    assert stats["step_errors"] == 0


def test_packed_multiple_defaults_by_provider_and_is_checked():
    """None: CUDA_PACKED_MULTIPLE on CUDA, 1 (no padding) on the CPU; below 1 or not an integer
    is refused, naming the knob."""
    from ort_kvlayout.serve.engine import EngineConfig
    from ort_kvlayout.serve.engine_config import CUDA_PACKED_MULTIPLE

    assert EngineConfig().packed_tokens_multiple == 1
    assert EngineConfig(provider="cuda").packed_tokens_multiple == CUDA_PACKED_MULTIPLE
    assert EngineConfig(provider="cuda", packed_multiple=1).packed_tokens_multiple == 1
    with pytest.raises(ValueError, match="packed_multiple must be >= 1, got 0"):
        EngineConfig(packed_multiple=0)
    with pytest.raises(ValueError, match="packed_multiple must be an integer"):
        EngineConfig(packed_multiple=2.5)


@pytest.mark.parametrize("chunk", [1, 3, 256])
@pytest.mark.parametrize("pipeline", [False, True], ids=["steps", "pipelined"])
def test_graphed_prefill_steps_give_every_request_its_tokens(model, alone, chunk, pipeline):
    """EngineConfig.graph_chunk: a step that prefills runs as one call of slots [0, bucket) at
    the fixed shapes of (bucket, tokens), its decode rows beside each prompt's chunk of at most
    graph_chunk tokens (here uncaptured: the CPU runs the same calls). Every request gets its
    tokens alone, whatever the chunk (1: a prompt a token a step; 256: whole prompts, the step's
    budget shared), and the shapes repeat: far fewer than the calls."""
    config = {"decode_buckets": (1, 2, 4), "pipeline": pipeline}
    with engine(
        model, max_batch=4, packed=True, graph_chunk=chunk, prefill_chunk=8, **config
    ) as eng:
        handles = [eng.submit(p, params(n)) for p, n in zip(PROMPTS, LENGTHS)]
        got = [h.result() for h in handles]
        stats = idle_stats(eng)
        # one logits buffer a bucket, whatever the shapes (they stay on the device, never read)
        assert len(eng.executor._logits) <= len((1, 2, 4))
    assert got == alone
    assert stats["graph_chunk"] == chunk
    assert stats["graphed_calls"] == stats["prefill_calls"] >= len(PROMPTS)
    assert stats["mixed_calls"] >= 1  # decode rows rode in a graphed call
    # shapes: a bucket and a count of chunk blocks (the step's budget over graph_chunk) each
    blocks = -(-8 // chunk)
    assert 1 <= stats["graphed_shapes_used"] <= len((1, 2, 4)) * blocks
    assert stats["graphed_shapes_used"] < stats["graphed_calls"]
    assert stats["step_errors"] == 0 and stats["kv_committed_bytes"] == 0
    assert all(h.finish_reason == "length" for h in handles)


def test_graph_chunk_is_checked():
    """graph_chunk needs packed calls of the served graph and padded decode calls; below 0 is
    refused, naming the knob."""
    from ort_kvlayout.serve.engine import EngineConfig

    with pytest.raises(ValueError, match="graph_chunk must be >= 0 tokens"):
        EngineConfig(graph_chunk=-1)
    with pytest.raises(ValueError, match="graph_chunk needs packed calls"):
        EngineConfig(graph_chunk=4, packed=False, decode_buckets=(1, 2))
    with pytest.raises(ValueError, match="graph_chunk needs padded decode calls"):
        EngineConfig(graph_chunk=4)
    assert EngineConfig(graph_chunk=4, decode_buckets=(1, 2)).graph_chunk == 4


@pytest.mark.parametrize("chunk", [4, 256])
@pytest.mark.parametrize("packed", [False, True], ids=["served", "packed"])
@pytest.mark.parametrize("stops", [False, True], ids=["lengths", "stop-ids"])
def test_device_fed_pipeline_equals_generate_alone(model, alone, chunk, packed, stops):
    """EngineConfig.device_ids: each pipelined decode call after the first takes its ids from
    the last call's token ids where they are (a bucket's two bindings feed each other), and
    the host reads them during the next call. Joins, leaves (a request's last token ends the
    pipeline after the call in flight, whose token for it is dropped), slot reuse and chunked
    prefill: every request its tokens alone, no byte left committed. With stop ids (a token
    each request makes midway), requests end on a token read during the next call."""
    want, kwargs = alone, [{} for _ in PROMPTS]
    if stops:
        stop = [a[len(a) // 2] for a in alone]
        want = [a[: a.index(t) + 1] for a, t in zip(alone, stop)]
        kwargs = [{"stop_token_ids": (t,)} for t in stop]
    with engine(
        model, max_batch=4, prefill_chunk=chunk, packed=packed, device_ids=True, **PIPELINE
    ) as eng:
        handles = [eng.submit(p, params(n, **kw)) for p, n, kw in zip(PROMPTS, LENGTHS, kwargs)]
        got = [h.result() for h in handles]
        stats = idle_stats(eng)
    assert got == want
    assert stats["device_ids"] is True and stats["pipeline"] is True
    assert stats["pipelined_steps"] > len(PROMPTS)
    reason = "finished_stop" if stops else "finished_length"
    assert stats[reason] == len(PROMPTS) and stats["tokens"] == sum(map(len, want))
    assert stats["step_errors"] == 0
    assert stats["kv_bytes_moved"] == 0 and stats["kv_committed_bytes"] == 0


def test_device_ids_need_the_pipeline(model):
    from ort_kvlayout.serve.engine import EngineConfig

    with pytest.raises(ValueError, match="device_ids=True needs the pipeline"):
        EngineConfig(device_ids=True, pipeline=False)
    with pytest.raises(ValueError, match="device_ids=True needs the pipelined decode"):
        engine(model, max_batch=2, device_ids=True)


@pytest.mark.parametrize("chunk", [4, 256])
@pytest.mark.parametrize("fed", [False, True], ids=["host-ids", "device-ids"])
def test_prefill_prepared_during_the_last_call_gives_every_request_its_tokens(
    model, alone, chunk, fed
):
    """More requests than slots, pipelined: when a request ends and a waiting one can start, the
    helper prepares that step's prefill call during the last decode call (its admission, KV
    rows and packed call bound); the step runs it when its chunks are those. Every request its
    tokens alone, prepared calls among the prefill calls, no byte left committed."""
    with engine(
        model, max_batch=2, prefill_chunk=chunk, packed=True, device_ids=fed, **PIPELINE
    ) as eng:
        handles = [eng.submit(p, params(n)) for p, n in zip(PROMPTS, LENGTHS)]
        got = [h.result() for h in handles]
        stats = idle_stats(eng)
    assert got == alone
    # device-fed, an admission is planned before the last call's tokens are read: made again
    assert (0 if fed else 1) <= stats["prefill_calls_ahead"] <= stats["prefill_calls"]
    assert stats["step_errors"] == 0 and stats["finished_length"] == len(PROMPTS)
    assert stats["kv_bytes_moved"] == 0 and stats["kv_committed_bytes"] == 0


def test_a_failed_preparation_costs_only_itself(model, alone):
    """_prepare_admission raising, after committing the rows it planned: counted in
    prefill_ahead_errors, and the step plans and binds its call itself; every request its
    tokens, no step error, every byte back."""
    with engine(model, max_batch=2, prefill_chunk=256, packed=True, **PIPELINE) as eng:
        prepare = eng._prepare_admission

        def broken(*args):
            if prepare(*args) is not None:  # its rows committed, its call bound
                raise RuntimeError("binding refused")

        eng._prepare_admission = broken
        handles = [eng.submit(p, params(n)) for p, n in zip(PROMPTS, LENGTHS)]
        got = [h.result() for h in handles]
        stats = idle_stats(eng)
    assert got == alone
    assert stats["prefill_ahead_errors"] >= 1 and stats["prefill_calls_ahead"] == 0
    assert stats["step_errors"] == 0 and stats["kv_committed_bytes"] == 0
