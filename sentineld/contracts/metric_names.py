"""Every Prometheus metric name sentineld exports, in one place.

deploy/ (rules, dashboards) and tests check against this list, so a renamed metric breaks a test
instead of a dashboard. Names follow prometheus.io naming practice: ``sentineld_`` prefix, base
units, counters end in ``_total``. Agent series carry labels ``run`` and ``rank``; per-layer series
add ``module`` (bounded: one per parameterised module, sampled).
"""

from __future__ import annotations

__all__ = ["AGENT", "AGENT_LAYER", "DAEMON", "ALL"]

#: Per-step series exported by the agent (labels: run, rank).
AGENT = {
    "sentineld_step": "gauge: last optimizer step recorded",
    "sentineld_train_loss": "gauge: loss of the last recorded step (NaN when non-finite)",
    "sentineld_grad_norm": "gauge: global L2 grad norm of the last recorded step",
    "sentineld_learning_rate": "gauge: learning rate of parameter group 0",
    "sentineld_step_duration_seconds": "gauge: wall time of the last step",
    "sentineld_last_step_timestamp_seconds": "gauge: Unix time of the last recorded step",
    "sentineld_loss_scale": "gauge: GradScaler scale (absent without a scaler)",
    "sentineld_train_steps_total": "counter: optimizer steps recorded",
    "sentineld_nonfinite_steps_total": "counter: steps whose loss or grad norm was nan/inf",
    "sentineld_optimizer_skipped_steps_total": "counter: steps GradScaler skipped",
    "sentineld_captures_total": "counter: capture files written",
    "sentineld_agent_enabled": "gauge: 1 while the agent records, 0 once it disabled itself",
}

#: Sampled per-layer series exported by the agent (labels: run, rank, module).
AGENT_LAYER = {
    "sentineld_layer_grad_norm": "gauge: L2 norm of the module's parameter gradients",
    "sentineld_layer_update_ratio": "gauge: ||delta w|| / ||w|| over the last sampled step",
    "sentineld_layer_dead_ratio": "gauge: share of units never active over the sampled batch",
}

#: Series exported by the daemon (labels as noted).
DAEMON = {
    "sentineld_daemon_runs_watched": "gauge: run directories being watched",
    "sentineld_signature_active": "gauge{run,signature,severity}: 1 while a signature is firing",
    "sentineld_alerts_sent_total": "counter{signature}: notifications delivered",
    "sentineld_alert_delivery_failures_total": "counter: failed delivery attempts (retried)",
    "sentineld_alerts_pending": "gauge: notifications in the outbox not yet delivered",
    "sentineld_replays_total": "counter{result}: replays finished (localized|not_localized|failed|timeout)",
}

ALL = {**AGENT, **AGENT_LAYER, **DAEMON}
