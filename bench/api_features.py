"""What structured output and n > 1 cost: grammar sampling, and one prefill for n choices.

Starts ``skippyd serve`` on loopback with the embedded SmolLM2-135M model and measures,
in the same run:

* **Grammar cost.** 8 concurrent chat completions constrained by a JSON Schema against
  8 plain ones with the same prompt, sampling and length (``max_tokens`` is reached
  before the schema can close, and the plain ones use ``ignore_eos``, so every request
  produces exactly ``--output-tokens`` tokens). Aggregate output tok/s of the burst;
  target: the constrained burst is at most 15 % slower.
* **n = 4.** One completion with ``n = 4`` against 4 concurrent completions of the same
  (long) prompt: time until the last token. Target: ``n = 4`` at least 1.5x faster. It
  runs on two servers, the default one (prefix cache on: separate requests with one
  prompt then share its prefill through the cache) and one with ``kv_cache.mode =
  "disabled"`` (each separate request computes the prompt itself). One request with one
  choice is timed beside them: the prefill and decode every way of serving pays.

Each comparison runs ``--rounds`` times, alternating which side goes first; medians are
compared. Any failed request makes the comparison NOT MET.

Usage::

    python bench/api_features.py [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from skippyd.bench.process import sigterm_exits, skippyd_process
from skippyd.config import default_model_path

logger = logging.getLogger(__name__)

MAX_GRAMMAR_COST = 0.15
MIN_CHOICES_SPEEDUP = 1.5
#: Never closes within a few hundred tokens: every constrained request runs to max_tokens.
PEOPLE_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["people"],
                 "properties": {"people": {"type": "array", "minItems": 40, "items": {
                     "type": "object", "additionalProperties": False,
                     "required": ["name", "age", "city"],
                     "properties": {"name": {"type": "string", "maxLength": 24},
                                    "age": {"type": "integer"},
                                    "city": {"type": "string", "maxLength": 24}}}}}}
PEOPLE_PROMPT = "List forty people as JSON, with their name, age and city."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8, help="requests per burst")
    parser.add_argument("--output-tokens", type=int, default=96)
    parser.add_argument("--choices", type=int, default=4, help="n of the n-choices request")
    parser.add_argument("--prompt-words", type=int, default=300,
                        help="length of the n-choices prompt")
    parser.add_argument("--choice-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    return parser.parse_args(argv)


#: KV cells per lane: the n-choices prompt (~1 450 tokens of SmolLM2 at 300 words) and its
#: completion must fit one lane's stream.
LANE_TOKENS = 2048


def server_config(name: str, model: Path, args: argparse.Namespace, cache: str) -> str:
    return (f'[stage]\nid = "{name}-{os.getpid()}"\nmodel_path = "{model}"\n\n'
            f"[runtime]\nctx_size = {LANE_TOKENS * args.concurrency}\n"
            f"lane_count = {args.concurrency}\n"
            f"threads = {args.threads}\nthreads_batch = {args.threads}\n\n"
            f'[kv_cache]\nmode = "{cache}"\n')


class Failures(list):
    """Messages of requests that failed."""


async def post(client: httpx.AsyncClient, url: str, body: dict[str, Any],
               failures: Failures) -> dict[str, Any] | None:
    try:
        response = await client.post(url, json=body)
    except httpx.HTTPError as exc:
        failures.append(f"{url}: {exc!r}")
        return None
    if response.status_code != 200:
        failures.append(f"{url}: {response.status_code} {response.text[:200]}")
        return None
    return response.json()


async def grammar_burst(client: httpx.AsyncClient, base: str, args: argparse.Namespace,
                        constrained: bool, round_index: int, failures: Failures) -> float:
    """Aggregate output tok/s of one burst of chat completions."""
    def body(i: int) -> dict[str, Any]:
        request: dict[str, Any] = {
            "messages": [{"role": "user", "content": PEOPLE_PROMPT}],
            "max_tokens": args.output_tokens, "seed": 1000 * (round_index + 1) + i}
        if constrained:
            request["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "people", "schema": PEOPLE_SCHEMA}}
        else:
            request["ignore_eos"] = True
        return request

    started = time.perf_counter()
    replies = await asyncio.gather(*(post(client, f"{base}/v1/chat/completions", body(i),
                                          failures) for i in range(args.concurrency)))
    elapsed = time.perf_counter() - started
    tokens = 0
    for reply in replies:
        if reply is None:
            continue
        tokens += reply["usage"]["completion_tokens"]
        if reply["choices"][0]["finish_reason"] != "length":
            failures.append("a burst request ended before max_tokens: lengths differ")
    return tokens / elapsed


async def choices_run(client: httpx.AsyncClient, base: str, args: argparse.Namespace,
                      together: bool, round_index: int, failures: Failures,
                      choices: int | None = None) -> float:
    """Seconds until the last token: one n-choices request, or n separate ones.

    Every run has a prompt of its own (no prefix shared with another run), so only the
    requests of one run can share their prefill. ``choices`` (default ``--choices``)
    of 1 times one request alone: the floor any way of serving n choices pays.
    """
    n = args.choices if choices is None else choices
    salt = 3 * (round_index + 1) + together + (n == 1)
    words = " ".join(f"word{(salt * 7919 + i * 31) % 5003}" for i in range(args.prompt_words))
    prompt = f"Run {salt}. Summarize these words in one sentence: {words}\nSummary:"
    body = {"prompt": prompt, "max_tokens": args.choice_tokens, "ignore_eos": True, "seed": 5}
    started = time.perf_counter()
    url = f"{base}/v1/completions"
    if together:
        reply = await post(client, url, {**body, "n": n}, failures)
        count = 0 if reply is None else len(reply["choices"])
    else:
        replies = await asyncio.gather(*(post(client, url, {**body, "seed": 5 + i}, failures)
                                         for i in range(n)))
        count = sum(reply is not None for reply in replies)
    if count != n:
        failures.append(f"expected {n} choices, got {count}")
    return time.perf_counter() - started


async def alternate(rounds: int, first: Callable[[int], Awaitable[float]],
                    second: Callable[[int], Awaitable[float]]) -> tuple[list[float], list[float]]:
    """Run both sides ``rounds`` times, swapping which goes first every round."""
    a_values, b_values = [], []
    for index in range(rounds):
        if index % 2 == 0:
            a_values.append(await first(index))
            b_values.append(await second(index))
        else:
            b_values.append(await second(index))
            a_values.append(await first(index))
    return a_values, b_values


def verdict(met: bool, failures: Failures, text: str) -> tuple[bool, str]:
    ok = met and not failures
    detail = f" ({len(failures)} failed requests: {failures[0]})" if failures else ""
    return ok, f"{'MET' if ok else 'NOT MET'}  {text}{detail}"


async def measure(base: str, args: argparse.Namespace, grammar: bool) -> dict[str, Any]:
    results: dict[str, Any] = {}
    timeout = httpx.Timeout(600.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=64)) as client:
        if grammar:
            failures = Failures()
            await grammar_burst(client, base, args, True, -1, failures)  # warm-up
            constrained, plain = await alternate(
                args.rounds,
                lambda i: grammar_burst(client, base, args, True, i, failures),
                lambda i: grammar_burst(client, base, args, False, i, failures))
            cost = 1.0 - statistics.median(constrained) / statistics.median(plain)
            results["grammar"] = {"constrained_tok_s": constrained, "plain_tok_s": plain,
                                  "cost": cost, "failures": list(failures)}
        failures = Failures()
        await choices_run(client, base, args, True, -1, failures)  # warm-up
        together, separate = await alternate(
            args.rounds,
            lambda i: choices_run(client, base, args, True, i, failures),
            lambda i: choices_run(client, base, args, False, i, failures))
        single = [await choices_run(client, base, args, True, i, failures, choices=1)
                  for i in range(args.rounds)]
        speedup = statistics.median(separate) / statistics.median(together)
        results["choices"] = {"n_s": together, "separate_s": separate, "single_s": single,
                              "speedup": speedup, "failures": list(failures)}
    return results


def report(name: str, results: dict[str, Any], args: argparse.Namespace) -> list[bool]:
    outcomes = []
    if "grammar" in results:
        g = results["grammar"]
        ok, line = verdict(g["cost"] <= MAX_GRAMMAR_COST, Failures(g["failures"]),
                           f"[{name}] json_schema burst {statistics.median(g['constrained_tok_s']):.1f}"
                           f" tok/s vs plain {statistics.median(g['plain_tok_s']):.1f} tok/s:"
                           f" grammar costs {100 * g['cost']:.1f} % (target <= "
                           f"{100 * MAX_GRAMMAR_COST:.0f} %)")
        print(line)
        outcomes.append(ok)
    c = results["choices"]
    ok, line = verdict(c["speedup"] >= MIN_CHOICES_SPEEDUP, Failures(c["failures"]),
                       f"[{name}] n={args.choices}: {statistics.median(c['n_s']):.2f} s vs "
                       f"{args.choices} separate requests {statistics.median(c['separate_s']):.2f}"
                       f" s to the last token: {c['speedup']:.2f}x (target >= "
                       f"{MIN_CHOICES_SPEEDUP}x); one request alone "
                       f"{statistics.median(c['single_s']):.2f} s")
    print(line)
    outcomes.append(ok)
    return outcomes


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    model = args.model or default_model_path()
    all_results: dict[str, Any] = {}
    with sigterm_exits(), tempfile.TemporaryDirectory() as workdir:
        for name, cache in (("prefix cache on", "auto"), ("prefix cache off", "disabled")):
            config = Path(workdir) / f"{cache}.toml"
            config.write_text(server_config(cache, model, args, cache))
            with contextlib.ExitStack() as stack:
                url = stack.enter_context(skippyd_process(str(config))).url
                base = url.removesuffix("/v1")
                all_results[name] = asyncio.run(measure(base, args, grammar=cache == "auto"))
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    outcomes = [ok for name, results in all_results.items()
                for ok in report(name, results, args)]
    if args.json is not None:
        args.json.write_text(json.dumps(all_results, indent=2))
    return 0 if all(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
