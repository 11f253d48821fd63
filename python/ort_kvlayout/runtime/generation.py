"""Generation over a plain ONNX Runtime session, IO-bound to a `KvCache`.

    with Runtime("smollm2-seq-major", provider="cuda", cache="growable") as rt:
        out = rt.generate([ids_a, ids_b], max_new_tokens=64, sampling=SamplingParams(...))
        out.tokens, out.ttft_seconds, out.decode_tokens_per_second, out.stats

How it binds (the onnxruntime-genai shared-buffer scheme, with our cache underneath): each KV
buffer is bound by pointer as both the past input and the present output with its full-capacity
shape (B, Nkv, C, H), so the GQA op appends in place. The builder's graph derives
seqlens_k = ReduceSum(attention_mask) - 1 and total_sequence_length = attention_mask.shape[1], so
a batch of prompts of different lengths is right-padded (the only padding GQA supports): entry b's
mask has ones over its own tokens, its first token comes from the logits at its last real prompt
position, and every later step writes its row at seqlens_k[b].

* Prefill: the padded prompts, mask width = the longest prompt (a "first prompt" for GQA).
* Decode: one token per entry. Without CUDA graphs the mask is as wide as the longest live
  sequence; with them (or fixed_mask=True) it is as wide as the cache's capacity and updated in
  place, so total_sequence_length and every bound address stay the same from step to step.
* CUDA graphs (provider "cuda", cuda_graph=True): the session runs with enable_cuda_graph=1; the
  prefill runs uncaptured (gpu_graph_id -1) and decode steps under one graph id per binding. ORT
  runs a graph id's first CUDA_GRAPH_WARMUP_RUNS steps normally, captures the next and replays
  it afterwards (the CUDA EP's rule); the counters on the cache follow that rule. A growable cache
  keeps the same pointers and shapes while it grows, so one capture serves the whole generation; a
  bucket cache's growth changes both, so it needs a new graph id: counted as a re-capture.
* Every step ensures the cache holds the rows the op will write first (max(prompt width, live
  length) per entry: a first prompt writes all padded rows); on CUDA an unmapped row would be a
  device fault, so this is not optional. A growable cache also needs attention kernels that read
  only live rows: ai.kvlayout's CUDA kernels predicate every K/V load on the entry's length
  (rows past it are zero-filled, not read); ORT's own com.microsoft kernels may read every
  capacity row (an illegal-address fault on unmapped memory), so a growable cache on CUDA is
  refused unless every GQA node is ai.kvlayout: run original models there with "preallocated".
* Quantized caches (int8, packed int4, fp8; ModelSpec reads the type and scheme from the graph)
  are bound like any other: the op quantizes the new rows in place. A PER_TOKEN model's scale
  caches are buffers of the same cache, bound as past and present in place beside their KV
  caches (kv_cache.py).
* After every step (prefill, each decode step, graph replays included) the runtime takes the
  length violations the CUDA op recorded on the device (ort_kvlayout.take_length_error) and
  raises LengthError naming the step: a replayed graph runs no host code of the op, so its Run
  cannot fail by itself. The logits copied to the host before the check order it after the
  step's kernels. The record is process-wide: a violation of another session's ai.kvlayout
  CUDA node in the same process is reported here too.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from numbers import Integral
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from ..op.length_errors import check_length_error
from ..op.library import register_library, registered_library
from .fixed_binding import FixedBinding, bind_host_array
from .kv_cache import (
    BUCKET_TOKENS,
    CACHE_MODES,
    KvCache,
    KvCacheStats,
    KvCapacityError,
    bind_in_place,
)
from .model_spec import ModelSpec
from .sampling import GREEDY, Sampler, SamplingParams

__all__ = ["CUDA_GRAPH_WARMUP_RUNS", "GenerationOutput", "Runtime"]

# Rows mapped past the prompt before a CUDA fp16/bf16 prefill: one 128-row key tile of cuDNN's
# flash attention (Runtime.prefill_read_slack).
PREFILL_READ_SLACK = 128
# ORT's CUDA EP: regular runs of a graph id before it captures (min_num_runs_before_cuda_graph_capture_).
CUDA_GRAPH_WARMUP_RUNS = 2
_ORT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
}


@dataclass
class GenerationOutput:
    tokens: list[list[int]]  # per batch entry, prompt excluded, up to and including EOS
    finish_reasons: list[str]  # "eos" or "length" per entry
    ttft_seconds: float  # prefill: prompt in -> the first token's logits on the host
    decode_seconds: float  # every later step
    steps: int  # model runs (prefill included)
    stats: KvCacheStats  # the cache's counters after the generation
    logits: list[np.ndarray] = field(default_factory=list, repr=False)  # (B, V) float32 per step

    @property
    def decode_tokens_per_second(self) -> float:
        """Steps after the prefill over their time (per batch entry: a step yields B tokens)."""
        n = self.steps - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0


def _library_for(spec: ModelSpec, custom_ops_library: str | os.PathLike | None) -> str | None:
    if custom_ops_library != "auto":
        return str(custom_ops_library) if custom_ops_library else None
    name = spec.custom_ops_library
    if not name:
        return None
    path = Path(name) if Path(name).is_absolute() else spec.model_dir / name
    if not path.is_file():
        raise FileNotFoundError(f"genai_config.json names custom_ops_library {name}, not found")
    # Absolute: a bare file name (model_dir "" or ".") would make dlopen search the system's
    # library path instead of the model folder.
    return str(path.resolve())


class Runtime:
    """One ORT session over a model directory's decoder and one KV cache reused across calls."""

    def __init__(
        self,
        model_dir: str | os.PathLike,
        provider: str = "cpu",
        cache: str = "growable",
        cuda_graph: bool | None = None,
        capacity: int | None = None,
        device_id: int = 0,
        custom_ops_library: str | os.PathLike | None = "auto",
        session_options: ort.SessionOptions | None = None,
        fixed_mask: bool | None = None,
        granule: int | None = None,
        bucket_tokens: int = BUCKET_TOKENS,
        model: onnx.ModelProto | None = None,
    ):
        """provider "cpu" | "cuda"; cache one of CACHE_MODES; cuda_graph defaults to True on
        CUDA; capacity: tokens per batch entry the cache reserves (default: the model's
        context); custom_ops_library "auto" registers the one genai_config.json names; model:
        a rewritten decoder graph to run instead of the file's (its external data is read from
        the model folder; the serving engine's served graph)."""
        if provider not in ("cpu", "cuda"):
            raise ValueError(f"provider {provider!r}: expected 'cpu' or 'cuda'")
        if cache not in CACHE_MODES:
            raise ValueError(f"cache mode {cache!r}: expected one of {', '.join(CACHE_MODES)}")
        self.spec = ModelSpec.from_dir(model_dir)
        foreign = self.spec.foreign_gqa_nodes()
        if cache == "growable" and provider == "cuda" and foreign:
            # Checked before any CUDA call: the com.microsoft kernels are not known to read only
            # live rows, and a growable range's rows past the live prefix are unmapped.
            raise ValueError(
                f"cache 'growable' on CUDA needs ai.kvlayout GroupQueryAttention nodes; "
                f"{len(foreign)} node(s) run ORT's com.microsoft op ({', '.join(foreign[:3])}"
                f"{', ...' if len(foreign) > 3 else ''}), which may read unmapped rows: use "
                "--cache preallocated (cache='preallocated') or patch the model "
                "(patch_kv_layout)"
            )
        self.provider = provider
        self.cache_mode = cache
        self.device_id = device_id
        self.cuda_graph = provider == "cuda" if cuda_graph is None else bool(cuda_graph)
        if self.cuda_graph and provider != "cuda":
            raise ValueError("cuda_graph=True needs provider='cuda'")
        self.fixed_mask = self.cuda_graph if fixed_mask is None else bool(fixed_mask)
        if self.cuda_graph and not self.fixed_mask:
            raise ValueError("CUDA graphs need fixed_mask=True (constant shapes)")
        if capacity is not None and capacity < 1:
            raise ValueError(
                f"capacity {capacity}: the tokens reserved per batch entry must be >= 1 "
                "(None: the model's context length)"
            )
        self.capacity = self.spec.kv.context_length if capacity is None else int(capacity)
        self.granule = granule
        self.bucket_tokens = bucket_tokens

        so = session_options
        if so is None:
            so = ort.SessionOptions()
            # Spinning intra-op threads compete with the step's own work when the cores are
            # shared (SmolLM2 on a loaded 2-core machine: 9.9 tokens/s spinning, 18.5 without,
            # the rate onnxruntime-genai reached there).
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.library = _library_for(self.spec, custom_ops_library)
        held = registered_library(so)
        if self.library and held and custom_ops_library == "auto":
            self.library = held  # the options carry the op already (ort_kvlayout.register)
        elif self.library:
            register_library(so, self.library)
        providers: list = []
        if provider == "cuda":
            options = {"device_id": str(device_id)}
            if self.cuda_graph:
                options["enable_cuda_graph"] = "1"
            providers.append(("CUDAExecutionProvider", options))
        providers.append("CPUExecutionProvider")
        source: str | bytes = str(self.spec.onnx_path)
        if model is not None:
            if model.ByteSize() >= 1 << 31:
                raise ValueError(
                    "the rewritten graph is over protobuf's 2 GiB: keep the weights as external "
                    "data (the builder's models do)"
                )
            source = model.SerializeToString()
            so.add_session_config_entry(
                "session.model_external_initializers_file_folder_path",
                str(self.spec.onnx_path.parent.resolve()),
            )
        try:
            self.session = ort.InferenceSession(source, so, providers=providers)
        except Exception as exc:
            if "Domain already set in registry" in str(exc):  # ORT's words for a clash
                raise ValueError(
                    "the session options register the ai.kvlayout op library twice: once through "
                    "ort_kvlayout.register() (or a Runtime / Engine) and once through "
                    "register_custom_ops_library(); call only ort_kvlayout.register()"
                ) from exc
            raise
        if provider == "cuda" and "CUDAExecutionProvider" not in self.session.get_providers():
            raise RuntimeError("CUDAExecutionProvider is not available in this onnxruntime")
        outputs = {o.name: o.type for o in self.session.get_outputs()}
        self.logits_dtype = np.dtype(_ORT_TYPES[outputs[self.spec.logits]])
        self.cache: KvCache | None = None
        self._graph_id = -1  # the decode graph id of the current binding
        self._graph_runs: dict[int, int] = {}
        self._stale_capture = False  # a captured decode graph was invalidated by growth
        self._decode: _DecodeBinding | None = None
        self._narrow: tuple[KvCache, int, ort.IOBinding] | None = None  # _run_narrow's binding
        # generate() owns the cache, the bindings and the graph counters for its whole run: calls
        # from several threads take turns (interleaved, they would write each other's rows).
        self._lock = threading.Lock()
        self._owner: int | None = None  # the thread inside generate()
        self._closed = False

    # -----------------------------------------------------------------------------------------
    def check_length_record(self, where: str) -> None:
        """Raises LengthError if our op recorded a bad length on the device (graph replays
        included); only the library the session registered keeps such records."""
        if self.library is not None:
            check_length_error(where, self.library)

    def prefill_read_slack(self) -> int:
        """Rows past the prompt that the prefill may read. On CUDA, fp16/bf16 prefill of 64 or
        more rows runs cuDNN's flash attention (docs/ARCHITECTURE.md), whose key tiles are
        bounded by the cache's capacity, not by each entry's length: the last tile may read up
        to 127 rows past it, rows a growable cache has not mapped yet (a device fault). They are
        mapped with the prompt (at most one tile per entry, well inside a 2 MiB granule for the
        models measured). Our own kernels predicate every load on the length and need none, and
        preallocated and bucket caches hold their whole capacity: only growable caches need it."""
        half = np.dtype(self.spec.kv.dtype).itemsize == 2
        growable = self.cache_mode == "growable"
        return PREFILL_READ_SLACK if self.provider == "cuda" and half and growable else 0

    def _cache_for(self, batch: int) -> KvCache:
        if self.cache is not None and self.cache.batch == batch and not self.cache.closed:
            self.cache.reset()
            return self.cache
        if self.cache is not None:
            self.cache.close()
            self._decode = None
            self._narrow = None
        self.cache = KvCache.create(
            self.spec.kv,
            self.cache_mode,
            device="cuda" if self.provider == "cuda" else "cpu",
            batch=batch,
            capacity=self.capacity,
            device_id=self.device_id,
            granule=self.granule,
            bucket_tokens=self.bucket_tokens,
        )
        return self.cache

    def _bind_kv(self, binding: ort.IOBinding, cache: KvCache) -> None:
        """Every KV buffer (and PER_TOKEN scale buffer) as its past input and present output,
        in place."""
        bind_in_place(binding, cache.buffers)

    def generate(
        self,
        prompts: list[list[int]] | list[int],
        max_new_tokens: int,
        sampling: SamplingParams = GREEDY,
        eos_token_ids: list[int] | None = None,
        on_step: Callable[[list[int | None]], None] | None = None,
        keep_logits: bool = False,
    ) -> GenerationOutput:
        """Generates for a batch of prompts (or one prompt: a list of ids).

        eos_token_ids: None uses the model's; [] never stops early. on_step receives, after each
        step, the new token of every entry (None for entries already finished).

        Thread-safe: concurrent calls run one after the other (the runtime has one cache); a
        call from inside on_step raises RuntimeError. For requests that come and go, use the
        serving engine (ort_kvlayout.serve.engine)."""
        if self._owner == threading.get_ident():
            raise RuntimeError(
                "Runtime.generate called from inside its own on_step callback: the running "
                "generation owns the KV cache until it returns"
            )
        with self._lock:
            self._owner = threading.get_ident()
            try:
                return self._generate(
                    prompts, max_new_tokens, sampling, eos_token_ids, on_step, keep_logits
                )
            finally:
                self._owner = None

    def _generate(
        self,
        prompts: list[list[int]] | list[int],
        max_new_tokens: int,
        sampling: SamplingParams,
        eos_token_ids: list[int] | None,
        on_step: Callable[[list[int | None]], None] | None,
        keep_logits: bool,
    ) -> GenerationOutput:
        if self._closed:
            raise RuntimeError("the Runtime is closed")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, Integral):
            raise TypeError(f"max_new_tokens must be an integer, got {max_new_tokens!r}")
        if prompts and not isinstance(prompts[0], (list, tuple, np.ndarray)):
            prompts = [list(prompts)]  # one prompt: a list of ids  # type: ignore[list-item]
        for b, p in enumerate(prompts):
            bad = [t for t in p if isinstance(t, bool) or not isinstance(t, Integral)]
            if bad:  # int() would truncate 6.5 to 6: a silently different prompt
                raise ValueError(f"prompt {b}: token ids must be integers, got {bad[0]!r}")
        prompts = [[int(t) for t in p] for p in prompts]  # type: ignore[union-attr]
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        vocab = self.spec.vocab_size
        for b, p in enumerate(prompts):
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise ValueError(
                    f"prompt {b}: token ids {bad[:5]} outside the vocabulary [0, {vocab})"
                )
        lengths = [len(p) for p in prompts]
        width = max(lengths)
        # The last step writes row len+max_new-2 (the last token is chosen, never fed back).
        needed = width + max_new_tokens - 1
        limit = min(self.capacity, self.spec.kv.context_length)
        if needed > limit:
            b = lengths.index(width)
            which = f"prompt {b}" if len(prompts) > 1 else "the prompt"  # the entry, in a batch
            raise KvCapacityError(
                f"{which} of {width} tokens + {max_new_tokens} new tokens needs {needed} "
                f"cache rows; the KV cache reserves {limit} (capacity {self.capacity}, model "
                f"context {self.spec.kv.context_length})"
            )
        eos = set(self.spec.eos_token_ids if eos_token_ids is None else eos_token_ids)
        sampler = Sampler(sampling)
        batch = len(prompts)
        cache = self._cache_for(batch)

        # Prefill.
        start = time.perf_counter()
        cache.ensure([min(width + self.prefill_read_slack(), cache.max_capacity)] * batch)
        ids = np.full((batch, width), self.spec.pad_token_id, np.int64)
        mask = np.zeros((batch, width), self.spec.mask_dtype)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = p
            mask[b, : len(p)] = 1
        positions = np.broadcast_to(np.arange(width, dtype=np.int64), (batch, width))
        logits = self._run_prefill(cache, ids, mask, positions)
        self.check_length_record("prefill")
        # The logits stay in the model's dtype: the sampler reads float16 greedily on its bits
        # (sampling.py; a float32 copy of SmolLM2's logits was ~75 us of a CUDA decode step).
        last = np.stack([logits[b, n - 1] for b, n in enumerate(lengths)])
        ttft = time.perf_counter() - start

        tokens: list[list[int]] = [[] for _ in prompts]
        reasons = ["length"] * batch
        done = [False] * batch
        kept: list[np.ndarray] = []
        live = list(lengths)  # rows in the cache per entry
        steps, decode_seconds = 1, 0.0
        while True:
            if keep_logits:
                kept.append(np.array(last, np.float32))  # a copy: `last` may view a reused buffer
            chosen = sampler(last)
            step_tokens: list[int | None] = []
            for b in range(batch):
                if done[b]:
                    step_tokens.append(None)
                    continue
                token = int(chosen[b])
                tokens[b].append(token)
                step_tokens.append(token)
                if token in eos:
                    done[b], reasons[b] = True, "eos"
                elif len(tokens[b]) >= max_new_tokens:
                    done[b] = True
            if on_step is not None:
                on_step(step_tokens)
            if all(done):
                break
            start = time.perf_counter()
            feed = np.array(
                [[t if t is not None else tokens[b][-1]] for b, t in enumerate(step_tokens)],
                np.int64,
            )
            live = [n + 1 for n in live]
            cache.ensure([max(width, n) for n in live])
            last = self._run_decode(cache, feed, live)
            self.check_length_record(f"decode step {steps}")
            decode_seconds += time.perf_counter() - start
            steps += 1
        return GenerationOutput(
            tokens, reasons, ttft, decode_seconds, steps, dataclasses.replace(cache.stats), kept
        )

    # -----------------------------------------------------------------------------------------
    def run_options(self, graph_id: int | None) -> ort.RunOptions | None:
        if not self.cuda_graph:
            return None
        options = ort.RunOptions()
        options.add_run_config_entry("gpu_graph_id", str(-1 if graph_id is None else graph_id))
        return options

    def _run_prefill(self, cache: KvCache, ids, mask, positions) -> np.ndarray:
        binding = self.session.io_binding()
        self._bind_kv(binding, cache)
        return self._run_step(binding, ids, mask, positions)

    def _run_step(self, binding: ort.IOBinding, ids, mask, positions) -> np.ndarray:
        """Binds a step's host inputs and its logits to `binding` (whose KV buffers are bound)
        and runs it uncaptured; the logits as a host array."""
        binding.bind_cpu_input(self.spec.input_ids, ids)
        binding.bind_cpu_input(self.spec.attention_mask, mask)
        if self.spec.position_ids:
            binding.bind_cpu_input(self.spec.position_ids, np.ascontiguousarray(positions))
        # A fresh host array at every step of a reused binding (a reused one would be written
        # under an array an earlier step still views), bound by pointer and read as it is:
        # get_outputs() would wrap every bound output, the cache's 2 x layers among them.
        logits = np.empty((*ids.shape, self.spec.vocab_size), self.logits_dtype)
        bind_host_array(binding.bind_output, self.spec.logits, logits)
        self.session.run_with_iobinding(binding, self.run_options(None))
        return logits

    def _run_narrow(self, cache: KvCache, ids, mask, positions) -> np.ndarray:
        """A decode step with the narrowest mask. Its binding lives as long as the cache's
        buffers (one cache generation): the KV buffers, 2 x layers of them, are bound once
        (binding them anew each step cost SmolLM2 about 2 ms of a 50 ms step on the CPU); the
        step's inputs, whose shapes change, and the logits are bound anew."""
        narrow = self._narrow
        if narrow is None or narrow[0] is not cache or narrow[1] != cache.generation:
            binding = self.session.io_binding()
            self._bind_kv(binding, cache)
            self._narrow = (cache, cache.generation, binding)
        return self._run_step(self._narrow[2], ids, mask, positions)

    def _run_decode(self, cache: KvCache, feed: np.ndarray, live: list[int]) -> np.ndarray:
        batch = cache.batch
        if not self.fixed_mask:  # the narrowest mask: as wide as the longest live sequence
            mask = np.zeros((batch, max(live)), self.spec.mask_dtype)
            for b, n in enumerate(live):
                mask[b, :n] = 1
            positions = np.array([[n - 1] for n in live], np.int64)
            return self._run_narrow(cache, feed, mask, positions)[:, -1]

        decode = self._decode
        if decode is None or decode.generation != cache.generation or decode.cache is not cache:
            if decode is not None and decode.cache is cache:
                # The old graph's pointers/shapes are stale: the next capture (if the generation
                # lasts long enough for ORT to make one) is a re-capture, when one was captured.
                self._stale_capture |= self._graph_runs.get(self._graph_id, 0) > (
                    CUDA_GRAPH_WARMUP_RUNS
                )
            else:
                self._stale_capture = False
            self._graph_id += 1
            decode = self._decode = _DecodeBinding(self, cache)
        decode.mask[:] = 0
        for b, n in enumerate(live):
            decode.mask[b, :n] = 1
        decode.set_inputs(feed, np.array([[n - 1] for n in live], np.int64))
        runs = self._graph_runs.get(self._graph_id, 0)
        self.session.run_with_iobinding(decode.binding, self.run_options(self._graph_id))
        self._graph_runs[self._graph_id] = runs + 1
        if self.cuda_graph:
            if runs == CUDA_GRAPH_WARMUP_RUNS:
                cache.stats.graph_captures += 1
                cache.stats.recaptures += self._stale_capture
                self._stale_capture = False
            elif runs > CUDA_GRAPH_WARMUP_RUNS:
                cache.stats.replays += 1
        return decode.logits()[:, -1]

    def close(self) -> None:
        if self._owner == threading.get_ident():
            raise RuntimeError("Runtime.close called from inside generate's on_step callback")
        with self._lock:
            self._closed = True
            self._decode = None
            self._narrow = None
            if self.cache is not None:
                self.cache.close()

    def __enter__(self) -> Runtime:  # noqa: PYI034
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _DecodeBinding:
    """The fixed decode binding (runtime/fixed_binding.py): ids, mask and positions in, the
    logits out, every one at one address with one shape, as a CUDA graph needs."""

    def __init__(self, rt: Runtime, cache: KvCache):
        spec = rt.spec
        self.cache, self.generation = cache, cache.generation
        batch, width = cache.batch, cache.capacity
        self.mask = np.zeros((batch, width), spec.mask_dtype)
        inputs = {spec.input_ids: np.zeros((batch, 1), np.int64), spec.attention_mask: self.mask}
        if spec.position_ids:
            inputs[spec.position_ids] = np.zeros((batch, 1), np.int64)
        self._names = spec
        self._fixed = FixedBinding(
            rt.session, "cuda" if rt.provider == "cuda" else "cpu", rt.device_id, cache.buffers,
            inputs, {spec.logits: np.zeros((batch, 1, spec.vocab_size), rt.logits_dtype)},
        )  # fmt: skip
        self.binding = self._fixed.binding

    def set_inputs(self, feed: np.ndarray, positions: np.ndarray) -> None:
        spec, host = self._names, self._fixed.host
        host[spec.input_ids][:] = feed
        if spec.position_ids:
            host[spec.position_ids][:] = positions
        self._fixed.upload(host)  # the mask too: it was edited in place

    def logits(self) -> np.ndarray:
        return self._fixed.read(self._names.logits)
