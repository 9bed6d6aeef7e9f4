"""How many drafted tokens a decode row may carry: only as many as the step can afford.

A request's drafts ride as extra rows of the step's one model call; each costs what a
row costs, and pays only if it is accepted. Drafts are accepted in runs: a copy goes on
for a while, then the text departs from it, and every draft after the first miss is
lost. So what is learned is how far drafts survive: at each depth ``j``, the chance that
draft ``j`` is accepted when draft ``j - 1`` was (:class:`Survival`). A row with ``k``
drafts then yields ``1 + s1 + s1*s2 + ... + s1*...*sk`` tokens instead of one. The step
itself costs ``fixed + per_row * rows`` (:class:`~skippyd.engine.policy.step_budget.StepCostModel`,
learned from decode steps) and produces one token per decode row, so its tokens cost
``step / decode_rows`` each. A draft length pays when the extra tokens it is expected
to yield cost less than that, at the rate drafting gets lately (:attr:`DraftControl.rate`):
a row spent on drafts that are lost could have carried drafts that pay, so once drafting
yields more than a token per row's cost, a draft must beat that yield, not plain
decoding's. On a small model whose step is mostly the fixed pass over the weights that
holds even for modest survival; on a model whose rows are compute-bound, or in a full
batch, it almost never does, and drafting stops. Pure: the driver feeds it outcomes and
step durations.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from skippyd.engine.policy.plan import IterationPhase, IterationPlan
from skippyd.engine.policy.step_budget import StepCostModel

logger = logging.getLogger(__name__)

#: Weight an earlier outcome keeps at each new one: a request's record forgets fast (it
#: follows where its own text goes), a kind of draft's more slowly.
REQUEST_MEMORY = 0.8
KIND_MEMORY = 0.97
#: Weight, in rows, of the prior a request's record starts from: what drafts of the
#: same kind get on the stage lately.
PRIOR_ROWS = 2.0
#: Survival at every depth before anything is known: hopeful, so a stage tries drafts of
#: a kind it has not seen and learns what they get (a kind that fails is soon dropped).
FIRST_SURVIVAL = 0.9
#: Generated tokens after which a request that stopped drafting tries again, its record
#: halfway back to the prior.
RETRY_AFTER_TOKENS = 32
#: Tokens the stage generates without a draft before each kind's record goes halfway
#: back to hopeful, so a workload that starts copying is noticed again.
KIND_RETRY_AFTER_TOKENS = 512
#: Weight an earlier row keeps in the rate drafting gets (:attr:`DraftControl.rate`): the
#: rate follows the last few tens of rows.
RATE_MEMORY = 0.95


@dataclass(slots=True)
class Survival:
    """How far drafts survive: decayed counts of drafts tried and accepted at each depth
    (index 0 is the first draft after the pending token)."""

    depth: int
    memory: float
    tried: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tried = [0.0] * self.depth
        self.accepted = [0.0] * self.depth

    def record(self, drafted: int, accepted: int) -> None:
        """One verified row: ``accepted`` of its ``drafted`` drafts were kept. Drafts
        after the first miss were never put to the test and count for nothing."""
        keep = self.memory
        self.tried = [t * keep for t in self.tried]
        self.accepted = [a * keep for a in self.accepted]
        for j in range(min(accepted + 1, drafted, self.depth)):
            self.tried[j] += 1.0
            if j < accepted:
                self.accepted[j] += 1.0

    def chances(self, prior: list[float] | None = None) -> list[float]:
        """The chance of surviving each depth, given the one before, starting from
        ``prior`` (worth :data:`PRIOR_ROWS` rows). Without one, the first depth starts
        from :data:`FIRST_SURVIVAL` and each deeper one from the chance just before it:
        a run that got this far tends to go on, and depths seldom reached are not held
        at a guess."""
        chances: list[float] = []
        for depth, (a, t) in enumerate(zip(self.accepted, self.tried, strict=True)):
            if prior is not None:
                base = prior[depth]
            else:
                base = chances[-1] if chances else FIRST_SURVIVAL
            chances.append((a + base * PRIOR_ROWS) / (t + PRIOR_ROWS))
        return chances

    def forget_half(self) -> None:
        self.tried = [t / 2 for t in self.tried]
        self.accepted = [a / 2 for a in self.accepted]


@dataclass(slots=True)
class DraftStats:
    """One request's drafting record."""

    survival: Survival
    num_drafted: int = 0
    """Drafts verified, in all."""
    num_accepted: int = 0
    """Drafts accepted, in all."""
    idle_tokens: int = 0
    """Tokens generated since the request last drafted."""
    price: float = 0.0
    """What one of its drafts cost, in its step's tokens, when its length was last chosen."""

    def record(self, drafted: int, accepted: int) -> None:
        self.survival.record(drafted, accepted)
        self.num_drafted += drafted
        self.num_accepted += accepted
        self.idle_tokens = 0

    def note_plain_step(self, tokens: int) -> None:
        """A step without drafts generated ``tokens``; after a while, try drafting again."""
        self.idle_tokens += tokens
        if self.idle_tokens >= RETRY_AFTER_TOKENS:
            self.survival.forget_half()
            self.idle_tokens = 0


def expected_tokens(chances: list[float], drafts: int) -> float:
    """Tokens a row with ``drafts`` drafts yields on average: one, plus the chance that
    each draft survives (the product of the chances up to it)."""
    total, alive = 1.0, 1.0
    for chance in chances[:drafts]:
        alive *= chance
        total += alive
    return total


class DraftControl:
    """Chooses draft lengths from how far drafts survive and what rows cost here.

    Args:
        min_draft: Fewest drafts worth a row's verification (fewer are not proposed).
        max_draft: Most drafts one row carries.
    """

    def __init__(self, min_draft: int, max_draft: int) -> None:
        if not 1 <= min_draft <= max_draft:
            raise ValueError(f"need 1 <= min_draft <= max_draft (got {min_draft}, {max_draft})")
        self.min_draft = min_draft
        self.max_draft = max_draft
        self.costs = StepCostModel()
        """Duration of decode steps (no prompt rows) against their rows, drafts included."""
        self.by_kind: dict[int, Survival] = {}
        """How far drafts survive by how they were found (the length of the n-gram that
        matched: a longer match is a surer guess; 0 for a draft model), over every
        request."""
        self._plain_tokens = 0
        self._rate_tokens = 0.0
        self._rate_cost = 0.0

    @property
    def rate(self) -> float:
        """Tokens a speculating row yields lately per unit of its cost, at least 1: a row
        without drafts yields one token at a cost of one; a row with ``k`` drafts yields
        ``1 + kept`` at a cost of ``1 + k * price`` (its request's
        :attr:`DraftStats.price`). Weighted by :data:`RATE_MEMORY` per row."""
        return max(1.0, (self._rate_tokens + 1.0) / (self._rate_cost + 1.0))

    def _count(self, tokens: float, cost: float) -> None:
        self._rate_tokens = RATE_MEMORY * self._rate_tokens + tokens
        self._rate_cost = RATE_MEMORY * self._rate_cost + cost

    def new_stats(self) -> DraftStats:
        """An empty record for a new request."""
        return DraftStats(Survival(self.max_draft, REQUEST_MEMORY))

    def record(self, stats: DraftStats, kind: int, drafted: int, accepted: int) -> None:
        """Learn one verified row's outcome, for its request and its kind of draft."""
        stats.record(drafted, accepted)
        self._kind(kind).record(drafted, accepted)
        self._plain_tokens = 0
        self._count(1 + accepted, 1 + stats.price * drafted)

    def note_plain_step(self, stats: DraftStats, tokens: int) -> None:
        """A speculating request's row carried no drafts and yielded ``tokens``."""
        stats.note_plain_step(tokens)
        self._plain_tokens += tokens
        self._count(tokens, tokens)
        if self._plain_tokens >= KIND_RETRY_AFTER_TOKENS:
            for survival in self.by_kind.values():
                survival.forget_half()
            self._plain_tokens = 0

    def chances(self, stats: DraftStats, kind: int = 0) -> list[float]:
        """A request's survival chances for a draft of ``kind``, starting from what such
        drafts get on the stage lately."""
        return stats.survival.chances(self._kind(kind).chances())

    def _kind(self, kind: int) -> Survival:
        found = self.by_kind.get(kind)
        if found is None:
            found = self.by_kind[kind] = Survival(self.max_draft, KIND_MEMORY)
        return found

    def observe(self, plan: IterationPlan, elapsed_s: float) -> None:
        """Learn from a step that ran; only decode steps (with or without drafts) count."""
        if plan.work and all(w.phase is IterationPhase.DECODE for w in plan.work):
            self.costs.observe(plan, elapsed_s)

    def draft_length(self, chances: list[float], decode_rows: int, step_rows: int,
                     available: int, fallback: StepCostModel | None = None,
                     stats: DraftStats | None = None) -> int:
        """Drafts one row should carry (0: none pays).

        Args:
            chances: How far the request's drafts survive (:meth:`chances`).
            decode_rows: Decode rows of the step (the tokens it yields without drafts).
            step_rows: Rows of the step before this request's drafts.
            available: Drafts the drafter offers (and room allows).
            fallback: Costs learned from every step, used until decode steps alone show
                what a row adds (they need rows of different counts to tell).
            stats: The request's record, which keeps a draft's price for :meth:`record`.
        """
        most = min(self.max_draft, available)
        if most < self.min_draft or decode_rows <= 0:
            return 0
        fixed, per_row = self._coefficients(fallback)
        if per_row <= 0:
            return 0
        step = fixed + per_row * max(step_rows, decode_rows)
        price = per_row * decode_rows / step  # a draft's cost in the step's tokens
        if stats is not None:
            stats.price = price
        # Priced at what drafting yields lately: a draft must pay at least that.
        price *= self.rate
        best, best_gain = 0, 0.0
        for drafts in range(self.min_draft, most + 1):
            gain = expected_tokens(chances, drafts) - 1.0 - price * drafts
            if gain > best_gain and math.isfinite(gain):
                best, best_gain = drafts, gain
        return best

    def _coefficients(self, fallback: StepCostModel | None) -> tuple[float, float]:
        own = self.costs.coefficients()
        if own is not None and own[0] > 0:
            return own
        if fallback is not None:
            learned = fallback.coefficients()
            if learned is not None:
                return learned
        return own if own is not None else (0.0, 0.0)
