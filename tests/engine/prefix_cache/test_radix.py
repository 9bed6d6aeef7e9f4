"""The radix tree over token prefixes (pure: no runtime)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skippyd.engine.prefix_cache import PrefixIndex, RadixTree, common_prefix_length


def test_exact_and_partial_matches_find_every_entry_holding_the_prefix():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4, 5], "long")
    tree.insert([1, 2, 3, 9], "branch")
    tree.insert([1, 2], "short")
    assert tree.match([1, 2, 3, 4, 5, 6]).num_tokens == 5
    assert set(tree.match([1, 2, 3, 4, 5, 6]).entry_ids) == {"long"}
    # Mid-edge stop: both entries below the branch point hold [1, 2, 3].
    assert tree.match([1, 2, 3, 7]).num_tokens == 3
    assert set(tree.match([1, 2, 3, 7]).entry_ids) == {"long", "branch"}
    assert set(tree.match([1, 2]).entry_ids) == {"long", "branch", "short"}
    assert tree.match([8, 1, 2]).num_tokens == 0 and tree.match([8]).entry_ids == ()
    assert tree.path("branch") == (1, 2, 3, 9)


def test_removal_prunes_branches_and_merges_single_children():
    tree = RadixTree()
    tree.insert([1, 2, 3, 4], "a")
    tree.insert([1, 2, 5, 6], "b")
    tree.remove("b")
    tree.remove("b")  # idempotent
    assert len(tree) == 1 and "b" not in tree
    assert tree.match([1, 2, 5, 6]).num_tokens == 2  # only "a" holds [1, 2] now
    assert tree.path("a") == (1, 2, 3, 4)
    tree.remove("a")
    assert tree.match([1, 2, 3, 4]).num_tokens == 0 and len(tree) == 0


def test_duplicate_ids_and_empty_entries_are_refused():
    tree = RadixTree()
    tree.insert([1], "a")
    with pytest.raises(ValueError, match="already indexed"):
        tree.insert([2], "a")
    with pytest.raises(ValueError, match="at least one token"):
        tree.insert([], "b")


def test_namespaces_never_share_entries():
    index = PrefixIndex()
    index.tree("model-a:0-30").insert([1, 2, 3], "e")
    assert index.match("model-a:0-30", [1, 2, 3]).num_tokens == 3
    assert index.match("model-a:0-15", [1, 2, 3]).num_tokens == 0
    assert index.match("unknown", [1]).num_tokens == 0


def test_a_long_shared_prefix_is_one_edge_not_a_deep_walk():
    shared = list(range(100_000))
    tree = RadixTree()
    tree.insert(shared + [1], "x")
    tree.insert(shared + [2], "y")
    found = tree.match(shared + [3])
    assert found.num_tokens == 100_000 and set(found.entry_ids) == {"x", "y"}


token_lists = st.lists(st.integers(0, 3), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(entries=st.lists(token_lists, min_size=1, max_size=8), prompt=token_lists,
       removed=st.sets(st.integers(0, 7)))
def test_match_equals_the_brute_force_longest_common_prefix(entries, prompt, removed):
    tree = RadixTree()
    for index, tokens in enumerate(entries):
        tree.insert(tokens, f"e{index}")
    kept = {f"e{i}": tuple(t) for i, t in enumerate(entries) if i not in removed}
    for index in removed:
        tree.remove(f"e{index}")
    found = tree.match(prompt)
    best = max((common_prefix_length(tuple(prompt), t) for t in kept.values()), default=0)
    assert found.num_tokens == best
    if best:
        expected = {i for i, t in kept.items() if common_prefix_length(tuple(prompt), t) == best}
        assert set(found.entry_ids) == expected
    for entry_id, tokens in kept.items():
        assert tree.path(entry_id) == tokens
