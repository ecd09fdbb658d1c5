"""The daemon's Prometheus metrics (names: :mod:`sentineld.contracts.metric_names`).

:class:`DaemonMetrics` is the no-op form: every verb does nothing, so the daemon calls the same
verbs whether or not it exports (``metrics_port = 0``). :class:`PrometheusMetrics` records them
in a registry of its own, served by :meth:`~DaemonMetrics.serve`::

    metrics = daemon_metrics(port=9400)
    server, bound = metrics.serve(9400, "127.0.0.1")
    metrics.replay_finished("localized")
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

from sentineld.contracts import metric_names as M

if TYPE_CHECKING:
    from http.server import HTTPServer

    from prometheus_client import CollectorRegistry

__all__ = ["REPLAY_RESULTS", "DaemonMetrics", "PrometheusMetrics", "daemon_metrics"]

log = logging.getLogger("sentineld.daemon")

#: Every ``result`` label of the replays counter (exported at 0 from the start).
REPLAY_RESULTS = ("localized", "not_localized", "not_reproduced", "failed", "timeout", "refused",
                  "no_recipe")


class DaemonMetrics:
    """What the daemon reports about itself; this base class exports nothing."""

    def watching(self, run_ids: Iterable[str]) -> None:
        """The runs watched now (the runs gauge, and 1 per run for the rules to defer to)."""

    def signature_active(self, run_id: str, signature: str, severity: str, firing: bool) -> None:
        """Whether ``signature`` fires in ``run_id`` now."""

    def delivered(self, failed: int, by_signature: Mapping[str, int], pending: Callable[[], int]) -> None:
        """One delivery pass: ``failed`` attempts, notifications sent per signature, and the
        outbox's pending count (a callable: read only where it is exported)."""

    def replay_finished(self, result: str) -> None:
        """A replay ended with ``result`` (one of :data:`REPLAY_RESULTS`)."""

    def serve(self, port: int, addr: str) -> tuple[HTTPServer | None, int | None]:
        """Serve the metrics over HTTP: ``(server, bound port)``; ``(None, None)`` here."""
        return None, None


class PrometheusMetrics(DaemonMetrics):
    """The daemon's metrics in ``registry``.

    Args:
        registry: a ``prometheus_client.CollectorRegistry`` (a fresh one per daemon or test).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        from prometheus_client import Counter, Gauge  # noqa: PLC0415 - only a daemon that exports loads it

        self.registry = registry
        self.runs = Gauge(M.DAEMON_RUNS_WATCHED, "Run directories watched", registry=registry)
        self.active = Gauge(M.SIGNATURE_ACTIVE, "1 while a signature fires", ["run", "signature", "severity"],
                            registry=registry)
        self.sent = Counter(M.counter_base(M.ALERTS_SENT_TOTAL), "Notifications delivered", ["signature"],
                            registry=registry)
        self.failures = Counter(M.counter_base(M.DELIVERY_FAILURES_TOTAL), "Failed delivery attempts",
                                registry=registry)
        self.pending = Gauge(M.ALERTS_PENDING, "Notifications not yet delivered", registry=registry)
        self.replays = Counter(M.counter_base(M.REPLAYS_TOTAL), "Replays finished", ["result"], registry=registry)
        # The rules' non-finite alerts are a fallback for runs no daemon watches (deploy/prometheus).
        self.watched = Gauge(M.RUN_WATCHED, "1 for each run this daemon watches (rules defer to it)", ["run"],
                             registry=registry)
        for result in REPLAY_RESULTS:
            self.replays.labels(result)  # export 0 from the start so increase() sees the first one

    def watching(self, run_ids: Iterable[str]) -> None:
        ids = list(run_ids)
        self.runs.set(len(ids))
        for run_id in ids:
            self.watched.labels(run_id).set(1)

    def signature_active(self, run_id: str, signature: str, severity: str, firing: bool) -> None:
        self.active.labels(run_id, signature, severity).set(1 if firing else 0)

    def delivered(self, failed: int, by_signature: Mapping[str, int], pending: Callable[[], int]) -> None:
        if failed:
            self.failures.inc(failed)
        for sig, count in by_signature.items():
            self.sent.labels(sig).inc(count)
        self.pending.set(pending())

    def replay_finished(self, result: str) -> None:
        self.replays.labels(result).inc()


    def serve(self, port: int, addr: str) -> tuple[HTTPServer | None, int | None]:
        """Serve on ``addr:port`` (-1: any free port). A port that cannot be bound logs one
        warning and serves nothing (the daemon still runs): ``(None, None)``."""
        from prometheus_client import start_http_server  # noqa: PLC0415

        bind = 0 if port == -1 else port
        try:
            server, _ = start_http_server(bind, addr=addr, registry=self.registry)
        except OSError as exc:
            log.warning("daemon metrics off: cannot bind %s:%d (%s)", addr, bind, exc)
            return None, None
        return server, int(server.server_port)


def daemon_metrics(port: int) -> DaemonMetrics:
    """The daemon's metrics for config ``metrics_port``: the no-op form when it is 0 (off), else
    Prometheus metrics in a fresh registry."""
    if port == 0:
        return DaemonMetrics()
    from prometheus_client import CollectorRegistry  # noqa: PLC0415

    return PrometheusMetrics(CollectorRegistry())
