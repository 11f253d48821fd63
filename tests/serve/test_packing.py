"""The inputs of a packed call (ort_kvlayout.serve.packing), against the rule written out: the
packed tokens gathered by `unpack` give each row's tokens in place, and `pack` inverts it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from ort_kvlayout.serve.packing import pack_rows

rows_strategy = st.lists(
    st.tuples(st.lists(st.integers(0, 1000), max_size=6), st.integers(0, 50)), min_size=1,
    max_size=6,
).filter(lambda rows: any(tokens for tokens, _ in rows))  # fmt: skip


@given(rows_strategy)
def test_unpack_and_pack_place_every_row_token(rows):
    call = pack_rows(rows)
    width = max(len(t) for t, _ in rows)
    assert call.unpack.shape == (len(rows), width)
    assert call.tokens == sum(len(t) for t, _ in rows)
    padded = call.ids[0][call.unpack]  # what attention sees: (B, S)
    for b, (tokens, cached) in enumerate(rows):
        assert list(padded[b, : len(tokens)]) == list(tokens)
        assert call.query_seqlens[b] == len(tokens)
        if tokens:
            assert call.seqlens_k[b] == cached + len(tokens) - 1
            assert call.ids[0][call.last[b]] == tokens[-1]
        else:
            assert call.seqlens_k[b] == 0 and call.last[b] == 0
    # the output gather takes each packed token back from its (row, position)
    assert np.array_equal(padded.reshape(-1)[call.pack[0]], call.ids[0])
    assert call.total == max(c + len(t) for t, c in rows if t)


def test_types_are_the_graphs():
    call = pack_rows([([1, 2], 3), ([], 0)])
    assert (call.ids.dtype, call.unpack.dtype, call.pack.dtype) == (np.int64,) * 3
    assert (call.query_seqlens.dtype, call.seqlens_k.dtype) == (np.int32, np.int32)
    assert call.last.dtype == np.int64 and call.ids.shape == (1, 2) and call.pack.shape == (1, 2)


def test_a_call_without_tokens_is_refused():
    with pytest.raises(ValueError, match="at least one row with tokens"):
        pack_rows([([], 4), ([], 0)])
    with pytest.raises(ValueError, match="at least one row with tokens"):
        pack_rows([])


def test_host_sampling_ends_only_the_rows_whose_logits_are_not_finite():
    """The host sampler (a model served with its own graph): a row of NaN or inf logits gets
    NONFINITE_LOGITS (its request ends with an error) and the other rows their tokens, greedy
    or sampled, as with the device sampler; float16 rows too."""
    from types import SimpleNamespace

    import numpy as np
    from ort_kvlayout.runtime.sampling import GREEDY, Sampler, SamplingParams
    from ort_kvlayout.serve.executor import NONFINITE_LOGITS, Executor

    host = SimpleNamespace(_greedy=Sampler(GREEDY))
    for dtype in (np.float32, np.float16):
        logits = np.zeros((5, 8), dtype)
        logits[0, 3] = logits[3, 1] = 1
        logits[1, 2] = np.nan  # greedy row
        logits[4, 6] = np.inf  # sampled row
        rows = [Sampler(GREEDY), Sampler(GREEDY), None, Sampler(SamplingParams(0.5, seed=1)),
                Sampler(SamplingParams(0.5, seed=1))]  # fmt: skip
        tokens = Executor._host_sample(host, logits, rows)
        assert tokens[:3] == [3, NONFINITE_LOGITS, None] and tokens[4] == NONFINITE_LOGITS
        assert 0 <= tokens[3] < 8


@given(rows_strategy, st.integers(1, 16))
def test_padding_to_a_multiple_leaves_every_row_its_own_tokens(rows, multiple):
    """multiple: T padded up to a multiple of it with `pad` ids after the real tokens, packed
    from position 0; the rows' unpacking, lengths and sampled positions are the unpadded
    call's, so no row (attention, the cache) sees a padding token."""
    plain, call = pack_rows(rows), pack_rows(rows, multiple=multiple, pad=7)
    real = plain.tokens
    assert call.tokens % multiple == 0 and real <= call.tokens < real + multiple
    assert np.array_equal(call.ids[0, :real], plain.ids[0])
    assert (call.ids[0, real:] == 7).all() and (call.pack[0, real:] == 0).all()
    assert np.array_equal(call.pack[0, :real], plain.pack[0])
    assert call.unpack.max() < real  # unpacking reads real tokens only
    for name in ("unpack", "query_seqlens", "seqlens_k", "last"):
        assert np.array_equal(getattr(call, name), getattr(plain, name))
    assert call.total == plain.total


def test_a_multiple_below_one_is_refused():
    with pytest.raises(ValueError, match="multiple must be >= 1, got 0"):
        pack_rows([([1], 0)], multiple=0)


@given(rows_strategy, st.integers(0, 4), st.integers(0, 9))
def test_a_fixed_width_and_token_count_keep_every_row_its_tokens(rows, wider, more):
    """width (S at least the longest row) and tokens (T at least the real tokens): the shapes a
    captured call keeps; each row still unpacks its own tokens in place and the padding tokens
    are unpacked by no row."""
    longest = max(len(t) for t, _ in rows)
    real = sum(len(t) for t, _ in rows)
    call = pack_rows(rows, pad=3, width=longest + wider, tokens=real + more)
    assert call.unpack.shape == (len(rows), longest + wider) and call.tokens == real + more
    padded = call.ids[0][call.unpack]
    for b, (tokens, _) in enumerate(rows):
        assert list(padded[b, : len(tokens)]) == list(tokens)
        assert call.query_seqlens[b] == len(tokens)
    live = np.arange(longest + wider)[None, :] < call.query_seqlens[:, None]
    assert call.unpack[live].max() < real  # no row unpacks a padding token
    assert np.array_equal(padded.reshape(-1)[call.pack[0, :real]], call.ids[0, :real])
    assert (call.ids[0, real:] == 3).all()


def test_a_width_or_token_count_below_the_rows_is_refused():
    with pytest.raises(ValueError, match="width 1 is below the longest row's 2 tokens"):
        pack_rows([([1, 2], 0)], width=1)
    with pytest.raises(ValueError, match="tokens 2 is below the rows' 3 tokens"):
        pack_rows([([1, 2], 0), ([3], 0)], tokens=2)
