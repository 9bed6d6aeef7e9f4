"""Connection attacks on a real skippyd at its default deadlines, with clients beside them.

Starts ``skippyd serve`` (the embedded SmolLM2 via ``examples/configs/single.toml`` by
default), then runs each case for ``--duration`` seconds while ``--clients`` clients
loop short completions and a supervisor probes ``/health`` twice a second:

* ``idle``: ``--idle`` connections that never send a byte (default 1 000);
* ``slow-heads``: 64 request heads dripped one byte per second;
* ``slow-bodies``: 64 complete heads whose 4 KB bodies are dripped one byte per second;
* ``all``: the three at once.

For each case it prints the clients' answers, the probes' answers, the daemon's peak
RSS growth and open fds against the idle baseline, how many attacking connections the
server cut and how long the shortest-lived of them had lived (the deadline at work).
A case passes when every client request and every probe got a 200, no dripper ever
finished, RSS grew less than ``--rss-bound-mib`` and the fds came back afterwards.

    python bench/attack.py                                   # about 4 x 150 s
    python bench/attack.py --cases idle,all --duration 90    # shorter
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from skippyd.bench.attacks import (
    SLOW_HEAD,
    Drippers,
    IdleFlood,
    ProbeLoop,
    process_figures,
    running,
    slow_body_request,
)
from skippyd.bench.process import sigterm_exits, skippyd_process

ROOT = Path(__file__).resolve().parents[1]
CASES = ("idle", "slow-heads", "slow-bodies", "all")


def attacks_for(case: str, address: tuple[str, int], idle: int) -> list:
    head, body = slow_body_request()
    make = {
        "idle": lambda: IdleFlood(address, idle),
        "slow-heads": lambda: Drippers(address, 64, SLOW_HEAD, every_s=1.0),
        "slow-bodies": lambda: Drippers(address, 64, body, every_s=1.0, prefix=head),
    }
    names = list(make) if case == "all" else [case]
    return [make[name]() for name in names]


class Clients:
    """``n`` threads looping short completions until stopped; counts status codes."""

    def __init__(self, url: str, n: int) -> None:
        self.url = url
        self.answers: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True)
                         for i in range(n)]

    def _loop(self, i: int) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self._stop.is_set():
                try:
                    answer = str(client.post("/v1/completions", json={
                        "prompt": f"Client {i} asks: what is the capital of France?",
                        "max_tokens": 16, "temperature": 0}).status_code)
                except httpx.HTTPError as exc:
                    answer = type(exc).__name__
                with self._lock:
                    self.answers[answer] = self.answers.get(answer, 0) + 1

    def __enter__(self) -> Clients:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(180)


def run_case(case: str, url: str, pid: int, args) -> dict:
    host, port = httpx.URL(url).host, httpx.URL(url).port
    baseline = process_figures(pid)
    attacks = attacks_for(case, (host, port), args.idle)
    probe = ProbeLoop(url, every_s=0.5)
    peak = dict(baseline)
    with running(*attacks, probe), Clients(url, args.clients) as clients:
        ends = time.monotonic() + args.duration
        while time.monotonic() < ends:
            now = process_figures(pid)
            peak = {key: max(peak[key], now[key]) for key in peak}
            time.sleep(1.0)
    after = _settled(pid, baseline)
    lifetimes = [t for attack in attacks for t in attack.stats.lifetimes_s]
    figures = {
        "case": case, "clients": clients.answers, "probes": probe.answers,
        "rss_growth_mib": (peak["rss_kib"] - baseline["rss_kib"]) / 1024,
        "fds": (baseline["fds"], peak["fds"], after["fds"]),
        "opened": sum(a.stats.opened for a in attacks), "cut": sum(a.stats.cut for a in attacks),
        "completed": sum(getattr(a, "completed", 0) for a in attacks),
        "min_life_s": min(lifetimes) if lifetimes else None,
        "median_life_s": statistics.median(lifetimes) if lifetimes else None,
    }
    figures["passed"] = (set(clients.answers) == {"200"} and set(probe.answers) == {"200"}
                         and figures["completed"] == 0
                         and figures["rss_growth_mib"] < args.rss_bound_mib
                         and after["fds"] <= baseline["fds"])
    return figures


def _settled(pid: int, baseline: dict, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        now = process_figures(pid)
        if now["fds"] <= baseline["fds"] or time.monotonic() > deadline:
            return now
        time.sleep(0.5)


def show(figures: dict) -> None:
    life = ("-" if figures["min_life_s"] is None else
            f"{figures['min_life_s']:.1f}/{figures['median_life_s']:.1f} s")
    base, peak, after = figures["fds"]
    print(f"{figures['case']:<12} {'PASS' if figures['passed'] else 'FAIL'}  clients "
          f"{figures['clients']}  probes {figures['probes']}  rss "
          f"{figures['rss_growth_mib']:+.1f} MiB  fds {base}->{peak}->{after}  attackers "
          f"opened {figures['opened']} cut {figures['cut']} (min/median life {life}) "
          f"finished {figures['completed']}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "examples/configs/single.toml"))
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--duration", type=float, default=150.0,
                        help="seconds per case (past the 60 s deadlines)")
    parser.add_argument("--idle", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rss-bound-mib", type=float, default=64.0)
    args = parser.parse_args(argv)
    cases = [case for case in args.cases.split(",") if case]
    if unknown := set(cases) - set(CASES):
        parser.error(f"unknown cases {sorted(unknown)}; choose from {', '.join(CASES)}")
    with sigterm_exits(), skippyd_process(args.config) as server:
        url = server.url.removesuffix("/v1")
        results = []
        for case in cases:
            results.append(run_case(case, url, server.pid, args))
            show(results[-1])
    return 0 if all(figures["passed"] for figures in results) else 1


if __name__ == "__main__":
    sys.exit(main())
