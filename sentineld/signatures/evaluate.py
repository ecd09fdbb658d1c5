"""Run every detector over one window of step records.

The daemon calls :func:`evaluate` after each read of a rank's stream with a bounded window (e.g.
the last 200 records) and ``new``, the records read since it last evaluated that rank; the agent
may call it too. The detectors that judge single records (``loss_spike``, ``divergence_spike``)
judge every new one, so nothing between two reads goes untested. Each detector looks only at the
tail it needs, so a call costs well under a millisecond per run (bench/signature_latency.py prints
the figure).
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

from sentineld.contracts.records import StepRecord

from .activations import detect_dead_relu, detect_saturated_activation
from .base import Verdict
from .divergence import detect_divergence_growth, detect_divergence_spike
from .gradients import (
    detect_exploding_gradients,
    detect_missing_gradients,
    detect_vanishing_gradients,
)
from .liveness import detect_stalled
from .loss import (
    detect_initial_loss,
    detect_oscillation,
    detect_plateau,
)
from .numerics import detect_loss_scale_collapse, detect_nonfinite
from .replicas import detect_replica_divergence
from .signature_config import SignatureConfig
from .spike import detect_loss_spike
from .updates import detect_gradients_not_applied, detect_update_ratio
from .zero_grad import detect_forgotten_zero_grad

__all__ = ["evaluate"]


def evaluate(records: Sequence[StepRecord] | Iterable[StepRecord],
             config: SignatureConfig | None = None, *, now_s: float | None = None,
             num_classes: int | None = None, new: int = 0) -> list[Verdict]:
    """Run every enabled detector over a window of step records.

    Args:
        records: the run's most recent step records, oldest first (a list, tuple or deque; any
            iterable is copied). Records may lack per-layer stats except on sampled steps.
        config: thresholds; None uses the defaults.
        now_s: the caller's Unix time in seconds, for ``stalled``; None skips that detector.
        num_classes: classes of a classification loss (the ln C rule of ``initial_loss`` and the
            reference level of ``plateau``/``oscillation``); None when unknown or not a
            classifier.
        new: records at the end of ``records`` not evaluated before (0: only the newest, as
            each detector's own tail); ``loss_spike`` and ``divergence_spike`` judge each of
            them against the records before it.

    Returns:
        Verdicts of every firing detector, critical first, in detector order. Never raises: a
        detector that fails on malformed input contributes nothing.
    """
    cfg = config if config is not None else SignatureConfig()
    if not isinstance(records, (list, tuple)):
        try:
            records = list(records)
        except Exception:  # noqa: BLE001
            return []
    checks: tuple[Callable[[], list[Verdict]], ...] = (
        lambda: detect_nonfinite(records, cfg.nonfinite),
        lambda: detect_replica_divergence(records, cfg.replica_divergence),
        lambda: detect_loss_scale_collapse(records, cfg.loss_scale_collapse),
        lambda: detect_divergence_spike(records, cfg.divergence_spike, num_classes, new),
        lambda: detect_divergence_growth(records, cfg.divergence_growth, num_classes),
        lambda: detect_loss_spike(records, cfg.loss_spike, new),
        lambda: detect_exploding_gradients(records, cfg.exploding_gradients, num_classes),
        lambda: detect_gradients_not_applied(records, cfg.gradients_not_applied,
                                                     num_classes),
        lambda: detect_missing_gradients(records, cfg.missing_gradients),
        lambda: detect_forgotten_zero_grad(records, cfg.forgotten_zero_grad),
        lambda: detect_stalled(records, cfg.stalled, now_s),
        lambda: detect_vanishing_gradients(records, cfg.vanishing_gradients, num_classes),
        lambda: detect_dead_relu(records, cfg.dead_relu),
        lambda: detect_saturated_activation(records, cfg.saturated_activation),
        lambda: detect_update_ratio(records, cfg.update_ratio, num_classes),
        lambda: detect_plateau(records, cfg.plateau, num_classes),
        lambda: detect_oscillation(records, cfg.oscillation, num_classes),
        lambda: detect_initial_loss(records, cfg.initial_loss, num_classes),
    )
    out: list[Verdict] = []
    for check in checks:
        try:
            out.extend(check())
        except Exception:  # noqa: BLE001 - detectors are total; this is defence in depth
            continue
    out.sort(key=lambda v: v.severity != "critical")
    return out
