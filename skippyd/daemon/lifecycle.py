"""``skippyd serve``: the daemon's life story — startup, serve, drain, shutdown.

The HTTP port opens first and answers ``/health`` with 503 while the model loads in a
worker thread; once the stage engine is up, ``/health`` turns 200. SIGINT/SIGTERM (via
uvicorn's handlers) start a bounded drain: new generations get 503, running ones may
finish within ``http.drain_timeout_s``, then the worker is stopped, failing whatever it
still holds with an error, and llama.cpp is freed.

If the worker fails (a bug it contained: every request it held has already been
answered with an error), ``/health`` turns 503 naming the failure, a split chain's other
stages get an ERROR frame, and the daemon stays up for ``http.drain_timeout_s`` (new
requests get 503, ``/health``, ``/metrics`` and ``skippyd status`` say why), then exits
with :attr:`ExitCode.WORKER_FAILED`, so a supervisor restarts it. A signal in that
window ends it at once, with the same exit code.

A later stage of a split pipeline (no ``[http]``) runs as a :class:`LinkStageDaemon`:
the same control socket, systemd notifications and watchdog, with the stage link in
place of the HTTP port.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import signal
import sys
import threading
from collections.abc import Callable

import uvicorn

from skippyd.config import StageConfig
from skippyd.config.schema import HttpSection
from skippyd.control.server import ControlServer, ControlSocketError
from skippyd.daemon.assembly import StageEngine, StartupError
from skippyd.daemon.metrics_listener import MetricsListener, open_metrics_listener
from skippyd.daemon.sdnotify import SystemdNotifier
from skippyd.daemon.snapshot import snapshot_source
from skippyd.daemon.split import slice_progress
from skippyd.daemon.startup import load_with_progress
from skippyd.daemon.stats_log import log_throughput
from skippyd.engine.runtime.contract import SamplingConfig
from skippyd.exitcodes import ExitCode
from skippyd.http.api.routes import create_app
from skippyd.http.event_relay import relay_for
from skippyd.http.guard.connections import (
    ConnectionGuard,
    ConnectionLimits,
    fit_fd_limit,
    guarded_protocol,
    protocol_class,
)
from skippyd.http.observability.metrics import ServingMetrics, metrics_route
from skippyd.http.parsing.request_params import HttpLimits
from skippyd.model_files.model_info import ModelFileError

logger = logging.getLogger(__name__)

#: Exit code of a daemon that could not start (uvicorn's STARTUP_FAILURE).
STARTUP_FAILURE = ExitCode.STARTUP
#: How often the systemd STATUS line is refreshed when no watchdog asks for more.
STATUS_INTERVAL_S = 5.0


def _http(config: StageConfig) -> HttpSection:
    """The ``[http]`` section of a stage that serves HTTP."""
    if config.http is None:
        raise StartupError("only the first stage serves HTTP")
    return config.http


def http_limits(config: StageConfig) -> HttpLimits:
    """The API's limits; a prompt limit left open is what one request may hold (the
    context check against the loaded runtime enforces it)."""
    http = _http(config)
    prompt_limit = {} if http.max_prompt_tokens is None else {
        "max_prompt_tokens": http.max_prompt_tokens}
    return HttpLimits(
        **prompt_limit,
        max_body_bytes=http.max_body_bytes,
        max_tokens_limit=http.max_tokens_limit,
        max_stop_strings=http.max_stop_strings,
        max_stop_length=http.max_stop_length,
        max_logit_bias=http.max_logit_bias,
        max_choices=http.max_choices,
    )


def sampling_defaults(config: StageConfig) -> SamplingConfig:
    """What the API samples with when a request leaves a field out (``[sampling]``)."""
    sampling = config.sampling
    return SamplingConfig(temperature=sampling.temperature, top_k=sampling.top_k,
                          top_p=sampling.top_p, min_p=sampling.min_p,
                          repeat_penalty=sampling.repeat_penalty)


def connection_limits(config: StageConfig) -> ConnectionLimits:
    """The HTTP connection limits of ``config``, the cap fitted to the open-files limit."""
    http = _http(config)
    return ConnectionLimits(
        header_timeout_s=http.header_timeout_s,
        body_timeout_s=http.body_timeout_s,
        keep_alive_timeout_s=http.keep_alive_timeout_s,
        send_timeout_s=http.send_timeout_s,
        max_open_connections=fit_fd_limit(http.max_open_connections),
    )


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class _Server(uvicorn.Server):
    """uvicorn's server with a started event and a drain hook (no polling)."""

    def __init__(self, config: uvicorn.Config, engine: StageEngine,
                 notifier: SystemdNotifier) -> None:
        super().__init__(config)
        self.engine = engine
        self.notifier = notifier
        self.started_event = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self):
        """Like uvicorn's, minus re-raising the signal after a graceful exit.

        The daemon owns the process: SIGTERM means "drain, then exit 0", not "die by it".
        """
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        self.started_event.set()

    async def shutdown(self, sockets=None) -> None:
        # Drain: new generations get 503 at once; uvicorn closes the listeners and waits
        # up to timeout_graceful_shutdown for running requests before cancelling them.
        self.engine.begin_drain()
        self.notifier.stopping("draining: finishing running requests")
        logger.info("draining: waiting up to %ss for running requests",
                    self.config.timeout_graceful_shutdown)
        await super().shutdown(sockets=sockets)


class Daemon:
    """One stage process serving HTTP over a :class:`StageEngine`."""

    def __init__(self, config: StageConfig) -> None:
        http = self.http = _http(config)
        self.config = config
        # A split stage 0 slices its layer range on first start: show a progress bar.
        self.engine = StageEngine(config, progress=slice_progress())
        self.metrics = ServingMetrics.for_engine(self.engine)
        app = create_app(self.engine, api_key=http.api_key, limits=http_limits(config),
                         default_max_tokens=http.default_max_tokens,
                         sampling_defaults=sampling_defaults(config),
                         reasoning=http.reasoning_format == "auto",
                         extra_routes=[metrics_route(self.metrics)], metrics=self.metrics,
                         max_concurrent_requests=http.max_connections)
        host, port = http.address
        if http.api_key is None and not _is_loopback(host):
            logger.warning(
                "SECURITY: http.listen %s is reachable from other machines and no"
                " http.api_key is set: anyone who can reach it can use the model", host)
        self.connections = ConnectionGuard(connection_limits(config))
        uv_config = uvicorn.Config(
            app, host=host, port=port, log_config=None, access_log=False, lifespan="off",
            timeout_graceful_shutdown=max(1, round(http.drain_timeout_s)),
            # NOTE: no limit_concurrency: uvicorn counts idle connections against it and
            # then answers every request, /health included, with a bare 503. The app
            # bounds requests in flight (429) and the guard bounds connections.
            http=guarded_protocol(protocol_class(http.protocol), self.connections),
            # uvicorn's own keep-alive timer is only a backstop: the guard's fires first.
            timeout_keep_alive=int(http.keep_alive_timeout_s) + 1,
        )
        self.notifier = SystemdNotifier()
        if self.notifier.watchdog_s is not None:
            # A runtime call stuck for half the watchdog period stops the pings.
            self.engine.hang_threshold_s = min(self.engine.hang_threshold_s,
                                               self.notifier.watchdog_s / 2)
        self.server = _Server(uv_config, self.engine, self.notifier)
        self.exit_code = 0

    @property
    def bound_address(self) -> tuple[str, int] | None:
        """The (host, port) actually listened on (useful with port 0)."""
        for server in getattr(self.server, "servers", []):
            for sock in server.sockets:
                return sock.getsockname()[:2]
        return None

    async def serve(self) -> int:
        """Run until a signal stops the server; return the process exit code."""
        serving = asyncio.create_task(self.server.serve())
        started = asyncio.create_task(self.server.started_event.wait())
        await asyncio.wait({serving, started}, return_when=asyncio.FIRST_COMPLETED)
        if not self.server.started_event.is_set():
            await serving
            return STARTUP_FAILURE  # could not bind: uvicorn logged why
        self.metrics.attach(self.engine.telemetry)
        control = await self._start_control()
        listener = await self._start_metrics() if control is not None else None
        if control is not None and not self.server.should_exit:
            await self._load()
        chores = start_chores(self.engine, self.notifier, self.metrics)
        await serving
        for chore in chores:
            chore.cancel()
        if listener is not None:
            await listener.close()
        if control is not None:
            await control.close()
        self.metrics.detach()
        await asyncio.to_thread(self.engine.close)
        self.notifier.close()
        logger.info("stage %s stopped", self.config.stage.id)
        return self.exit_code

    async def _start_control(self) -> ControlServer | None:
        control = await open_control(self.engine, self.metrics)
        if control is None:
            self.exit_code = STARTUP_FAILURE
            self.server.should_exit = True
        return control

    async def _start_metrics(self) -> MetricsListener | None:
        try:
            return await open_metrics_listener(self.engine, self.metrics)
        except StartupError as exc:
            logger.error("startup failed: %s", exc)
            self.engine.fail(str(exc))
            self.exit_code = STARTUP_FAILURE
            self.server.should_exit = True
            return None

    async def _load(self) -> None:
        host, port = self.bound_address or self.http.address
        logger.info("listening on http://%s:%d (loading the model)", host, port)
        try:
            await load_with_progress(self.engine.load, self.engine.startup, self.notifier)
        except (StartupError, ModelFileError, OSError, ValueError) as exc:
            logger.error("startup failed: %s", exc)
            self.engine.fail(str(exc))
            self.exit_code = STARTUP_FAILURE
            self.server.should_exit = True
            return
        wake_loop_while_worker_waits(self.engine)
        stop_when_worker_fails(self.engine, self.notifier, failed=self._worker_failed,
                               stop=self._stop_serving,
                               linger_s=self.http.drain_timeout_s)
        self.notifier.ready(f"serving {self.engine.model_id} on {host}:{port}")
        print(f"skippyd serving {self.engine.model_id} on http://{host}:{port}/v1",
              file=sys.stderr, flush=True)

    def _worker_failed(self) -> None:
        self.exit_code = ExitCode.WORKER_FAILED

    def _stop_serving(self) -> None:
        self.server.should_exit = True  # uvicorn's drain, as after SIGTERM


class LinkStageDaemon:
    """A later stage of a split pipeline: the stage link instead of HTTP.

    It opens the control socket (``skippyd top``/``status`` on this stage), loads the
    slice and starts the link listener, tells systemd it is ready once it is, pings the
    watchdog while no runtime call is stuck, and on SIGINT/SIGTERM says STOPPING, closes
    the link (stage 0 sees the chain go down) and frees llama.cpp.
    """

    def __init__(self, config: StageConfig) -> None:
        self.config = config
        self.engine = StageEngine(config, progress=slice_progress())
        self.metrics = ServingMetrics.for_engine(self.engine)
        self.exit_code = 0
        self._stop = asyncio.Event()
        self.notifier = SystemdNotifier()
        if self.notifier.watchdog_s is not None:
            self.engine.hang_threshold_s = min(self.engine.hang_threshold_s,
                                               self.notifier.watchdog_s / 2)

    async def serve(self) -> int:
        """Run until SIGINT/SIGTERM; return the process exit code."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stop.set)
        self.metrics.attach(self.engine.telemetry)
        control = await open_control(self.engine, self.metrics)
        listener: MetricsListener | None = None
        try:
            if control is None:
                return STARTUP_FAILURE
            listener = await open_metrics_listener(self.engine, self.metrics)
            if not await self._load():
                return STARTUP_FAILURE
            chores = start_chores(self.engine, self.notifier, self.metrics)
            await self._stop.wait()
            logger.info("stage %s stopping", self.config.stage.id)
            self.notifier.stopping("stopping: closing the stage link")
            for chore in chores:
                chore.cancel()
            return self.exit_code
        except StartupError as exc:  # the metrics listener could not bind
            logger.error("startup failed: %s", exc)
            self.engine.fail(str(exc))
            return STARTUP_FAILURE
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            if listener is not None:
                await listener.close()
            if control is not None:
                await control.close()
            self.metrics.detach()
            await asyncio.to_thread(self.engine.close)
            self.notifier.close()

    async def _load(self) -> bool:
        try:
            await load_with_progress(self.engine.load, self.engine.startup, self.notifier)
        except (StartupError, ModelFileError, OSError, ValueError) as exc:
            logger.error("startup failed: %s", exc)
            self.engine.fail(str(exc))
            return False
        wake_loop_while_worker_waits(self.engine)
        # No drain time here: the chain's first stage already heard of the failure, and
        # it is the one that reports it to clients.
        stop_when_worker_fails(self.engine, self.notifier, failed=self._worker_failed,
                               stop=self._stop.set, linger_s=0.0)
        host, port = self.engine.link_address or ("?", 0)
        stage = self.config.stage
        self.notifier.ready(f"serving layers {stage.layer_start}:{stage.layer_end} of "
                            f"{self.engine.model_id} on link {host}:{port}")
        print(f"skippyd stage {stage.id} serving layers {stage.layer_start}:"
              f"{stage.layer_end} on link {host}:{port}", file=sys.stderr, flush=True)
        return True

    def _worker_failed(self) -> None:
        self.exit_code = ExitCode.WORKER_FAILED


def wake_loop_while_worker_waits(engine: StageEngine) -> None:
    """Have the worker's events wake this event loop when the worker waits (a model
    call, or no work), not the moment they are posted; see :mod:`skippyd.http.event_relay`.

    Call on the event loop, once the engine is loaded.
    """
    worker = engine.worker
    if worker is None:
        return
    relay = relay_for(asyncio.get_running_loop())
    worker.add_wait_hook(relay.owed_wake)
    relay.defer_wakes_from(worker.thread)


def stop_when_worker_fails(engine: StageEngine, notifier: SystemdNotifier, *,
                           failed: Callable[[], None], stop: Callable[[], None],
                           linger_s: float) -> None:
    """If the worker dies: call ``failed`` (which sets the exit code), tell the chain and
    systemd, go on answering 503 for ``linger_s`` so that health checks and
    ``skippyd status`` can see why, then call ``stop``; all on this event loop.

    Call on the event loop, once the engine is loaded.
    """
    loop = asyncio.get_running_loop()

    async def on_failed(reason: str) -> None:
        failed()
        logger.critical("the worker failed: %s; answering 503 for %gs, then exiting with "
                        "code %d so that a supervisor restarts the stage",
                        reason, linger_s, ExitCode.WORKER_FAILED)
        notifier.status(f"failed: {reason}")
        await asyncio.to_thread(engine.announce_failure, reason)
        await asyncio.sleep(linger_s)
        stop()

    tasks: set[asyncio.Task] = set()

    def start(reason: str) -> None:
        task = loop.create_task(on_failed(reason))
        tasks.add(task)  # the loop keeps only a weak reference
        task.add_done_callback(tasks.discard)

    def on_failure(reason: str) -> None:  # the worker's thread: hand over, never block
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            loop.call_soon_threadsafe(start, reason)

    engine.on_worker_failure(on_failure)


async def open_control(engine: StageEngine, metrics: ServingMetrics) -> ControlServer | None:
    """Open the control socket (``skippyd top``/``status``) before the model loads.

    Returns None (and marks the engine failed) when the socket cannot be opened.
    """
    config = engine.config
    control = ControlServer(
        config.control.socket_path, stage_id=config.stage.id,
        snapshot=snapshot_source(engine, metrics), telemetry=engine.telemetry,
        group=config.control.group, event_level=config.telemetry.level,
    )
    try:
        await control.start()
    except ControlSocketError as exc:
        logger.error("startup failed: %s", exc)
        engine.fail(str(exc))
        return None
    logger.info("control socket at %s", config.control.socket_path)
    return control


def start_chores(engine: StageEngine, notifier: SystemdNotifier,
                 metrics: ServingMetrics) -> list[asyncio.Task]:
    """The periodic tasks of a serving stage: watchdog and STATUS, the throughput line."""
    telemetry = engine.config.telemetry
    return [asyncio.create_task(housekeeping(engine, notifier)),
            asyncio.create_task(log_throughput(metrics, serves_http=engine.config.http is not None,
                                               interval_s=telemetry.stats_interval_s))]


async def housekeeping(engine: StageEngine, notifier: SystemdNotifier) -> None:
    """Watchdog pings while the worker is alive, and a STATUS line for systemctl."""
    watchdog_s = notifier.watchdog_s
    interval = watchdog_s / 4 if watchdog_s is not None else STATUS_INTERVAL_S
    while True:
        if watchdog_s is not None and engine.is_alive(engine.hang_threshold_s):
            notifier.watchdog()
        notifier.status(status_line(engine))
        await asyncio.sleep(interval)


def status_line(engine: StageEngine) -> str:
    """One line for ``systemctl status``: health, then what the stage is doing."""
    state, reason = engine.health()
    worker = engine.worker
    if state != "ok" or worker is None:
        return f"{state}: {reason}"
    stats = worker.stats()
    if engine.config.http is None:
        return (f"serving layers {engine.config.stage.layer_start}:"
                f"{engine.config.stage.layer_end}: {stats.active_runtime_sessions} sessions,"
                f" {stats.num_iterations} iterations")
    return (f"serving {engine.model_id}: {stats.num_active} active,"
            f" {stats.num_waiting} waiting, {stats.num_finished} finished")


def run_daemon(config: StageConfig) -> int:
    """Serve ``config`` until SIGINT/SIGTERM; returns the exit code."""
    daemon = LinkStageDaemon(config) if config.http is None else Daemon(config)
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        return runner.run(daemon.serve())


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when it is installed (it is a dependency on Linux and macOS),
    else asyncio's own: every token a stream sends passes through the loop, and uvloop
    does a wake-up and a socket write in C."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
