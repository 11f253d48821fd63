"""The engine's executor: runs the model calls a step plans, and returns a token per sampled row.

    executor = Executor(runtime, cache, graphs=True, served=served_graph.inputs)  # or None
    tokens = executor.run(first_slot, ids, totals, last, rows)    # an eager call: (B, S) ids
    tokens = executor.run_bucket(bucket, ids, totals, rows)      # a padded decode call (graphs)
    tokens = executor.run_packed(first_slot, [(new_ids, cached), ...], rows)  # packed graph
    tokens = executor.run_graphed(bucket, rows_of_slots, rows, width, tokens)  # fixed shapes

It owns the session's bindings, the fixed per-bucket decode bindings (one CUDA graph each) and
how tokens are chosen. Two graphs, the served one packed or not:

* **Served** (`served`, model/serving_graph.py): lengths in place of the attention mask,
  logits only at the sampled position of each row, and ai.kvlayout::SampleTokens at the end.
  A call uploads the ids, one length per row and, when a row samples, its parameters and a
  uniform number; it reads back one int64 per row. On CUDA the logits never leave the device.
* **The model's own** (host sampling): the attention mask (as wide as the cache in a padded
  call), logits of every position copied to the host, sampled there with each request's
  Sampler (greedy rows together, one argmax).
* **Packed** (`packed`, the served graph's rewrite 4): the dense layers take the call's new
  tokens packed as (1, T) and only attention sees rows (serve/packing.py), so one call prefills
  the chunks of several requests, and may carry decode rows, at the cost of its real tokens.
  `run_packed` makes such a call; a bucket's decode call is the packed form of one token a row.
  `run_graphed` makes one over slots [0, bucket) at fixed shapes (rows of at most `width` new
  tokens, `tokens` tokens in all; EngineConfig.graph_chunk): one CUDA graph a shape, so that a
  step that prefills replays a graph as a decode step does.

`rows` says what each row samples with: None for a row whose token is not used (padding, a
prefill chunk that does not end its prompt), else the request's Sampler (its params and seeded
generator). A served call draws one uniform number from the generator of each sampling row it
runs, so a seeded request gets the same tokens whatever shares its calls.

Tokens come back as ints; -1 marks a row whose logits held NaN or infinity, -2 a row whose
sampling parameters the op refused (SampleTokens' contract); the engine ends that request with
an error.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnxruntime as ort

from ..model.serving_graph import ServedInputs
from ..runtime.fixed_binding import CallUpload, FixedBinding, bind_host_array
from ..runtime.generation import CUDA_GRAPH_WARMUP_RUNS, Runtime
from ..runtime.kv_cache import KvCache, bind_in_place
from ..runtime.sampling import GREEDY, Sampler, finite_rows
from .packing import pack_rows

__all__ = ["BAD_SAMPLING", "NONFINITE_LOGITS", "Executor", "StepProfile"]

NONFINITE_LOGITS, BAD_SAMPLING = -1, -2
# The CUDA graph ids of run_graphed's shapes: past every decode bucket's (a bucket's id is its
# size, at most max_batch).
GRAPHED_IDS = 1 << 20
# The CUDA graph id of a bucket's second binding (device-fed ids): its size past this.
PARITY_IDS = 1 << 19
_TOP_K_MAX = np.iinfo(np.int32).max
_BELOW_ONE = np.nextafter(np.float32(1), np.float32(0))


class StepProfile:
    """Host time per phase of the engine's steps (perf_counter_ns sums): where a step's
    milliseconds go. `schedule` is the engine's own bookkeeping (admission, the budget, the step
    plan); `kv` the cache's commits and releases (on CUDA the driver's map and unmap calls);
    `run` is ORT's Run, which returns when the step's kernels are done (the GPU's time and the
    launch overhead both land there); `emit` applies the tokens; `publish` decodes text and
    hands events over. Without overlap the phases add up to the step; with it, `publish` runs on
    the publisher thread during the next step's `run`, off the step's critical path, and `wait`
    is the engine thread waiting for the publisher to finish the last step's hand-over. With
    EngineConfig.commit_ahead, `kv_ahead` is the worker's commits of the next step's rows
    during the calls (off the critical path) and `kv` includes waiting for it to finish. With
    EngineConfig.pipeline, a pipelined decode step's schedule, kv, emit and publish, and the
    staging part of its inputs, run on the helper thread during the last step's `run` (so the
    phases add up to more than the wall time), and `wait` includes joining the helper."""

    PHASES = (
        "schedule", "kv", "inputs", "run", "readback", "sample", "emit", "publish", "wait",
        "kv_ahead",
    )  # fmt: skip

    def __init__(self) -> None:
        # every key present: two threads add to disjoint phases, never inserting a key
        self.ns = collections.Counter(dict.fromkeys(self.PHASES, 0))
        self.steps = 0

    def add(self, phase: str, start_ns: int) -> int:
        now = time.perf_counter_ns()
        self.ns[phase] += now - start_ns
        return now

    def summary(self) -> dict:
        per = max(self.steps, 1)
        return {
            "steps": self.steps,
            "total_ms": {p: self.ns[p] / 1e6 for p in self.PHASES},
            "per_step_ms": {p: self.ns[p] / 1e6 / per for p in self.PHASES},
        }


@dataclass
class _SamplingPlan:
    """A call's sampling parameters, staged (_Sampling.stage); the rows in `drawing` take their
    uniform number when the plan is applied."""

    rows: list
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    drawing: list


@dataclass
class _Sampling:
    """Per-row SampleTokens inputs of one call (host arrays)."""

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    uniform: np.ndarray

    last: list | None = None  # the rows of the last fill, when all of them were greedy

    @classmethod
    def zeros(cls, rows: int) -> _Sampling:
        return cls(np.zeros(rows, np.float32), np.zeros(rows, np.int32),
                   np.ones(rows, np.float32), np.zeros(rows, np.float32))  # fmt: skip

    def fill(self, rows: list[Sampler | None]) -> bool:
        """Sets every row (greedy for None); True when a value changed."""
        return self.apply(self.stage(rows))

    def stage(self, rows: list[Sampler | None]) -> _SamplingPlan | None:
        """The parameters of `rows` (None: the same samplers as the last fill, none drawing:
        nothing changes), computed without touching this object or drawing a number, so that a
        step can be staged while the last one runs (Executor.stage_bucket)."""
        if rows == self.last:  # the same samplers (params are frozen), none drawing: no change
            return None
        t, k, p = self.temperature.copy(), self.top_k.copy(), self.top_p.copy()
        drawing = []
        for i, sampler in enumerate(rows):
            params = sampler.params if sampler is not None else GREEDY
            t[i] = params.temperature
            k[i] = min(params.top_k, _TOP_K_MAX)
            p[i] = params.top_p
            if sampler is not None and not params.greedy:
                drawing.append((i, sampler))
        return _SamplingPlan(list(rows), t, k, p, drawing)

    def apply(self, plan: _SamplingPlan | None) -> bool:
        """Takes a staged plan, drawing each sampling row's uniform number now (one per call
        that samples the row, whenever the call was staged); True when a value changed."""
        if plan is None:
            return False
        for i, sampler in plan.drawing:
            self.uniform[i] = min(np.float32(sampler.rng.random()), _BELOW_ONE)
        changed = bool(plan.drawing) or not (
            np.array_equal(plan.temperature, self.temperature)
            and np.array_equal(plan.top_k, self.top_k) and np.array_equal(plan.top_p, self.top_p)
        )  # fmt: skip
        self.temperature, self.top_k, self.top_p = plan.temperature, plan.top_k, plan.top_p
        self.last = None if plan.drawing else plan.rows
        return changed

    def feeds(self, names: ServedInputs) -> dict[str, np.ndarray]:
        return {names.temperature: self.temperature, names.top_k: self.top_k,
                names.top_p: self.top_p, names.uniform: self.uniform}  # fmt: skip


def _used(tokens: list[int], rows: list[Sampler | None]) -> list[int | None]:
    """The served graph's token of each row whose token is used (None for the others)."""
    return [t if r is not None else None for t, r in zip(tokens, rows)]


class Executor:
    """See the module docstring. One thread (the engine loop) calls it."""

    def __init__(
        self, runtime: Runtime, cache: KvCache, graphs: bool, served: ServedInputs | None,
        packed: bool = False, packed_multiple: int = 1, device_ids: bool = False,
    ):  # fmt: skip
        if packed and served is None:
            raise ValueError("packed calls need the served graph")
        self.packed_multiple = packed_multiple  # a packed call's tokens: padded to a multiple
        if device_ids and served is None:
            raise ValueError("device-fed ids need the served graph (its token ids output)")
        # a bucket's calls in two bindings that feed each other's ids (run_staged with ids None)
        self.device_ids = device_ids
        self._last_run: tuple[int, int] | None = None  # (bucket, parity) of the last bucket call
        self._graph_runs: collections.Counter = collections.Counter()  # (bucket, parity) -> runs
        self.runtime, self.cache, self.graphs = runtime, cache, graphs
        self.spec = runtime.spec
        self.served, self.packed = served, packed
        self.device = "cuda" if runtime.provider == "cuda" else "cpu"
        self.device_id = runtime.device_id
        self.profile = StepProfile()
        self._bindings: dict[tuple[int, int], ort.IOBinding] = {}
        self._buckets: dict[int, tuple[_BucketCall, ...]] = {}  # one call, or two (device_ids)
        self.bucket_calls: collections.Counter = collections.Counter()
        self._greedy = Sampler(GREEDY)
        self._helper: ThreadPoolExecutor | None = None  # runs run_staged's `during`
        self._graphed: dict[tuple[int, int], _GraphedCall] = {}  # (bucket, tokens) -> call
        self._logits: dict[int, Any] = {}  # bucket -> the served graph's logits (never read)
        self.graphed_calls: collections.Counter = collections.Counter()  # (bucket, tokens)
        self._upload: CallUpload | None = None  # CUDA: an eager call's inputs in one copy

    @property
    def buckets_used(self) -> int:
        return len(self._buckets)

    def served_logits(self, bucket: int):
        """The logits output of the served graph's calls of `bucket` rows (bucket and graphed
        calls alike): on the device, never read, so one buffer a bucket serves them all (they
        run one at a time); an OrtValue on CUDA, a host array on the CPU."""
        held = self._logits.get(bucket)
        if held is None:
            array = np.zeros((bucket, 1, self.spec.vocab_size), self.runtime.logits_dtype)
            if self.device == "cuda":
                array = ort.OrtValue.ortvalue_from_numpy(array, "cuda", self.device_id)
            held = self._logits[bucket] = array
        return held

    @property
    def graphed_shapes_used(self) -> int:
        """The (bucket, tokens) shapes run_graphed has made a call of (a graph each)."""
        return len(self._graphed)

    def close(self) -> None:
        if self._helper is not None:
            self._helper.shutdown(wait=True)
            self._helper = None
        self._bindings.clear()
        self._buckets.clear()
        self._graphed.clear()
        self._logits.clear()

    # --- eager calls ---------------------------------------------------------------------------
    def _binding(self, first: int, count: int) -> ort.IOBinding:
        key = (first, count)
        binding = self._bindings.get(key)
        if binding is None:
            binding = self.runtime.session.io_binding()
            bind_in_place(binding, self.cache.entry_buffers(first, count))
            self._bindings[key] = binding
        return binding

    def run(
        self, first: int, ids: np.ndarray, totals: list[int], last: list[int],
        rows: list[Sampler | None],
    ) -> list[int | None]:  # fmt: skip
        """One uncaptured call over slots [first, first + B): ids (B, S), each row's total rows
        after the call, the index in S of the token each row samples at (`last`), and who
        samples (None: the row's token is not used). A token per row (None where not used)."""
        if self.packed:
            raise RuntimeError("the packed graph runs run_packed")
        t = time.perf_counter_ns()
        spec, binding = self.spec, self._binding(first, ids.shape[0])
        feeds = {spec.input_ids: ids}
        if spec.position_ids:
            positions = (
                np.asarray(totals, np.int64)[:, None] - ids.shape[1] + np.arange(ids.shape[1])
            )
            feeds[spec.position_ids] = np.maximum(positions, 0)
        if self.served is not None:
            names = self.served
            feeds[names.seqlens] = np.asarray(totals, np.int32) - 1
            feeds[names.logits_positions] = np.asarray(last, np.int64)
            feeds.update(self._sampling_feeds(rows))
            self._bind_inputs(binding, feeds)
            binding.bind_cpu_input(names.total, np.array(max(totals), np.int32))  # on the host
            out = self._bind_served_outputs(binding, ids.shape[0])
        else:
            mask = np.zeros((ids.shape[0], max(totals)), spec.mask_dtype)
            for i, n in enumerate(totals):
                mask[i, :n] = 1
            feeds[spec.attention_mask] = mask
            self._bind_inputs(binding, feeds)
            out = np.empty((*ids.shape, spec.vocab_size), self.runtime.logits_dtype)
            bind_host_array(binding.bind_output, spec.logits, out)
        return self._run_eager(binding, rows, last, t, out)

    def run_packed(
        self, first: int, rows: list[tuple[list[int], int]], samplers: list[Sampler | None]
    ) -> list[int | None]:
        """One packed call over slots [first, first + B): each row's new tokens and the rows its
        slot holds before the call (no tokens: the slot idles, its cache untouched), sampled at
        its last token by its Sampler (None: not used). A token per row (None where not used)."""
        return self._run_bound(self.prepare_packed(first, rows, samplers))

    def run_prepared(self, prepared: _PreparedCall) -> list[int | None]:
        """Runs a packed call that prepare_packed bound (no eager call in between: their device
        inputs share CallUpload's buffers)."""
        return self._run_bound(prepared)

    def _run_bound(self, prepared: _PreparedCall) -> list[int | None]:
        return self._run_eager(
            prepared.binding, prepared.samplers, None, time.perf_counter_ns(), prepared.out
        )

    def prepare_packed(
        self, first: int, rows: list[tuple[list[int], int]], samplers: list[Sampler | None]
    ) -> _PreparedCall:
        """run_packed's call bound, not run: its inputs packed and uploaded, its outputs bound
        (each sampling row draws its uniform number now: the engine prepares a call ahead of
        its step only where no row draws)."""
        t = time.perf_counter_ns()
        # Padded only where a row prefills: a decode call's token count is its rows, already
        # one of few values, and it keeps the GEMM shapes of the same rows' bucket calls.
        chunked = any(len(tokens) > 1 for tokens, _ in rows)
        call = pack_rows(rows, self.packed_multiple if chunked else 1, self.spec.pad_token_id)
        names, binding = self.served, self._binding(first, len(rows))
        feeds = {
            self.spec.input_ids: call.ids, names.unpack_index: call.unpack,
            names.pack_index: call.pack, names.query_seqlens: call.query_seqlens,
            names.seqlens: call.seqlens_k, names.logits_positions: call.last,
            **self._sampling_feeds(samplers),
        }  # fmt: skip
        self._bind_inputs(binding, feeds)
        binding.bind_cpu_input(names.total, np.array(call.total, np.int32))  # on the host
        out = self._bind_served_outputs(binding, len(rows))
        self.profile.add("inputs", t)
        return _PreparedCall(binding, list(samplers), out)

    def run_graphed(
        self, bucket: int, rows: list[tuple[list[int], int]], samplers: list[Sampler | None],
        width: int, tokens: int,
    ) -> list[int | None]:  # fmt: skip
        """A packed call of slots [0, bucket) at fixed shapes (EngineConfig.graph_chunk): rows
        of at most `width` new tokens, padded to `tokens` tokens, through the fixed binding of
        its (bucket, tokens) shape, a CUDA graph of its own with graphs on (ORT runs it
        CUDA_GRAPH_WARMUP_RUNS times, captures the next run and replays it from then on). A
        token per row (None where not used)."""
        t = time.perf_counter_ns()
        call = pack_rows(rows, pad=self.spec.pad_token_id, width=width, tokens=tokens)
        key = (bucket, tokens)
        graphed = self._graphed.get(key)
        if graphed is None:
            graph_id = GRAPHED_IDS + len(self._graphed)
            graphed = self._graphed[key] = _GraphedCall(self, bucket, width, tokens, graph_id)
        graphed.apply(call, samplers)
        t = self.profile.add("inputs", t)
        runs = self.graphed_calls[key]
        self.graphed_calls[key] = runs + 1
        options = self.runtime.run_options(graphed.graph_id if self.graphs else None)
        self.runtime.session.run_with_iobinding(graphed.binding, options)
        t = self.profile.add("run", t)
        self._count_graph_run(runs)
        out = graphed.output()
        self.runtime.check_length_record("engine graphed step")
        t = self.profile.add("readback", t)
        tokens_out = _used(out[:, 0].tolist(), samplers)
        self.profile.add("sample", t)
        return tokens_out

    def _bind_inputs(self, binding: ort.IOBinding, feeds: dict[str, np.ndarray]) -> None:
        """An eager call's device inputs: on CUDA in one copy (CallUpload), on the CPU bound
        as they are."""
        if self.device == "cuda":
            if self._upload is None:
                self._upload = CallUpload(self.device_id)
            self._upload.bind(binding, feeds)
            return
        for name, array in feeds.items():
            binding.bind_cpu_input(name, array)

    def _sampling_feeds(self, rows: list[Sampler | None]) -> dict[str, np.ndarray]:
        """The served graph's sampling inputs of `rows`."""
        sampling = _Sampling.zeros(len(rows))
        sampling.fill(rows)
        return sampling.feeds(self.served)

    def _bind_served_outputs(self, binding: ort.IOBinding, rows: int) -> np.ndarray:
        """The served graph's outputs: the logits stay on the device, the tokens come back into
        the host array returned, bound by pointer (_run_eager)."""
        binding.bind_output(self.spec.logits, self.device, self.device_id)
        tokens = np.zeros((rows, 1), np.int64)
        bind_host_array(binding.bind_output, self.served.token_ids, tokens)
        return tokens

    def _run_eager(
        self, binding: ort.IOBinding, rows: list[Sampler | None], last: list[int] | None, t: int,
        out: np.ndarray,
    ) -> list[int | None]:  # fmt: skip
        """Runs a bound eager call and returns its tokens (`last`: the host-sampled position of
        each row in the model's own graph; `out`: the host array its tokens, or the model's own
        graph's logits, are bound to by pointer: read as it is, without get_outputs(), which
        wraps every bound output, the cache's 2 x layers included, at each call)."""
        t = self.profile.add("inputs", t)
        # gpu_graph_id -1 with CUDA graphs on: never captured (ORT's default id 0 would be)
        self.runtime.session.run_with_iobinding(binding, self.runtime.run_options(None))
        t = self.profile.add("run", t)
        self.runtime.check_length_record("engine step")
        t = self.profile.add("readback", t)
        if self.served is not None:
            tokens = _used(out[:, 0].tolist(), rows)
        else:
            tokens = self._host_sample(out[np.arange(len(last)), last], rows)
        self.profile.add("sample", t)
        return tokens

    # --- padded decode calls -------------------------------------------------------------------
    def run_bucket(
        self, bucket: int, ids: list[int], totals: list[int], rows: list[Sampler | None]
    ) -> list[int | None]:
        """The decode call of slots [0, bucket) through its fixed binding; with CUDA graphs,
        graph id `bucket`: ORT runs it CUDA_GRAPH_WARMUP_RUNS times, captures it on the next
        run and replays it from then on (the cache's counters follow that rule)."""
        return self.read_tokens(self.run_staged(self.stage_bucket(bucket, totals, rows), ids))

    def stage_bucket(
        self, bucket: int, totals: list[int], rows: list[Sampler | None]
    ) -> _StagedBucket:
        """A bucket call's inputs but its ids, computed on the host without touching anything a
        call in flight reads: the engine stages the next decode step while this one runs."""
        t = time.perf_counter_ns()
        calls = self._buckets.get(bucket)
        if calls is None:
            calls = self._buckets[bucket] = _BucketCall.made(self, bucket)
        # device-fed ids: the parity that follows the last call of this bucket, whose token ids
        # are its ids
        last = self._last_run
        parity = 1 - last[1] if last is not None and last[0] == bucket and len(calls) > 1 else 0
        staged = calls[parity].stage(totals, rows)
        self.profile.add("inputs", t)
        return staged

    def run_staged(
        self, staged: _StagedBucket, ids: list[int] | None,
        during: Callable[[], Any] | None = None,
    ) -> _BucketRun:  # fmt: skip
        """Applies a staged call's inputs with its ids (each sampling row draws its uniform
        number now) and runs it on this thread. With device_ids, ids None feeds the call the
        token ids of the last call, the same bucket's other binding, without leaving the device
        (each row's token in its row: padding rows take whatever theirs sampled, a valid id or a
        negative error code, which the embedding's Gather reads from the end). `during` runs
        on the helper thread while the
        call runs (ORT's Run releases the GIL, so the two overlap; the engine plans its next
        step there), and is joined before this returns: the result carries what it returned,
        and an exception it raised is raised here once the call is done. Around a graph's warm-up
        and capture runs it runs after the call instead: a capture records the stream, and a
        driver call from another thread may spoil it."""
        t = time.perf_counter_ns()
        call = staged.call
        bucket, parity = call.bucket, call.parity
        if ids is None and self._last_run != (bucket, 1 - parity):
            raise RuntimeError(
                f"device-fed ids: bucket {bucket}'s call {parity} follows {self._last_run}, not "
                "the same bucket's other call"
            )
        call.apply(staged, ids)
        t = self.profile.add("inputs", t)
        self.bucket_calls[bucket] += 1
        runs = self._graph_runs[bucket, parity]
        self._graph_runs[bucket, parity] = runs + 1
        self._last_run = (bucket, parity)
        options = self.runtime.run_options(call.graph_id if self.graphs else None)
        beside = during is not None and (not self.graphs or runs > CUDA_GRAPH_WARMUP_RUNS)
        job = None
        if beside:
            if self._helper is None:
                self._helper = ThreadPoolExecutor(1, thread_name_prefix="ort-kvlayout-plan")
            job = self._helper.submit(during)
        try:
            self.runtime.session.run_with_iobinding(call.binding, options)
        finally:
            t = self.profile.add("run", t)
            if job is not None:  # joined whatever happened: one thread owns the engine again
                failure = job.exception()
                self.profile.add("wait", t)
        if job is not None and failure is not None:
            raise failure
        result = job.result() if job is not None else during() if during is not None else None
        return _BucketRun(staged, runs, result)

    def read_tokens(self, done: _BucketRun) -> list[int | None]:
        """The tokens of a bucket call that ran (None where not used)."""
        t = time.perf_counter_ns()
        self._count_graph_run(done.runs)
        call, rows = done.staged.call, done.staged.rows
        out = call.output()  # on the host: the step's kernels are done
        self.runtime.check_length_record("engine decode step")
        t = self.profile.add("readback", t)
        if self.served is not None:
            tokens = _used(out[:, 0].tolist(), rows)
        else:
            tokens = self._host_sample(out[:, -1], rows)
        self.profile.add("sample", t)
        return tokens

    def _count_graph_run(self, runs: int) -> None:
        """The cache's graph counters for a call of a graph id that had run `runs` times before
        (graphs on): ORT captures on the run after its warm-up and replays from then on."""
        if not self.graphs:
            return
        if runs == CUDA_GRAPH_WARMUP_RUNS:
            self.cache.stats.graph_captures += 1
        elif runs > CUDA_GRAPH_WARMUP_RUNS:
            self.cache.stats.replays += 1

    def _host_sample(self, logits: np.ndarray, rows: list[Sampler | None]) -> list[int | None]:
        """Tokens from host logits (B, V): greedy rows together (one argmax, the same tokens as
        each request's own Sampler), the others by their Sampler. A row whose logits are not all
        finite gets NONFINITE_LOGITS (its request ends with an error; the others go on, as with
        the device sampler)."""
        tokens: list[int | None] = [None] * len(rows)
        used = [i for i, r in enumerate(rows) if r is not None]
        if not used:
            return tokens
        finite = dict(zip(used, finite_rows(logits[used]).tolist()))
        greedy = [i for i in used if finite[i] and rows[i].params.greedy]  # type: ignore[union-attr]
        if greedy:
            for i, token in zip(greedy, self._greedy(logits[greedy])):
                tokens[i] = int(token)
        for i in used:
            r = rows[i]
            if not finite[i]:
                tokens[i] = NONFINITE_LOGITS
            elif not r.params.greedy:  # type: ignore[union-attr]
                tokens[i] = int(r(logits[i][None])[0])  # type: ignore[misc]
        return tokens


class _BucketCall:
    """The decode call of slots [0, bucket): the KV buffers bound at slot 0 with batch `bucket`
    and every other input and output at one address with one shape for the engine's life, as a
    CUDA graph needs (device OrtValues on CUDA, updated in place each step; host arrays bound by
    pointer on the CPU). The cache's pointers never move (growth commits granules under them, a
    freed slot keeps its addresses), so the binding, and the graph captured from it, stay valid
    across growth and slot reuse.

    Served graph: ids, lengths (int32 a row), zero logits positions, the sampling inputs (sent
    only when they change) and total_sequence_length = the capacity in CPU memory; out come the
    token ids (the logits stay on the device). Packed, the ids are (1, bucket), the packing is
    fixed (the identity, one token a row) and the logits positions are the rows' indices. The
    model's own graph: ids and a mask as wide as the cache (only the rows whose length changed
    are rewritten); out come the logits."""

    @classmethod
    def made(cls, executor: Executor, bucket: int) -> tuple[_BucketCall, ...]:
        """The bucket's call, or with device_ids its two calls, each reading its ids from the
        other's token ids (a buffer each, bound as one's output and the other's input)."""
        if not executor.device_ids:
            return (cls(executor, bucket),)
        tokens = [np.zeros((bucket, 1), np.int64) for _ in range(2)]
        if executor.device == "cuda":
            tokens = [
                ort.OrtValue.ortvalue_from_numpy(t, "cuda", executor.device_id) for t in tokens
            ]
        return tuple(cls(executor, bucket, p, tokens[p], tokens[1 - p]) for p in range(2))

    def __init__(
        self, executor: Executor, bucket: int, parity: int = 0, tokens_out=None, ids_from=None
    ):
        rt, spec, served = executor.runtime, executor.spec, executor.served
        self.bucket, self.served, self.spec = bucket, served, spec
        self.parity = parity
        # the CUDA graph id: the bucket's size, or past every size for the second binding
        self.graph_id = bucket + parity * PARITY_IDS
        self.packed = executor.packed
        capacity = executor.cache.capacity
        self._lengths = np.zeros(bucket, np.int64)  # rows of each mask row / length now
        ids_shape = (1, bucket) if self.packed else (bucket, 1)
        self._ids_from = ids_from  # the other call's token ids, this one's ids (device_ids)
        device_inputs = {}
        if ids_from is None:
            inputs: dict[str, np.ndarray] = {spec.input_ids: np.zeros(ids_shape, np.int64)}
        elif isinstance(ids_from, np.ndarray):  # the CPU: a view of the other's bound array
            inputs = {spec.input_ids: ids_from.reshape(ids_shape)}
        else:
            inputs = {}
            device_inputs[spec.input_ids] = (ids_from, ids_shape)
        if self.packed:  # one token a row, in row order: the packing is the identity
            rows = np.arange(bucket, dtype=np.int64)
            inputs[served.unpack_index] = rows[:, None].copy()
            inputs[served.pack_index] = rows[None, :].copy()
            inputs[served.query_seqlens] = np.ones(bucket, np.int32)
        if spec.position_ids:
            inputs[spec.position_ids] = np.zeros((bucket, 1), np.int64)
        host_inputs = {}
        if served is not None:  # the logits stay on the device, never read: shared
            outputs = {spec.logits: executor.served_logits(bucket)}
        else:
            outputs = {spec.logits: np.zeros((bucket, 1, spec.vocab_size), rt.logits_dtype)}
        if served is not None:
            self._sampling = _Sampling.zeros(bucket)
            inputs[served.seqlens] = np.zeros(bucket, np.int32)
            # the row's token: index 0 of its row, or its packed index
            positions = np.arange(bucket) if self.packed else np.zeros(bucket)
            inputs[served.logits_positions] = positions.astype(np.int64)
            inputs.update(self._sampling.feeds(served))
            # in CPU memory (the op's input 6); the logits stay on the device
            host_inputs[served.total] = np.array(capacity, np.int32)
            out = np.zeros((bucket, 1), np.int64) if tokens_out is None else tokens_out
            outputs[served.token_ids] = out
            self._read = served.token_ids
        else:
            self.mask = np.zeros((bucket, capacity), spec.mask_dtype)
            inputs[spec.attention_mask] = self.mask
            self._read = spec.logits
        self._fixed = FixedBinding(
            rt.session, executor.device, executor.device_id,
            executor.cache.entry_buffers(0, bucket), inputs, outputs, host_inputs,
            device_inputs,
        )  # fmt: skip
        self.binding = self._fixed.binding
        self._dirty = set(inputs)  # every input is uploaded before the first call
        if ids_from is not None:
            self._dirty.discard(spec.input_ids)  # the other call's output: never uploaded

    def stage(self, totals: list[int], rows: list[Sampler | None]) -> _StagedBucket:
        """The call's lengths and sampling parameters for `totals` and `rows`, computed without
        touching the bound arrays (a call may be running from them)."""
        lengths = sampling = None
        if self.served is not None:
            lengths = np.asarray(totals, np.int32) - 1
            sampling = self._sampling.stage(rows)
        return _StagedBucket(self, list(totals), list(rows), lengths, sampling)

    def apply(self, staged: _StagedBucket, ids: list[int] | None) -> None:
        """Writes a staged call's inputs and its ids to the bound arrays and uploads them (the
        same device addresses: updated in place). Only between calls."""
        spec, host, totals = self.spec, self._fixed.host, staged.totals
        if ids is None:  # device_ids: the other call's token ids, as they are
            pass
        elif isinstance(self._ids_from, ort.OrtValue):  # CUDA: into the other's output buffer
            self._ids_from.update_inplace(np.asarray(ids, np.int64).reshape(-1, 1))
        elif self.packed:
            host[spec.input_ids][0, :] = ids
        else:
            host[spec.input_ids][:, 0] = ids
        if ids is not None and self._ids_from is None:
            self._dirty.add(spec.input_ids)
        if spec.position_ids:
            host[spec.position_ids][:, 0] = np.asarray(totals, np.int64) - 1
            self._dirty.add(spec.position_ids)
        if self.served is not None:
            if not np.array_equal(staged.lengths, host[self.served.seqlens]):
                host[self.served.seqlens][:] = staged.lengths
                self._dirty.add(self.served.seqlens)
            if self._sampling.apply(staged.sampling):
                feeds = self._sampling.feeds(self.served)
                for name, array in feeds.items():
                    host[name][:] = array
                self._dirty.update(feeds)
        else:
            for i, t in enumerate(totals):
                held = self._lengths[i]
                if t > held:
                    self.mask[i, held:t] = 1
                elif t < held:
                    self.mask[i, t:held] = 0
                self._lengths[i] = t
            self._dirty.add(spec.attention_mask)
        self._fixed.upload(self._dirty)
        self._dirty.clear()

    def output(self) -> np.ndarray:
        """Token ids (bucket, 1), or the logits (bucket, 1, vocab) of the model's own graph; on
        the CPU the bound buffer itself, valid until the next call."""
        return self._fixed.read(self._read)


class _GraphedCall:
    """A packed call of slots [0, bucket) whose shapes stay put (Executor.run_graphed): the KV
    buffers bound at slot 0 with batch `bucket`, the ids and packing of `tokens` tokens in rows
    of `width` ((1, tokens) ids and pack index, (bucket, width) unpack index), lengths, logits
    positions and sampling inputs of `bucket` rows, total_sequence_length = the capacity in CPU
    memory, the token ids out (the logits stay on the device): one address and one shape each
    for the engine's life, as a CUDA graph needs. Every input is rewritten and uploaded at each
    call (FixedBinding: the small ones in one copy)."""

    def __init__(self, executor: Executor, bucket: int, width: int, tokens: int, graph_id: int):
        rt, spec, served = executor.runtime, executor.spec, executor.served
        self.graph_id, self.served = graph_id, served
        self._sampling = _Sampling.zeros(bucket)
        self._ids, self._pack = spec.input_ids, served.pack_index
        inputs = {
            spec.input_ids: np.zeros((1, tokens), np.int64),
            served.unpack_index: np.zeros((bucket, width), np.int64),
            served.pack_index: np.zeros((1, tokens), np.int64),
            served.query_seqlens: np.zeros(bucket, np.int32),
            served.seqlens: np.zeros(bucket, np.int32),
            served.logits_positions: np.zeros(bucket, np.int64),
            **{name: array.copy() for name, array in self._sampling.feeds(served).items()},
        }
        outputs = {
            spec.logits: executor.served_logits(bucket),  # on the device, never read
            served.token_ids: np.zeros((bucket, 1), np.int64),
        }
        host_inputs = {served.total: np.array(executor.cache.capacity, np.int32)}
        self._fixed = FixedBinding(
            rt.session, executor.device, executor.device_id,
            executor.cache.entry_buffers(0, bucket), inputs, outputs, host_inputs,
        )  # fmt: skip
        self.binding = self._fixed.binding

    def apply(self, call, samplers: list[Sampler | None]) -> None:
        """Writes a packed call's inputs (pack_rows at this call's width and tokens) and the
        rows' sampling parameters (each sampling row draws its uniform number now) to the bound
        arrays and uploads them. Only between calls."""
        names, host = self.served, self._fixed.host
        host[self._ids][...] = call.ids
        host[names.unpack_index][...] = call.unpack
        host[self._pack][...] = call.pack
        host[names.query_seqlens][...] = call.query_seqlens
        host[names.seqlens][...] = call.seqlens_k
        host[names.logits_positions][...] = call.last
        self._sampling.fill(samplers)
        for name, array in self._sampling.feeds(names).items():
            host[name][...] = array
        self._fixed.upload(host)

    def output(self) -> np.ndarray:
        """Token ids (bucket, 1); on the CPU the bound buffer itself, valid until the next call."""
        return self._fixed.read(self.served.token_ids)


@dataclass
class _PreparedCall:
    """A packed call bound and ready to run (Executor.prepare_packed): its binding, who samples
    each row and the host array its tokens come back into."""

    binding: ort.IOBinding
    samplers: list
    out: np.ndarray


@dataclass
class _StagedBucket:
    """A bucket call staged (Executor.stage_bucket): what _BucketCall.apply writes, ids aside
    (`lengths` None: the model's own graph, which takes a mask; `sampling` None: the samplers
    of the last call applied, none drawing)."""

    call: _BucketCall
    totals: list[int]
    rows: list
    lengths: np.ndarray | None
    sampling: _SamplingPlan | None


@dataclass
class _BucketRun:
    """A bucket call that ran (run_staged): what it was, the runs its graph had before it
    (captures and replays are counted from them) and what its `during` returned."""

    staged: _StagedBucket
    runs: int
    during: Any
