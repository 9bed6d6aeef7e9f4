"""How stage 0 cuts a call into decode groups: nearly equal token counts, prompt chunks
cut across groups in pieces of at least MIN_PIECE_TOKENS, decode rows never cut; a call's
prompt tokens in batches of about PREFILL_PIECE_TOKENS, and the last batch of a call that
samples a prompt tapered."""

from __future__ import annotations

import pytest

from skippyd.engine.runtime.pipeline_types import (
    MIN_PIECE_TOKENS,
    PREFILL_PIECE_TOKENS,
    split_call_groups,
    split_token_groups,
)


def shape(lengths, groups):
    return [[(p.index, p.begin, p.end) for p in group]
            for group in split_token_groups(lengths, groups)]


def call_shape(lengths, groups, taper=False):
    return [[(p.index, p.begin, p.end) for p in group]
            for group in split_call_groups(lengths, groups, taper=taper)]


def test_decode_rows_split_evenly_and_in_order():
    assert shape([1] * 8, 2) == [[(i, 0, 1) for i in range(4)],
                                 [(i, 0, 1) for i in range(4, 8)]]
    assert shape([1] * 3, 4) == [[(0, 0, 1)], [(1, 0, 1)], [(2, 0, 1)]]
    # Look-ahead steps are re-split this way too: parts differ by at most one row.
    assert [len(group) for group in split_token_groups([1] * 7, 2)] == [4, 3]
    assert [len(group) for group in split_token_groups([1] * 7, 3)] == [2, 3, 2]
    assert shape([1] * 7, 0) == [[(i, 0, 1) for i in range(7)]]
    assert split_token_groups([], 3) == []


def test_a_prompt_chunk_is_cut_across_groups():
    assert shape([60, 1, 1, 1, 1, 1, 1, 1], 2) == [
        [(0, 0, 34)], [(0, 34, 60), *((i, 0, 1) for i in range(1, 8))]]
    assert shape([60], 4) == [[(0, 0, 15)], [(0, 15, 30)], [(0, 30, 45)], [(0, 45, 60)]]


def test_short_requests_are_never_cut():
    assert shape([3, 2], 2) == [[(0, 0, 3)], [(1, 0, 2)]]
    assert shape([5], 3) == [[(0, 0, 5)]]


@pytest.mark.parametrize("lengths", [[1] * 7, [40, 1, 1, 1], [1, 1, 90, 2, 17], [9, 9, 9],
                                     [200], [16, 16]])
@pytest.mark.parametrize("groups", [1, 2, 3, 5])
def test_pieces_cover_every_token_once_in_order(lengths, groups):
    result = split_token_groups(lengths, groups)
    assert 1 <= len(result) <= groups
    assert_cover_in_order(lengths, [p for group in result for p in group])


def assert_cover_in_order(lengths, pieces) -> None:
    """Every request's tokens once, in order, in pieces of at least MIN_PIECE_TOKENS
    when cut, the requests in order."""
    covered = {i: [] for i in range(len(lengths))}
    for p in pieces:
        covered[p.index].append((p.begin, p.end))
    for index, length in enumerate(lengths):
        spans = covered[index]
        assert spans[0][0] == 0 and spans[-1][1] == length
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
        if len(spans) > 1:
            assert all(end - begin >= MIN_PIECE_TOKENS for begin, end in spans)
    assert [p.index for p in pieces] == sorted(p.index for p in pieces)


def test_a_call_without_prompt_tokens_keeps_its_decode_groups():
    for lengths, groups in (([1] * 8, 3), ([1] * 3, 4), ([1] * 7, 1)):
        assert call_shape(lengths, groups, taper=True) == shape(lengths, groups)


def test_a_calls_prompt_goes_in_pieces_of_about_64_whatever_the_groups():
    # Eight 60-token prompts in 3 groups were 3 batches of 160 rows: stage 0 then waited
    # for the last stage to run a whole third of them after computing its own share.
    sizes = [sum(e - b for _, b, e in g) for g in call_shape([60] * 8, 3)]
    assert sizes == [69, 68, 69, 68, 69, 68, 69]
    assert all(size >= PREFILL_PIECE_TOKENS for size in sizes)
    # Look-ahead batches in flight leave one group: the prompt is still cut.
    assert [sum(e - b for _, b, e in g) for g in call_shape([1, 1, 200], 1)] == [67, 68, 67]
    assert call_shape([100], 1) == [[(0, 0, 100)]]  # fewer than two pieces' worth


def test_the_last_batch_of_a_sampled_prompt_is_tapered():
    assert call_shape([61], 1, taper=True) == [[(0, 0, 31)], [(0, 31, 46)], [(0, 46, 61)]]
    assert call_shape([200], 1, taper=True) == [
        [(0, 0, 67)], [(0, 67, 133)], [(0, 133, 166)], [(0, 166, 183)], [(0, 183, 192)],
        [(0, 192, 200)]]
    # Decode rows after the prompt stay whole: the cut falls on the nearer boundary.
    assert call_shape([60, 1, 1], 2, taper=True) == [
        [(0, 0, 31)], [(0, 31, 46)], [(0, 46, 60)], [(1, 0, 1), (2, 0, 1)]]
    assert call_shape([15], 1, taper=True) == [[(0, 0, 15)]]  # too short to cut


@pytest.mark.parametrize("lengths", [[1] * 7, [40, 1, 1, 1], [1, 1, 90, 2, 17], [9, 9, 9],
                                     [200], [16, 16], [60] * 8, [1, 1, 300, 1]])
@pytest.mark.parametrize("groups", [1, 2, 3, 5])
@pytest.mark.parametrize("taper", [False, True])
def test_call_pieces_cover_every_token_once_in_order(lengths, groups, taper):
    assert_cover_in_order(
        lengths, [p for group in split_call_groups(lengths, groups, taper=taper) for p in group])
