"""A serving engine: iteration-level scheduling over one growable KV cache of `max_batch` slots.

    with Engine(model_dir, EngineConfig(max_batch=8, kv_budget_bytes=1 << 30)) as engine:
        handle = engine.submit(prompt_ids, RequestParams(max_tokens=64))
        for event in handle:                      # or: async for event in handle (asyncio)
            event.token_id, event.text, event.finish_reason
        engine.stats()                            # running, waiting, preemptions, KV bytes, ...

One thread (the engine loop) owns the ORT session and the cache; `submit` and `cancel` may be
called from any thread and only post to its inbox. The model calls run through the executor
(executor.py) on the served graph (model/serving_graph.py: lengths in, logits only at the
sampled rows, tokens chosen on the device; only ids read back) unless `sample_on_device` is
False or the graph does not allow it. Each step, planned by scheduler.plan_step (a pure
function of the slots and the queue) and applied by the loop:

1. Admission. Waiting requests (oldest first) take the lowest free slot while the step's KV need
   plus their whole sequence fits the budget (`kv_budget_bytes`).
2. Budget. If the rows this step will write do not fit, the running request that arrived last
   is preempted: its slot and pages are released and it goes back to the queue with its tokens
   so far, to be recomputed (prefilled again) later (`preemptions` counts them).
3. Decode. One call for a slot range holding every decoding request: the KV buffers are bound
   at the range's first slot with its length as the batch (the same reservation, nothing
   moved). Padded (the default on CUDA, where each call is a CUDA graph): slots [0, bucket)
   with the smallest bucket (1, 2, 4, then multiples of 8, and max_batch) that holds the
   highest decoding slot, total_sequence_length = the cache's capacity, one fixed binding and
   one graph per bucket, captured once and replayed across growth and slot reuse (the cache's
   addresses never move; the lengths are read on the device). Eager (the CPU default): the
   span [lo, hi] of the decoding slots. A slot in the range that is not decoding writes one scratch row: a
   prefilling request's next row (its next chunk overwrites it) or row 0 of a free slot (one
   granule per buffer, released when the slot leaves the range or the engine goes idle).
   Scratch rows count against the budget; where a bucket's do not fit but the span does, that
   step's decode runs the span eagerly (serve/batching.py has the rules).
4. Prefill. Prefilling requests, oldest first, get chunks of their remaining prompt until
   `prefill_chunk` tokens were scheduled in this step. Packed (`packed`, the served graph's
   rewrite 4): the step's chunks are one call over the slots from the lowest to the highest
   that prefills (the slots between idle: query_seqlens 0), whose dense layers compute the
   chunks' tokens alone; with `mixed`, that call carries the step's decode rows too (one Run a
   step, uncaptured). Otherwise each chunk is one call of batch 1 bound at the request's slot
   (a first prompt, then GQA's chunk case: rows written at [P, P+S)). A running request
   therefore waits at most one decode call plus `prefill_chunk` prompt tokens per step, however
   long the new prompts are (chunked prefill, Sarathi/vLLM-style).

A request's slot and pages go back to the pool the moment it finishes or is cancelled, but for
the granule under its row 0, kept until the next step for its next request or scratch row; a
waiting request reuses the slot in place (0 bytes moved). Events reach their readers after the
step's counters are published. With `overlap` (the CUDA default) that work leaves the step's
critical path: the engine thread plans a step, passes the previous step's stats and events to a
publisher thread (publisher.py), and runs the step's calls, during which (ORT's Run releases the GIL) the
publisher decodes the events' text and hands them over. A stop string is still checked as its
token comes (a request with stop strings has its text decoded at once), so no request runs a
step past its end.

Pipelined decode (`pipeline`, the CUDA default where the served graph runs): while a decode call
of a bucket runs, the executor's helper thread emits the last step's tokens, publishes, and
plans the next step as if no row of the call ends (the budget's fit, the KV rows it writes
committed, its lengths and sampling parameters staged); once the call's tokens are read, the
next call is launched with them before anything else. A row whose token may end its request (a
stop id, max_tokens, stop strings, an error) is emitted first; a row that ends ends the
pipeline, as do a waiting request that a free slot and the budget would admit, the inbox and
close(): the loop then plans the next step as usual, so no token passes a request's end and no
slot is released under a running call. A sampling row draws its uniform number when its call is
launched, so a seed gives the same tokens pipelined or not.

A mixed or multi-request call needs the packed graph: the model's own graph is right-padded,
and its dense layers would compute every row of the (batch, longest chunk) shape, multiplying a
decode row's cost by the chunk length (docs/SERVING.md).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from numbers import Integral

import numpy as np
import onnx
import onnxruntime as ort

from ..model.serving_graph import ServingGraphError, serving_graph
from ..op.library import library_path
from ..runtime.generation import Runtime
from ..runtime.kv_cache import KvCache, KvMemoryError
from ..runtime.model_spec import ModelSpec
from ..runtime.sampling import Sampler
from . import memory
from .batching import bucket_for, decode_rows, resolve_buckets
from .detokenizer import IncrementalText
from .engine_config import EngineConfig
from .executor import NONFINITE_LOGITS, Executor
from .publisher import LATER, Publisher, decode_failure
from .requests import (
    EngineClosed,
    EngineOverloaded,
    Event,
    RequestHandle,
    RequestParams,
    RequestTooLarge,
)
from .scheduler import (
    Limits,
    Running,
    StepPlan,
    keep_scratch,
    next_prefill_rows,
    plan_step,
)

__all__ = [
    "Engine",
    "EngineClosed",
    "EngineConfig",
    "EngineOverloaded",
    "Event",
    "RequestHandle",
    "RequestParams",
    "RequestTooLarge",
]


_log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Request:
    id: int
    prompt_len: int
    seq: list[int]  # prompt + generated so far (what a recompute prefills)
    params: RequestParams
    handle: RequestHandle
    sampler: Sampler
    arrival: int  # submission order: preemption takes the largest
    generated: int = 0
    cached: int = 0  # rows in the slot's KV (len(seq) - cached == 1: decoding)
    slot: int = -1
    stop_ids: frozenset = frozenset()
    text: IncrementalText | None = None  # with a tokenizer: the text sent so far
    submitted_at: float = field(default_factory=time.perf_counter)

    @property
    def decoding(self) -> bool:
        return self.slot >= 0 and len(self.seq) - self.cached == 1


@dataclass
class _AheadCall:
    """The next step's packed prefill call, prepared during the last call (_prepare_admission):
    its chunks as (slot, request id, rows cached, tokens), the bound call, and the slots its
    admissions took."""

    key: list[tuple[int, int, int, int]]
    prepared: object
    slots: list[int]
    ending: frozenset  # the ids of the requests whose last token the last call made


def _chunk_row(r: _Request, start: int, take: int) -> tuple[tuple[list[int], int], object]:
    """A packed call's row for r's prompt tokens [start, start + take) and who samples it: r's
    Sampler where the whole sequence is in (its last row gives the next token), else None."""
    return (r.seq[start : start + take], start), r.sampler if start + take == len(r.seq) else None


def _ends_by_length(r: _Request | None) -> bool:
    """Whether r's next token (the one in flight) is its last by max_tokens."""
    return r is not None and r.generated + 1 >= r.params.max_tokens


class Engine:
    """See the module docstring. `tokenizer` (encode/decode, optional) gives events text and
    enables stop strings."""

    def __init__(
        self,
        model_dir: str | os.PathLike,
        config: EngineConfig | None = None,
        tokenizer=None,
        session_options: ort.SessionOptions | None = None,
        start: bool = True,
    ):
        self.config = config = config or EngineConfig()
        spec = ModelSpec.from_dir(model_dir)
        served, self.served_refusal, self.packed_refusal = self._served_graph(spec, config)
        if config.pipeline and served is None:
            raise ValueError(
                f"pipeline=True needs the served graph, which this model cannot run: "
                f"{self.served_refusal}"
            )
        # The served graph runs this package's own library: SampleTokens is ours whatever runs
        # the attention, and the copy a patched folder holds (for onnxruntime-genai) may predate
        # it. One library per session: the same domain twice would clash.
        library = library_path() if served is not None else "auto"
        self.runtime = Runtime(
            model_dir,
            provider=config.provider,
            cache=config.cache,
            cuda_graph=config.graphs,
            capacity=config.capacity,
            device_id=config.device_id,
            session_options=session_options,
            granule=config.granule,
            custom_ops_library=library,
            model=served.model if served is not None else None,
        )
        self.spec = self.runtime.spec
        self.tokenizer = tokenizer
        self.packed = served is not None and served.packed
        if config.graph_chunk and not self.packed:
            raise ValueError(
                f"graph_chunk={config.graph_chunk} needs packed calls, which this model cannot "
                f"run: {self.packed_refusal}"
            )
        self.pipelined = config.pipelined(served is not None)
        if config.device_ids and not self.pipelined:
            raise ValueError(
                "device_ids=True needs the pipelined decode (the served graph and padded decode "
                "calls; pipeline on, the CUDA default)"
            )
        try:
            self._allocate(config)
        except BaseException:
            self.runtime.close()
            raise
        self._slots: list[_Request | None] = [None] * self.max_batch
        self._waiting: collections.deque[_Request] = collections.deque()
        self._inbox: list[tuple[str, object]] = []
        self._cond = threading.Condition()
        self._ids = itertools.count(1)
        self.executor = Executor(
            self.runtime, self.cache, config.graphs,
            served.inputs if served is not None else None, self.packed,
            packed_multiple=config.packed_tokens_multiple, device_ids=config.device_ids,
        )  # fmt: skip
        # commit_ahead: one worker, joined before the step that ran it goes on
        self._ahead = (
            ThreadPoolExecutor(1, thread_name_prefix="ort-kvlayout-kv-ahead")
            if config.commit_ahead
            else None
        )
        self._counters = collections.Counter()
        # each step's stats, then its events, to the readers (publisher.py); with overlap on a
        # thread of its own, at most one step behind
        self.publisher = Publisher(
            config.overlapped, self.executor.profile, self._counters, self._post, self._show
        )
        # the next step's prefill call, prepared by the pipeline's helper during the last call
        self._ahead_call: _AheadCall | None = None
        self._peak_running = 0
        self._closing = False
        self._drain = False
        self._thread: threading.Thread | None = None
        self._started = False  # start() was called (close() of an engine never started ends
        # its submitted requests itself)
        self._snapshot: dict = self._make_snapshot()
        if start:
            self.start()

    @staticmethod
    def _served_graph(spec: ModelSpec, config: EngineConfig):
        """The served graph of the model, packed where asked and allowed (None with
        sample_on_device False, or when it does not apply and was not asked for), read without
        the weights; and why it is not served, and why not packed (None where it is)."""
        want, want_packed = config.sample_on_device, config.packing
        if want is False:
            return None, "sample_on_device=False", "sample_on_device=False"
        model = onnx.load(str(spec.onnx_path), load_external_data=False)
        packed_refusal = None
        if want_packed is False:
            packed_refusal = "packed=False"
        if packed_refusal is None and spec.position_ids:
            # the engine feeds position ids by row: a packed call has none to feed
            packed_refusal = f"the model has a {spec.position_ids!r} input"
        if packed_refusal is None:
            try:
                served = serving_graph(model, spec.attention_mask, spec.logits, packed=True,
                                       input_ids=spec.input_ids)  # fmt: skip
                return served, None, None
            except ServingGraphError as exc:
                packed_refusal = str(exc)
        if want_packed:
            raise ValueError(f"packed=True, but the graph cannot be packed: {packed_refusal}")
        try:
            return serving_graph(model, spec.attention_mask, spec.logits), None, packed_refusal
        except ServingGraphError as exc:
            if want:
                raise ValueError(f"sample_on_device=True, but the graph cannot be served: {exc}")
            return None, str(exc), packed_refusal

    def _allocate(self, config: EngineConfig) -> None:
        """The KV budget (resolved once, from the memory free now that the model is loaded),
        the cache of `max_batch` slots (fewer for a preallocating cache whose budget buys fewer
        whole slots) and the decode buckets."""
        self.capacity = self.runtime.capacity
        cuda = config.provider == "cuda"
        free, total = memory.device_memory(config.provider, config.device_id)
        budget = memory.resolve_kv_budget(
            config.kv_budget_bytes, config.kv_budget_fraction, free, total,
            f"cuda:{config.device_id}" if cuda else "cpu",
            default_fraction=memory.DEFAULT_CUDA_FRACTION if cuda else None,
        )  # fmt: skip
        self.device_free_bytes, self.device_total_bytes = free, total
        slots = config.max_batch
        if config.cache == "preallocated" and budget is not None:
            # A preallocating cache commits whole slots up front: the budget buys that many.
            slot_bytes = self.spec.kv.entry_bytes(self.capacity)  # KV and PER_TOKEN scales
            slots = min(slots, budget // slot_bytes)
            if slots < 1:
                raise ValueError(
                    f"a KV budget of {budget} bytes is less than one preallocated slot of "
                    f"{self.capacity} tokens ({slot_bytes} bytes)"
                )
        self.max_batch = slots
        self.cache = KvCache.create(
            self.spec.kv,
            config.cache,
            device="cuda" if config.provider == "cuda" else "cpu",
            batch=slots,
            capacity=self.capacity,
            device_id=config.device_id,
            granule=config.granule,
        )
        self._bytes_per_token = self.spec.kv.entry_bytes(1)
        # Bytes per entry of n rows: the same for every slot, asked several times a step.
        self._commit_bytes = functools.lru_cache(maxsize=1 << 16)(self.cache.entry_commit_bytes)
        reserved = self.cache.stats.reserved_bytes
        if budget is None:  # the CPU default: the reservation, at most the machine's memory
            self.budget = reserved if total is None else min(reserved, total)
        elif config.kv_budget_bytes is None:  # a share of free memory: no more than it can use
            self.budget = min(budget, reserved)
        else:
            self.budget = budget
        self.eos = frozenset(self.spec.eos_token_ids)
        self.buckets = resolve_buckets(config.decode_buckets, slots) if config.padded_decode else ()
        # Rows a CUDA fp16 prefill may read past its chunk (Runtime.prefill_read_slack: cuDNN's
        # key tiles); 0 on the CPU.
        self._limits = Limits(
            self.budget, self.capacity, config.chunk, self.runtime.prefill_read_slack(),
            self.buckets, packed=self.packed, prefill_wait=config.prefill_wait,
            request_chunk=config.graph_chunk,
        )  # fmt: skip
        self._held = 0  # steps the waiting requests were held (scheduler.hold_admissions)
        first = self.cache.entry_commit_bytes(min(1 + self._limits.slack, self.capacity))
        if self.budget < first:  # every request would be refused (413): say so at start
            self.cache.close()
            raise ValueError(
                f"a KV budget of {self.budget} bytes cannot hold one token of this model: its "
                f"first token commits {first} KV bytes ({self._bytes_per_token} bytes a token, "
                "committed in whole granules)"
            )

    # ---------------------------------------------------------------------------------------
    # Any thread

    def start(self) -> None:
        self.publisher.start()
        self._started = True
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="ort-kvlayout-engine")
            self._thread.daemon = True
            self._thread.start()

    def check_request(self, prompt: list[int], params: RequestParams) -> None:
        """Raises ValueError / RequestTooLarge for a request the engine could never run."""
        if not prompt:
            raise ValueError("the prompt needs at least one token")
        vocab = self.spec.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (the model directory has none)")
        rows = len(prompt) + params.max_tokens - 1  # the last token is never fed back
        if rows > self.capacity:
            raise RequestTooLarge(
                f"{len(prompt)} prompt tokens + {params.max_tokens} max_tokens need {rows} "
                f"rows of context; the limit is {self.capacity}"
            )
        need = self._commit_bytes(min(rows + self.runtime.prefill_read_slack(), self.capacity))
        if need > self.budget:
            raise RequestTooLarge(
                f"{len(prompt)} prompt tokens + {params.max_tokens} max_tokens need {need} KV "
                f"bytes; the KV budget is {self.budget}"
            )

    def submit(
        self,
        prompt: list[int],
        params: RequestParams | None = None,
        on_event: Callable[[Event], None] | None = None,
    ) -> RequestHandle:
        """Queues a request; thread-safe. From a running event loop the handle is read with
        `async for`, otherwise by iterating it; on_event (optional) is called from the engine
        thread instead. Raises ValueError / RequestTooLarge (bad request), EngineOverloaded
        (queue full) or EngineClosed."""
        params = params or RequestParams()
        if self._closing:  # before the checks: a closed engine's cache answers nothing
            raise EngineClosed("the engine is shutting down")
        bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, Integral)]
        if bad:  # int() would truncate 1.9 to 1: a silently different prompt
            raise ValueError(f"prompt token ids must be integers, got {bad[0]!r}")
        prompt = [int(t) for t in prompt]
        self.check_request(prompt, params)
        try:
            loop = asyncio.get_running_loop() if on_event is None else None
        except RuntimeError:
            loop = None
        rid = next(self._ids)
        handle = RequestHandle(self.cancel, rid, loop)
        if on_event is not None:
            # tokens and finish_reason kept on the handle for callback users too
            handle._push = lambda event: on_event(handle._take(event))  # type: ignore[method-assign]
            handle._callback = True
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.eos
        )
        request = _Request(
            rid, len(prompt), list(prompt), params, handle, Sampler(params.sampling), rid,
            stop_ids=stop_ids,
        )  # fmt: skip
        if self.tokenizer is not None:
            request.text = IncrementalText(self.tokenizer, len(prompt), params.stop)
        with self._cond:
            if self._closing:
                raise EngineClosed("the engine is shutting down")
            queued = len(self._waiting) + sum(1 for k, _ in self._inbox if k == "submit")
            if queued >= self.config.max_waiting + self._free_slots():
                self._counters["rejected"] += 1
                raise EngineOverloaded(
                    f"{queued} requests are waiting (limit {self.config.max_waiting})"
                )
            self._inbox.append(("submit", request))
            self._cond.notify()
        return handle

    def cancel(self, request_id: int) -> None:
        """Ends a request at the next step (thread-safe; unknown or finished ids are ignored)."""
        with self._cond:
            self._inbox.append(("cancel", request_id))
            self._cond.notify()

    def generate(self, prompt: list[int], params: RequestParams | None = None) -> list[int]:
        """Submits and waits (a convenience for scripts and tests; blocks even when called
        from an event loop's thread)."""
        if self._thread is None and not self._closing:  # nothing would ever run it
            raise RuntimeError("the engine is not started: call start() (Engine(start=False))")
        if threading.current_thread() in (self._thread, self.publisher.thread):
            raise RuntimeError(
                "generate() waits for the engine's thread and cannot be called from an "
                "on_event callback (which runs there); submit() from it instead"
            )
        done: queue.SimpleQueue = queue.SimpleQueue()
        handle = self.submit(prompt, params, on_event=done.put)
        while not done.get().finished:
            pass
        return handle.tokens

    @property
    def closing(self) -> bool:
        """True once close() was called (the server's /health answers 503)."""
        return self._closing

    def stats(self) -> dict:
        """Counters, as of the last step (thread-safe): running, waiting, preemptions,
        committed/reserved/peak KV bytes, bytes moved, graph captures, steps, tokens, ..."""
        with self._cond:
            return dict(self._snapshot)

    def close(self, drain: bool = False, timeout: float | None = None) -> None:
        """Stops the loop: with drain, running and queued requests finish first; otherwise they
        end with finish_reason "cancelled". Releases the cache."""
        with self._cond:
            self._closing = True
            self._drain = drain
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return  # still draining: the caller chose a timeout
            self._thread = None
        elif not self._started:  # the loop never ran: the requests submitted to it end here
            with self._cond:
                inbox, self._inbox = self._inbox, []
            if inbox:  # a request or a cancel: the prepared admission may not be the next one
                self._drop_ahead_call()
            for kind, item in inbox:
                if kind == "submit":
                    self._finish(item, "cancelled")  # type: ignore[arg-type]
            self.publisher.flush()
        self.publisher.close(timeout)  # every event handed over before close returns
        if self._ahead is not None:
            self._ahead.shutdown(wait=True)
        self.executor.close()
        self.cache.close()
        self.runtime.close()

    def __enter__(self) -> Engine:  # noqa: PYI034
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---------------------------------------------------------------------------------------
    # The engine thread

    def _free_slots(self) -> int:
        return sum(1 for r in self._slots if r is None)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._inbox and not self._has_work() and not self._closing:
                    self._cond.wait()
                inbox, self._inbox = self._inbox, []
                closing, drain = self._closing, self._drain
            if inbox:  # a request or a cancel: the prepared admission may not be the next one
                self._drop_ahead_call()
            for kind, item in inbox:
                if kind == "submit":
                    self._waiting.append(item)  # type: ignore[arg-type]
                elif kind == "fail":
                    self._cancel(*item, reason="error")  # type: ignore[misc]
                else:
                    self._cancel(item)  # type: ignore[arg-type]
            if closing and not drain:
                for r in [*self._running(), *self._waiting]:
                    self._finish(r, "cancelled")
                self._publish()
                return
            if not self._has_work():
                self._release_scratch({})  # a cancel may have left a freed slot's row 0
                self._publish()
                if closing:
                    return
                continue
            try:
                self._step()
                if not self._has_work():
                    self._release_scratch({})  # idle: no scratch row is needed
            except Exception as exc:  # noqa: BLE001 -- a failed step ends its requests, not the loop
                self._counters["step_errors"] += 1
                message = f"{type(exc).__name__}: {exc}"
                for r in self._running():
                    self._finish(r, "error", error=message)
            if not self.publisher.overlapped or not self._has_work():
                self._publish()  # else before the next step's calls

    def _publish(self) -> None:
        """The stats as of now, then the step's events (so a reader that sees its last event
        also sees stats() without its request): here, or with overlap on the publisher."""
        self.publisher.publish(self._make_snapshot())

    def _show(self, snapshot: dict) -> None:
        """The stats that stats() returns from now on (the publisher's, before its events)."""
        with self._cond:
            self._snapshot = snapshot

    def _post(self, kind: str, item: object) -> None:
        """A message to the loop's inbox from another thread (the publisher's cancels and
        failures of one request)."""
        with self._cond:
            self._inbox.append((kind, item))
            self._cond.notify()

    def _has_work(self) -> bool:
        return bool(self._waiting) or any(r is not None for r in self._slots)

    def _running(self) -> list[_Request]:
        return [r for r in self._slots if r is not None]

    def _cancel(self, request_id: int, error: str | None = None, reason: str = "cancelled") -> None:
        for r in [*self._running(), *self._waiting]:
            if r.id == request_id:
                self._finish(r, reason, error=error)
                return

    def _release_slot(self, r: _Request) -> None:
        if r.slot >= 0:
            self._slots[r.slot] = None
            t = time.perf_counter_ns()
            # Row 0 stays committed: the slot's next request or its scratch row reuses the
            # granule under it; the next step's _release_scratch returns it if neither comes.
            self.cache.release(r.slot, keep=1)
            self.executor.profile.add("kv", t)
            r.slot = -1
        r.cached = 0

    def _finish(
        self,
        r: _Request,
        reason: str,
        token: int | None = None,
        text: str | None = None,
        error: str | None = None,
        flush: bool = True,
    ) -> None:
        self._release_slot(r)
        if r in self._waiting:
            self._waiting.remove(r)
        if flush and r.text is not None:
            text = LATER if r.generated else ""
            if text is LATER and r.text.stops:
                try:
                    text = r.text.delta(r.seq, final=True)[0]
                except Exception as exc:  # noqa: BLE001 -- the tokenizer's code, r's problem only
                    self._counters["detokenize_errors"] += 1
                    text = None
                    if error is None:
                        reason, error = "error", decode_failure(exc)
        self._counters[f"finished_{reason}"] += 1
        self.publisher.deliver(r, token, text, reason, error)

    # --- memory ------------------------------------------------------------------------------
    def _view(self) -> list[Running | None]:
        """The slots as the scheduler (scheduler.py) sees them."""
        return [
            None if r is None else Running(r.arrival, r.cached, len(r.seq)) for r in self._slots
        ]

    def _need_bytes(self, tokens: list[int]) -> int:
        """The scheduler's commit_bytes: the bytes committed now when they already hold these
        rows and fit the budget (then so do the rows' own bytes: the same answer to "does it
        fit?", without the granule arithmetic in the common step that commits nothing), else
        the cache's count."""
        if self.cache.covers(tokens):
            committed = self.cache.stats.committed_bytes
            if committed <= self.budget:
                return committed
        return self.cache.commit_bytes(tokens)

    def _waiting_view(self, first: int | None = None) -> list[tuple[int, int]]:
        """The waiting requests as the scheduler sees them ((arrival, length), oldest first),
        the first `first` of them (None: all)."""
        return [(r.arrival, len(r.seq)) for r in itertools.islice(self._waiting, first)]

    def _plan(self) -> StepPlan:
        """This step's plan (scheduler.plan_step) of the slots as they are. Only as many waiting
        requests as there are free slots can be admitted (or hold the others' company)."""
        waiting = self._waiting_view(self._slots.count(None))
        return plan_step(
            self._view(), waiting, self.cache.tokens, self._limits, self._need_bytes, self._held
        )

    def _apply(self, plan: StepPlan) -> None:
        """The plan's admissions and preemptions made: a held step counted, the admitted
        requests in their slots (the oldest waiting, in order), the victims back in the queue."""
        if plan.held:
            self._held += 1
            self._counters["admission_holds"] += 1
        else:
            self._held = 0
        for slot in plan.admitted:
            r = self._waiting.popleft()
            r.slot = slot
            r.cached = 0
            self._slots[slot] = r
            self._counters["admitted"] += 1
        for slot in plan.fit.victims:
            self._preempt(self._slots[slot])
        if plan.fit.eager_fallback:
            self._counters["decode_eager_fallbacks"] += 1

    def _preempt(self, victim: _Request) -> None:
        self._release_slot(victim)
        self._counters["preemptions"] += 1
        # Back to the queue in arrival order: it is recomputed (prefilled with its tokens).
        position = sum(1 for w in self._waiting if w.arrival < victim.arrival)
        self._waiting.insert(position, victim)

    def _release_scratch(self, rows: dict[int, int]) -> None:
        """Scratch rows of free slots outside `rows` (this step's) go back (the docstring),
        except while admissions are held where they fit the budget beside this step's rows
        (the fit counted them out): the requests held take those slots soon."""
        if self.cache.closed:
            return
        held = self.cache.tokens
        free = [s for s, r in enumerate(self._slots) if r is None and s not in rows and held[s]]
        if not free:
            return
        holding = self._held and self._waiting
        if holding and keep_scratch(rows, held, free, self._limits, self._need_bytes):
            return
        for s in free:
            self.cache.release(s)

    # --- a step ------------------------------------------------------------------------------
    def _step(self) -> None:
        profile = self.executor.profile
        ahead, self._ahead_call = self._ahead_call, None
        t = time.perf_counter_ns()
        plan = self._plan()
        self._apply(plan)
        rows, padded, view = plan.fit.rows, plan.fit.padded, plan.view
        t = profile.add("schedule", t)
        self._release_scratch(rows)
        try:
            held = self.cache.tokens  # a copy: once, not once a slot
            self.cache.ensure([rows.get(s, n) for s, n in enumerate(held)])
            t = profile.add("kv", t)
        except KvMemoryError as exc:
            # The device had less memory than the budget assumed: the newest request makes room
            # (recomputed later), or, alone, ends with an error; the loop goes on.
            running = self._running()
            if len(running) <= 1:
                for r in running:
                    self._finish(r, "error", error=f"KV memory: {exc}")
                return
            self._preempt(max(running, key=lambda r: r.arrival))
            return
        self._counters["steps"] += 1
        profile.steps += 1
        span = plan.span
        chunks = [(self._slots[s], take) for s, take in plan.chunks]
        profile.add("schedule", t)
        if self.pipelined and padded and span is not None and not chunks:
            if self.executor.device_ids:
                self._decode_pipeline_fed(span[1])
            else:
                self._decode_pipeline(span[1])
            return
        calls = []
        packed = self.executor.packed
        if chunks and self.config.graph_chunk:  # one call of fixed shapes: a graph
            calls.append(self._packed_call(chunks, range(*span) if span else range(0), True))
        elif (
            ahead is not None
            and packed
            and not self.config.mixed
            and ahead.key == [(r.slot, r.id, r.cached, take) for r, take in chunks]
        ):  # the prefill call the pipeline prepared for these chunks
            self._counters["prefill_calls_ahead"] += 1
            if span is not None:
                calls.append(self._decode_call(*span, padded=padded))
            calls.append(self._packed_call(chunks, prepared=ahead.prepared))
        elif packed and chunks and self.config.mixed and span is not None:
            calls.append(self._packed_call(chunks, range(*span)))
        else:
            if span is not None:
                calls.append(self._decode_call(*span, padded=padded))
            if packed and chunks:
                calls.append(self._packed_call(chunks))
            else:
                calls += [self._prefill_call(r, take) for r, take in chunks]
        ahead = self._rows_ahead(view, chunks) if self._ahead is not None else None
        if self.publisher.overlapped:
            self._publish()  # the last step's events go out while these calls run
        if ahead is not None:  # after the snapshot (_publish reads the cache's counters)
            ahead = self._ahead.submit(self._ensure_ahead, ahead)
        try:
            results = [run() for run, _ in calls]
        finally:
            if ahead is not None:  # the cache is the engine thread's again
                t = time.perf_counter_ns()
                ahead.result()
                profile.add("kv", t)
        for (_, commit), tokens in zip(calls, results):
            commit(tokens)

    # --- pipelined decode ----------------------------------------------------------------------
    def _decode_pipeline(self, bucket: int) -> None:
        """This step's decode call of slots [0, bucket), then the steps after it of the same
        bucket (EngineConfig.pipeline; the module docstring). While a call runs on this thread
        (ORT's Run releases the GIL), the executor's helper thread emits the last step's
        tokens, publishes and plans the next step; once the call's tokens are read, the next
        one is launched at once. Returns, with no call running and the last step's tokens
        emitted, when the next step may differ: a row ended (its slot and pages went back
        between calls), a request that can start or a cancel arrived, close(), or the budget
        asks for a preemption or another bucket; the loop then plans it as usual."""
        ex, pad = self.executor, self.spec.pad_token_id
        requests, ids, staged = self._pipeline_start(bucket)
        later: list[tuple[_Request, int]] = []  # the last step's rows, emitted during this call

        def during():
            self._emit_rows(later)  # no end: _may_end said so
            self._publish()  # the last step's stats and events
            return self._next_pipelined(bucket, requests)

        while True:
            done = ex.run_staged(staged, ids, during=during)
            if any(r.slot < 0 for r, _ in later):  # _may_end missed a way to end
                raise RuntimeError("pipelined decode: a request ended while its row ran")
            tokens = ex.read_tokens(done)
            self._count_decode_call(bucket, sum(r is None for r in requests))
            t = time.perf_counter_ns()
            # Rows whose token may end their request are emitted now, between calls: an ended
            # request's slot and pages go back at once (_release_slot).
            later, ended = [], False
            for r, token in zip(requests, tokens):
                if r is None:
                    continue
                r.cached += 1
                if self._may_end(r, token):
                    self._emit(r, token)
                    ended = ended or r.slot < 0
                else:
                    later.append((r, token))
            staged = done.during
            if staged is None or ended or self._inbox or self._closing:
                done_ids = {r.id for r in requests if r is not None and r.slot < 0}
                ahead = self._ahead_call
                if ahead is None or self._inbox or self._closing or done_ids != ahead.ending:
                    self._drop_ahead_call()  # its admission may not be the next step's
                for r, token in later:
                    self._emit(r, token)
                ex.profile.add("emit", t)
                return
            ex.profile.add("emit", t)
            ids = [token if r is not None else pad for r, token in zip(requests, tokens)]
            self._count_pipelined_step()

    def _decode_pipeline_fed(self, bucket: int) -> None:
        """_decode_pipeline with device-fed ids (EngineConfig.device_ids): each call after the
        first takes its ids from the last call's token ids on the device, so it is launched as
        soon as the last one returns, before the host has read them; the helper thread reads
        them during the next call, emits the rows whose token cannot end their request,
        publishes and plans the call after. A row whose token may end its request is emitted
        between calls, and the pipeline then stops after the call in flight (whose row for
        that request computed a token that is dropped if it ended: its KV row, one past, goes
        back with the slot). Returns with no call running and every read token emitted."""
        ex = self.executor
        requests, ids, staged = self._pipeline_start(bucket)
        unread = None  # the last call, its tokens not read yet

        def during():  # while a call runs: the last call's tokens, the stats, the next call
            held = self._take_tokens(unread, requests) if unread is not None else []
            self._publish()  # the stats and events so far
            if held:  # a row may end: the loop looks between calls, after this one
                return None, held
            return self._next_pipelined(bucket, requests), held

        call_ids: list[int] | None = ids  # the first call's from the host, then on the device
        while True:
            done = ex.run_staged(staged, call_ids, during=during)
            call_ids = None
            staged, held = done.during
            self._count_decode_call(bucket, sum(r is None for r in requests))
            self._emit_rows(held)  # between calls: an ended request's slot goes back now
            unread = done
            ended = any(r is not None and r.slot < 0 for r in requests)
            if staged is None or ended or self._inbox or self._closing:
                self._drop_ahead_call()  # planned with this call's tokens unread: made again
                # the call's own tokens, ended rows out
                self._emit_rows(self._take_tokens(done, requests))
                return
            self._count_pipelined_step()

    def _pipeline_start(self, bucket: int):  # -> (requests, ids, executor._StagedBucket)
        """A pipeline's first call over slots [0, bucket): the decoding request of each row
        (None for the others), the ids it feeds and its inputs staged."""
        requests = [r if r is not None and r.decoding else None for r in self._slots[:bucket]]
        slots = [(r.seq[r.cached], r.cached) if r is not None else None for r in requests]
        ids, totals = decode_rows(slots, self.spec.pad_token_id)
        samplers = [r.sampler if r is not None else None for r in requests]
        return requests, ids, self.executor.stage_bucket(bucket, totals, samplers)

    def _next_pipelined(self, bucket: int, requests: list[_Request | None]):
        """On the helper: the pipeline's next call staged (_plan_next_decode), or None, and then
        the next step's prefill call prepared where it admits (_prepare_admission)."""
        plan = self._plan_next_decode(bucket, requests)
        if plan is None:
            self._ahead_call = self._prepare_admission_safely(bucket, requests)
        return plan

    def _count_decode_call(self, rows: int, padded: int) -> None:
        self._counters["decode_calls"] += 1
        self._counters["decode_rows"] += rows
        self._counters["decode_padded_rows"] += padded

    def _count_pipelined_step(self) -> None:
        """A step launched by the pipeline, not the loop."""
        self._counters["steps"] += 1
        self._counters["pipelined_steps"] += 1
        self.executor.profile.steps += 1

    def _emit_rows(self, rows: list[tuple[_Request, int]]) -> None:
        t = time.perf_counter_ns()
        for r, token in rows:
            self._emit(r, token)
        self.executor.profile.add("emit", t)

    def _take_tokens(self, done, requests: list[_Request | None]) -> list[tuple[_Request, int]]:
        """A pipelined call's tokens read and applied: each running row's request advances a
        row, the rows whose token cannot end their request are emitted, and those that may are
        returned (the caller emits them between calls). A request that ended since the call was
        launched (slot < 0) drops its token."""
        tokens = self.executor.read_tokens(done)
        t = time.perf_counter_ns()
        held = []
        for r, token in zip(requests, tokens):
            if r is None or r.slot < 0:
                continue
            r.cached += 1
            if self._may_end(r, token):
                held.append((r, token))
            else:
                self._emit(r, token)
        self.executor.profile.add("emit", t)
        return held

    def _prepare_admission(self, bucket: int, requests: list[_Request | None]) -> _AheadCall | None:
        """On the helper, while a pipelined call runs and the next step is not the same decode
        call because waiting requests would be admitted: that step as the loop will plan it if
        no row of the call ends and nothing arrives (the same pure functions on the same
        view), its KV rows committed and its packed prefill call bound (Executor.prepare_packed),
        so that _step only checks that its chunks are these and runs it. None where it cannot be
        foreseen or bound now: admissions held (prefill_wait), a preemption, mixed or graphed
        steps, a sampling row that would draw a number (the draw belongs to the call's launch),
        a running request outside the call."""
        ex = self.executor
        if (
            self._inbox or self._closing or not self._waiting or not ex.packed
            or self.config.mixed or self.config.graph_chunk or self._limits.prefill_wait
        ):  # fmt: skip
            return None
        t = time.perf_counter_ns()
        view: list[Running | None] = []
        ending = []  # requests whose token in flight is their last (max_tokens): slots freed
        for s, r in enumerate(self._slots):
            if r is None:
                view.append(None)
            elif s >= bucket or requests[s] is not r:
                return None
            elif _ends_by_length(r):
                view.append(None)
                ending.append(r.id)
            else:  # after this call: a row more
                view.append(Running(r.arrival, r.cached + 1, len(r.seq) + 1))
        # the step's own plan of the view this call leaves (admissions are not held here)
        plan = plan_step(
            view, self._waiting_view(view.count(None)), self.cache.tokens, self._limits,
            self._need_bytes,
        )  # fmt: skip
        admitted = dict(zip(plan.admitted, self._waiting))
        fit, chunks = plan.fit, plan.chunks
        if not admitted or fit.victims or not chunks or any(s not in admitted for s, _ in chunks):
            return None
        try:
            self.cache.ensure([fit.rows.get(s, n) for s, n in enumerate(self.cache.tokens)])
        except KvMemoryError:
            return None  # the step's own ensure meets it
        finally:
            t = ex.profile.add("kv", t)
        lo, hi = chunks[0][0], chunks[0][0]
        for s, _ in chunks:
            lo, hi = min(lo, s), max(hi, s)
        takes = dict(chunks)
        rows, samplers = [], []
        for s in range(lo, hi + 1):
            r = admitted.get(s) if s in takes else None
            if r is None:
                rows.append(((), 0))
                samplers.append(None)
                continue
            row, sampler = _chunk_row(r, 0, takes[s])
            rows.append(row)
            if sampler is not None and not sampler.params.greedy:
                return None  # its uniform number is drawn when its call is launched
            samplers.append(sampler)
        key = [(s, admitted[s].id, 0, take) for s, take in chunks]  # _step's order
        prepared = ex.prepare_packed(lo, rows, samplers)
        return _AheadCall(key, prepared, list(admitted), frozenset(ending))

    def _prepare_admission_safely(
        self, bucket: int, requests: list[_Request | None]
    ) -> _AheadCall | None:
        """_prepare_admission, whose failure costs only the preparation: the step plans and
        binds its call itself (the same functions meet the same error there, where it ends the
        step's requests as any step's error does). Counted in `prefill_ahead_errors`."""
        try:
            return self._prepare_admission(bucket, requests)
        except Exception:  # noqa: BLE001 -- an optimization must not fail the call it runs beside
            self._counters["prefill_ahead_errors"] += 1
            _log.debug("ort-kvlayout engine: preparing the next prefill call failed", exc_info=True)
            return None

    def _drop_ahead_call(self) -> None:
        """A prepared call that will not run: the rows it committed in slots still free go back
        now, before the next step's admissions count them."""
        ahead, self._ahead_call = self._ahead_call, None
        if ahead is None or self.cache.closed:
            return
        for s in ahead.slots:
            if self._slots[s] is None and self.cache.tokens[s]:
                self.cache.release(s)

    def _plan_next_decode(
        self, bucket: int, requests: list[_Request | None]
    ):  # -> executor._StagedBucket | None
        """The pipeline's next step, planned as if every row of the call in flight gets a token
        that does not end its request: the budget's fit, the KV rows it writes committed, its
        lengths and sampling parameters staged (no uniform number drawn). None where that step
        is not the same decode call (a waiting request would take a free slot, one prefills,
        the fit preempts or changes the bucket, a commit fails) or where the inbox or close()
        asks the loop to look first. A request that waits for budget, not for a slot, leaves
        the pipeline running (scheduler.admissions decides, at every step). What it commits
        stays valid whatever the tokens: rows one past a request's end go back with its slot."""
        if self._inbox or self._closing or any(_ends_by_length(r) for r in requests):
            return None  # a row's token in flight is its last: the next step differs
        t = time.perf_counter_ns()
        view: list[Running | None] = []
        for s, r in enumerate(self._slots):
            if r is None:
                view.append(None)
            elif s >= bucket or requests[s] is not r:
                return None  # a running request outside the call: not this pipeline's step
            else:
                view.append(Running(r.arrival, r.cached + 1, len(r.seq) + 1))
        if self._waiting and None in view and self._limits.prefill_wait:
            return None  # the loop holds the waiting (a held step it counts) or admits them
        # The step's own plan of the view this call leaves. The oldest waiting request alone
        # decides whether the loop would admit (admissions are in order): unless the budget
        # keeps it out, the step is not the same decode.
        plan = plan_step(
            view, self._waiting_view(1), self.cache.tokens, self._limits, self._need_bytes
        )
        fit = plan.fit
        profile = self.executor.profile
        t = profile.add("schedule", t)
        if plan.admitted or fit.victims or not fit.padded or plan.span != (0, bucket):
            return None
        try:
            self.cache.ensure([fit.rows.get(s, n) for s, n in enumerate(self.cache.tokens)])
        except KvMemoryError:
            return None  # the loop's own step meets it (and makes room)
        finally:
            profile.add("kv", t)
        # each row one row further: its token (unknown yet) fed at row cached + 1
        _, totals = decode_rows(
            [(None, r.cached + 1) if r is not None else None for r in requests],
            self.spec.pad_token_id,
        )
        samplers = [r.sampler if r is not None else None for r in requests]
        return self.executor.stage_bucket(bucket, totals, samplers)

    def _rows_ahead(
        self, view: list[Running | None], chunks: list[tuple[_Request, int]]
    ) -> list[int] | None:
        """The rows per slot the worker commits while this step's calls run
        (EngineConfig.commit_ahead): the next step's prefill rows beside what is held, where
        they need a commit and fit the budget; None otherwise."""
        rows = next_prefill_rows(view, [(r.slot, take) for r, take in chunks], self._limits)
        if not rows:
            return None
        tokens = [max(h, rows.get(s, 0)) for s, h in enumerate(self.cache.tokens)]
        if self.cache.covers(tokens) or self._need_bytes(tokens) > self.budget:
            return None  # nothing to map (the rows held are covered), or the scheduler decides
        return tokens

    def _ensure_ahead(self, tokens: list[int]) -> None:
        """On the worker: the ensure of the next step's rows. A commit that fails leaves the
        cache as it was (KvCache.ensure), and the next step's own ensure meets the error."""
        t = time.perf_counter_ns()
        try:
            self.cache.ensure(tokens)
            self._counters["kv_ahead_commits"] += 1
        except KvMemoryError:
            self._counters["kv_ahead_failures"] += 1
        finally:
            self.executor.profile.add("kv_ahead", t)

    def _decode_call(self, lo: int, hi: int, padded: bool):
        """The decode call of slots [lo, hi), planned now: what runs it and what applies its
        tokens."""
        requests = self._slots[lo:hi]
        slots, samplers = [], []
        for r in requests:
            if r is None:
                slots.append(None)
                samplers.append(None)
            else:
                slots.append((r.seq[r.cached] if r.decoding else None, r.cached))
                samplers.append(r.sampler if r.decoding else None)
        ids, totals = decode_rows(slots, self.spec.pad_token_id)
        if padded:
            run = functools.partial(self.executor.run_bucket, hi, ids, totals, samplers)
        elif self.executor.packed:  # the slots that decode nothing idle
            rows = [
                ([r.seq[r.cached]], r.cached) if r is not None and r.decoding else ((), 0)
                for r in requests
            ]
            run = functools.partial(self.executor.run_packed, lo, rows, samplers)
        else:
            ids_array = np.array(ids, np.int64)[:, None]
            run = functools.partial(
                self.executor.run, lo, ids_array, totals, [0] * (hi - lo), samplers
            )

        def commit(tokens: list[int | None]) -> None:
            t = time.perf_counter_ns()
            running = [(r, token) for r, token in zip(requests, tokens) if token is not None]
            self._count_decode_call(hi - lo, hi - lo - len(running))
            for r, token in running:
                r.cached += 1
                self._emit(r, token)
            self.executor.profile.add("emit", t)

        return run, commit

    def _prefill_call(self, r: _Request, take: int):
        """The call prefilling r's next `take` prompt tokens, as _decode_call's."""
        start = r.cached
        ids = np.array([r.seq[start : start + take]], np.int64)
        # The whole sequence in: its last row gives the next token (else no row is sampled).
        completes = start + take == len(r.seq)
        sampler = r.sampler if completes else None
        run = functools.partial(
            self.executor.run, r.slot, ids, [start + take], [take - 1], [sampler]
        )

        def commit(tokens: list[int | None]) -> None:
            self._counters["prefill_calls"] += 1
            self._counters["prefill_chunks"] += 1
            self._counters["prefill_tokens"] += take
            r.cached = start + take
            if completes:
                t = time.perf_counter_ns()
                self._emit(r, tokens[0])
                self.executor.profile.add("emit", t)

        return run, commit

    def _packed_call(
        self, chunks: list[tuple[_Request, int]], decode: range = range(0), graphed: bool = False,
        prepared=None,
    ):  # fmt: skip
        """One packed call, as _decode_call's: the prefill chunks (request, tokens) and, mixed
        or graphed, the decoding requests of the slots `decode`, over the slots from the lowest
        to the highest they use (the slots between idle); graphed (EngineConfig.graph_chunk),
        over the slots [0, bucket) at the shapes of its bucket and token count."""
        prefill = {r.slot: (r, r.cached, take) for r, take in chunks}
        decoding = {s: self._slots[s] for s in decode if self._slots[s] is not None}
        decoding = {s: r for s, r in decoding.items() if r.decoding}
        used = sorted(prefill.keys() | decoding.keys())
        lo, hi = used[0], used[-1] + 1
        if graphed:
            lo, hi = 0, bucket_for(hi, self.buckets)
        rows: list[tuple[list[int], int]] = []
        samplers: list[Sampler | None] = []
        for s in range(lo, hi):
            if s in prefill:
                row, sampler = _chunk_row(*prefill[s])
                rows.append(row)
                samplers.append(sampler)
            elif s in decoding:
                r = decoding[s]
                rows.append(([r.seq[r.cached]], r.cached))
                samplers.append(r.sampler)
            else:
                rows.append(((), 0))
                samplers.append(None)
        if graphed:
            width = self.config.graph_chunk
            taken = sum(take for _, take in chunks)
            tokens = hi + width * -(-taken // width)  # room for the decode rows and the chunks
            run = functools.partial(self.executor.run_graphed, hi, rows, samplers, width, tokens)
        elif prepared is not None:  # bound during the last call (_prepare_admission)
            run = functools.partial(self.executor.run_prepared, prepared)
        else:
            run = functools.partial(self.executor.run_packed, lo, rows, samplers)

        def commit(tokens: list[int | None]) -> None:
            counters = self._counters
            counters["prefill_calls"] += 1
            counters["graphed_calls"] += graphed
            counters["prefill_chunks"] += len(prefill)
            if decoding:
                counters["mixed_calls"] += 1
                counters["decode_rows"] += len(decoding)
            t = time.perf_counter_ns()
            for s, token in zip(range(lo, hi), tokens):
                if s in prefill:
                    r, start, take = prefill[s]
                    counters["prefill_tokens"] += take
                    r.cached = start + take
                elif s in decoding:
                    r = decoding[s]
                    r.cached += 1
                else:
                    continue
                if token is not None:
                    self._emit(r, token)
            self.executor.profile.add("emit", t)

        return run, commit

    @staticmethod
    def _may_end(r: _Request, token: int) -> bool:
        """Whether _emit(r, token) may finish r: every way it can (an error token, a stop id,
        max_tokens, a stop string or a tokenizer that raises on r's text). The pipeline emits
        such rows before it launches the next step, and launches it only if none of them ended;
        the other rows are emitted during the next step's call."""
        return (
            token < 0
            or token in r.stop_ids
            or r.generated + 1 >= r.params.max_tokens
            or (r.text is not None and bool(r.text.stops))
        )

    def _emit(self, r: _Request, token: int) -> None:
        """Streams r's next token, or finishes r (a negative token: the sampler refused the row,
        see executor.py)."""
        if token < 0:
            why = (
                "the model's logits contain NaN or infinite values"
                if token == NONFINITE_LOGITS
                else "the device sampler refused the request's sampling parameters"
            )
            self._finish(r, "error", error=why)
            return
        r.seq.append(token)  # len(seq) - cached == 1: r decodes it next
        r.generated += 1
        self._counters["tokens"] += 1
        reason = None
        if token in r.stop_ids:
            reason = "stop"
        elif r.generated >= r.params.max_tokens:
            reason = "length"
        text = None
        if r.text is not None:
            text = LATER  # decoded when handed over, off the step's critical path
            if r.text.stops:  # now: a stop string ends the request before its next step
                try:
                    text, hit = r.text.delta(r.seq, final=reason is not None)
                except Exception as exc:  # noqa: BLE001 -- the tokenizer's code, r's problem only
                    self._counters["detokenize_errors"] += 1
                    self._finish(r, "error", token=token, error=decode_failure(exc), flush=False)
                    return
                if hit and reason is None:
                    reason = "stop"  # the text ends before the stop string
        if reason is not None:
            self._finish(r, reason, token=token, text=text, flush=False)
        else:
            self.publisher.deliver(r, token, text)

    def _make_snapshot(self) -> dict:
        st = self.cache.stats if not self.cache.closed else None
        running = sum(1 for r in self._slots if r is not None)
        self._peak_running = max(self._peak_running, running)
        snap = {
            "running": running,
            "waiting": len(self._waiting),
            "max_batch": self.max_batch,
            "peak_running": self._peak_running,
            "preemptions": self._counters["preemptions"],
            "kv_budget_bytes": self.budget,
            "kv_bytes_per_token": self._bytes_per_token,  # every buffer, scales included
            "kv_committed_bytes": st.committed_bytes if st else 0,
            "kv_peak_committed_bytes": st.peak_committed_bytes if st else 0,
            "kv_reserved_bytes": st.reserved_bytes if st else 0,
            "kv_live_bytes": st.live_bytes if st else 0,
            "kv_bytes_moved": st.bytes_moved if st else 0,
            "kv_growth_events": st.growth_events if st else 0,
            "graph_captures": st.graph_captures if st else 0,
            "graph_replays": st.replays if st else 0,
            "graph_recaptures": st.recaptures if st else 0,
            "cuda_graph": self.config.graphs,
            "decode_buckets": list(self.buckets),
            "decode_buckets_used": self.executor.buckets_used,
            "decode_bucket_calls": dict(self.executor.bucket_calls),  # bucket -> decode calls
            "sample_on_device": self.executor.served is not None,
            "packed": self.executor.packed,
            "mixed": self.executor.packed and self.config.mixed,
            "graph_chunk": self.config.graph_chunk,
            "graphed_shapes_used": self.executor.graphed_shapes_used,
            "pipeline": self.pipelined,
            "device_ids": self.executor.device_ids,
            "step_profile": self.executor.profile.summary(),
        }
        for key in (
            "steps", "pipelined_steps", "decode_calls", "decode_rows", "decode_padded_rows",
            "decode_eager_fallbacks", "prefill_calls", "prefill_chunks", "prefill_tokens",
            "mixed_calls", "graphed_calls", "prefill_calls_ahead", "prefill_ahead_errors",
            "tokens", "admitted",
            "admission_holds", "rejected",
            "kv_ahead_commits", "kv_ahead_failures", "step_errors", "callback_errors",
            "detokenize_errors", "publish_errors", "finished_stop", "finished_length",
            "finished_cancelled", "finished_error",
        ):  # fmt: skip
            snap[key] = self._counters[key]
        return snap
