"""The daemon's Prometheus endpoint (names: :mod:`sentineld.contracts.metric_names`)."""

from __future__ import annotations

import logging
from typing import Any

from sentineld.contracts import metric_names as M

__all__ = ["REPLAY_RESULTS", "start_metrics"]

log = logging.getLogger("sentineld.daemon")

#: Every ``result`` label of the replays counter (exported at 0 from the start).
REPLAY_RESULTS = ("localized", "not_localized", "not_reproduced", "failed", "timeout", "refused")


def start_metrics(port: int, addr: str) -> tuple[Any, dict[str, Any], int | None]:
    """Serve the daemon's metrics on ``addr:port`` (0 = off, -1 = any free port).

    Returns:
        ``(server or None, {short name: metric}, bound port or None)``; a port that cannot be
        bound logs one warning and turns the metrics off (the daemon still runs).
    """
    if port == 0:
        return None, {}, None
    from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server  # noqa: PLC0415

    reg = CollectorRegistry()
    m: dict[str, Any] = {
        "runs": Gauge(M.DAEMON_RUNS_WATCHED, "Run directories watched", registry=reg),
        "active": Gauge(M.SIGNATURE_ACTIVE, "1 while a signature fires",
                        ["run", "signature", "severity"], registry=reg),
        "sent": Counter(M.counter_base(M.ALERTS_SENT_TOTAL), "Notifications delivered", ["signature"],
                        registry=reg),
        "failures": Counter(M.counter_base(M.DELIVERY_FAILURES_TOTAL), "Failed delivery attempts",
                            registry=reg),
        "pending": Gauge(M.ALERTS_PENDING, "Notifications not yet delivered", registry=reg),
        "replays": Counter(M.counter_base(M.REPLAYS_TOTAL), "Replays finished", ["result"], registry=reg),
    }
    for result in REPLAY_RESULTS:
        m["replays"].labels(result)  # export 0 from the start so increase() sees the first one
    bind = 0 if port == -1 else port
    try:
        server, _ = start_http_server(bind, addr=addr, registry=reg)
    except OSError as exc:
        log.warning("daemon metrics off: cannot bind %s:%d (%s)", addr, bind, exc)
        return None, {}, None
    return server, m, int(server.server_port)
