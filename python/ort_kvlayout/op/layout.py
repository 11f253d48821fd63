"""KV-cache layouts: names, ids and the stride arithmetic (the Python mirror of csrc/core/kv_strides.h).

The declared shape of a past/present buffer is (B, Nkv, C, H) in both layouts; the layout decides
where logical element (b, h, s, d) lives in it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

HEAD_MAJOR = 0
SEQ_MAJOR = 1
HEAD_MAJOR_BNSH = "head_major_bnsh"
SEQ_MAJOR_BSNH = "seq_major_bsnh"

LAYOUT_NAMES = {HEAD_MAJOR: HEAD_MAJOR_BNSH, SEQ_MAJOR: SEQ_MAJOR_BSNH}
LAYOUT_IDS = {name: layout for layout, name in LAYOUT_NAMES.items()}


class KvStrides(NamedTuple):
    """Element strides of (batch, kv head, sequence position, head dim)."""

    batch: int
    head: int
    seq: int
    dim: int


def layout_id(layout: int | str) -> int:
    """Accepts 0/1, the metadata names, or the CLI names (head-major, seq-major)."""
    if isinstance(layout, str):
        key = layout.strip().lower().replace("-", "_")
        aliases = {
            "head_major": HEAD_MAJOR,
            "bnsh": HEAD_MAJOR,
            "seq_major": SEQ_MAJOR,
            "bsnh": SEQ_MAJOR,
        }
        if key in LAYOUT_IDS:
            return LAYOUT_IDS[key]
        if key in aliases:
            return aliases[key]
        raise ValueError(
            f"unknown KV layout {layout!r}: expected one of {sorted(LAYOUT_IDS)} or 0/1"
        )
    if layout not in LAYOUT_NAMES:
        raise ValueError(
            f"kv_layout must be 0 (head-major BNSH) or 1 (seq-major BSNH), got {layout}"
        )
    return int(layout)


def kv_strides(layout: int | str, kv_heads: int, capacity: int, head_dim: int) -> KvStrides:
    """Element strides of a (B, kv_heads, capacity, head_dim)-declared cache in `layout`."""
    if layout_id(layout) == HEAD_MAJOR:
        return KvStrides(kv_heads * capacity * head_dim, capacity * head_dim, head_dim, 1)
    return KvStrides(capacity * kv_heads * head_dim, head_dim, kv_heads * head_dim, 1)


def to_layout(bnsh, layout: int | str):
    """A logical (B, Nkv, C, H) numpy array -> the buffer (same declared shape) in `layout`."""
    import numpy as np

    if layout_id(layout) == HEAD_MAJOR:
        return np.ascontiguousarray(bnsh)
    b, n, c, h = bnsh.shape
    return np.ascontiguousarray(bnsh.transpose(0, 2, 1, 3)).reshape(b, n, c, h)


def from_layout(buf, layout: int | str):
    """A (B, Nkv, C, H)-declared buffer in `layout` -> the logical (B, Nkv, C, H) array."""
    import numpy as np

    if layout_id(layout) == HEAD_MAJOR:
        return np.asarray(buf)
    b, n, c, h = buf.shape
    return np.asarray(buf).reshape(b, c, n, h).transpose(0, 2, 1, 3)


def prefix_spans(
    layout: int | str,
    kv_heads: int,
    capacity: int,
    head_dim: int,
    tokens_per_entry: list[int],
) -> list[tuple[int, int, int]]:
    """(entry, start, end) element spans of rows 0..t_b-1 of every (entry b, kv head), in (b, h)
    order, entries without tokens skipped. Head-major: each span is dense; seq-major: the heads'
    spans interleave (row stride Nkv*H) and together cover one dense prefix per entry."""
    for b, tokens in enumerate(tokens_per_entry):
        if not 0 <= tokens <= capacity:
            raise ValueError(f"batch entry {b}: {tokens} tokens, capacity is {capacity}")
    return entry_spans(layout, kv_heads, capacity, head_dim, enumerate(tokens_per_entry))


def entry_spans(
    layout: int | str,
    kv_heads: int,
    capacity: int,
    head_dim: int,
    entry_tokens: Iterable[tuple[int, int]],
) -> list[tuple[int, int, int]]:
    """prefix_spans of the given (entry, tokens) pairs alone, in their order (token counts not
    checked): every span lies in its entry's block (entry_blocks), so a cache can work on the
    entries a change touches rather than on the whole batch."""
    s = kv_strides(layout, kv_heads, capacity, head_dim)
    return [
        (b, b * s.batch + h * s.head, b * s.batch + h * s.head + (t - 1) * s.seq + head_dim)
        for b, t in entry_tokens
        if t
        for h in range(kv_heads)
    ]


def entry_blocks(
    layout: int | str,
    kv_heads: int,
    capacity: int,
    head_dim: int,
    batch: int,
    start: int,
    end: int,
) -> range:
    """The batch entries whose blocks meet elements [start, end): the only entries with rows
    there. In both layouts entry b's elements lie in [b * B, (b + 1) * B), B the batch stride
    (Nkv * C * H): heads and rows stride inside it (head-major H, then C * H; seq-major H, then
    Nkv * H). A granule shared by entries is shared by neighbours whose blocks it meets."""
    block = kv_strides(layout, kv_heads, capacity, head_dim).batch
    return range(max(0, start // block), min(batch, -(-end // block)))


def prefix_tokens(
    layout: int | str, kv_heads: int, capacity: int, head_dim: int, elements: int
) -> int:
    """The most rows of one (entry, head) whose span (prefix_spans) fits in `elements` elements
    from its start: the inverse of prefix_spans' end, at most the capacity."""
    seq = kv_strides(layout, kv_heads, capacity, head_dim).seq
    return max(0, min(capacity, (elements - head_dim) // seq + 1))


def live_ranges(
    layout: int | str,
    kv_heads: int,
    capacity: int,
    head_dim: int,
    tokens_per_entry: list[int],
) -> list[tuple[int, int]]:
    """Element ranges [start, end) of one (B, kv_heads, capacity, head_dim) buffer that hold rows
    0..t_b-1 of every batch entry b, sorted, touching ranges merged.

    Seq-major: one dense prefix per batch entry ([b*C*Nkv*H, b*C*Nkv*H + t_b*Nkv*H)); head-major:
    one prefix per (entry, head), C*H apart. What a growable cache must keep committed.
    """
    spans = prefix_spans(layout, kv_heads, capacity, head_dim, tokens_per_entry)
    merged: list[tuple[int, int]] = []
    for _, start, end in sorted(spans, key=lambda span: span[1:]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
