"""How many drafted tokens a decode row may carry: only as many as the step can afford.

A request's drafts ride as extra rows of the step's one model call; each costs what a
row costs, and pays only if it is accepted. With per-token acceptance ``a`` and ``k``
drafts a row yields ``1 + a + a^2 + ... + a^k`` tokens instead of one. The step itself
costs ``fixed + per_row * rows`` (:class:`~skippyd.engine.policy.step_budget.StepCostModel`,
learned from decode steps), and produces one token per decode row, so its tokens cost
``step / decode_rows`` each. A draft length pays when the extra tokens it is expected to
yield cost less than that: ``(E(k) - 1) / (per_row * k) > decode_rows / step``. On a small
model whose step is mostly the fixed pass over the weights that holds even for modest
acceptance; on a model whose rows are compute-bound, or in a full batch, it almost never
does, and drafting stops. Pure: the driver feeds it outcomes and step durations.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from skippyd.engine.policy.plan import IterationPhase, IterationPlan
from skippyd.engine.policy.step_budget import StepCostModel

logger = logging.getLogger(__name__)

#: Weight an earlier outcome keeps at each new one in a request's acceptance estimate.
ACCEPTANCE_MEMORY = 0.9
#: The estimate before any outcome (as if one draft had been accepted out of two).
PRIOR_ACCEPTED, PRIOR_TRIALS = 1.0, 2.0
#: Generated tokens after which a request that stopped drafting tries again, its
#: estimate halfway back to the prior.
RETRY_AFTER_TOKENS = 32


@dataclass(slots=True)
class DraftStats:
    """One request's drafting record."""

    accepted_sum: float = 0.0
    """Decayed count of drafts accepted."""
    trials_sum: float = 0.0
    """Decayed count of drafts put to the test (accepted ones, plus each first miss)."""
    num_drafted: int = 0
    """Drafts verified, in all."""
    num_accepted: int = 0
    """Drafts accepted, in all."""
    idle_tokens: int = 0
    """Tokens generated since the request last drafted."""

    @property
    def acceptance(self) -> float:
        """Estimated chance that the next draft token is accepted."""
        return (self.accepted_sum + PRIOR_ACCEPTED) / (self.trials_sum + PRIOR_TRIALS)

    def record(self, drafted: int, accepted: int) -> None:
        """Learn from one verified row: ``accepted`` of ``drafted`` drafts kept."""
        trials = accepted + (1 if accepted < drafted else 0)
        self.accepted_sum = self.accepted_sum * ACCEPTANCE_MEMORY + accepted
        self.trials_sum = self.trials_sum * ACCEPTANCE_MEMORY + trials
        self.num_drafted += drafted
        self.num_accepted += accepted
        self.idle_tokens = 0

    def note_plain_step(self, tokens: int) -> None:
        """A step without drafts generated ``tokens``; after a while, try drafting again."""
        self.idle_tokens += tokens
        if self.idle_tokens >= RETRY_AFTER_TOKENS:
            self.accepted_sum /= 2
            self.trials_sum /= 2
            self.idle_tokens = 0


def expected_tokens(acceptance: float, drafts: int) -> float:
    """Tokens a row with ``drafts`` drafts yields on average: ``sum(a^i, i=0..drafts)``."""
    if acceptance >= 1.0:
        return float(drafts + 1)
    return (1.0 - acceptance ** (drafts + 1)) / (1.0 - acceptance)


class DraftControl:
    """Chooses draft lengths from each request's acceptance and what rows cost here.

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

    def observe(self, plan: IterationPlan, elapsed_s: float) -> None:
        """Learn from a step that ran; only decode steps (with or without drafts) count."""
        if plan.work and all(w.phase is IterationPhase.DECODE for w in plan.work):
            self.costs.observe(plan, elapsed_s)

    def draft_length(self, acceptance: float, decode_rows: int, step_rows: int,
                     available: int, fallback: StepCostModel | None = None) -> int:
        """Drafts one row should carry (0: none pays).

        Args:
            acceptance: The request's estimated per-token acceptance.
            decode_rows: Decode rows of the step (the tokens it yields without drafts).
            step_rows: Rows of the step before this request's drafts.
            available: Drafts the drafter offers (and room allows).
            fallback: Costs learned from every step, used until decode steps alone show
                what a row adds (they need rows of different counts to tell).
        """
        most = min(self.max_draft, available)
        if most < self.min_draft or decode_rows <= 0:
            return 0
        fixed, per_row = self._coefficients(fallback)
        if per_row <= 0:
            return 0
        step = fixed + per_row * max(step_rows, decode_rows)
        price = per_row * decode_rows / step  # a draft's cost in the step's tokens
        best, best_gain = 0, 0.0
        for drafts in range(self.min_draft, most + 1):
            gain = expected_tokens(acceptance, drafts) - 1.0 - price * drafts
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
