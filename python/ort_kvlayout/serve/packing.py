"""The inputs of one packed call (model/serving_graph.py, rewrite 4) from the rows it runs.

    call = pack_rows([(prompt[0:256], 0), ([], 0), ([next_token], 41)])
    call.ids             # (1, T): every row's new tokens, one row after the other
    call.unpack          # (B, S): the packed index of row b's token s (0 past its tokens)
    call.pack            # (1, T): b * S + s of each packed token
    call.query_seqlens   # (B,) int32: new tokens per row; 0: an idle row (its cache untouched)
    call.seqlens_k       # (B,) int32: rows after the call - 1 (0 for an idle row)
    call.total           # max rows after the call
    call.last            # (B,) int64: the packed index of each row's last token (0 when idle)

A row is (its new tokens, the rows its slot holds before the call). The call runs slots
[first, first + B) in order; a slot that runs nothing this call is ([], anything).

`multiple` pads T up to a multiple of it (EngineConfig.packed_multiple), `tokens` to exactly
that many: the padding tokens (id `pad`) follow the real ones, each packed from position 0 of
the unpacked rows, and no row unpacks them, so attention and the cache never see them and every
real token's output is its own (the dense layers act on each token alone). `width` sets S (at
least the longest row): a captured call's shapes stay put whatever its rows hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["PackedCall", "pack_rows"]


@dataclass(frozen=True)
class PackedCall:
    ids: np.ndarray
    unpack: np.ndarray
    pack: np.ndarray
    query_seqlens: np.ndarray
    seqlens_k: np.ndarray
    total: int
    last: np.ndarray

    @property
    def tokens(self) -> int:
        return self.ids.shape[1]


def pack_rows(
    rows: Sequence[tuple[Sequence[int], int]],
    multiple: int = 1,
    pad: int = 0,
    width: int | None = None,
    tokens: int | None = None,
) -> PackedCall:
    """The packed inputs of `rows` (see the module docstring); at least one row has tokens."""
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    counts = np.array([len(new) for new, _ in rows], np.int64)
    if not rows or counts.sum() == 0:
        raise ValueError("a packed call needs at least one row with tokens")
    cached = np.array([c for _, c in rows], np.int64)
    longest = int(counts.max())
    if width is not None and width < longest:
        raise ValueError(f"width {width} is below the longest row's {longest} tokens")
    if tokens is not None and tokens < int(counts.sum()):
        raise ValueError(f"tokens {tokens} is below the rows' {int(counts.sum())} tokens")
    width = longest if width is None else width
    offsets = np.concatenate(([0], np.cumsum(counts)[:-1]))
    ids = np.fromiter((t for new, _ in rows for t in new), np.int64, int(counts.sum()))
    s = np.arange(width)
    live = s[None, :] < counts[:, None]  # (B, S): row b's token s exists
    unpack = np.where(live, offsets[:, None] + s[None, :], 0)
    pack = (np.arange(len(rows))[:, None] * width + s[None, :])[live]
    ends = cached + counts
    padding = -len(ids) % multiple if tokens is None else tokens - len(ids)
    if padding:
        ids = np.concatenate((ids, np.full(padding, pad, np.int64)))
        pack = np.concatenate((pack, np.zeros(padding, pack.dtype)))
    return PackedCall(
        ids=ids[None, :],
        unpack=unpack.astype(np.int64),
        pack=pack[None, :].astype(np.int64),
        query_seqlens=counts.astype(np.int32),
        seqlens_k=np.where(counts > 0, ends - 1, 0).astype(np.int32),
        total=int(ends[counts > 0].max()),
        last=np.where(counts > 0, offsets + counts - 1, 0).astype(np.int64),
    )
