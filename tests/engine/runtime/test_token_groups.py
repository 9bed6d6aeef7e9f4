"""How stage 0 cuts a call into decode groups: nearly equal token counts, prompt chunks
cut across groups in pieces of at least MIN_PIECE_TOKENS, decode rows never cut."""

from __future__ import annotations

import pytest

from skippyd.engine.runtime.pipeline_types import MIN_PIECE_TOKENS, split_token_groups


def shape(lengths, groups):
    return [[(p.index, p.begin, p.end) for p in group]
            for group in split_token_groups(lengths, groups)]


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
    pieces = [p for group in result for p in group]
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
