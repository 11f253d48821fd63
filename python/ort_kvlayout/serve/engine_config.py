"""EngineConfig: the serving engine's knobs, checked when made (serve/engine.py runs them)."""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral

__all__ = ["CPU_PREFILL_CHUNK", "CUDA_PACKED_MULTIPLE", "CUDA_PREFILL_CHUNK", "EngineConfig"]

# Prompt tokens prefilled a step by default. CUDA: 1,024 gave 1.06-1.13x the output tok/s of
# 256 in the chat burst on an H100 (Llama-3.2-1B shape, docs/SERVING.md), ITL p99 12 against
# 10 ms; 2,048 gave no more.
CPU_PREFILL_CHUNK = 256
CUDA_PREFILL_CHUNK = 1024
# A packed call's tokens padded up to a multiple of this on CUDA (EngineConfig.packed_multiple):
# calls then repeat a few token counts, and each new count costs an eager Run the GEMMs' and
# ORT's per-shape host work again.
CUDA_PACKED_MULTIPLE = 64


@dataclass(frozen=True)
class EngineConfig:
    """max_batch: slots (concurrent requests); capacity: tokens per slot (default: the model's
    context); kv_budget_bytes: KV bytes the engine may commit, refused when more than the
    device has; kv_budget_fraction (instead): that share of the memory free when the engine
    starts (after the model loaded); neither: on CUDA 0.9 of the free memory (at most the whole
    reservation), on the CPU the whole reservation; prefill_chunk: prompt tokens prefilled per
    step (bounds the decode stall; None: CUDA_PREFILL_CHUNK with provider "cuda", where a
    step's eager prefill call is bound by ORT's kernel launches until its chunk is long enough
    to keep the GPU busy, else CPU_PREFILL_CHUNK); max_waiting: queued requests before submit raises
    EngineOverloaded; cache: "growable" or "preallocated" (the baseline: every slot committed
    whole); cuda_graph: decode calls captured as CUDA graphs, one per bucket (None: on with
    provider "cuda"; True on the CPU is an error); decode_buckets: the batch sizes a decode call
    is padded to, over slots [0, bucket) (None: 1, 2, 4, then multiples of 8, and max_batch;
    graphs need them; () runs each step's decoding range as it is, uncaptured);
    sample_on_device: run the served graph (model/serving_graph.py: lengths in place of the
    mask, logits only at sampled positions, tokens chosen by ai.kvlayout::SampleTokens, only ids
    copied back; None: when the graph allows it, True: an error otherwise) or, False, the
    model's own graph with every position's logits sampled on the host; packed: the served graph
    with packed tokens (its rewrite 4; None: where the graph allows it, True: an error
    otherwise): a step's prefill chunks run as one call that computes only their tokens;
    mixed: with packed, a step that prefills carries its decode rows in that call too (one
    uncaptured Run a step; off: the decode rows keep their own call, a CUDA graph; with packed
    None, mixed asks for packing: an error where the graph does not allow it); overlap: a
    publisher thread decodes the events' text and hands them to their readers while the next
    step's calls run (None: on with provider "cuda", where Run waits on the GPU with the GIL
    released; off on the CPU, where ORT's threads want the cores); commit_ahead: while a step's
    calls run, a worker thread commits the KV rows of the next step's prefill chunks
    (scheduler.next_prefill_rows; on CUDA the driver's map calls), so that the next step finds
    them committed (off by default: its effect on a GPU step is not measured yet); prefill_wait:
    steps a waiting request may be held while the running ones decode, so that prompts arriving
    one by one start together in one prefill call (scheduler.hold_admissions: until they fill
    a chunk or an eighth of the slots; 0, the default: admitted at once); pipeline: decode
    steps of one bucket run back to back, the next one planned (budget, KV commits, lengths and
    sampling parameters) on a helper thread while a step's Run is in flight, and launched once
    the step's tokens are read, before they are emitted (engine.py, "Pipelined decode"; needs
    the served graph and padded decode; None: on with provider "cuda" where the served graph
    runs and decode calls are padded (the chat burst on an H100: 15,550 to 16,987 output tok/s,
    docs/SERVING.md), off on the CPU, where the helper thread competes with ORT's for the cores;
    True: an error where they are not used); packed_multiple: a packed call that prefills has
    its tokens padded up to a multiple of this with tokens no row attends to (serve/packing.py;
    a call of decode rows alone is not padded; None:
    CUDA_PACKED_MULTIPLE with provider "cuda", 1 on the CPU, where a padding token costs its
    compute and a new count nothing more); graph_chunk: above 0, a step that prefills runs as
    one packed call of slots [0, bucket) (the bucket holding every slot it runs) carrying the
    step's decode rows and each prefilling request's chunk of at most graph_chunk tokens, its
    shapes fixed by (bucket, token count padded up to bucket + a multiple of graph_chunk): a CUDA
    graph each where graphs are on (on the CPU uncaptured, the same calls), where an eager
    packed call is launched kernel by kernel; prefill_chunk stays the step's token budget. It
    needs packed calls and padded decode calls (0, the default: eager packed calls);
    device_ids: with the pipeline, each decode call after the first takes its ids from the last
    call's token ids without leaving the device (a bucket's calls in two bindings, each the
    other's ids), so that it is launched as soon as the last one returns and the host reads
    the tokens during it (engine.py, _decode_pipeline_fed; off by default)."""

    max_batch: int = 8
    capacity: int | None = None
    kv_budget_bytes: int | None = None
    kv_budget_fraction: float | None = None
    prefill_chunk: int | None = None
    max_waiting: int = 256
    cache: str = "growable"
    provider: str = "cpu"
    device_id: int = 0
    granule: int | None = None
    cuda_graph: bool | None = None
    decode_buckets: tuple[int, ...] | None = None
    sample_on_device: bool | None = None
    packed: bool | None = None
    mixed: bool = False
    overlap: bool | None = None
    commit_ahead: bool = False
    prefill_wait: int = 0
    pipeline: bool | None = None
    packed_multiple: int | None = None
    graph_chunk: int = 0
    device_ids: bool = False

    @property
    def overlapped(self) -> bool:
        """Whether the host work of a step overlaps its model calls."""
        return self.provider == "cuda" if self.overlap is None else bool(self.overlap)

    def pipelined(self, served: bool) -> bool:
        """Whether consecutive decode steps of one bucket are pipelined, given whether the
        served graph runs (the engine knows once it has looked at the model)."""
        if self.pipeline is not None:
            return bool(self.pipeline)
        return self.provider == "cuda" and served and self.padded_decode

    @property
    def chunk(self) -> int:
        """Prompt tokens prefilled a step (prefill_chunk, or the provider's default)."""
        if self.prefill_chunk is not None:
            return self.prefill_chunk
        return CUDA_PREFILL_CHUNK if self.provider == "cuda" else CPU_PREFILL_CHUNK

    @property
    def packed_tokens_multiple(self) -> int:
        """What a packed call's token count is padded up to a multiple of."""
        if self.packed_multiple is not None:
            return self.packed_multiple
        return CUDA_PACKED_MULTIPLE if self.provider == "cuda" else 1

    @property
    def packing(self) -> bool | None:
        """Packed calls: True (or an error), None (where the graph allows them) or False."""
        if self.packed is not None:
            return self.packed
        return True if self.mixed else None

    @property
    def graphs(self) -> bool:
        """Whether decode calls run as CUDA graphs."""
        return self.provider == "cuda" if self.cuda_graph is None else bool(self.cuda_graph)

    @property
    def padded_decode(self) -> bool:
        """Whether decode calls are padded to buckets (with graphs, or asked for on the CPU)."""
        return self.graphs if self.decode_buckets is None else bool(self.decode_buckets)

    def __post_init__(self) -> None:
        for name in ("max_batch", "capacity", "kv_budget_bytes", "prefill_chunk", "max_waiting",
                     "device_id", "granule", "prefill_wait", "packed_multiple",
                     "graph_chunk"):  # fmt: skip
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, Integral)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.granule is not None and self.granule < 1:  # 0 would mean the default silently
            raise ValueError(f"granule must be >= 1 bytes (None: the device's), got {self.granule}")
        if self.packed_multiple is not None and self.packed_multiple < 1:
            raise ValueError(f"packed_multiple must be >= 1, got {self.packed_multiple}")
        if self.graph_chunk < 0:
            raise ValueError(f"graph_chunk must be >= 0 tokens (0: off), got {self.graph_chunk}")
        if self.graph_chunk and (self.packed is False or self.sample_on_device is False):
            raise ValueError(
                "graph_chunk needs packed calls of the served graph (packed and "
                "sample_on_device not False)"
            )
        if self.graph_chunk and not self.padded_decode:
            raise ValueError(
                "graph_chunk needs padded decode calls (CUDA graphs, or decode_buckets on the "
                "CPU): its calls run slots [0, bucket)"
            )
        if self.device_ids and self.pipeline is False:
            raise ValueError("device_ids=True needs the pipeline (pipeline not False)")
        if self.prefill_wait < 0:
            raise ValueError(f"prefill_wait must be >= 0 steps, got {self.prefill_wait}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.kv_budget_bytes is not None and self.kv_budget_bytes < 1:
            raise ValueError(f"kv_budget_bytes must be >= 1, got {self.kv_budget_bytes}")
        if self.cache not in ("growable", "preallocated"):
            raise ValueError(f"cache {self.cache!r}: the engine runs 'growable' or 'preallocated'")
        if self.provider not in ("cpu", "cuda"):
            raise ValueError(f"provider {self.provider!r}: expected 'cpu' or 'cuda'")
        if self.kv_budget_bytes is not None and self.kv_budget_fraction is not None:
            raise ValueError("give kv_budget_bytes or kv_budget_fraction, not both")
        if self.kv_budget_fraction is not None and not 0 < self.kv_budget_fraction <= 1:
            raise ValueError(f"kv_budget_fraction must be in (0, 1], got {self.kv_budget_fraction}")
        if self.cuda_graph and self.provider != "cuda":
            raise ValueError(
                "cuda_graph=True needs provider='cuda': CUDA graphs capture CUDA kernels (on "
                "the CPU, decode_buckets runs the same padded decode calls uncaptured)"
            )
        if (self.packed or self.mixed) and self.sample_on_device is False:
            what = "packed=True" if self.packed else "mixed=True"
            raise ValueError(f"{what} needs the served graph (sample_on_device not False)")
        if self.mixed and self.packed is False:
            raise ValueError("mixed=True needs packed calls (packed not False)")
        if self.pipeline and self.sample_on_device is False:
            raise ValueError(
                "pipeline=True needs the served graph (sample_on_device not False): a step is "
                "launched once its last step's token ids are read, without host logits"
            )
        if self.pipeline and not self.padded_decode:
            raise ValueError(
                "pipeline=True needs padded decode calls (CUDA graphs, or decode_buckets on the "
                "CPU): the next step is staged into its bucket's fixed binding"
            )
        if self.graphs and self.decode_buckets is not None and not self.decode_buckets:
            raise ValueError("CUDA graphs need decode buckets (a fixed batch per graph)")
        if self.decode_buckets is not None:
            bad = [b for b in self.decode_buckets if int(b) < 1]
            if bad:
                raise ValueError(f"decode bucket sizes must be >= 1, got {bad}")
