"""The load benchmark's workload: option parsing, prompts and arrival times.

Prompt lengths are counted in words, not tokens: prompts are built from common English
words that most tokenizers (SmolLM2's, Llama's…) encode as one token each, so a prompt of
N words is about N tokens on any server without asking it to tokenize. The report shows
the servers' own ``usage.prompt_tokens`` when they send it.

Every request gets its own prompt (random words from a per-run seed), so a server's
prompt cache cannot flatter it; only ``shared_prefix_words`` words at the start are
common to all requests of a run, on purpose, to exercise prefix caches.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

logger = logging.getLogger(__name__)

#: Per-request timeout of the load benchmark, seconds (``--timeout``).
DEFAULT_TIMEOUT_S = 300.0

# NOTE: every word here is a single token (with its leading space) in SmolLM2's
# tokenizer; checked when the list was written.
WORDS: tuple[str, ...] = tuple("""
time year people way day man thing woman life child world school state family student
group country problem hand part place case week company system program question work
government number night point home water room mother area money story fact month lot
right study book eye job word business issue side kind head house service friend father
power hour game line end member law car city community name president team minute idea
kid body information back parent face others level office door health person art war
history party result change morning reason research girl guy moment air teacher force
education foot boy age policy music market sense nation plan college interest death
experience effect use class control care field development role effort rate heart drug
show leader light voice wife police mind price report decision son view relationship
town road arm difference value building action model season society tax director
position player record paper space ground form event official matter center couple site
project activity star table need court oil situation cost industry figure street image
phone data picture practice piece land product doctor wall patient worker news test
movie north love support technology step baby computer type attention film tree source
organization hair window evidence population truth
""".split())


class WorkloadError(ValueError):
    """A workload option is malformed or inconsistent; the message names the option."""


@dataclass(frozen=True, slots=True)
class IntRange:
    """An inclusive integer range; ``low == high`` for a fixed value."""

    low: int
    high: int

    def draw(self, rng: random.Random) -> int:
        """A uniform draw from the range."""
        return self.low if self.low == self.high else rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


def parse_range(text: str, option: str, *, minimum: int = 1) -> IntRange:
    """Parse ``"64"`` or ``"32:96"`` (inclusive) into an :class:`IntRange`.

    Raises:
        WorkloadError: Not an integer or ``LOW:HIGH``, below ``minimum``, or LOW > HIGH.
    """
    parts = text.strip().split(":")
    try:
        if len(parts) not in (1, 2):
            raise ValueError
        low, high = int(parts[0]), int(parts[-1])
    except ValueError:
        raise WorkloadError(f"{option}: expected N or LOW:HIGH, e.g. 64 or 32:96 (got {text!r})"
                            ) from None
    if low < minimum:
        raise WorkloadError(f"{option}: must be >= {minimum} (got {text!r})")
    if low > high:
        raise WorkloadError(f"{option}: LOW must not exceed HIGH (got {text!r})")
    return IntRange(low, high)


def parse_concurrency(text: str) -> tuple[int, ...]:
    """Parse a concurrency sweep such as ``"1,4,8"``.

    Raises:
        WorkloadError: An item is not a positive integer, or the list is empty.
    """
    items = [item.strip() for item in text.split(",")]
    levels: list[int] = []
    for item in items:
        if not item.isdigit() or int(item) < 1:
            raise WorkloadError(f"--concurrency: expected positive integers separated by "
                                f"commas, e.g. 1,4,8 (got {text!r})")
        levels.append(int(item))
    return tuple(levels)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """What one benchmark run sends to every target."""

    concurrency: tuple[int, ...]
    """Concurrent streams per level (with ``rate``: the cap on requests in flight)."""
    num_requests: int
    """Requests per concurrency level."""
    prompt_words: IntRange
    """Prompt length in words (about tokens), shared prefix included."""
    output_tokens: IntRange
    """``max_tokens`` per request; exact because ``ignore_eos`` is sent."""
    shared_prefix_words: int = 0
    """Words at the start of every prompt that are the same for all requests."""
    rate: float | None = None
    """Poisson arrivals at this many requests/s; None for a closed loop."""
    seed: int = 0
    temperature: float = 0.0

    def __post_init__(self) -> None:
        if not self.concurrency:
            raise WorkloadError("--concurrency: at least one level is needed")
        if self.num_requests < 1:
            raise WorkloadError(f"--requests: must be >= 1 (got {self.num_requests})")
        if self.shared_prefix_words < 0:
            raise WorkloadError(f"--shared-prefix: must be >= 0 (got {self.shared_prefix_words})")
        if self.shared_prefix_words >= self.prompt_words.low:
            raise WorkloadError(
                f"--shared-prefix: {self.shared_prefix_words} words leave no unique part in a "
                f"prompt of {self.prompt_words.low} words; it must be below the shortest prompt")
        if self.rate is not None and self.rate <= 0:
            raise WorkloadError(f"--rate: must be > 0 requests/s (got {self.rate})")
        if self.temperature < 0:
            raise WorkloadError(f"--temperature: must be >= 0 (got {self.temperature})")

    def to_dict(self) -> dict[str, object]:
        """The spec as JSON-ready values (ranges as ``"LOW:HIGH"`` strings)."""
        return {
            "concurrency": list(self.concurrency), "requests_per_level": self.num_requests,
            "prompt_words": str(self.prompt_words), "output_tokens": str(self.output_tokens),
            "shared_prefix_words": self.shared_prefix_words, "rate": self.rate,
            "seed": self.seed, "temperature": self.temperature,
        }


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of one level."""

    index: int
    prompt: str
    num_prompt_words: int
    max_tokens: int
    arrival_s: float
    """Offset from the level start at which to send it (0 in a closed loop)."""


def build_level(spec: WorkloadSpec, level_index: int) -> list[RequestSpec]:
    """The requests of one concurrency level, the same for every target.

    Prompts differ between levels too (the level index seeds them), so a level never
    finds the previous level's prompts in a cache.
    """
    rng = random.Random(f"{spec.seed}:{level_index}")
    prefix = shared_prefix(spec)
    arrivals = _arrival_offsets(spec, rng)
    requests: list[RequestSpec] = []
    seen: set[str] = set()
    for index, arrival_s in enumerate(arrivals):
        num_words = spec.prompt_words.draw(rng)
        prompt = _unique_prompt(prefix, num_words - len(prefix), rng, seen)
        requests.append(RequestSpec(index, prompt, num_words, spec.output_tokens.draw(rng),
                                    arrival_s))
    return requests


def shared_prefix(spec: WorkloadSpec) -> list[str]:
    """The words every prompt of the run starts with (empty without a shared prefix)."""
    rng = random.Random(f"{spec.seed}:prefix")
    return [rng.choice(WORDS) for _ in range(spec.shared_prefix_words)]


_MAX_DRAWS = 100


def _unique_prompt(prefix: list[str], num_words: int, rng: random.Random,
                   seen: set[str]) -> str:
    for _ in range(_MAX_DRAWS):
        prompt = " ".join(prefix + [rng.choice(WORDS) for _ in range(num_words)])
        if prompt not in seen:
            seen.add(prompt)
            return prompt
    raise WorkloadError(f"--prompt-tokens: {num_words} unique words per prompt are too few "
                        f"to make {len(seen) + 1} different prompts; use longer prompts")


def _arrival_offsets(spec: WorkloadSpec, rng: random.Random) -> list[float]:
    if spec.rate is None:
        return [0.0] * spec.num_requests
    offsets, now = [], 0.0
    for _ in range(spec.num_requests):
        offsets.append(now)
        now += rng.expovariate(spec.rate)
    return offsets
