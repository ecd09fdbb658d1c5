"""Every Prometheus metric name sentineld exports, in one place.

deploy/ (rules, dashboards) and tests check against this list, so a renamed metric breaks a test
instead of a dashboard. Names follow prometheus.io naming practice: ``sentineld_`` prefix, base
units, counters end in ``_total``. Agent series carry labels ``run``, ``rank`` and ``host``; per-layer series
add ``module`` (bounded: one per parameterised module, sampled).
"""

from __future__ import annotations

__all__ = ["AGENT", "AGENT_LAYER", "DAEMON", "ALL", "counter_base"]

# Names as the exporters spell them (agent/exporter.py, sentineld/daemon/metrics.py).
STEP = "sentineld_step"
TRAIN_LOSS = "sentineld_train_loss"
GRAD_NORM = "sentineld_grad_norm"
LEARNING_RATE = "sentineld_learning_rate"
STEP_DURATION = "sentineld_step_duration_seconds"
LAST_STEP_TIMESTAMP = "sentineld_last_step_timestamp_seconds"
LOSS_SCALE = "sentineld_loss_scale"
TRAIN_STEPS_TOTAL = "sentineld_train_steps_total"
NONFINITE_STEPS_TOTAL = "sentineld_nonfinite_steps_total"
OPTIMIZER_SKIPPED_TOTAL = "sentineld_optimizer_skipped_steps_total"
CAPTURES_TOTAL = "sentineld_captures_total"
AGENT_ENABLED = "sentineld_agent_enabled"
RING_MEMORY_BOUND = "sentineld_agent_ring_memory_bound_bytes"
LAYER_GRAD_NORM = "sentineld_layer_grad_norm"
LAYER_UPDATE_RATIO = "sentineld_layer_update_ratio"
LAYER_DEAD_RATIO = "sentineld_layer_dead_ratio"
DAEMON_RUNS_WATCHED = "sentineld_daemon_runs_watched"
SIGNATURE_ACTIVE = "sentineld_signature_active"
ALERTS_SENT_TOTAL = "sentineld_alerts_sent_total"
DELIVERY_FAILURES_TOTAL = "sentineld_alert_delivery_failures_total"
ALERTS_PENDING = "sentineld_alerts_pending"
REPLAYS_TOTAL = "sentineld_replays_total"
RUN_WATCHED = "sentineld_run_watched"


def counter_base(name: str) -> str:
    """A counter's name without ``_total``, as prometheus_client's ``Counter`` takes it."""
    return name.removesuffix("_total")


#: Per-step series exported by the agent (labels: run, rank, host = the training host's name).
AGENT = {
    STEP: "gauge: last optimizer step recorded",
    TRAIN_LOSS: "gauge: loss of the last recorded step (NaN when non-finite)",
    GRAD_NORM: "gauge: global L2 grad norm of the last recorded step",
    LEARNING_RATE: "gauge: learning rate of parameter group 0",
    STEP_DURATION: "gauge: wall time of the last step",
    LAST_STEP_TIMESTAMP: "gauge: Unix time of the last recorded step",
    LOSS_SCALE: "gauge: GradScaler scale (absent without a scaler)",
    TRAIN_STEPS_TOTAL: "counter: optimizer steps recorded",
    NONFINITE_STEPS_TOTAL: "counter: steps whose loss or grad norm was nan/inf",
    OPTIMIZER_SKIPPED_TOTAL: "counter: steps GradScaler skipped",
    CAPTURES_TOTAL: "counter: capture files written",
    AGENT_ENABLED: "gauge: 1 while the agent records, 0 once it disabled itself",
    RING_MEMORY_BOUND: "gauge: upper bound of the ring's host memory (batches <= ring_bytes, "
    "forward args <= ring_bytes, 2 snapshots), bytes, stated at attach (agent/memory.py)",
}

#: Sampled per-layer series exported by the agent (labels: run, rank, host, module).
AGENT_LAYER = {
    LAYER_GRAD_NORM: "gauge: L2 norm of the module's parameter gradients",
    LAYER_UPDATE_RATIO: "gauge: ||delta w|| / ||w|| over the last sampled step",
    LAYER_DEAD_RATIO: "gauge: share of units never active over the sampled batch",
}

#: Series exported by the daemon (labels as noted).
DAEMON = {
    DAEMON_RUNS_WATCHED: "gauge: run directories being watched",
    SIGNATURE_ACTIVE: "gauge{run,signature,severity}: 1 while a signature is firing",
    ALERTS_SENT_TOTAL: "counter{signature}: notifications delivered",
    DELIVERY_FAILURES_TOTAL: "counter: failed delivery attempts (retried)",
    ALERTS_PENDING: "gauge: notifications in the outbox not yet delivered",
    REPLAYS_TOTAL: "counter{result}: replays finished "
    "(localized|not_localized|not_reproduced|failed|timeout|refused|no_recipe)",
    RUN_WATCHED: "gauge{run}: 1 for each run the daemon watches (the non-finite rules defer to it)",
}

ALL = {**AGENT, **AGENT_LAYER, **DAEMON}
