"""A worker's Prometheus exporter: its engine's KV pages, prefix-cache and integrity counters and its queue
depth, read at scrape time (nothing is kept twice), served over HTTP by prometheus-client.

Labels: the deployment and the pool (Prometheus' ``instance`` tells the workers of a pool apart).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from threading import Thread
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)


@dataclass(eq=False)  # hashed by identity: the registry keys collectors by themselves
class EngineCollector(Collector):
    """The meters of one worker: ``stats`` is ``Engine.stats``, ``queue_depth`` the tasks waiting for it."""

    deployment: str
    pool: str
    stats: Callable[[], dict]
    queue_depth: Callable[[], int]

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        labels = ["deployment", "pool"]
        values = [self.deployment, self.pool]
        for name, doc, value in (
            (
                "tessera_kv_pages_used",
                "KV pages held by requests or the prefix cache",
                stats["kv_pages_used"],
            ),
            ("tessera_kv_pages_total", "KV pages in the worker's pool", stats["kv_pages_total"]),
            ("tessera_running_requests", "Requests the engine is running", stats["running"]),
            (
                "tessera_waiting_requests",
                "Requests admitted to the engine, waiting for pages",
                stats["waiting"],
            ),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            gauge.add_metric(values, value)
            yield gauge
        try:
            depth = self.queue_depth()
        except Exception as exc:  # Redis away: the scrape still reports the engine
            log.warning("metrics: could not read the queue depth: %s", exc)
        else:
            gauge = GaugeMetricFamily(
                "tessera_queue_depth", "Tasks waiting in the worker's queues", labels=labels
            )
            gauge.add_metric(values, depth)
            yield gauge
        for name, doc, key in (
            (
                "tessera_prefix_cache_query_tokens",
                "Prompt tokens looked up in the prefix cache",
                "prefix_cache_query_tokens",
            ),
            (
                "tessera_prefix_cache_hit_tokens",
                "Prompt tokens served from the prefix cache",
                "prefix_cache_hit_tokens",
            ),
        ):
            counter = CounterMetricFamily(name, doc, labels=labels)
            counter.add_metric(values, stats[key])
            yield counter
        mismatches = CounterMetricFamily(
            "tessera_kv_integrity_mismatches",
            "KV page integrity-tag mismatches (each aborted its request)",
            labels=["deployment"],
        )
        mismatches.add_metric([self.deployment], stats["integrity_mismatches"])
        yield mismatches


class Exporter:
    """``GET /metrics`` (any path, as prometheus-client serves it) for one worker on ``port``; 0 = off."""

    def __init__(self, collector: EngineCollector, port: int, addr: str = "0.0.0.0"):
        self.collector = collector
        self.port = port
        self.addr = addr
        self._server: WSGIServer | None = None
        self._thread: Thread | None = None

    def start(self) -> None:
        if not self.port:
            return
        registry = CollectorRegistry()
        registry.register(self.collector)
        self._server, self._thread = start_http_server(self.port, self.addr, registry=registry)
        log.info("metrics on http://%s:%d/metrics", self.addr, self.port)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
