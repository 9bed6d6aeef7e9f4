"""Soak a running skippyd: many mixed requests, abrupt disconnects, invalid input; no leaks.

Drives a daemon with ``--requests`` requests (default 10 000) of mixed prompt and output
lengths, streaming and not, at a concurrency above its lane count; 20 % of the clients
disconnect at a random moment and 5 % send invalid requests. At the end it checks, from
the control socket and from /proc: every request got a result or a clear error; no
session is active; the lanes hold no KV cells; the daemon's thread count and open file
descriptors are back to what they were after warm-up; resident memory grew less than
``--rss-bound-mib`` after warm-up, not counting what the prefix cache's host-RAM tier
holds on purpose (within ``kv_cache.host_ram_bytes``). A split pipeline is soaked
through stage 0 and every stage is checked. It prints a one-line summary per stage and
exits 0 only if every check passed.

With ``--attack`` the connection attacks run beside the load the whole time: idle
connections that never send a byte (``--attack-idle``, default 900), request heads and
bodies dripped a byte at a time, handshakes dripped at every stage's link port, and a
supervisor probing ``/health`` twice a second, which must never see anything but 200.

Daemons it started are stopped when it ends, however it ends: on SIGTERM, SIGHUP or
Ctrl-C it stops them first, and each daemon gets SIGTERM from the kernel if the soak
itself is killed outright.

    python bench/soak.py --config examples/configs/single.toml            # starts skippyd
    python bench/soak.py --config examples/configs/split-2/stage0.toml \
                         --config examples/configs/split-2/stage1.toml    # a 2-stage split
    python bench/soak.py --url http://127.0.0.1:8080 --socket S --pid P \
                         [--socket S1 --pid P1 ...]                        # running stages
    python bench/soak.py --config s0.toml --config s1.toml --restart-stage 1   # a stage dies
    python bench/soak.py --config examples/configs/single.toml --attack   # under attack

With ``--restart-stage INDEX`` that later stage is killed (SIGKILL) halfway through and
started again: requests in flight may fail with a 503 (counted as ``unavailable``), no
new request starts until the chain is healthy again, so the second half runs through
the restarted stage, and every stage, the restarted one from its restart on, must
still pass the leak checks.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from skippyd.bench.attacks import (
    SLOW_HEAD,
    Drippers,
    IdleFlood,
    ProbeLoop,
    running,
    slow_body_request,
)
from skippyd.control.client import ControlClient
from skippyd.link.wire import FrameKind, encode_frame

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex "
         "every jovial bard near the old stone bridge").split()
READY = "skippyd serving"
LINK_READY = "serving layers"
#: A stage-link HELLO, dripped at link ports by ``--attack``.
LINK_HELLO = encode_frame(FrameKind.HELLO, b"h" * 120)
SLOW_BODY_HEAD, SLOW_BODY = slow_body_request()


@dataclass
class Tally:
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)

    def add(self, outcome: str, detail: str | None = None) -> None:
        self.outcomes[outcome] += 1
        if detail is not None and len(self.failures) < 20:
            self.failures.append(detail)


def proc_stats(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in status if ":" in line)
    return {"threads": int(fields["Threads"]), "rss_kib": int(fields["VmRSS"].split()[0]),
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def invalid_request(rng: random.Random) -> tuple[str, dict | bytes]:
    choices = [
        ("/v1/completions", b"{not json"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}),
        ("/v1/completions", {"prompt": "hi", "n": 0}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}),
        ("/v1/chat/completions", {"messages": "not a list"}),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": 3}]}),
        ("/v1/completions", {"prompt": "hi", "stop": ["a"] * 100}),
    ]
    return rng.choice(choices)


def normal_request(rng: random.Random, max_output: int) -> tuple[str, dict]:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 120)))
    body = {"max_tokens": rng.randint(1, max_output), "temperature": rng.choice([0, 0.8]),
            "stream": rng.random() < 0.6, "seed": rng.randint(0, 1000)}
    if rng.random() < 0.5:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**body, "prompt": prompt}


async def run_one(client: httpx.AsyncClient, rng: random.Random, tally: Tally,
                  max_output: int) -> None:
    roll = rng.random()
    if roll < 0.05:
        path, body = invalid_request(rng)
        kwargs = {"content": body, "headers": {"content-type": "application/json"}} \
            if isinstance(body, bytes) else {"json": body}
        response = await client.post(path, **kwargs)
        if 400 <= response.status_code < 500 and response.json().get("error", {}).get("message"):
            tally.add("invalid->4xx")
        elif response.status_code == 503:  # a degraded stage 0 refuses before validating
            tally.add("unavailable", f"invalid request got 503: {response.text[:120]}")
        else:
            tally.add("error", f"invalid request got {response.status_code}: {response.text[:120]}")
        return
    path, body = normal_request(rng, max_output)
    if roll < 0.25:
        await disconnect_midway(client, rng, path, {**body, "stream": True}, tally)
        return
    response = await client.post(path, json=body) if not body["stream"] else None
    if response is None:
        await read_stream(client, path, body, tally)
    elif response.status_code == 200 and response.json()["choices"]:
        tally.add("ok")
    elif response.status_code == 429:
        tally.add("429")
    elif response.status_code == 503:
        tally.add("unavailable", f"503: {response.text[:120]}")
    else:
        tally.add("error", f"{response.status_code}: {response.text[:120]}")


async def read_stream(client, path, body, tally: Tally) -> None:
    async with client.stream("POST", path, json=body) as response:
        if response.status_code == 429:
            tally.add("429")
            return
        if response.status_code == 503:
            tally.add("unavailable", "stream 503")
            return
        if response.status_code != 200:
            tally.add("error", f"stream {response.status_code}")
            return
        done = False
        async for line in response.aiter_lines():
            if line.strip() == "data: [DONE]":
                done = True
            elif line.startswith("data: {") and '"error"' in line[:20]:
                # A stage lost mid-stream fails the stream with a retryable error.
                kind = "unavailable" if "unavailable" in line else "error"
                tally.add(kind, f"stream error {line[:120]}")
                return
        tally.add("ok" if done else "error", None if done else "stream ended without [DONE]")


async def disconnect_midway(client, rng, path, body, tally: Tally) -> None:
    chunks_before_drop = rng.randint(0, 6)
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            kind = {429: "429", 503: "unavailable"}.get(response.status_code, "error")
            tally.add(kind, None if kind == "429" else f"{response.status_code}")
            return
        seen = 0
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen > chunks_before_drop:
                    break
    tally.add("disconnected")  # leaving the block closes the connection mid-stream


async def drive(url: str, total: int, concurrency: int, seed: int, max_output: int,
                tally: Tally, progress_every: int,
                at_half: Callable[[], None] | None = None,
                resumed: threading.Event | None = None) -> None:
    """Run ``total`` requests; at half way start ``at_half`` on a thread and, when
    ``resumed`` is given, start no new request until it is set (requests in flight go
    on), so the second half runs against the restarted stage."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    semaphore = asyncio.Semaphore(concurrency)
    started = time.monotonic()
    gate = asyncio.Event()
    gate.set()

    async def reopen() -> None:
        assert resumed is not None
        await asyncio.to_thread(resumed.wait, 120)
        gate.set()

    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        async def one(i: int) -> None:
            async with semaphore:
                await gate.wait()
                try:
                    await run_one(client, random.Random(rng.random()), tally, max_output)
                except (httpx.HTTPError, ValueError) as exc:
                    tally.add("error", f"{type(exc).__name__}: {exc}")
            if at_half is not None and i + 1 == total // 2:
                threading.Thread(target=at_half, daemon=True).start()
                if resumed is not None:
                    gate.clear()
                    reopening.append(asyncio.create_task(reopen()))
            if progress_every and (i + 1) % progress_every == 0:
                print(f"  {i + 1}/{total} in {time.monotonic() - started:.0f}s "
                      f"{dict(tally.outcomes)}", file=sys.stderr, flush=True)

        reopening: list[asyncio.Task] = []
        await asyncio.gather(*(one(i) for i in range(total)))
        await asyncio.gather(*reopening)


def settle(control: ControlClient, timeout: float) -> dict:
    """Wait for the daemon to go idle; return its last snapshot.

    Idle as the leak checks mean it: no busy lane, nothing waiting, no session and no KV
    held. A later stage of a split pipeline frees a session when stage 0's drop reaches
    it, which can be a moment after its lanes went idle.
    """
    deadline = time.monotonic() + timeout
    while True:
        snapshot = control.status()
        busy = [lane for lane in snapshot["lanes"] if lane["phase"] != "idle"]
        idle = (not busy and snapshot["queues"]["waiting"] == 0
                and snapshot["wave"]["active_sessions"] == 0
                and snapshot["kv"]["cells_used"] == 0)
        if idle or time.monotonic() > deadline:
            return snapshot
        time.sleep(0.2)


def wait_back_to(pid: int, baseline: dict[str, int], timeout: float) -> dict[str, int]:
    """Idle worker threads of thread pools exit after a while: give them that while."""
    deadline = time.monotonic() + timeout
    while True:
        now = proc_stats(pid)
        if (now["threads"] <= baseline["threads"] and now["fds"] <= baseline["fds"]) \
                or time.monotonic() > deadline:
            return now
        time.sleep(0.5)


@dataclass
class Stage:
    """One daemon being soaked (a whole model, or one stage of a split pipeline)."""

    name: str
    pid: int
    control: ControlClient
    config: Path | None = None
    proc: subprocess.Popen | None = None
    restarted_at: float | None = None
    """Seconds into the run when it was killed and started again (``--restart-stage``)."""
    baseline: dict[str, int] | None = None
    """Threads, fds and RSS after (re)start and warm-up: what the end is compared with."""


def restart(stage: Stage, url: str, started: float) -> None:
    """SIGKILL a stage in the middle of the run and start it again from its config.

    Requests in flight fail with a 503 while it is away; stage 0 reconnects, and the
    new process's leak checks start from its state once the chain is healthy again.
    """
    assert stage.proc is not None and stage.config is not None
    print(f"  killing {stage.name} (pid {stage.pid})", file=sys.stderr, flush=True)
    stage.proc.kill()
    stage.proc.wait()
    stage.restarted_at = time.monotonic() - started
    stage.proc, _, socket_path = start_daemon(stage.config)
    stage.pid = stage.proc.pid
    stage.control = ControlClient.connect(socket_path)
    wait_healthy(url, 60)
    stage.baseline = proc_stats(stage.pid)
    print(f"  {stage.name} is back (pid {stage.pid}) after "
          f"{time.monotonic() - started - stage.restarted_at:.1f} s", file=sys.stderr,
          flush=True)


def start_daemon(config: Path) -> tuple[subprocess.Popen, str | None, Path]:
    """Start ``skippyd serve`` on ``config``; the URL is None for a stage without HTTP."""
    from skippyd.config import load_config

    loaded = load_config(config)
    argv = [sys.executable, "-m", "skippyd.cli", "serve", "--config", str(config)]
    if loaded.http is not None:
        argv += ["--listen", "127.0.0.1:0"]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_die_with_parent)
    for line in proc.stderr:
        if READY in line or (loaded.http is None and LINK_READY in line):
            url = (line.split(" on ", 1)[1].strip().removesuffix("/v1")
                   if loaded.http is not None else None)
            # Keep reading stderr so the daemon never blocks on a full pipe.
            threading.Thread(target=_drain, args=(proc.stderr,), daemon=True).start()
            return proc, url, loaded.control.socket_path
    raise SystemExit(f"skippyd ({config}) exited with {proc.wait()} before it was ready")


def _die_with_parent() -> None:
    """In the child: SIGTERM when the soak dies, even by SIGKILL (Linux prctl)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _exit_on_signals() -> None:
    """SIGTERM and SIGHUP unwind like Ctrl-C, so the daemons are stopped on the way out."""
    def stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)


def wait_healthy(url: str, timeout: float) -> None:
    """A split stage 0 answers 503 until it has connected to the rest of the chain."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{url} did not report healthy within {timeout:g} s")
        time.sleep(0.2)


def _drain(stream) -> None:
    for _line in stream:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--config", type=Path, action="append",
                        help="start skippyd with this config; repeat for each stage of a "
                             "split pipeline")
    target.add_argument("--url", help="base URL of a running skippyd (stage 0)")
    parser.add_argument("--socket", type=Path, action="append",
                        help="control socket of a stage (with --url; repeat per stage)")
    parser.add_argument("--pid", type=int, action="append",
                        help="pid of a stage, in --socket order (with --url)")
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--warmup", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=0,
                        help="parallel clients (default: 2 x lane_count)")
    parser.add_argument("--max-output", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rss-bound-mib", type=float, default=64.0)
    parser.add_argument("--restart-stage", type=int, default=None, metavar="INDEX",
                        help="SIGKILL this later stage (its index, with --config per stage) "
                             "halfway through and start it again; requests it breaks may "
                             "fail with a 503, nothing may leak")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON")
    parser.add_argument("--attack", action="store_true",
                        help="run the connection attacks beside the load")
    parser.add_argument("--attack-idle", type=int, default=900,
                        help="idle connections held open during --attack (default 900: with "
                             "the load and the drippers, just under http.max_open_connections)")
    args = parser.parse_args(argv)
    _exit_on_signals()

    procs: list[subprocess.Popen] = []
    soaked: list[Stage] = []
    try:
        links: list[tuple[str, int] | None] = []
        if args.config is not None:
            url, stages = None, []
            # Later stages first: stage 0 connects to them as soon as it starts.
            for config in sorted(args.config, key=_serves_http):
                proc, stage_url, socket_path = start_daemon(config)
                procs.append(proc)
                url = stage_url or url
                stages.append((config.stem, proc.pid, socket_path, config, proc))
                links.append(_link_address(config))
            if url is None:
                parser.error("no --config serves HTTP (a pipeline needs its stage 0)")
            stages.reverse()  # stage 0 first in the report
        else:
            if not args.socket or not args.pid or len(args.socket) != len(args.pid):
                parser.error("--url needs one --pid per --socket")
            url = args.url
            stages = [(f"stage {i}", pid, path, None, None)
                      for i, (path, pid) in enumerate(zip(args.socket, args.pid, strict=True))]
        if args.restart_stage is not None and not 0 < args.restart_stage < len(stages):
            parser.error("--restart-stage: the index of a later stage started with --config")
        wait_healthy(url, 60)
        soaked += [Stage(name, pid, ControlClient.connect(path), config, proc)
                   for name, pid, path, config, proc in stages]
        return soak(args, url, soaked, [link for link in links if link is not None])
    finally:
        # Stage 0 first, then the stages behind it, then a restarted stage's new process.
        for proc in procs + [s.proc for s in soaked if s.proc is not None and s.proc not in procs]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()


def _link_address(config: Path) -> tuple[str, int] | None:
    from skippyd.config import load_config

    address = load_config(config).link.listen_address
    if address is None:
        return None
    host, port = address
    return ("127.0.0.1" if host in ("0.0.0.0", "", "::") else host), port


def _serves_http(config: Path) -> bool:
    from skippyd.config import load_config

    return load_config(config).http is not None


def soak(args, url: str, stages: list[Stage],
         links: list[tuple[str, int]] | None = None) -> int:
    lanes = stages[0].control.status()["lane_count"]
    concurrency = args.concurrency or 2 * lanes
    warm = Tally()
    asyncio.run(drive(url, args.warmup, concurrency, args.seed + 1, args.max_output, warm, 0))
    baseline_host = [settle(stage.control, 60)["prefix_cache"]["bytes_host"] for stage in stages]
    for stage in stages:
        stage.baseline = proc_stats(stage.pid)
    tally = Tally()
    attacks = make_attacks(args, url, links or [])
    started = time.monotonic()
    victim = None if args.restart_stage is None else stages[args.restart_stage]
    restarted, over = threading.Event(), threading.Event()

    def at_half() -> None:
        try:
            restart(victim, url, started)
        finally:
            restarted.set()
        # The kernel's parent-death signal (see _die_with_parent) follows the thread that
        # started a child, not the process: this thread lives until the soak is over.
        over.wait()

    try:
        return _soak_run(args, url, stages, attacks, concurrency, tally, started, victim,
                         restarted, baseline_host, None if victim is None else at_half)
    finally:
        over.set()


def _soak_run(args, url: str, stages: list[Stage], attacks: dict, concurrency: int,
              tally: Tally, started: float, victim: Stage | None, restarted: threading.Event,
              baseline_host: list[int], at_half: Callable[[], None] | None) -> int:
    """The measured run and the leak checks after it (see :func:`soak`)."""
    with running(*attacks.values()):
        asyncio.run(drive(url, args.requests, concurrency, args.seed, args.max_output, tally,
                          max(args.requests // 10, 1), at_half, restarted))
        # The restarted stage's process is the one to measure: wait until it is up.
        if victim is not None and not restarted.wait(120):
            raise SystemExit(f"{victim.name} did not come back within 120 s")
        peaks = [proc_stats(stage.pid) for stage in stages]
    elapsed = time.monotonic() - started
    attack_figures = attack_report(attacks, peaks, [stage.baseline for stage in stages])
    if attack_figures.get("probe_failures"):
        tally.add("error", f"/health probes failed: {attacks['probe'].answers}")
    figures = []
    for stage, host in zip(stages, baseline_host, strict=True):
        snapshot = settle(stage.control, 60)
        base = stage.baseline
        assert base is not None
        after = wait_back_to(stage.pid, base, 30)
        # The prefix cache's host-RAM tier holds saved KV on purpose, within its own
        # configured budget (kv_cache.host_ram_bytes): that is not a leak.
        cache_growth_kib = (snapshot["prefix_cache"]["bytes_host"] - host) // 1024
        figures.append(stage_checks(args, stage.name, snapshot, base, after, cache_growth_kib))
        figures[-1]["restarted_at_s"] = stage.restarted_at
    return report(args, tally, figures, elapsed, attack_figures)


def make_attacks(args, url: str, links: list[tuple[str, int]]) -> dict:
    """The connection attacks of ``--attack`` (none without it)."""
    if not args.attack:
        return {}
    host, port = httpx.URL(url).host, httpx.URL(url).port
    attacks = {
        "idle": IdleFlood((host, port), args.attack_idle),
        "slow_heads": Drippers((host, port), 16, SLOW_HEAD, every_s=1.0),
        "slow_bodies": Drippers((host, port), 16, SLOW_BODY, every_s=1.0, prefix=SLOW_BODY_HEAD),
        "probe": ProbeLoop(url, every_s=0.5),
    }
    for i, link in enumerate(links):
        attacks[f"link{i}_handshakes"] = Drippers(link, 16, LINK_HELLO, every_s=3.5)
    return attacks


def attack_report(attacks: dict, peaks: list[dict], baseline: list[dict]) -> dict:
    """What the attacks did, and the daemons' peak figures while they ran."""
    if not attacks:
        return {}
    figures: dict = {"probe_answers": dict(attacks["probe"].answers),
                     "probe_failures": attacks["probe"].failures,
                     "peak_rss_growth_mib": [(p["rss_kib"] - b["rss_kib"]) / 1024
                                             for p, b in zip(peaks, baseline, strict=True)],
                     "peak_fds": [p["fds"] for p in peaks]}
    for name, attack in attacks.items():
        if name != "probe":
            figures[name] = {"opened": attack.stats.opened, "cut": attack.stats.cut,
                             "refused": attack.stats.refused,
                             "completed": getattr(attack, "completed", 0)}
    return figures


def stage_checks(args, name: str, snapshot, baseline, after, cache_growth_kib: int) -> dict:
    """The leak checks of one stage after the run."""
    active = sum(1 for lane in snapshot["lanes"] if lane["phase"] != "idle")
    rss_growth_mib = (after["rss_kib"] - baseline["rss_kib"] - cache_growth_kib) / 1024
    checks = {
        "no active session": (active == 0 and snapshot["queues"]["waiting"] == 0
                              and snapshot["wave"]["active_sessions"] == 0),
        "lanes hold no KV": snapshot["kv"]["cells_used"] == 0,
        "threads back": after["threads"] <= baseline["threads"],
        "fds back": after["fds"] <= baseline["fds"],
        f"rss growth < {args.rss_bound_mib:g} MiB": rss_growth_mib < args.rss_bound_mib,
    }
    return {"stage": name, "checks": checks, "active": active,
            "active_sessions": snapshot["wave"]["active_sessions"],
            "kv_cells": snapshot["kv"]["cells_used"], "baseline": baseline, "after": after,
            "rss_growth_mib": rss_growth_mib,
            "prefix_cache_host_growth_mib": cache_growth_kib / 1024}


def report(args, tally: Tally, stages: list[dict], elapsed: float,
           attacks: dict | None = None) -> int:
    accounted = sum(tally.outcomes.values()) == args.requests
    # Only a stage killed on purpose may fail requests, and only as "unavailable".
    allowed = args.restart_stage is not None or tally.outcomes["unavailable"] == 0
    answered = accounted and tally.outcomes["error"] == 0 and allowed
    passed = answered and all(all(stage["checks"].values()) for stage in stages)
    outcomes = " ".join(f"{k} {v}" for k, v in sorted(tally.outcomes.items()))
    print(f"soak: {args.requests} requests in {elapsed:.0f}s ({outcomes}): "
          f"{'PASS' if passed else 'FAIL'}")
    for stage in stages:
        base, after = stage["baseline"], stage["after"]
        if stage["restarted_at_s"] is not None:
            print(f"  {stage['stage']}: killed and restarted {stage['restarted_at_s']:.0f} s "
                  "into the run; its figures count from the restart")
        print(f"  {stage['stage']}: active {stage['active']} sessions "
              f"{stage['active_sessions']}; kv cells {stage['kv_cells']}; threads "
              f"{base['threads']}->{after['threads']}; fds {base['fds']}->{after['fds']}; rss "
              f"{stage['rss_growth_mib']:+.1f} MiB after warm-up (prefix-cache host tier "
              f"{stage['prefix_cache_host_growth_mib']:+.1f} MiB not counted)")
    if attacks:
        print(f"  under attack: /health probes {attacks['probe_answers']}; peak rss growth "
              + ", ".join(f"{g:+.1f} MiB" for g in attacks["peak_rss_growth_mib"])
              + "; " + "; ".join(f"{name} opened {f['opened']} cut {f['cut']} completed "
                                 f"{f['completed']}" for name, f in attacks.items()
                                 if isinstance(f, dict) and "opened" in f))
    if not answered:
        print("  failed: every request answered", file=sys.stderr)
    for stage in stages:
        for name, ok in stage["checks"].items():
            if not ok:
                print(f"  failed on {stage['stage']}: {name}", file=sys.stderr)
    for failure in tally.failures:
        print(f"  error: {failure}", file=sys.stderr)
    if args.json is not None:
        args.json.write_text(json.dumps({
            "requests": args.requests, "elapsed_s": elapsed, "outcomes": dict(tally.outcomes),
            "passed": passed, "checks": {"every request answered": answered, **{
                f"{stage['stage']}: {name}": ok for stage in stages
                for name, ok in stage["checks"].items()}},
            "stages": stages, "errors": tally.failures, "attacks": attacks or {}}, indent=2))
    return 0 if passed else 1

if __name__ == "__main__":
    sys.exit(main())
