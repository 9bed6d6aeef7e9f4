"""Prometheus families of a split stage's link probes: round trips and queues.

Read at scrape time from the stage's link status (the dict a STATUS reply carries),
so a slow later stage shows on stage 0's ``/metrics`` as a growing round trip on the
link into it and batches piling up in the credit window.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import GaugeMetricFamily

logger = logging.getLogger(__name__)

_PER_LINK = (
    ("link_rtt_seconds", "Moving average round trip of the link's probes (queueing "
     "behind frames included).", "rtt_avg_ms", 1e-3),
    ("link_rtt_max_seconds", "Longest of the link's recent probe round trips.",
     "rtt_max_ms", 1e-3),
    ("link_send_queue_bytes", "Bytes written to the link and not yet acknowledged.",
     "send_queue_bytes", 1.0),
)
_PER_STAGE = (
    ("link_inflight_batches", "Batches sent down the chain and not answered yet.",
     "inflight_batches"),
    ("link_inflight_batches_max", "The credit window: most unanswered batches.",
     "max_inflight_batches"),
    ("link_queued_batches", "Batches a later stage read and has not finished.",
     "queued_batches"),
)


def link_probe_families(link: Mapping[str, Any] | None) -> Iterator[Any]:
    """The link's round-trip and queue families; nothing for a whole-model stage.

    Its traffic and busy time come from :func:`skippyd.http.observability.prometheus.link_families`.
    """
    if not link:
        return
    views = [v for v in link.get("links") or () if isinstance(v, Mapping)]
    for name, doc, key, scale in _PER_LINK:
        family = GaugeMetricFamily("skippyd_" + name, doc, labels=["peer", "role"])
        for view in views:
            if view.get(key) is not None:
                family.add_metric([str(view.get("peer")), str(view.get("role"))],
                                  float(view[key]) * scale)
        yield family
    for name, doc, key in _PER_STAGE:
        if key in link:
            yield GaugeMetricFamily("skippyd_" + name, doc, value=float(link[key]))
    if link.get("reply_avg_ms") is not None:
        yield GaugeMetricFamily(
            "skippyd_link_reply_seconds", "Moving average from sending a batch down the "
            "chain to its predictions coming back (every stage's compute included).",
            value=float(link["reply_avg_ms"]) / 1000.0)
