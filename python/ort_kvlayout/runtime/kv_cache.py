"""A KV cache for a model's past/present buffers, in three modes, with exact memory accounting.

    spec = ModelSpec.from_dir(model_dir).kv          # or KvSpec.synthetic(...)
    with KvCache.create(spec, "growable", device="cpu", batch=2) as cache:
        cache.ensure([17, 9])                        # live tokens per batch entry
        for buf in cache.buffers:                    # bind buf.ptr with buf.shape (IO binding)
            ...
        cache.stats.committed_bytes, cache.stats.bytes_moved

Modes (every buffer is declared (B, Nkv, C, H); the model's kv_layout decides the byte order):

* ``preallocated``: the whole capacity committed up front (what onnxruntime-genai does).
* ``growable``: the whole capacity reserved as address space, physical granules committed as the
  live prefixes grow (host: MAP_NORESERVE pages; CUDA: cuMemAddressReserve + cuMemMap). The
  pointer and the declared shape (B, Nkv, C, H) never change, so the buffers stay bound and a
  captured CUDA graph stays valid. Seq-major keeps a batch entry's live tokens in one dense
  prefix (one run of granules per entry); head-major at the same stride needs one prefix per
  (entry, head), C*H elements apart, so it commits up to kv_heads times more.
* ``bucket``: a packed buffer of the current capacity, reallocated with a larger one (doubling)
  when full, the live rows copied over at the new strides, as runtimes without preallocation do.
  Pointers and shapes change at each growth (``generation`` counts them): every growth moves the
  live cache and invalidates a captured graph.

Quantized caches: every buffer holds the graph's element type, rows of `spec.row` elements (a
packed int4 row is (H + 1) // 2 bytes), so an int8 or fp8 cache commits half the bytes of an fp16
one and an int4 cache a quarter. A PER_TOKEN model's float32 scale caches (B, Nkv, C) travel
beside the KV caches: a cache of their own inside this one (the same mode, batch, capacity and
granule; laid out with head_dim 1), grown, committed, released and reset with it; `buffers`
lists them after the KV buffers, bound as past and present in place the same way.

The counters (`KvCacheStats`) are what the benchmarks and the CLI report; committed bytes come
from the allocators themselves (and on the host `measured_committed_bytes()` asks the kernel);
they include the scale caches, also counted apart (`scale_committed_bytes`).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import itertools
import math
import operator
import time
from dataclasses import dataclass

import numpy as np

from ..op.layout import (
    entry_blocks,
    entry_spans,
    from_layout,
    kv_strides,
    live_ranges,
    prefix_spans,
    prefix_tokens,
)
from .kv_memory import (
    DeviceReservation,
    HostReservation,
    KvMemoryError,
    OrtDeviceBuffer,
    Reservation,
    granule_runs,
)
from .model_spec import KvSpec, onnx_element_type

__all__ = [
    "CACHE_MODES",
    "KvBuffer",
    "KvCache",
    "KvCacheStats",
    "KvCapacityError",
    "KvMemoryError",
]

CACHE_MODES = ("preallocated", "growable", "bucket")
DEVICES = ("cpu", "cuda")
BUCKET_TOKENS = 256  # a bucket's capacity is a multiple of this; it doubles when full


class KvCapacityError(ValueError):
    """More tokens than the cache reserves (or than the model's context) were asked for."""


@dataclass
class KvCacheStats:
    reserved_bytes: int = 0  # address space held (growable) or allocated (other modes)
    committed_bytes: int = 0  # physical memory held now (all buffers, scale caches included)
    scale_committed_bytes: int = 0  # of which the PER_TOKEN scale caches (0 without them)
    peak_committed_bytes: int = 0
    live_bytes: int = 0  # bytes of the live rows last ensured (all buffers)
    bytes_moved: int = 0  # copied by growth (bucket re-striding); 0 for in-place growth
    growth_events: int = 0  # ensure() calls that committed or reallocated memory
    growth_seconds: float = 0.0  # time spent in those calls
    graph_captures: int = 0  # CUDA graphs captured (by the runtime using the cache)
    replays: int = 0  # decode steps run as a replay of a captured graph
    recaptures: int = 0  # captures forced by a pointer/shape change (bucket growth)


@dataclass(frozen=True)
class KvBuffer:
    """One past/present buffer as IO binding needs it."""

    past: str
    present: str
    ptr: int
    shape: tuple[int, ...]  # (B, Nkv, C, row): C is the bound capacity; a scale cache (B, Nkv, C)
    dtype: np.dtype
    device: str
    device_id: int

    @property
    def element_type(self) -> int:
        """The ONNX element type, what IO binding is given (onnxruntime binds no float8 numpy
        dtype)."""
        return onnx_element_type(self.dtype)


def bind_in_place(binding, buffers) -> None:
    """Binds every buffer (KV or PER_TOKEN scale) as its past input and present output at the
    same address, so the op appends in place. By ONNX element type: onnxruntime binds no
    float8 numpy dtype."""
    for buf in buffers:
        for bind, name in ((binding.bind_input, buf.past), (binding.bind_output, buf.present)):
            bind(name, buf.device, buf.device_id, buf.element_type, list(buf.shape), buf.ptr)


# Runs are (offset, size) lists, sorted and merged (no two overlap or touch): one list per set
# of bytes, so two computations of the same set compare equal. `held` and `runs` below may be a
# whole buffer's committed runs (one or more per entry): each change bisects to the runs it meets.


def _first_meeting(runs: list[tuple[int, int]], start: int, touching: bool) -> int:
    """The index of the first run ending after `start` (or at it, when `touching`)."""
    i = bisect.bisect_right(runs, (start, math.inf)) - 1  # the last run starting at or before
    if i < 0:
        return 0
    end = runs[i][0] + runs[i][1]
    return i if end > start or (touching and end == start) else i + 1


def _subtract(runs: list[tuple[int, int]], held: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(offset, size) runs minus the runs `held` (both sorted, merged), as a new list."""
    out = []
    for offset, size in runs:
        start, end = offset, offset + size
        i = _first_meeting(held, start, touching=False)
        while i < len(held) and held[i][0] < end and start < end:
            h_offset, h_size = held[i]
            if h_offset > start:
                out.append((start, h_offset - start))
            start = max(start, h_offset + h_size)
            i += 1
        if start < end:
            out.append((start, end - start))
    return out


def _remove_runs(runs: list[tuple[int, int]], removed: list[tuple[int, int]]) -> None:
    """runs -= removed, in place."""
    for offset, size in removed:
        start, end = offset, offset + size
        i = _first_meeting(runs, start, touching=False)
        j = bisect.bisect_left(runs, (end,))  # the first run starting at or past the end
        if i < j:
            first, (last, last_size) = runs[i][0], runs[j - 1]
            pieces = [(first, start - first)] if first < start else []
            if last + last_size > end:
                pieces.append((end, last + last_size - end))
            runs[i:j] = pieces


def _add_runs(runs: list[tuple[int, int]], added: list[tuple[int, int]]) -> None:
    """runs |= added, in place (touching runs merge, as granule_runs merges them)."""
    for offset, size in added:
        start, end = offset, offset + size
        i = _first_meeting(runs, start, touching=True)
        j = bisect.bisect_right(runs, (end, math.inf))  # the first run starting past the end
        if i < j:
            start = min(start, runs[i][0])
            end = max(end, runs[j - 1][0] + runs[j - 1][1])
        runs[i:j] = [(start, end - start)]


def _any_past(tokens: list[int], covered: list[int]) -> bool:
    """Whether some entry's tokens pass its cover (once a step per call: the loop in C)."""
    return any(map(operator.gt, tokens, covered))


def _new_reservation(
    device: str, size: int, device_id: int, granule: int | None, growable: bool
) -> Reservation:
    """Growable: a reserved range committed by granules. Otherwise a plain allocation: host
    memory committed by pages, or onnxruntime's CUDA allocator (no granule rounding)."""
    if device == "cpu":
        return HostReservation(size, granule) if growable and granule else HostReservation(size)
    return DeviceReservation(size, device_id) if growable else OrtDeviceBuffer(size, device_id)


class KvCache:
    """Use `KvCache.create`; a context manager (close() releases every reservation)."""

    def __init__(
        self,
        spec: KvSpec,
        mode: str,
        device: str,
        batch: int,
        capacity: int,
        device_id: int,
        granule: int | None,
        bucket_tokens: int = BUCKET_TOKENS,
    ):
        self.spec = spec
        self.mode = mode
        self.device = device
        self.device_id = device_id
        self.batch = batch
        self.max_capacity = capacity  # the most tokens per entry this cache can ever hold
        self.stats = KvCacheStats()
        self.generation = 0  # bumped whenever buffer pointers or shapes change (bucket growth)
        self._granule = granule
        self._itemsize = np.dtype(spec.dtype).itemsize
        self._scales: KvCache | None = None  # PER_TOKEN: the scale caches, a cache of their own
        self._reservations: list[Reservation] = []
        self._ensured = [0] * batch  # tokens per entry the last ensure() asked for (monotonic)
        self._covered = [0] * batch  # tokens per entry whose rows are committed for sure
        self._committed_runs: list[tuple[int, int]] = []  # (offset, size), in every buffer
        # _covered[b] never exceeds the cover of entry b's ensured rows: a neighbour's release
        # keeps only the granules under ensured rows, so a cover past them could name freed
        # memory as committed (ensure() would then commit nothing and the rows would be written
        # to unmapped memory). reset() zeroes the covers; a failed ensure() clamps them.
        self._closed = False
        if bucket_tokens < 1:
            raise ValueError(f"bucket_tokens must be >= 1, got {bucket_tokens}")
        self.bucket_tokens = bucket_tokens
        self.capacity = capacity if mode != "bucket" else min(capacity, bucket_tokens)

    # -----------------------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        spec: KvSpec,
        mode: str = "growable",
        device: str = "cpu",
        batch: int = 1,
        capacity: int | None = None,
        device_id: int = 0,
        granule: int | None = None,
        bucket_tokens: int = BUCKET_TOKENS,
    ) -> KvCache:
        """A cache of `batch` entries of up to `capacity` tokens (default: the model's context).

        granule: growable host caches' commit granule in bytes (a multiple of the page size;
        default one page); CUDA uses the device's allocation granularity. Preallocated and
        bucket buffers are plain allocations (host pages; onnxruntime's CUDA allocator). bucket_tokens: a bucket's first capacity
        and the multiple its later capacities are rounded to.
        """
        if mode not in CACHE_MODES:
            raise ValueError(f"cache mode {mode!r}: expected one of {', '.join(CACHE_MODES)}")
        if device not in DEVICES:
            raise ValueError(f"device {device!r}: expected one of {', '.join(DEVICES)}")
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        capacity = spec.context_length if capacity is None else int(capacity)
        if not 1 <= capacity:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if capacity > spec.context_length:
            raise KvCapacityError(
                f"capacity {capacity} exceeds the model's context length {spec.context_length}"
            )
        cache = cls(spec, mode, device, batch, capacity, device_id, granule, bucket_tokens)
        try:
            cache._allocate(cache.capacity)
            if mode != "growable":  # preallocated and bucket buffers are committed whole
                for res in cache._reservations:
                    res.commit(0, res.size)
                cache._covered = [cache.capacity] * batch
            scale_spec = spec.scale_spec()
            if scale_spec is not None:
                cache._scales = cls.create(
                    scale_spec, mode, device, batch, capacity, device_id, granule, bucket_tokens
                )
        except BaseException:
            cache.close()
            raise
        cache._update_bytes()
        return cache

    def _buffer_bytes(self, capacity: int) -> int:
        return self.batch * capacity * self.spec.token_bytes

    def _allocate(self, capacity: int) -> None:
        size = self._buffer_bytes(capacity)
        for _ in range(self.spec.buffers):
            self._reservations.append(
                _new_reservation(
                    self.device, size, self.device_id, self._granule, self.mode == "growable"
                )
            )

    # -----------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def granule(self) -> int:
        self._check_open()
        return self._reservations[0].granule

    @property
    def buffers(self) -> list[KvBuffer]:
        """The KV buffers (k0, v0, k1, ...), then the scale buffers in the same order."""
        self._check_open()
        shape = (self.batch, self.spec.kv_heads, self.capacity, self.spec.row)
        return [
            KvBuffer(past, present, res.ptr, shape, self.spec.dtype, self.device, self.device_id)
            for (past, present), res in zip(self.spec.names, self._reservations)
        ] + self._scale_buffers(self._scales.buffers if self._scales else [])

    @staticmethod
    def _scale_buffers(buffers: list[KvBuffer]) -> list[KvBuffer]:
        """A scale cache is declared (B, Nkv, C): its inner cache's (B, Nkv, C, 1) less the 1."""
        return [dataclasses.replace(b, shape=b.shape[:3]) for b in buffers]

    def entry_buffers(self, first: int, count: int) -> list[KvBuffer]:
        """The buffers of batch entries [first, first+count) alone: a batch entry's rows lie in
        one block of capacity x token bytes in both layouts, so the view is the same
        reservation at an offset with batch `count` (a serving engine runs the slots in use)."""
        self._check_open()
        if not (0 <= first and 1 <= count and first + count <= self.batch):
            raise ValueError(f"entries [{first}, {first + count}) outside a batch of {self.batch}")
        offset = first * self.capacity * self.spec.token_bytes
        shape = (count, self.spec.kv_heads, self.capacity, self.spec.row)
        scales = self._scales.entry_buffers(first, count) if self._scales else []
        return [
            KvBuffer(past, present, res.ptr + offset, shape, self.spec.dtype, self.device,
                     self.device_id)
            for (past, present), res in zip(self.spec.names, self._reservations)
        ] + self._scale_buffers(scales)  # fmt: skip

    def entry_commit_bytes(self, tokens: int) -> int:
        """Bytes (all buffers) that one entry of `tokens` live rows commits in this cache: its
        granule-rounded ranges (growable), or its share of the whole buffers (other modes)."""
        scales = self._scales.entry_commit_bytes(tokens) if self._scales else 0
        if self.mode != "growable":
            return self.max_capacity * self.spec.token_bytes * self.spec.buffers + scales
        runs = granule_runs(self._byte_ranges([tokens], self.capacity), self.granule)
        return sum(size for _, size in runs) * self.spec.buffers + scales

    def commit_bytes(self, tokens_per_entry: list[int]) -> int:
        """Bytes (all buffers) that live rows 0..t_b-1 of every entry b commit in this cache:
        the granules covering them, a granule shared by neighbouring entries counted once (a
        2 MiB CUDA granule holds several small entries). Other modes: every entry with rows
        holds its whole share. The sum of entry_commit_bytes over the entries is an upper
        bound that double-counts shared granules. The scale caches' bytes are included."""
        scales = self._scales.commit_bytes(tokens_per_entry) if self._scales else 0
        if self.mode != "growable":
            share = self.max_capacity * self.spec.token_bytes * self.spec.buffers
            return share * sum(1 for t in tokens_per_entry if t > 0) + scales
        if len(tokens_per_entry) != self.batch:
            raise ValueError(f"{len(tokens_per_entry)} token counts for a batch of {self.batch}")
        # prefix_spans + granule_runs, vectorized (a serving engine asks every step): the spans
        # of (entry, head) in (b, h) order start in increasing order in both layouts, so the
        # union of their granule intervals is each one's part past the furthest end before it.
        s, es, g = self.spec, self._itemsize, self.granule
        t = np.asarray(tokens_per_entry, np.int64)
        if t.min(initial=0) < 0 or t.max(initial=0) > self.capacity:
            raise ValueError(f"token counts {tokens_per_entry} outside [0, {self.capacity}]")
        entries = np.flatnonzero(t)
        if not entries.size:
            return scales
        st = kv_strides(s.layout, s.kv_heads, self.capacity, s.row)
        starts = (entries[:, None] * st.batch + np.arange(s.kv_heads) * st.head).ravel()
        ends = starts + np.repeat((t[entries] - 1) * st.seq + s.row, s.kv_heads)
        lo, hi = starts * es // g, -(-(ends * es) // g)
        before = np.maximum.accumulate(np.concatenate(([lo[0]], hi[:-1])))
        granules = np.maximum(hi - np.maximum(lo, before), 0).sum()
        return int(granules) * g * s.buffers + scales

    def release(self, entry: int, keep: int = 0) -> int:
        """Ends batch entry `entry`'s sequence: no live rows, and (growable) its granules go
        back to the system, except those it shares with another entry's live rows. With `keep`
        the entry holds rows [0, keep) on, as if ensured to that many (the granules under them
        stay committed and counted; their contents mean nothing): a serving engine keeps a freed
        slot's first granule for its scratch row or its next request, not a map and an unmap
        (CUDA driver calls) per request. Returns the bytes released (all buffers); pointers and
        shapes stay, nothing is moved."""
        self._check_open()
        if not 0 <= entry < self.batch:
            raise ValueError(f"entry {entry} outside a batch of {self.batch}")
        keep = min(max(int(keep), 0), self._ensured[entry])
        released = 0
        if self.mode == "growable" and self._ensured[entry] > keep:
            free = self._freed_runs(entry, keep)
            try:
                for res in self._reservations:
                    for offset, size in free:
                        released += res.decommit(offset, size)
            finally:
                _remove_runs(self._committed_runs, free)
                self._covered[entry] = 0
                self._update_bytes()
        if self.mode == "growable":
            self._covered[entry] = self._entry_covered(entry, keep)
        self._ensured[entry] = keep
        if self._scales is not None:
            released += self._scales.release(entry, keep)
            self._update_bytes()
        self._update_live_bytes()
        return released

    def _freed_runs(self, entry: int, keep: int) -> list[tuple[int, int]]:
        """The granules that entry's rows hold beyond its first `keep` and that no other entry's
        live rows touch: only the neighbours whose blocks meet those granules can share one."""
        s, es = self.spec, self._itemsize
        mine = self._entry_runs([(entry, self._ensured[entry])])
        start, end = mine[0][0], mine[-1][0] + mine[-1][1]
        near = entry_blocks(
            s.layout, s.kv_heads, self.capacity, s.row, self.batch, start // es, -(-end // es)
        )
        kept = self._entry_runs([(b, keep if b == entry else self._ensured[b]) for b in near])
        return _subtract(mine, kept)

    @property
    def tokens(self) -> list[int]:
        """Live tokens per entry, as last ensured."""
        return list(self._ensured)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("the KV cache is closed")

    def covers(self, tokens_per_entry: list[int]) -> bool:
        """Whether rows 0..t_b-1 of every entry b lie in memory committed now: ensure() would
        commit nothing, and commit_bytes() of them is at most the committed bytes (a serving
        engine asks every step; the answer is one comparison per entry)."""
        if _any_past(tokens_per_entry, self._covered):
            return False
        scales = self._scales
        return scales is None or not _any_past(tokens_per_entry, scales._covered)

    # -----------------------------------------------------------------------------------------
    def ensure(self, tokens_per_entry: list[int] | int) -> bool:
        """Makes rows 0..t_b-1 of every entry b writable; returns True when memory was committed
        or reallocated. Raises KvCapacityError past the capacity, KvMemoryError when committing
        fails (the cache keeps what it had and stays usable)."""
        self._check_open()
        tokens = (
            [int(tokens_per_entry)] * self.batch
            if isinstance(tokens_per_entry, (int, np.integer))
            else list(map(int, tokens_per_entry))
        )
        if len(tokens) != self.batch:
            raise ValueError(f"{len(tokens)} token counts for a batch of {self.batch}")
        if min(tokens) < 0 or max(tokens) > self.max_capacity:  # once a step: min/max first
            for b, t in enumerate(tokens):
                if t < 0:
                    raise ValueError(f"batch entry {b}: negative token count {t}")
                if t > self.max_capacity:
                    raise KvCapacityError(
                        f"batch entry {b} needs {t} tokens; the KV cache holds "
                        f"{self.max_capacity} per entry (model context {self.spec.context_length})"
                    )
        tokens = list(map(max, tokens, self._ensured))
        grew = False
        scales = self._scales
        if _any_past(tokens, self._covered) or (
            scales is not None and _any_past(tokens, scales._covered)
        ):
            start = time.perf_counter()
            moved = scales.stats.bytes_moved if scales is not None else 0
            try:
                if _any_past(tokens, self._covered):
                    grew = self._grow_bucket(tokens) if self.mode == "bucket" else (
                        self._commit(tokens)
                    )  # fmt: skip
                if scales is not None:  # grown alike (bucket: to the same capacity)
                    grew = scales.ensure(tokens) or grew
            except BaseException:  # covers may have been committed for rows not ensured
                self._clamp_covers()
                raise
            finally:  # a failed commit may have committed some buffers: count what is held
                if scales is not None:
                    self.stats.bytes_moved += scales.stats.bytes_moved - moved
                self._update_bytes()
            if grew:
                self.stats.growth_events += 1
                self.stats.growth_seconds += time.perf_counter() - start
        elif scales is not None:
            scales.ensure(tokens)  # its live counts (nothing to commit)
        self._ensured = tokens
        self._update_live_bytes()  # the rest changes only where memory was committed (above)
        return grew

    def reset(self) -> None:
        """A new sequence: no live tokens. Committed memory and pointers stay (reuse)."""
        self._check_open()
        self._ensured = [0] * self.batch
        self._covered = [0] * self.batch  # the granules stay; the next ensure finds them held
        if self._scales is not None:
            self._scales.reset()
        self._update_bytes()

    def _byte_ranges(self, tokens: list[int], capacity: int) -> list[tuple[int, int]]:
        s = self.spec
        ranges = live_ranges(s.layout, s.kv_heads, capacity, s.row, tokens)
        return [(a * self._itemsize, b * self._itemsize) for a, b in ranges]

    def _commit(self, tokens: list[int]) -> bool:
        """Commits the granules under rows 0..t_b-1 of the entries past what they cover. An
        entry within its cover needs nothing: its rows lie in the granules its covered rows
        committed (still held: a neighbour's release keeps granules under its rows), and its
        cover is unchanged (the granule holding its last row is the same)."""
        grown = list(itertools.compress(range(self.batch), map(operator.gt, tokens, self._covered)))
        runs = self._entry_runs([(b, tokens[b]) for b in grown])
        # Only the runs not yet committed in every buffer (usually a granule per prefix): the
        # reservations skip granules they hold, so a retry after a failure is cheap and exact.
        new = _subtract(runs, self._committed_runs)
        added = 0
        for res in self._reservations:
            for offset, size in new:
                added += res.commit(offset, size)
        _add_runs(self._committed_runs, runs)
        for b in grown:
            self._covered[b] = self._entry_covered(b, tokens[b])
        return added > 0

    def _clamp_covers(self) -> None:
        """Each cover at most that of the entry's ensured rows (the invariant in __init__),
        after an ensure() that failed part way (its covers may name rows it did not ensure)."""
        for b, t in enumerate(self._ensured):
            self._covered[b] = min(self._covered[b], self._entry_covered(b, t) if t else 0)

    def _entry_runs(self, entry_tokens: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The granule runs under rows 0..t-1 of each (entry, t): granule_runs of _byte_ranges
        for a batch where only these entries hold rows."""
        s, es = self.spec, self._itemsize
        spans = entry_spans(s.layout, s.kv_heads, self.capacity, s.row, entry_tokens)
        return granule_runs([(start * es, end * es) for _, start, end in spans], self.granule)

    def _entry_covered(self, entry: int, tokens: int) -> int:
        """The most tokens of `entry` whose rows lie in the granules its first `tokens` rows
        commit (so ensure() returns at once until a row would cross into an uncommitted
        granule); 0 without tokens."""
        s, es, g = self.spec, self._itemsize, self.granule
        covered = []
        for _, start, end in entry_spans(
            s.layout, s.kv_heads, self.capacity, s.row, [(entry, tokens)]
        ):
            granule_end = -(-(end * es) // g) * g  # the end of the granule holding the last row
            elements = granule_end // es - start
            covered.append(prefix_tokens(s.layout, s.kv_heads, self.capacity, s.row, elements))
        return min(covered, default=0)

    def _grow_bucket(self, tokens: list[int]) -> bool:
        need = max(tokens)
        step = self.bucket_tokens
        new_capacity = max(-(-need // step) * step, 2 * self.capacity)
        new_capacity = min(new_capacity, self.max_capacity)  # > capacity: ensure() checked
        old, old_capacity = self._reservations, self.capacity
        copies = self._restride_copies(self._ensured, old_capacity, new_capacity)
        self._reservations = []
        try:
            self._allocate(new_capacity)
            for res in self._reservations:
                res.commit(0, res.size)
            for src, dst in zip(old, self._reservations):
                for src_offset, dst_offset, size in copies:
                    dst.copy_from(dst_offset, src, src_offset, size)
        except BaseException:
            for res in self._reservations:
                res.close()
            self._reservations = old
            raise
        for res in old:
            res.close()
        self.stats.bytes_moved += sum(size for _, _, size in copies) * len(self._reservations)
        self.capacity = new_capacity
        self._covered = [new_capacity] * self.batch
        self.generation += 1
        return True

    def _restride_copies(
        self, tokens: list[int], old_capacity: int, new_capacity: int
    ) -> list[tuple[int, int, int]]:
        """(source offset, destination offset, bytes) moving the live rows of every (entry,
        head) from capacity old to new; runs that stay adjacent in both are merged."""
        s, es = self.spec, self._itemsize
        old = prefix_spans(s.layout, s.kv_heads, old_capacity, s.row, tokens)
        new = prefix_spans(s.layout, s.kv_heads, new_capacity, s.row, tokens)
        copies: list[list[int]] = []
        for (_, src_start, src_end), (_, dst_start, _) in zip(old, new):
            src, dst, size = src_start * es, dst_start * es, (src_end - src_start) * es
            if copies:
                ps, pd, pn = copies[-1]
                if src - ps == dst - pd and src <= ps + pn:  # same run in both buffers
                    copies[-1][2] = max(pn, src + size - ps)
                    continue
            copies.append([src, dst, size])
        return [(a, b, c) for a, b, c in copies]

    def _update_bytes(self) -> None:
        st = self.stats
        st.reserved_bytes = sum(r.size for r in self._reservations)
        st.committed_bytes = sum(r.committed_bytes for r in self._reservations)
        if self._scales is not None:
            inner = self._scales.stats
            st.reserved_bytes += inner.reserved_bytes
            st.committed_bytes += inner.committed_bytes
            st.scale_committed_bytes = inner.committed_bytes
        st.peak_committed_bytes = max(st.peak_committed_bytes, st.committed_bytes)
        self._update_live_bytes()

    def _update_live_bytes(self) -> None:
        live = sum(self._ensured) * self.spec.token_bytes * self.spec.buffers
        self.stats.live_bytes = live + (self._scales.stats.live_bytes if self._scales else 0)

    def measured_committed_bytes(self) -> int:
        """Host: resident bytes as the kernel reports them (mincore); CUDA: mapped granules."""
        self._check_open()
        scales = self._scales.measured_committed_bytes() if self._scales else 0
        return sum(r.resident_bytes() for r in self._reservations) + scales  # type: ignore[attr-defined]

    # -----------------------------------------------------------------------------------------
    def read_bytes(self, index: int, offset: int, size: int) -> bytes:
        """Raw bytes of buffer `index` (a device copy on CUDA): tests check growth moved none.
        Indices past the KV buffers are the scale buffers (as in `buffers`)."""
        self._check_open()
        if index >= len(self._reservations) and self._scales is not None:
            return self._scales.read_bytes(index - len(self._reservations), offset, size)
        return self._reservations[index].read(offset, size)

    def logical(self, index: int) -> np.ndarray:
        """A host copy of buffer `index` as the logical (B, Nkv, C, row) array (any layout; a
        scale buffer, past the KV buffers: (B, Nkv, C)). Only committed rows are read; the rest
        read as zeros."""
        self._check_open()
        if index >= len(self._reservations) and self._scales is not None:
            return self._scales.logical(index - len(self._reservations))[..., 0]
        s = self.spec
        res = self._reservations[index]
        data = np.zeros(self.batch * self.capacity * s.kv_heads * s.row, s.dtype)
        raw = data.view(np.uint8)
        for start, end in self._byte_ranges(self._ensured, self.capacity):
            raw[start:end] = np.frombuffer(res.read(start, end - start), np.uint8)
        shape = (self.batch, s.kv_heads, self.capacity, s.row)
        return np.array(from_layout(data.reshape(shape), s.layout))

    def close(self) -> None:
        """Releases every reservation (idempotent). The first error is raised after all tried."""
        if self._closed:
            return
        self._closed = True
        error: BaseException | None = None
        for res in self._reservations:
            try:
                res.close()
            except BaseException as exc:  # noqa: BLE001 -- release the rest first
                error = error or exc
        self._reservations = []
        if self._scales is not None:
            try:
                self._scales.close()
            except BaseException as exc:  # noqa: BLE001 -- report the first
                error = error or exc
        self.stats.committed_bytes = 0
        self.stats.scale_committed_bytes = 0
        if error is not None:
            raise error

    def __enter__(self) -> KvCache:  # noqa: PYI034
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: nobody to report to
            self.close()
