"""When a signature that fired has resolved: its own condition false for its window, on finite data.

A detector that stops returning a verdict has not shown that its condition is over: it may have
too little finite data to judge (a NaN grad norm is not "below 1e-7"), or its reference may have
moved (a plateau judged against the step-0 loss stops being judged once step 0 leaves the
window; an exploded grad norm becomes its own baseline 50 steps later). Issue 21 had both as
RESOLVED notices: ``vanishing_gradients`` "resolved" on a run NaN from step 60 on, ``plateau``
"resolved" at step 206 while the loss stayed at ln 3 from step 103 to 299.

:func:`unresolved` is what the daemon asks before it announces a recovery: the keys of the run's
active alerts that have *not* been shown over. The policy (:mod:`sentineld.daemon.policy`) keeps
those active, with no recovery notice, until they are. The rules, per signature:

- every signature except ``nonfinite`` and ``stalled``: the last :data:`RESOLVE_STEPS` records
  (or the rule's own window when longer) are finite: a loss and, where recorded, a grad norm that
  are neither nan nor inf. ``nonfinite`` has its own re-arm rule (20 finite steps,
  :mod:`sentineld.contracts.nonfinite`); ``stalled`` is over when records arrive.
- the per-module rules judged on sampled steps (``update_ratio``, ``dead_relu``,
  ``saturated_activation``, ``missing_gradients``, ``gradients_not_applied``): also their own
  number of sampled steps (``patience`` / ``layer_patience``) after the alert's step, every one of
  them finite (a one-step update ratio of 8 "falls by itself" on the next sample as the weights
  blow up: that is not a recovery).
- ``plateau``: the loss left the flagged band: the median of the last ``chunk`` finite losses is
  below ``stuck_fraction`` x the reference or above ``max_fraction`` x it (a 10-step median of
  minibatch losses moves by more than ``min_improvement`` = 5% by noise alone: the band's edges,
  not that share, say the loss moved).
- ``divergence_spike``: every loss of the window is back under the bar the alert was raised at.
- ``divergence_growth``: the median of the last ``chunk`` losses is back under ``ratio`` x the
  lowest chunk median the alert saw.
- ``exploding_gradients`` (ratio rule): every grad norm of the window is back under ``ratio`` x
  the baseline median the alert was raised at.
- ``vanishing_gradients`` (global rule): every grad norm of the last ``patience`` steps is at
  least ``min_grad_norm``.
- ``initial_loss``: a fact about step 0; it does not resolve while the run lasts (it is closed
  when the run ends). Nor does ``replica_divergence``: nothing makes DDP replicas equal again.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from sentineld.contracts.records import StepRecord

from .base import as_float, finite, finite_losses, median, tail
from .signature_config import SignatureConfig

__all__ = ["RESOLVE_STEPS", "resolve_window", "shown_resolved", "unresolved"]

#: finite records a signature needs after its last verdict before it counts as resolved (our
#: choice: the detectors' own confirmation windows are 2-10 steps; 10 covers every one of them)
RESOLVE_STEPS = 10

# replica_divergence: replicas that differ stay different (nothing re-syncs DDP replicas)
_NEVER = frozenset({"initial_loss", "replica_divergence"})
_OWN_RULE = frozenset({"nonfinite", "stalled"})


def resolve_window(signature: str, config: SignatureConfig) -> int:
    """Finite records needed before ``signature`` can resolve (see the module docstring)."""
    own = {"vanishing_gradients": config.vanishing_gradients.patience,
           "plateau": config.plateau.chunk,
           "divergence_growth": config.divergence_growth.chunk,
           "oscillation": config.oscillation.chunk}.get(signature, 0)
    return max(RESOLVE_STEPS, own)


def _finite_record(r: Any) -> bool:
    if finite(getattr(r, "loss", None)) is None:
        return False
    if getattr(r, "optimizer_skipped", False) and getattr(r, "loss_scale", None) is not None:
        return True  # GradScaler skipped an overflowing step: routine under fp16, not NaN data
    g = getattr(r, "grad_norm", None)
    return g is None or finite(g) is not None


def _sampled_needed(signature: str, config: SignatureConfig) -> int:
    return {"update_ratio": config.update_ratio.patience,
            "dead_relu": config.dead_relu.patience,
            "saturated_activation": config.saturated_activation.patience,
            "missing_gradients": config.missing_gradients.layer_patience,
            "gradients_not_applied": config.gradients_not_applied.layer_patience}.get(signature, 0)


def _sampled_since(records: Sequence[StepRecord], step: int, need: int) -> bool:
    """``need`` sampled records (with layers, optimizer ran) after ``step``, all finite."""
    seen = 0
    for r in reversed(records):
        if getattr(r, "step", -1) <= step:
            break
        if getattr(r, "layers", None) and not getattr(r, "optimizer_skipped", False):
            if not _finite_record(r):
                return False
            seen += 1
    return seen >= need


def shown_resolved(signature: str, numbers: Mapping[str, Any], records: Sequence[StepRecord],
                   config: SignatureConfig | None = None, num_classes: int | None = None,
                   since_step: int | None = None) -> bool:
    """True when the records show ``signature``'s condition over (see the module docstring).

    Args:
        signature: the alert's signature id.
        numbers: the figures of the verdict the alert was raised with (``Verdict.numbers``).
        records: the rank's window, oldest first.
        config: the daemon's signature config; None uses the defaults.
        num_classes: classes of a classification loss, or None.
        since_step: the alert's step (the sampled-step rules count samples after it); None:
            the window's first step.

    Returns:
        The answer; False on too little finite data. Never raises.
    """
    cfg = config if config is not None else SignatureConfig()
    if signature in _OWN_RULE:
        return True
    if signature in _NEVER:
        return False
    try:
        recent = list(tail(records, resolve_window(signature, cfg)))
        if len(recent) < resolve_window(signature, cfg) or not all(map(_finite_record, recent)):
            return False
        need = _sampled_needed(signature, cfg)
        if need and not _sampled_since(records, since_step if since_step is not None else -1, need):
            return False
        check = _CHECKS.get(signature)
        return True if check is None else check(numbers, recent, cfg, num_classes)
    except Exception:  # noqa: BLE001 - odd input: not shown resolved
        return False


def _num(numbers: Mapping[str, Any], key: str) -> float | None:
    try:
        return finite(numbers.get(key))
    except AttributeError:
        return None


def _plateau(numbers: Mapping[str, Any], recent: Sequence[StepRecord], cfg: SignatureConfig,
             num_classes: int | None) -> bool:
    pc = cfg.plateau
    ref = _num(numbers, "reference")
    now = median([v for _, v in finite_losses(recent)][-pc.chunk:])
    if ref is None or math.isnan(now):
        return True  # an alert without its band (an old saved state): the detector decides
    return now < pc.stuck_fraction * ref or now > pc.max_fraction * ref


def _spike(numbers: Mapping[str, Any], recent: Sequence[StepRecord], cfg: SignatureConfig,
           num_classes: int | None) -> bool:
    bar = _num(numbers, "threshold")
    return bar is None or all(v <= bar for _, v in finite_losses(recent))


def _growth(numbers: Mapping[str, Any], recent: Sequence[StepRecord], cfg: SignatureConfig,
            num_classes: int | None) -> bool:
    lowest = _num(numbers, "loss_median_min")
    now = median([v for _, v in finite_losses(recent)][-cfg.divergence_growth.chunk:])
    return lowest is None or now < cfg.divergence_growth.ratio * lowest


def _exploding(numbers: Mapping[str, Any], recent: Sequence[StepRecord], cfg: SignatureConfig,
               num_classes: int | None) -> bool:
    base = _num(numbers, "baseline_median")
    if base is None:
        return True
    norms = [as_float(getattr(r, "grad_norm", None)) for r in recent
             if not getattr(r, "optimizer_skipped", False)]
    return all(g is not None and g < cfg.exploding_gradients.ratio * base for g in norms)


def _vanishing(numbers: Mapping[str, Any], recent: Sequence[StepRecord], cfg: SignatureConfig,
               num_classes: int | None) -> bool:
    if "grad_norm" not in numbers:  # the first/last-module rule: the detector decides
        return True
    vc = cfg.vanishing_gradients
    norms = [as_float(getattr(r, "grad_norm", None)) for r in recent[-vc.patience:]]
    return all(g is not None and g >= vc.min_grad_norm for g in norms)


_CHECKS = {"plateau": _plateau, "divergence_spike": _spike, "divergence_growth": _growth,
           "exploding_gradients": _exploding, "vanishing_gradients": _vanishing}


def unresolved(active: Mapping[str, Mapping[str, Any]],
               windows: Mapping[int, Sequence[StepRecord]], config: SignatureConfig | None = None,
               num_classes: int | None = None) -> set[str]:
    """Keys of a run's active alerts that the records do not show resolved on every rank.

    Args:
        active: the run's active set (``key -> saved alert dict`` with ``signature`` and
            ``numbers``), as :class:`sentineld.daemon.policy.Active` saves it.
        windows: each rank's window of records, oldest first.
        config: the daemon's signature config; None uses the defaults.
        num_classes: classes of a classification loss, or None.

    Returns:
        The keys to keep active even where their detector no longer fires. Never raises.
    """
    out: set[str] = set()
    for key, saved in active.items():
        try:
            sig = str(saved.get("signature"))
            numbers = saved.get("numbers") or {}
        except AttributeError:
            continue
        try:
            since = int(saved.get("step", -1))
        except (TypeError, ValueError):
            since = -1
        if not windows or any(not shown_resolved(sig, numbers, w, config, num_classes, since)
                              for w in windows.values()):
            out.add(key)
    return out
