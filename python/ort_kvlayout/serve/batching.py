"""The shape of the engine's decode call: which slots it runs and what a padded row feeds.

Pure functions (no session, no cache), so the rules are tested without a model or a GPU.

A decode call runs one contiguous slot range of the cache (a slot's rows are one block of
capacity x token bytes in both layouts, so the range is the same reservation bound at an
offset with a smaller batch). Two ways to choose it:

* eager: [lowest decoding slot, highest decoding slot + 1], a new shape whenever requests come
  and go; the total length (the mask's width) that of the longest row;
* buckets (what CUDA graphs need): [0, bucket) with the smallest bucket holding the highest
  decoding slot, and a total length of the cache's capacity. Every bucket's call then has one
  shape and, the cache's addresses never moving, one set of addresses for the engine's life:
  one graph per bucket, captured once, replayed across growth and slot reuse.

Rows of the range that are not decoding are padding: a free slot feeds the pad token with a
total of 1 row (seqlens_k 0: it writes and reads row 0 of its own slot, a scratch row the engine
commits), a prefilling request feeds the pad token at its next row (seqlens_k = its cached rows:
it writes row `cached`, which its next chunk overwrites, and reads only its own rows). No padded
row touches another slot's rows, every seqlens_k lies in [0, capacity), and no query_seqlens is
needed (builder models lack that input).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["bucket_for", "decode_range", "decode_rows", "default_buckets", "resolve_buckets"]


def default_buckets(max_batch: int, step: int = 8) -> tuple[int, ...]:
    """1, 2, 4, then the multiples of `step` below max_batch, then max_batch (vLLM's capture
    sizes): at most step - 1 padded rows once the batch passes `step`, and 3 + max_batch / step
    graphs."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = {b for b in (1, 2, 4) if b < max_batch}
    sizes |= set(range(step, max_batch, step))
    return tuple(sorted(sizes | {max_batch}))


def resolve_buckets(buckets: Sequence[int] | None, max_batch: int) -> tuple[int, ...]:
    """The buckets a decode call may take: the given sizes below max_batch and max_batch itself
    (so every slot range has one), sorted; None gives default_buckets(max_batch); an empty
    sequence gives () (eager ranges)."""
    if buckets is None:
        return default_buckets(max_batch)
    sizes = [int(b) for b in buckets]
    if not sizes:
        return ()
    bad = [b for b in sizes if b < 1]
    if bad:
        raise ValueError(f"decode bucket sizes must be >= 1, got {bad}")
    return tuple(sorted({b for b in sizes if b < max_batch} | {max_batch}))


def bucket_for(rows: int, buckets: Sequence[int]) -> int:
    """The smallest bucket of at least `rows` rows (buckets sorted, the last one max_batch)."""
    for b in buckets:
        if b >= rows:
            return b
    raise ValueError(f"no decode bucket holds {rows} rows (buckets {tuple(buckets)})")


def decode_range(decoding: Sequence[int], buckets: Sequence[int]) -> tuple[int, int] | None:
    """The slot range [lo, hi) of a decode call over the decoding slots (None without any):
    [min, max + 1) without buckets, [0, bucket) with them."""
    if not decoding:
        return None
    hi = max(decoding) + 1
    if buckets:
        return 0, bucket_for(hi, buckets)
    return min(decoding), hi


def decode_rows(
    slots: Sequence[tuple[int | None, int] | None], pad_token: int
) -> tuple[list[int], list[int]]:
    """The input token and the total rows (mask ones; seqlens_k + 1) of every row of a decode
    call, one per slot of its range: None for a free slot (pad, 1: scratch row 0), (None,
    cached) for a prefilling request (pad, cached + 1: scratch row `cached`, overwritten by its
    next chunk), (token, cached) for a decoding one (token, cached + 1)."""
    ids, totals = [], []
    for state in slots:
        if state is None:
            ids.append(pad_token)
            totals.append(1)
            continue
        token, cached = state
        if cached < 0:
            raise ValueError(f"a slot holds {cached} rows")
        ids.append(pad_token if token is None else token)
        totals.append(cached + 1)
    return ids, totals
