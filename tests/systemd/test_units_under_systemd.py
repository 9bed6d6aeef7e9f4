"""The example units, run by a real systemd: readiness, journal, watchdog, restarts, drain,
two template instances, and the hardening under what the daemon really does.

systemd runs as PID 1 of a container over a root tree of its own (see
:mod:`systemd_machine`), with skippyd installed the way the README's "Running under
systemd" section says. The units are the ones in examples/systemd/, byte for byte; every
test-only setting is a drop-in:

* a system call the units deny kills the daemon (``SystemCallErrorNumber=kill``) instead
  of failing with EPERM, so a denial is a failed test, never a silent fallback; only the
  first test runs without it, to show that the units start exactly as shipped;
* per test, ``Environment=SKIPPYD_FAULT=...`` and a shorter ``WatchdogSec=``.

Where no container can be booted the tests skip and say why; ``SKIPPYD_REQUIRE_SYSTEMD=1``
(set by CI, which installs what they need) turns that into a failure.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tomli_w
from systemd_machine import Machine, Unbootable

REPO = Path(__file__).resolve().parents[2]
CONFIG = "/etc/skippyd/skippyd.toml"
STRICT_DROP_IN = "50-test-strict.conf"
STRICT = """[Service]
# Test only: a system call the unit denies kills the daemon instead of failing with EPERM,
# except the one the unit's comment names.
SystemCallErrorNumber=kill
SystemCallFilter=~mbind:EPERM
"""
#: A checkout's examples, inside the container: the README's commands run from there.
CHECKOUT = "/srv/skippyd"
EXAMPLES = ("systemd/skippyd.service", "systemd/skippyd@.service",
            "configs/split-2/stage0.toml", "configs/split-2/stage1.toml")
#: The README's commands that install skippyd and its units, as the test runs them (the
#: venv at /opt/skippyd/venv is the test run's own, mounted).
INSTALL = (
    "useradd --system --home /var/lib/skippyd --shell /usr/sbin/nologin skippyd",
    "ln -s /opt/skippyd/venv/bin/skippyd /usr/local/bin/skippyd",
    "install -m 0644 examples/systemd/skippyd.service examples/systemd/skippyd@.service"
    " /etc/systemd/system/",
    f"install -d /etc/skippyd && skippyd config init {CONFIG}",
    "systemctl daemon-reload && systemctl enable skippyd",
)


@pytest.fixture(scope="module")
def machine(tmp_path_factory) -> Iterator[Machine]:
    try:
        booted = Machine(tmp_path_factory.mktemp("systemd"))
    except Unbootable as exc:
        if os.environ.get("SKIPPYD_REQUIRE_SYSTEMD") == "1":
            pytest.fail(f"no systemd could be booted: {exc}")
        pytest.skip(f"no systemd can be booted here: {exc}")
    try:
        for example in EXAMPLES:
            booted.write(f"{CHECKOUT}/examples/{example}", (REPO / "examples" / example).read_text())
        for unit in ("skippyd.service", "skippyd@.service"):
            booted.write(f"/etc/systemd/system/{unit}.d/{STRICT_DROP_IN}", STRICT)
        for command in INSTALL:
            booted.sh(f"cd {CHECKOUT} && {command}")
        yield booted
    finally:
        booted.close()


@pytest.fixture(scope="module")
def initial_config(machine) -> str:
    """What ``skippyd config init`` wrote."""
    return machine.path(CONFIG).read_text()


@pytest.fixture
def unit(machine, initial_config) -> Iterator[Unit]:
    """skippyd.service with the test's config; stopped and reset after each test."""
    service = Unit(machine, "skippyd.service", initial_config)
    service.configure()
    try:
        yield service
    finally:
        machine.run("systemctl", "stop", "skippyd", check=False)
        machine.run("rm", "-f", "/etc/systemd/system/skippyd.service.d/60-test-fault.conf")
        machine.write(f"/etc/systemd/system/skippyd.service.d/{STRICT_DROP_IN}", STRICT)
        machine.run("systemctl", "daemon-reload")
        machine.run("systemctl", "reset-failed", "skippyd", check=False)


class Unit:
    """One unit in the booted machine, and the config of the daemon it runs."""

    def __init__(self, machine: Machine, name: str, initial_config: str) -> None:
        self.machine = machine
        self.name = name
        self.initial_config = initial_config
        self.port = 0

    def configure(self, **sections: dict) -> None:
        """The file ``skippyd config init`` wrote, as a user would edit it: a small
        runtime for a two-core machine, a free port, and ``sections`` on top."""
        config = tomllib.loads(self.initial_config)
        self.port = free_port()
        config["runtime"].update(ctx_size=1024, lane_count=2, threads=1, threads_batch=1)
        config["http"].update(listen=f"127.0.0.1:{self.port}")
        for name, values in sections.items():
            config.setdefault(name, {}).update(values)
        self.machine.path(CONFIG).write_text(tomli_w.dumps(config))

    def fault(self, fault: str, *, watchdog_s: int | None = None) -> None:
        """A drop-in arming ``SKIPPYD_FAULT``, and a shorter watchdog if asked."""
        text = f"[Service]\nEnvironment=SKIPPYD_FAULT={fault}\n"
        if watchdog_s is not None:
            text += f"WatchdogSec={watchdog_s}\n"
        self.machine.write("/etc/systemd/system/skippyd.service.d/60-test-fault.conf", text)
        self.machine.run("systemctl", "daemon-reload")

    def as_shipped(self) -> None:
        """No drop-in at all: the unit exactly as examples/systemd/ has it."""
        self.machine.run("rm", "-r", f"/etc/systemd/system/{self.name}.d")
        self.machine.run("systemctl", "daemon-reload")

    def invocation(self) -> str:
        """The id of the unit's current run: its journal entries carry it."""
        return self.show("InvocationID")["InvocationID"]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def show(self, *properties: str) -> dict[str, str]:
        return self.machine.show(self.name, *properties)

    def wait_for(self, condition, what: str, timeout: float = 90.0) -> dict[str, str]:
        """Poll the unit's properties until ``condition(properties)`` holds."""
        keys = ("ActiveState", "SubState", "Result", "NRestarts", "MainPID",
                "ExecMainStatus", "ExecMainCode")
        deadline = time.monotonic() + timeout
        while True:
            properties = self.show(*keys)
            if condition(properties):
                return properties
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: no {what} in {timeout:.0f} s: {properties}"
                                     f"\n{self.log()}")
            time.sleep(0.2)

    def log(self, after: str | None = None) -> str:
        entries = self.machine.journal("-u", self.name, after=after)
        return "\n".join(f"<{e.get('PRIORITY')}> {e.get('MESSAGE')}" for e in entries)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def messages(entries: list[dict[str, str]]) -> list[str]:
    return [entry.get("MESSAGE", "") for entry in entries]


def own(entries: list[dict[str, str]]) -> list[dict[str, str]]:
    """The entries the daemon wrote itself (its stderr), not systemd's about it."""
    return [entry for entry in entries if entry.get("_TRANSPORT") == "stdout"]


def notifications(machine: Machine, unit: str, after: str) -> list[str]:
    """The sd_notify messages systemd got from ``unit`` (logged at debug level)."""
    found = []
    for message in messages(machine.journal("-u", unit, after=after)):
        match = re.search(r"Got notification message from PID \d+ \((.*)\)$", message)
        if match:
            found.append(match[1])
    return found


#: ``systemctl start skippyd`` as the README runs it, with ``systemctl status`` read over
#: and over (a read takes about 10 ms) until the start returns; exits with the start's
#: status. The test model's loading steps last from tens to hundreds of milliseconds, so
#: the reads may miss a short one, never the whole load; systemd's debug log has them all.
WATCH_START = """
systemctl start skippyd & start=$!
while kill -0 "$start" 2>/dev/null; do
    systemctl status --no-pager --lines=0 skippyd | grep '^ *Status: '
done
wait "$start"
"""


def status_field(notification: str) -> str:
    """The ``STATUS=`` of one notification (always its last field), or ''."""
    match = re.search(r"(?:^|, )STATUS=(.*)$", notification)
    return match[1] if match else ""


def complete(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=60,
                      json={"prompt": "the cat", "max_tokens": 8, "temperature": 0, **body})


def test_start_returns_once_ready_and_systemd_saw_each_loading_step_first(machine, unit):
    unit.as_shipped()
    machine.run("systemd-analyze", "set-log-level", "debug")  # systemd logs each message
    try:
        cursor = machine.cursor()
        watched = machine.run("bash", "-c", WATCH_START, timeout=180)
        properties = unit.show("ActiveState", "SubState")
        health = httpx.get(unit.url + "/health", timeout=10)
    finally:
        machine.run("systemd-analyze", "set-log-level", "info")
    assert properties == {"ActiveState": "active", "SubState": "running"}
    assert health.status_code == 200, health.text  # ready means ready: no retry needed

    # What `systemctl status` showed while `systemctl start` waited, each line once.
    shown = list(dict.fromkeys(re.findall(r'^ *Status: "(.*)"$', watched.stdout, re.M)))
    serving = next((i for i, s in enumerate(shown) if not s.startswith("loading: ")),
                   len(shown))
    assert serving > 0 and all(s.startswith("serving ") for s in shown[serving:]), shown

    # systemd's debug log has every message the daemon sent, however short a step was.
    received = notifications(machine, "skippyd.service", cursor)
    ready = next(i for i, n in enumerate(received) if n.startswith("READY=1"))
    # Each step of the load, as it began (a long one also extends the start timeout), and
    # nothing else before READY=1.
    announced = [status_field(n) for n in received[:ready]]
    assert all(s.startswith("loading: ") for s in announced), received
    assert announced[0] == "loading: reading the model header", received
    assert "loading: loading the model" in announced, received
    assert received[ready] == (f"READY=1, STATUS=serving SmolLM2-135M-Instruct.Q4_1 on "
                               f"127.0.0.1:{unit.port}")
    # What `systemctl status` showed on the way is what the daemon announced, in order.
    steps = iter(announced)
    assert all(s in steps for s in shown[:serving]), (shown, announced)
    # The daemon's last start-up line: what it wrote before is in the journal too.
    entries = machine.wait_journal(lambda found: any(
        m.startswith("skippyd serving ") for m in messages(found)), "-u", "skippyd",
        after=cursor)
    log = messages(entries)
    started = log.index("Started skippyd.service - skippyd llama.cpp stage daemon.")
    assert any("(READY=1" in line for line in log[:started]), "started before READY=1"

    # Then the daemon's periodic line (right after READY=1, then each quarter of
    # WatchdogSec=) replaces the one READY=1 carried: what it serves, and its load.
    deadline = time.monotonic() + 60
    while 'Status: "serving SmolLM2-135M-Instruct.Q4_1: 0 active, 0 waiting, 0 finished"' \
            not in (status := machine.run("systemctl", "status", "--no-pager", "skippyd").stdout):
        assert time.monotonic() < deadline, status
        time.sleep(0.2)
    # skippyd status finds the control socket in the unit's runtime directory.
    assert "health ok" in machine.run("skippyd", "status").stdout
    # Under the sandbox, nothing fell back to a slower or weaker path: no warning at all.
    assert [e["MESSAGE"] for e in own(entries) if int(e["PRIORITY"]) <= 4] == []


def test_journal_priorities_are_real_and_each_request_is_logged_at_info(machine, unit):
    cursor = machine.cursor()
    machine.run("systemctl", "start", "skippyd")
    plain = complete(unit.url)
    odd = complete(unit.url, frobnicate=True)  # an unknown field: one warning
    assert plain.status_code == odd.status_code == 200

    ids = [response.json()["id"] for response in (plain, odd)]
    # The last request's line is in the journal, and with it all the daemon wrote before.
    everything = own(machine.wait_journal(lambda found: any(
        f"request {ids[-1]}: " in m for m in messages(found)), "-u", "skippyd", after=cursor))
    for request_id in ids:
        [entry] = [e for e in everything if f"request {request_id}: 200" in e["MESSAGE"]]
        assert entry["PRIORITY"] == "6"
        assert entry["MESSAGE"].startswith("skippyd.http.observability.request_log: ")

    run = unit.invocation()
    warnings = [e for e in machine.journal("-u", "skippyd", "-p", "warning")
                if run in (e.get("INVOCATION_ID"), e.get("_SYSTEMD_INVOCATION_ID"))]
    assert [e["MESSAGE"] for e in warnings if int(e["PRIORITY"]) > 4] == []
    assert messages(own(warnings)) == [
        "skippyd.http.parsing.unsupported: completions request field 'frobnicate' is unknown"
        " to skippyd and is ignored (logged once per name)"]
    # The priority prefix was read by the journal, never left in the text.
    assert not any(re.match(r"<\d>", m) for m in messages(everything))


def test_the_watchdog_kills_a_hung_daemon_and_systemd_restarts_it(machine, unit):
    unit.fault("hang-iteration", watchdog_s=4)
    cursor = machine.cursor()
    machine.run("systemctl", "start", "skippyd")
    before = unit.show("MainPID", "NRestarts")

    def hung_request() -> None:
        with contextlib.suppress(httpx.HTTPError):  # the daemon is killed under it
            complete(unit.url)

    client = threading.Thread(target=hung_request, daemon=True)
    client.start()
    restarted = unit.wait_for(lambda p: int(p["NRestarts"]) > int(before["NRestarts"])
                              and p["SubState"] == "running", "restart")
    assert restarted["MainPID"] != before["MainPID"]
    log = messages(machine.journal("-u", "skippyd", after=cursor))
    assert "skippyd.service: Watchdog timeout (limit 4s)!" in log, log
    assert "skippyd.service: Failed with result 'watchdog'." in log, log
    assert httpx.get(unit.url + "/health", timeout=10).status_code == 200
    client.join(30)


def test_a_fatal_worker_fault_exits_7_and_is_restarted_without_waiting_for_the_watchdog(
        machine, unit):
    unit.configure(http={"drain_timeout_s": 2.0})  # how long it says why before exiting
    unit.fault("raise-in=execute")
    cursor = machine.cursor()
    machine.run("systemctl", "start", "skippyd")
    before = unit.show("MainPID", "NRestarts")
    failed = complete(unit.url)
    assert failed.status_code >= 500, failed.text

    restarted = unit.wait_for(lambda p: int(p["NRestarts"]) > int(before["NRestarts"])
                              and p["SubState"] == "running", "restart")
    assert restarted["MainPID"] != before["MainPID"]
    entries = machine.journal("-u", "skippyd", after=cursor)
    log = messages(entries)
    assert "skippyd.service: Main process exited, code=exited, status=7/NOTRUNNING" in log, log
    assert not any("Watchdog timeout" in line for line in log), log
    [critical] = [e for e in own(entries) if "the worker failed" in e["MESSAGE"]]
    assert critical["PRIORITY"] == "2"


def test_a_config_error_exits_4_and_is_not_restarted(machine, unit):
    unit.configure(runtime={"lane_count": 0})
    cursor = machine.cursor()
    start = machine.run("systemctl", "start", "skippyd", check=False)
    assert start.returncode != 0
    # RestartPreventExitStatus=4: failed at once, never "activating (auto-restart)".
    properties = unit.show("ActiveState", "SubState", "Result", "ExecMainStatus", "NRestarts")
    assert properties == {"ActiveState": "failed", "SubState": "failed", "Result": "exit-code",
                          "ExecMainStatus": "4", "NRestarts": "0"}, unit.log(cursor)
    machine.wait_journal(lambda found: any("runtime.lane_count: must be between 1 and" in m
                                           for m in messages(own(found))),
                         "-u", "skippyd", after=cursor)


def test_a_config_error_is_in_the_journal_as_an_error(machine, unit):
    unit.configure(runtime={"lane_count": 0})
    cursor = machine.cursor()
    machine.run("systemctl", "start", "skippyd", check=False)
    entries = own(machine.wait_journal(lambda found: any(
        "runtime.lane_count" in m for m in messages(found)), "-u", "skippyd", after=cursor))
    assert [e["PRIORITY"] for e in entries if "runtime.lane_count" in e["MESSAGE"]] == ["3"]
    errors = messages(machine.journal("-u", "skippyd", "-p", "err", after=cursor))
    assert any("runtime.lane_count" in m for m in errors), errors


def test_stop_lets_a_streaming_request_finish_and_the_unit_ends_inactive(machine, unit):
    unit.configure(http={"drain_timeout_s": 30.0})
    cursor = machine.cursor()
    machine.run("systemctl", "start", "skippyd")
    # Long enough that most of it is generated after the stop even on a machine ten times
    # faster than one that takes 5 s for it (the stop reaches the daemon within about
    # 0.1 s of the 4th token), short enough for the drain time on one three times slower.
    max_tokens = 400
    arrivals: list[float] = []  # when each chunk with a token reached the client (epoch s)
    result: dict = {}
    streaming = threading.Event()

    def stream() -> None:
        tokens, finish = 0, None
        with httpx.stream("POST", unit.url + "/v1/completions", timeout=60, json={
                "prompt": "the cat", "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}) as response:
            result["status"] = response.status_code
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = httpx.Response(200, content=line[6:]).json()
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk["choices"]:
                    finish = choice["finish_reason"] or finish
                    if choice["text"]:
                        arrivals.append(time.time())
                if len(arrivals) >= 4:
                    streaming.set()
        result.update(tokens=tokens, finish=finish)

    def stream_or_error() -> None:
        try:
            stream()
        except httpx.HTTPError as exc:
            result["error"] = repr(exc)
        finally:
            streaming.set()  # never leave the test waiting

    client = threading.Thread(target=stream_or_error)
    client.start()
    assert streaming.wait(60) and "error" not in result, result
    started = time.monotonic()
    machine.run("systemd-analyze", "set-log-level", "debug")  # systemd logs each message
    try:
        machine.run("systemctl", "stop", "skippyd")  # returns once the daemon has exited
    finally:
        machine.run("systemd-analyze", "set-log-level", "info")
    stopped_in = time.monotonic() - started
    client.join(60)
    assert result == {"status": 200, "tokens": max_tokens, "finish": "length"}, unit.log(cursor)
    assert stopped_in < 30  # within http.drain_timeout_s
    assert unit.show("ActiveState", "Result", "ExecMainStatus") == {
        "ActiveState": "inactive", "Result": "success", "ExecMainStatus": "0"}
    assert "STOPPING=1, STATUS=draining: finishing running requests" in notifications(
        machine, "skippyd.service", cursor)

    # The stream was running when the daemon began to drain, and went on after it: most of
    # its tokens reached the client after the draining line was in the journal (which
    # stamps a line when it reads it, so never before the daemon wrote it; the container
    # reads the host's clock), and its request line, written as it ended, comes after.
    log = own(machine.journal("-u", "skippyd", after=cursor))
    [draining] = [i for i, e in enumerate(log) if "draining: waiting up to" in e["MESSAGE"]]
    [finished] = [i for i, e in enumerate(log) if re.search(
        rf"request \S+: 200 length, .* generated {max_tokens} tok", e["MESSAGE"])]
    assert draining < finished, messages(log)
    drain_began = int(log[draining]["__REALTIME_TIMESTAMP"]) / 1e6
    after = sum(arrival > drain_began for arrival in arrivals)
    assert 0 < len(arrivals) - after and after > max_tokens // 2, (len(arrivals), after)


def test_two_template_instances_run_side_by_side_with_their_own_sockets_and_directories(
        machine):
    machine.sh(f"cd {CHECKOUT} && install -m 0644 examples/configs/split-2/stage0.toml "
               "examples/configs/split-2/stage1.toml /etc/skippyd/")
    # Edited as a user would: a secret of their own, and ports that are free here.
    ports = {"8080": free_port(), "9101": free_port(), "9102": free_port()}
    for stage in (0, 1):
        path = machine.path(f"/etc/skippyd/stage{stage}.toml")
        text = path.read_text().replace("change-me-split-2-example-secret",
                                        "a-secret-of-this-test-0123456789")
        for example, port in ports.items():
            text = text.replace(f"127.0.0.1:{example}", f"127.0.0.1:{port}")
        path.write_text(text)
    machine.run("skippyd", "config", "check", "/etc/skippyd/stage0.toml",
                "/etc/skippyd/stage1.toml")
    cursor = machine.cursor()
    instances = ("skippyd@stage0", "skippyd@stage1")
    try:
        machine.run("systemctl", "start", "skippyd@stage0", "skippyd@stage1")
        url = f"http://127.0.0.1:{ports['8080']}"
        deadline = time.monotonic() + 60  # the chain connects after both are ready
        while httpx.get(url + "/health", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, httpx.get(url + "/health").text
            time.sleep(0.2)
        response = complete(url)
        assert response.status_code == 200

        for stage, name in ((0, "stage0"), (1, "stage1")):
            pid = machine.show(f"skippyd@{name}", "MainPID")["MainPID"]
            environ = machine.run("cat", f"/proc/{pid}/environ").stdout.split("\0")
            assert f"RUNTIME_DIRECTORY=/run/skippyd/{name}" in environ
            assert "CACHE_DIRECTORY=/var/cache/skippyd" in environ
            machine.run("test", "-S", f"/run/skippyd/{name}/stage-{stage}.sock")
            status = machine.run("skippyd", "status", "--config", f"/etc/skippyd/{name}.toml")
            assert f"stage-{stage}" in status.stdout
        # Both instances sliced the model into the one cache they share, as user skippyd.
        slices = machine.run("find", "/var/cache/skippyd/slices", "-type", "f", "-user",
                             "skippyd").stdout.split()
        assert len(slices) == 2, slices
        # Both daemons' last lines so far are in the journal: nothing before was a warning.
        request = f"request {response.json()['id']}: 200"
        entries = own(machine.wait_journal(lambda found: all(any(
            line in m for m in messages(found)) for line in (
                request, "skippyd stage stage-1 serving layers 17:30")),
            "-u", "skippyd@stage0", "-u", "skippyd@stage1", after=cursor))
        assert [e["MESSAGE"] for e in entries if int(e["PRIORITY"]) <= 4] == []

        machine.run("systemctl", "stop", "skippyd@stage1")
        assert machine.run("test", "-e", "/run/skippyd/stage1", check=False).returncode != 0
        machine.run("test", "-S", "/run/skippyd/stage0/stage-0.sock")
        status = machine.run("skippyd", "status", "--config", "/etc/skippyd/stage0.toml",
                             check=False)
        assert status.returncode in (0, 1), status.stderr  # answers (degraded), not gone
        machine.run("systemctl", "stop", "skippyd@stage0")
        for name in instances:
            assert machine.show(name, "ActiveState", "Result") == {
                "ActiveState": "inactive", "Result": "success"}
    finally:
        machine.run("systemctl", "stop", *instances, check=False)
