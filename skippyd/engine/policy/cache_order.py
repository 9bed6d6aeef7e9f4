"""Cache-aware ordering of waiting work ("weighted_lpm_aging_dfs_waiting_prefix").

A waiting request is worth more when more of its prompt is already cached somewhere in the
pipeline (weighted longest-prefix match), and it gains credit for every turn it waits
(aging, against starvation). Among equally valued requests, an ephemeral radix walk over
the *waiting* prompts puts the heaviest shared-prefix subtree first, so the first cold
request of a family materialises reusable KV before its peers run (DFS grouping). The
walk never touches a real cache. ``docs/scheduler.md``, *Cache-aware ordering*.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from skippyd.engine.policy.input_errors import PolicyInputError, checked_count

logger = logging.getLogger(__name__)

#: Chunk used to find the end of a shared token run with C-speed slice comparisons.
_RUN_PROBE_TOKENS = 256


@dataclass(frozen=True, slots=True)
class StageCacheAffinity:
    """What one pipeline stage already holds of a request's prompt."""

    stage_index: int
    """Index of the stage in the pipeline."""
    matched_tokens: int
    """Leading prompt tokens that stage can restore instead of computing."""
    prefill_cost_per_token: int
    """Modelled cost of computing one prompt token on that stage."""
    restore_cost: int = 0
    """Modelled cost of restoring the matched span."""
    cache_epoch: int = 0
    """Version of that stage's cache when the match was taken."""

    def __post_init__(self) -> None:
        for name in ("stage_index", "matched_tokens", "prefill_cost_per_token",
                     "restore_cost", "cache_epoch"):
            checked_count(getattr(self, name), f"StageCacheAffinity.{name}")

    def estimated_saved_cost(self) -> int:
        """Prefill cost avoided on this stage, never negative."""
        return max(0, self.matched_tokens * self.prefill_cost_per_token - self.restore_cost)


@dataclass(frozen=True, slots=True)
class CacheAffinity:
    """Per-stage cache matches of one request; the default has no stage (cost 0)."""

    stages: tuple[StageCacheAffinity, ...] = field(default_factory=tuple)
    """One entry per split stage: a downstream stage may hit even when stage 0 misses."""

    def __post_init__(self) -> None:
        stages = tuple(self.stages)
        for stage in stages:
            if not isinstance(stage, StageCacheAffinity):
                raise PolicyInputError(
                    f"CacheAffinity.stages must hold StageCacheAffinity, got {type(stage).__name__}"
                )
        object.__setattr__(self, "stages", stages)

    @classmethod
    def from_stage(cls, stage: StageCacheAffinity) -> CacheAffinity:
        """Build a one-stage affinity."""
        return cls((stage,))

    def estimated_saved_cost(self) -> int:
        """Sum of per-stage saved costs; restore cost is taken off per stage first."""
        return sum(stage.estimated_saved_cost() for stage in self.stages)

    def matched_tokens(self) -> int:
        """Total matched tokens over all stages."""
        return sum(stage.matched_tokens for stage in self.stages)


@dataclass(frozen=True, slots=True)
class CacheAwareCandidate:
    """One waiting item as seen by the ordering."""

    index: int
    """Caller's identifier for the item; returned in the ordered result."""
    affinity: CacheAffinity
    """Cache matches of the item's prompt."""
    prompt_tokens: Sequence[int]
    """The prompt, used only by the waiting-prefix DFS grouping."""
    enqueued_turn: int
    """Turn at which the item first entered the queue (aging starts there)."""
    order: int
    """Monotone enqueue counter; the final tie-break."""


def order_cache_aware_candidates(
    candidates: Sequence[CacheAwareCandidate],
    current_turn: int,
    aging_cost_per_turn: int,
    group_waiting_prefixes: bool,
) -> list[int]:
    """Order waiting candidates best first and return their ``index`` values.

    Key, compared in this order:
    ``saved_cost + age * aging_cost_per_turn`` descending, with
    ``age = max(0, current_turn - enqueued_turn)``; waiting-prefix DFS rank ascending
    (all ranks 0 when grouping is off); enqueue ``order`` ascending.

    Args:
        candidates: The waiting items.
        current_turn: The caller's turn counter now.
        aging_cost_per_turn: Credit one waiting turn is worth.
        group_waiting_prefixes: Whether to apply the DFS tie-break.

    Returns:
        Candidate ``index`` values, best first.
    """
    if group_waiting_prefixes:
        dfs = waiting_prefix_dfs_order(
            [c.prompt_tokens for c in candidates], [c.order for c in candidates]
        )
        ranks = [0] * len(candidates)
        for rank, position in enumerate(dfs):
            ranks[position] = rank
    else:
        ranks = [0] * len(candidates)

    def key(position: int) -> tuple[int, int, int]:
        candidate = candidates[position]
        age = max(0, current_turn - candidate.enqueued_turn)
        score = candidate.affinity.estimated_saved_cost() + age * aging_cost_per_turn
        return (-score, ranks[position], candidate.order)

    ordered = sorted(range(len(candidates)), key=key)
    return [candidates[position].index for position in ordered]


def waiting_prefix_dfs_order(
    prompts: Sequence[Sequence[int]], orders: Iterable[int]
) -> list[int]:
    """Depth-first order of waiting prompts over their shared-prefix tree.

    At every branch the subtree with most prompts goes first, then the one with the
    earliest-enqueued member, then the smaller token; prompts ending at a branch follow
    the subtrees that extend them, by enqueue order.
    Shared runs are skipped in one step and the walk keeps its own stack, so no prompt
    reaches Python's recursion limit (``docs/scheduler.md``, *Cache-aware ordering*).

    Args:
        prompts: Token lists of the waiting items.
        orders: Enqueue order of each item (same length as ``prompts``).

    Returns:
        Positions into ``prompts``; a position's index in this list is its DFS rank.
    """
    order_of = list(orders)
    if len(order_of) != len(prompts):
        raise PolicyInputError(
            f"waiting_prefix_dfs_order needs one order per prompt, "
            f"got {len(order_of)} orders for {len(prompts)} prompts"
        )
    # Tuples everywhere so shared runs can be compared slice by slice (a list slice never
    # equals a tuple slice); tuple() of a tuple is the same object, so this is cheap.
    prompts = [p if isinstance(p, tuple) else tuple(p) for p in prompts]
    output: list[int] = []
    # Stack entries: ("group", positions, depth) to expand, or ("emit", positions, 0).
    stack: list[tuple[str, list[int], int]] = [("group", list(range(len(prompts))), 0)]
    while stack:
        action, positions, depth = stack.pop()
        if action == "emit" or len(positions) <= 1:
            output.extend(positions)
            continue
        group = [prompts[p] for p in positions]
        depth = _common_run_end(group, depth)
        terminal, children = _partition_at(prompts, positions, depth, order_of)
        stack.append(("emit", sorted(terminal, key=order_of.__getitem__), 0))
        for child in reversed(children):
            stack.append(("group", child, depth + 1))
    return output


def _partition_at(
    prompts: Sequence[Sequence[int]],
    positions: list[int],
    depth: int,
    order_of: list[int],
) -> tuple[list[int], list[list[int]]]:
    """Split a group into prompts ending at ``depth`` and children keyed by next token."""
    terminal: list[int] = []
    by_token: dict[int, list[int]] = {}
    for position in positions:
        prompt = prompts[position]
        if len(prompt) <= depth:
            terminal.append(position)
        else:
            by_token.setdefault(prompt[depth], []).append(position)
    # Heaviest subtree first, then earliest member, then token value.
    ordered_tokens = sorted(
        by_token,
        key=lambda token: (
            -len(by_token[token]),
            min(order_of[p] for p in by_token[token]),
            token,
        ),
    )
    return terminal, [by_token[token] for token in ordered_tokens]


def _common_run_end(group: list[Sequence[int]], depth: int) -> int:
    """Return the first depth at which the prompts of ``group`` differ or one ends."""
    limit = min(len(prompt) for prompt in group)
    reference = group[0]
    end = limit
    for prompt in group[1:]:
        end = first_mismatch(reference, prompt, depth, end)
        if end == depth:
            break
    return end


def first_mismatch(left: Sequence[int], right: Sequence[int], start: int, end: int) -> int:
    """First index in ``[start, end)`` where the two prompts differ, else ``end``."""
    position = start
    # Skip whole equal chunks with slice comparison before scanning token by token.
    while position < end:
        stop = min(position + _RUN_PROBE_TOKENS, end)
        if left[position:stop] != right[position:stop]:
            break
        position = stop
    while position < end and left[position] == right[position]:
        position += 1
    return position
