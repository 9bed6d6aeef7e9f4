"""The scheduler lab's named workloads and fixture traces."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from skippyd.bench.lab_sim import RuntimeCostModel, SimRequest
from skippyd.engine.policy import UNLIMITED, CacheAffinity, SchedulerConfig, StageCacheAffinity

#: The policy knobs the lab's scenarios start from: many sequences, 256-token chunks,
#: prefill and decode in separate iterations, no step-time budget (the policy's own
#: rules, without the step-time sizing a stage adds).
LAB_CONFIG = SchedulerConfig(
    max_active_sequences=32,
    max_waiting_sequences=256,
    prefill_chunk_tokens=256,
    max_consecutive_prefill_iterations=UNLIMITED,
    mixed_prefill_decode=False,
    target_step_us=0,
)


def lab_config(**overrides: Any) -> SchedulerConfig:
    """:data:`LAB_CONFIG` with ``overrides``."""
    return dataclasses.replace(LAB_CONFIG, **overrides)


logger = logging.getLogger(__name__)

#: Tokens each family of the locality fixture trace shares.
FAMILY_PROMPT_TOKENS = 128
#: Token-id distance between families, so different families share no prefix.
FAMILY_TOKEN_STRIDE = 10_000


@dataclass(frozen=True, slots=True)
class LabScenario:
    """A named workload with the scheduler config it runs under."""

    name: str
    config: SchedulerConfig
    requests: tuple[SimRequest, ...]
    cost: RuntimeCostModel = field(default_factory=RuntimeCostModel)


class LabPrefixIndex:
    """Resident prefixes of the lab's modelled cache, per stage.

    A stand-in for peeking a real radix cache: it only answers "how many leading tokens of
    this prompt are resident on that stage", and nothing it does changes what is cached.
    """

    def __init__(self, cache_epoch: int = 1) -> None:
        self.cache_epoch = cache_epoch
        self._prefixes: dict[int, list[tuple[int, ...]]] = {}

    def seed(self, stage_index: int, tokens: Iterable[int]) -> None:
        """Record ``tokens`` as resident on ``stage_index``."""
        self._prefixes.setdefault(stage_index, []).append(tuple(tokens))

    def longest_match(self, stage_index: int, prompt: Sequence[int]) -> int:
        """Length of the longest resident prefix of ``prompt`` on ``stage_index``."""
        best = 0
        for resident in self._prefixes.get(stage_index, ()):
            matched = 0
            for left, right in zip(resident, prompt, strict=False):
                if left != right:
                    break
                matched += 1
            best = max(best, matched)
        return best


def apply_resident_radix_affinity(
    index: LabPrefixIndex,
    stage_index: int,
    prefill_cost_per_token: int,
    requests: Iterable[SimRequest],
) -> list[SimRequest]:
    """Give every request that hits ``index`` its restored prefix and a one-stage affinity."""
    result = []
    for request in requests:
        matched = index.longest_match(stage_index, request.prompt())
        if matched:
            affinity = CacheAffinity.from_stage(StageCacheAffinity(
                stage_index, matched, prefill_cost_per_token, 0, index.cache_epoch))
            request = dataclasses.replace(request, prefix_tokens=matched,
                                          cache_affinity=affinity)
        result.append(request)
    return result


def _burst(name: str, count: int, prefix_tokens: int) -> LabScenario:
    requests = tuple(SimRequest(f"request-{i}", 0, 4096, 32, prefix_tokens=prefix_tokens)
                     for i in range(count))
    config = lab_config(max_consecutive_prefill_iterations=UNLIMITED,
                        mixed_prefill_decode=False, max_active_sequences=32,
                        group_waiting_prefixes=True)
    return LabScenario(name, config, requests)


def staggered_requests() -> tuple[SimRequest, ...]:
    """A long decoder at t=0 and four 1024-token prompts arriving 1 ms apart."""
    decoder = SimRequest("decoder", 0, 32, 64)
    prefills = tuple(
        SimRequest(f"prefill-{i}", 1000 * (i + 1), 1024, 4, token_offset=10_000 * (i + 1))
        for i in range(4)
    )
    return (decoder, *prefills)


def _staggered(name: str, **overrides: object) -> LabScenario:
    return LabScenario(name, lab_config(**overrides), staggered_requests())


def radix_requests(cache_aware: bool, prompt_tokens: int = 4096, resident_tokens: int = 3072,
                   output_tokens: int = 16) -> tuple[SimRequest, ...]:
    """Two cold requests and one whose prefix is resident on stage 0.

    Under FCFS the affinity is cleared but the prefix restore still applies.
    """
    requests = [
        SimRequest("a-cold", 0, prompt_tokens, output_tokens, token_offset=10_000),
        SimRequest("b-cold", 0, prompt_tokens, output_tokens, token_offset=20_000),
        SimRequest("c-hot", 0, prompt_tokens, output_tokens, token_offset=0),
    ]
    index = LabPrefixIndex()
    index.seed(0, range(resident_tokens))
    hit = apply_resident_radix_affinity(index, 0, RuntimeCostModel().prefill_token_us, requests)
    if not cache_aware:
        hit = [dataclasses.replace(r, cache_affinity=CacheAffinity()) for r in hit]
    return tuple(hit)


def _radix(name: str, cache_aware: bool) -> LabScenario:
    config = lab_config(max_active_sequences=1, max_consecutive_prefill_iterations=1)
    return LabScenario(name, config, radix_requests(cache_aware))


def _waiting_prefix(name: str, grouping: bool) -> LabScenario:
    requests = (
        SimRequest("a-unique", 0, 4096, 16, token_offset=10_000),
        SimRequest("b-shared", 0, 4096, 16),
        SimRequest("c-shared", 0, 4096, 16),
    )
    config = lab_config(max_active_sequences=1, max_consecutive_prefill_iterations=1,
                             group_waiting_prefixes=grouping)
    return LabScenario(name, config, requests)


def family_trace(families: Sequence[int], output_tokens: int = 1) -> tuple[SimRequest, ...]:
    """The locality fixture: one request per entry, all at t=0, prompts shared per family."""
    return tuple(
        SimRequest(f"r{i:03d}-f{family}", 0, FAMILY_PROMPT_TOKENS, output_tokens,
                   token_offset=FAMILY_TOKEN_STRIDE * (family + 1))
        for i, family in enumerate(families)
    )


def family_of(requests: Iterable[SimRequest]) -> dict[str, int]:
    """Family number of each request of :func:`family_trace`."""
    return {r.id: r.token_offset // FAMILY_TOKEN_STRIDE - 1 for r in requests}


def family_config(grouping: bool) -> SchedulerConfig:
    """One active sequence, so admission order is the family order."""
    return lab_config(max_active_sequences=1, max_consecutive_prefill_iterations=1,
                           group_waiting_prefixes=grouping)


SCENARIO_BUILDERS: dict[str, Callable[[], LabScenario]] = {
    **{f"cold-burst-n{n}": functools.partial(_burst, f"cold-burst-n{n}", n, 0)
       for n in (1, 2, 4)},
    **{f"warm-divergent-n{n}": functools.partial(_burst, f"warm-divergent-n{n}", n, 4080)
       for n in (1, 2, 4)},
    "staggered-prefill": lambda: _staggered("staggered-prefill"),
    "staggered-prefill-bounded": lambda: _staggered(
        "staggered-prefill-bounded", max_consecutive_prefill_iterations=1),
    "staggered-prefill-mixed": lambda: _staggered(
        "staggered-prefill-mixed", max_consecutive_prefill_iterations=1,
        mixed_prefill_decode=True),
    "radix-fcfs": lambda: _radix("radix-fcfs", cache_aware=False),
    "radix-cache-aware": lambda: _radix("radix-cache-aware", cache_aware=True),
    "waiting-prefix-fcfs": lambda: _waiting_prefix("waiting-prefix-fcfs", grouping=False),
    "waiting-prefix-dfs": lambda: _waiting_prefix("waiting-prefix-dfs", grouping=True),
}
