"""A radix tree over token prefixes: which cached entries share how much of a prompt.

Edges are runs of tokens (a compressed trie), so a 100 000-token shared prefix costs one
edge, not 100 000 nodes. Entries hang off the node where their token path ends; every
leaf carries at least one entry (empty branches are pruned and single-child chains
merged on removal). Matching a prompt walks as deep as the tokens agree; every entry in
the subtree below the stopping point holds the matched prefix, so a partial match into a
longer entry is as usable as an exact one (its first ``n`` KV cells are that prefix).

Pure data structure: no runtime, no LRU. :class:`PrefixIndex` keeps one tree per
namespace (model and stage layer range), so stages never share entries by accident.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from skippyd.engine.policy.cache_order import first_mismatch

logger = logging.getLogger(__name__)

def common_prefix_length(left: Sequence[int], right: Sequence[int]) -> int:
    """Number of leading tokens ``left`` and ``right`` share.

    Both arguments should be tuples (or both lists): a list slice never equals a tuple
    slice, so mixed types only compare token by token.
    """
    return first_mismatch(left, right, 0, min(len(left), len(right)))


@dataclass(eq=False)
class _Node:
    edge: tuple[int, ...]
    """Tokens from the parent to this node."""
    depth: int
    """Tokens from the root to the end of this node."""
    parent: _Node | None = None
    children: dict[int, _Node] = field(default_factory=dict)
    """Children keyed by the first token of their edge."""
    entries: set[str] = field(default_factory=set)
    """Entries whose token path ends exactly here."""


@dataclass(frozen=True, slots=True)
class RadixMatch:
    """How much of a prompt the tree holds, and which entries hold it."""

    num_tokens: int
    """Leading prompt tokens found in the tree."""
    entry_ids: tuple[str, ...]
    """Entries whose path starts with those tokens (all of them, unordered)."""


class RadixTree:
    """Token-prefix index of cache entries; see the module docstring."""

    def __init__(self) -> None:
        self._root = _Node(edge=(), depth=0)
        self._nodes: dict[str, _Node] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self._nodes

    def insert(self, tokens: Sequence[int], entry_id: str) -> None:
        """Index ``entry_id`` under ``tokens``.

        Raises:
            ValueError: ``tokens`` is empty or ``entry_id`` is already indexed.
        """
        if not tokens:
            raise ValueError("a cache entry needs at least one token")
        if entry_id in self._nodes:
            raise ValueError(f"cache entry {entry_id} is already indexed")
        tokens = tuple(tokens)
        node, position = self._root, 0
        while position < len(tokens):
            child = node.children.get(tokens[position])
            if child is None:
                leaf = _Node(edge=tokens[position:], depth=len(tokens), parent=node)
                node.children[tokens[position]] = leaf
                node = leaf
                break
            shared = common_prefix_length(child.edge, tokens[position:position + len(child.edge)])
            if shared < len(child.edge):
                child = self._split(child, shared)
            node, position = child, position + shared
        node.entries.add(entry_id)
        self._nodes[entry_id] = node

    def remove(self, entry_id: str) -> None:
        """Forget ``entry_id``; unknown ids are ignored."""
        node = self._nodes.pop(entry_id, None)
        if node is None:
            return
        node.entries.discard(entry_id)
        self._prune(node)

    def match(self, tokens: Sequence[int]) -> RadixMatch:
        """The longest indexed prefix of ``tokens`` and the entries holding it."""
        tokens = tuple(tokens)
        node, position = self._root, 0
        while position < len(tokens):
            child = node.children.get(tokens[position])
            if child is None:
                break
            shared = common_prefix_length(child.edge, tokens[position:position + len(child.edge)])
            position += shared
            node = child
            if shared < len(child.edge):
                break
        if position == 0:
            return RadixMatch(0, ())
        return RadixMatch(position, tuple(self._subtree_entries(node)))

    def path(self, entry_id: str) -> tuple[int, ...]:
        """The tokens of an indexed entry.

        Raises:
            KeyError: ``entry_id`` is not indexed.
        """
        node: _Node | None = self._nodes[entry_id]
        parts = []
        while node is not None:
            parts.append(node.edge)
            node = node.parent
        return tuple(token for part in reversed(parts) for token in part)

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut ``child``'s edge after ``at`` tokens; returns the new middle node."""
        parent = _parent(child)
        middle = _Node(edge=child.edge[:at], depth=child.depth - len(child.edge) + at,
                       parent=parent)
        parent.children[middle.edge[0]] = middle
        child.edge = child.edge[at:]
        child.parent = middle
        middle.children[child.edge[0]] = child
        return middle

    def _prune(self, node: _Node) -> None:
        """Drop empty leaves upwards, then merge a pass-through node into its child."""
        while node is not self._root and not node.entries and not node.children:
            parent = _parent(node)
            del parent.children[node.edge[0]]
            node = parent
        if node is not self._root and not node.entries and len(node.children) == 1:
            (child,) = node.children.values()
            parent = _parent(node)
            child.edge = node.edge + child.edge
            child.parent = parent
            parent.children[child.edge[0]] = child

    @staticmethod
    def _subtree_entries(node: _Node) -> Iterator[str]:
        stack = [node]
        while stack:
            current = stack.pop()
            yield from current.entries
            stack.extend(current.children.values())


def _parent(node: _Node) -> _Node:
    """The parent of a non-root node."""
    if node.parent is None:
        raise RuntimeError(f"radix node at depth {node.depth} has no parent")
    return node.parent


class PrefixIndex:
    """One :class:`RadixTree` per namespace (a model and stage layer range)."""

    def __init__(self) -> None:
        self._trees: dict[str, RadixTree] = {}

    def tree(self, namespace: str) -> RadixTree:
        """The tree of ``namespace``, created empty on first use."""
        tree = self._trees.get(namespace)
        if tree is None:
            tree = self._trees[namespace] = RadixTree()
        return tree

    def match(self, namespace: str, tokens: Sequence[int]) -> RadixMatch:
        """Match ``tokens`` in ``namespace`` only (an unknown namespace matches nothing)."""
        tree = self._trees.get(namespace)
        return tree.match(tokens) if tree is not None else RadixMatch(0, ())
