"""What ``/metrics`` serves beyond the request windows: gauges and counters read at
scrape time, the build info, the link of a split stage, and the two ways to serve them.

:class:`StageCollector` reads the worker's stats, the prefix cache and the stage link
when Prometheus scrapes (nothing is recorded per token). :func:`metrics_route` adds
``/metrics`` to the OpenAI app; :func:`metrics_app` is the small app of
``telemetry.metrics_listen``: ``/metrics`` and ``/health`` only, no API key, for a later
stage of a split pipeline (which has no HTTP API) or a scrape port apart from the API.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from skippyd.engine.worker.worker_stats import WorkerStats
from skippyd.http.observability.link_metrics import link_probe_families

if TYPE_CHECKING:
    from skippyd.http.backend import HealthStatus
    from skippyd.http.observability.metrics import ServingMetrics

logger = logging.getLogger(__name__)

#: Labels of ``skippyd_build_info``, in order.
BUILD_INFO_LABELS = ("version", "model", "stage", "stage_index", "layer_start", "layer_end")


class StageCollector(Collector):
    """Gauges and worker counters read at scrape time."""

    def __init__(self, metrics: ServingMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Any]:
        return []  # collected on demand: values depend on the live worker

    def collect(self) -> Iterator[Any]:
        m = self._metrics
        yield from _build_info(m.build_info)
        stats = m.stats() or WorkerStats()
        used, total = m.kv_cells()
        for name, doc, value in (
            ("requests_running", "Generations holding a lane.", stats.num_active),
            ("requests_waiting", "Generations waiting for a lane.", stats.num_waiting),
            ("kv_cache_usage_ratio", "Used share of the KV cell pool (0..1).",
             used / total if total else 0.0),
            ("kv_cache_cells_used", "KV cells in use.", used),
            ("kv_cache_cells_total", "KV cells in the pool.", total),
            ("worker_failed", "1 once the worker has failed.", int(stats.failure is not None)),
        ):
            yield GaugeMetricFamily("skippyd_" + name, doc, value=value)
        yield from _prefix_cache(m.prefix_cache())
        for name, doc, value in (
            ("preemptions", "Sequences preempted by the scheduler.", stats.num_preempted),
            ("speculative_draft_tokens", "Drafted tokens verified by speculative decoding.",
             stats.num_drafted),
            ("speculative_accepted_tokens", "Drafted tokens accepted.",
             stats.num_draft_accepted),
            ("iterations", "Planned iterations run by the worker.", stats.num_iterations),
            ("direct_iterations", "Direct iterations run by the worker (a later split "
             "stage's batches).", stats.num_direct_iterations),
        ):
            yield CounterMetricFamily("skippyd_" + name, doc, value=value)
        link = m.link_status()
        yield from link_families(link)
        yield from link_probe_families(link)


def _build_info(labels: Mapping[str, str]) -> Iterator[Any]:
    info = GaugeMetricFamily("skippyd_build_info", "What this stage runs: skippyd version, "
                             "served model, stage and its layer range (always 1).",
                             labels=BUILD_INFO_LABELS)
    info.add_metric([str(labels.get(name, "")) for name in BUILD_INFO_LABELS], 1)
    yield info


def _prefix_cache(prefix: Mapping[str, Any]) -> Iterator[Any]:
    hits, misses = int(prefix.get("hits", 0)), int(prefix.get("misses", 0))
    for name, doc, value in (
        ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache (the token "
         "hit rate's denominator).", prefix.get("queried_tokens", 0)),
        ("prefix_cache_hits", "Prompt tokens found in the prefix cache (restored instead of "
         "computed).", prefix.get("matched_tokens", 0)),
        ("prefix_cache_lookups", "Prefix-cache lookups, one per request.", hits + misses),
        ("prefix_cache_lookup_hits", "Prefix-cache lookups that restored a prefix.", hits),
        ("prefix_cache_evictions", "Prefix-cache entries evicted.", prefix.get("evictions", 0)),
    ):
        yield CounterMetricFamily("skippyd_" + name, doc, value=value)
    yield GaugeMetricFamily("skippyd_prefix_cache_resident_bytes", "KV bytes of the prefix-cache "
                            "entries resident in the pool.", value=prefix.get("bytes_resident", 0))
    yield GaugeMetricFamily("skippyd_prefix_cache_host_bytes", "Host RAM of the prefix cache's "
                            "host tier.", value=prefix.get("bytes_host", 0))


def link_families(link: Mapping[str, Any] | None) -> Iterator[Any]:
    """The stage link's traffic, for a stage of a split pipeline (nothing otherwise).

    ``peer="upstream"`` is the listener's side (activations coming in on a later stage),
    ``peer="downstream"`` the chain stage 0 dials.
    """
    if link is None:
        return
    data = CounterMetricFamily("skippyd_link_bytes", "Bytes over the stage link, by peer "
                               "side and direction.", labels=("peer", "direction"))
    data.add_metric(["upstream", "in"], link.get("bytes_in", 0))
    data.add_metric(["upstream", "out"], link.get("bytes_out", 0))
    chain = link.get("chain")
    if isinstance(chain, Mapping):
        data.add_metric(["downstream", "out"], chain.get("bytes_out", 0))
        data.add_metric(["downstream", "in"], chain.get("bytes_in", 0))
        yield GaugeMetricFamily("skippyd_link_up", "1 while the chain to the later stages is "
                                "connected (stage 0).", value=int(bool(chain.get("up"))))
    yield data
    for name, doc, key in (
        ("link_batches", "Batches received from the upstream stage.", "batches"),
        ("link_batches_sent", "Batches stage 0 sent down the chain.", "batches_sent"),
        ("link_connections", "Upstream link connections accepted.", "connections"),
        ("link_rejected", "Upstream link connections refused (handshake).", "rejected"),
        ("link_busy_seconds", "Seconds this stage spent computing its layers.", "busy_s"),
    ):
        yield CounterMetricFamily("skippyd_" + name, doc, value=float(link.get(key, 0) or 0))
    yield GaugeMetricFamily("skippyd_link_sessions", "Sessions this stage holds KV for.",
                            value=link.get("active_sessions", 0))


def metrics_route(metrics: ServingMetrics, path: str = "/metrics") -> Route:
    """The Starlette route serving ``metrics.registry`` in the Prometheus text format."""
    async def endpoint(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
    return Route(path, endpoint, methods=["GET"])


def metrics_app(metrics: ServingMetrics,
                health: Callable[[], tuple[HealthStatus, str | None]]) -> Starlette:
    """``/metrics`` and ``/health`` only: the app of ``telemetry.metrics_listen``."""
    async def health_endpoint(request: Request) -> Response:
        status, reason = health()
        body: dict[str, Any] = {"status": status}
        if reason:
            body["reason"] = reason
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    return Starlette(routes=[metrics_route(metrics),
                             Route("/health", health_endpoint, methods=["GET"])])
