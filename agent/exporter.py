"""Prometheus export of the agent's latest step, read at scrape time.

A custom collector reads a few attributes the training thread sets per step, so a step costs
attribute stores, not prometheus-client calls (prometheus client_python "custom collectors").
"""

from __future__ import annotations

import logging
import math
import socket
from dataclasses import dataclass, field, fields, replace
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from sentineld.contracts import metric_names as M
from sentineld.contracts.records import LayerStats, StepRecord

__all__ = ["Latest", "merge_layers", "start_exporter"]

log = logging.getLogger("sentineld.agent")


@dataclass
class Latest:
    """What the exporter shows; mutated by the training thread, read by the scrape thread."""

    record: StepRecord | None = None
    steps_total: int = 0
    nonfinite_total: int = 0
    skipped_total: int = 0
    captures_total: int = 0
    enabled: bool = True
    layers: dict[str, Any] = field(default_factory=dict)
    #: Upper bound of the ring's host memory, bytes (agent/memory.py), set once at attach.
    ring_bound_bytes: int | None = None


def merge_layers(shown: dict[str, Any], sample: dict[str, Any]) -> dict[str, Any]:
    """The per-module figures the exporter shows after ``sample`` (a pure function).

    A gauge shows the last value measured. An activations-only sample (the dense head's steps
    between full samples, agent/probes.py) measures no norms: its modules keep the norms and
    update ratio of the last full sample instead of losing those series until the next one (a
    scrape that fell after such a step showed no per-layer gradient norms at all).

    Args:
        shown: module name -> LayerStats now shown (not modified).
        sample: module name -> LayerStats of the newest sampled step.

    Returns:
        A new dict: every module of either, each field the sample's where it measured one.
    """
    out = dict(shown)
    for name, new in sample.items():
        old = out.get(name)
        if not isinstance(old, LayerStats) or not isinstance(new, LayerStats):
            out[name] = new
            continue
        kept = {f.name: getattr(old, f.name) for f in fields(new) if getattr(new, f.name) is None}
        inst: Any = new  # (is_dataclass narrows to instance | class; replace takes an instance)
        out[name] = replace(inst, **kept) if kept else new
    return out


#: Labels of every agent series. ``host`` is the training host's name, as in the daemon's alerts
#: (the scrape address may be 127.0.0.1 or an IP; prometheus.yml honours this label).
_LABELS = ["run", "rank", "host"]


class _Collector:
    def __init__(self, latest: Latest, run: str, rank: int) -> None:
        self.latest = latest
        self.labels = [run, str(rank), socket.gethostname()]

    def describe(self) -> list[Metric]:
        return []  # unchecked collector: names are known only at scrape time

    def collect(self) -> Iterator[Metric]:
        lt, lab = self.latest, self.labels
        r = lt.record

        def gauge(name: str, doc: str, value: float | None) -> Iterator[Metric]:
            if value is None:
                return
            g = GaugeMetricFamily(name, doc, labels=_LABELS)
            g.add_metric(lab, float(value))
            yield g

        def counter(name: str, doc: str, value: int) -> Metric:
            c = CounterMetricFamily(name.removesuffix("_total"), doc, labels=_LABELS)
            c.add_metric(lab, value)
            return c

        yield from gauge(M.AGENT_ENABLED, "1 while the agent records", 1 if lt.enabled else 0)
        yield counter(M.TRAIN_STEPS_TOTAL, "Optimizer steps recorded", lt.steps_total)
        yield counter(M.NONFINITE_STEPS_TOTAL, "Steps with nan/inf loss or grad norm",
                      lt.nonfinite_total)
        yield counter(M.OPTIMIZER_SKIPPED_TOTAL, "Steps GradScaler skipped",
                      lt.skipped_total)
        yield counter(M.CAPTURES_TOTAL, "Capture files written", lt.captures_total)
        yield from gauge(M.RING_MEMORY_BOUND, "Upper bound of the ring's host memory",
                         lt.ring_bound_bytes)
        if r is not None:
            yield from gauge(M.STEP, "Last optimizer step recorded", r.step)
            yield from gauge(M.TRAIN_LOSS, "Loss of the last step", r.loss)
            yield from gauge(M.GRAD_NORM, "Global L2 gradient norm", r.grad_norm)
            yield from gauge(M.LEARNING_RATE, "Learning rate of group 0", r.lr)
            yield from gauge(M.STEP_DURATION, "Wall time of the last step", r.step_s)
            yield from gauge(M.LAST_STEP_TIMESTAMP, "Unix time of the last step",
                             r.time_s)
            yield from gauge(M.LOSS_SCALE, "GradScaler scale", r.loss_scale)
        for metric, attr, doc in (
            (M.LAYER_GRAD_NORM, "grad_norm", "Per-module gradient L2 norm (sampled)"),
            (M.LAYER_UPDATE_RATIO, "update_ratio", "Per-module ||dw||/||w|| (sampled)"),
            (M.LAYER_DEAD_RATIO, "dead_fraction", "Per-module dead unit share (sampled)"),
        ):
            g = GaugeMetricFamily(metric, doc, labels=[*_LABELS, "module"])
            for name, stats in lt.layers.items():
                v = getattr(stats, attr, None)
                if v is not None and not (isinstance(v, float) and math.isnan(v) and attr != "grad_norm"):
                    g.add_metric(lab + [name], float(v))
            if g.samples:
                yield g


def start_exporter(latest: Latest, run: str, rank: int, port: int, addr: str,
                   port_range: int = 1) -> tuple[Any, int]:
    """Serve ``latest`` on ``http://addr:port/metrics``; return ``(server, bound_port)``.

    ``port=-1`` binds any free port. A port in use moves to the next of ``port .. port +
    port_range - 1`` (a fixed scrape config lists that range), and only past it to a free one,
    with one warning (two runs on one host must not kill each other's metrics); the port bound
    is in run.json (``extra.metrics_port``) and ``sentineld runs``.

    Raises:
        OSError: nothing could be bound at all.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(latest, run, rank))  # type: ignore[arg-type]
    want = 0 if port == -1 else port
    tries = [want] if want == 0 else [p for p in range(want, want + max(1, port_range)) if p <= 65535] + [0]
    err: OSError | None = None
    for p in tries:
        try:
            server, _ = start_http_server(p, addr=addr, registry=registry)
        except OSError as exc:
            err = err or exc
            continue
        if p != want:
            where = "outside its range, a fixed scrape config misses it" if p == 0 else "the next in its range"
            log.warning("sentineld: metrics port %d is busy (%s); serving on %d instead (%s; set "
                        "metrics_port_range to widen the range)", want, err, server.server_port, where)
        return server, int(server.server_port)
    assert err is not None
    raise err
