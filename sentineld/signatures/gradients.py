"""Gradients: exploding, vanishing, missing (carried over from a forgotten ``zero_grad()``: :mod:`.zero_grad`).

The method's second layer of evidence ("prove the gradients are fine"): plot the global grad norm
and watch for spikes (explosion) or a slide to zero (vanishing); check that every parameter that
should learn has a gradient; and remember that a forgotten ``optimizer.zero_grad()`` makes the
gradients pile up step after step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from sentineld.contracts.records import LayerStats, StepRecord

from .base import Verdict, finite, layer_value, make_verdict, median, sampled_layers, step_of, tail
from .floors import loss_at_floor

__all__ = ["ExplodingConfig", "VanishingConfig", "MissingGradientsConfig",
           "detect_exploding_gradients", "detect_vanishing_gradients",
           "detect_missing_gradients", "applied_norms"]

EXPLODING_FIX = (
    "Gradient explosion: clip gradients (torch.nn.utils.clip_grad_norm_(model.parameters(), "
    "max_norm=1.0)) - a safety net, not a cure; lower the learning rate; check initialisation "
    "(weights with exploding magnitudes precede gradient explosion) and normalisation layers.")
VANISHING_FIX = (
    "Gradients vanish before reaching the first layers: use ReLU-family activations instead of "
    "saturating sigmoid/tanh, He/Kaiming initialisation, normalisation layers (BatchNorm/"
    "LayerNorm) or residual connections.")
MISSING_FIX = (
    "Parameters that should learn get no gradient: is the module used in forward? is the graph cut "
    "(.detach(), .item(), .data, torch.no_grad(), numpy round-trip) between it and the loss? is "
    "loss.backward() called on the loss that uses it? Print name, 'grad_ok' if p.grad is not None "
    "and p.grad.abs().max() > 0 for model.named_parameters().")


@dataclass(frozen=True)
class ExplodingConfig:
    """``exploding_gradients``: the global grad norm jumped far above its recent level.

    Fires when each of the last ``confirm_steps`` finite grad norms (of steps the optimizer ran) is
    at least ``ratio`` times the median of the ``baseline_steps`` before them and at least
    ``min_grad_norm``, while the loss is not at its floor (:mod:`.floors`); or when they all exceed
    ``max_grad_norm`` when set (an absolute ceiling holds whatever the loss). Non-finite norms are
    ``nonfinite``'s to report. The norm is the pre-clip one (the agent records it before
    ``clip_grad_norm_`` when told ``clip_grad_norm=``), so clipping does not hide an explosion.

    Attributes:
        enabled: run this detector.
        baseline_steps: steps of history. Default 50.
        min_baseline_steps: fewer baseline norms: no verdict. Default 20.
        confirm_steps: consecutive high norms needed. Default 4 (our measurement: the noisy SGD
            run in tests/signatures has 3 steps in a row at 6.1x its median, never 4 above 2.9x).
        ratio: multiple of the baseline median. Default 10.0 (the faults in tests/signatures
            reach 20x-470x; AUTOTRAINER flags a 70x first/last-layer ratio, see
            ``first_last_ratio``).
        min_grad_norm: absolute floor of the ratio rule. Default 1e-3 (issue 21: a converged run's
            norm of 6.5e-5 was 215x its median of 3e-7; the faults in tests/signatures explode to
            10-1000 from a baseline of 0.1-1, and no gradient under 1e-3 moves weights by more
            than lr x 1e-3 under SGD).
        max_grad_norm: absolute ceiling, or None (default: norms depend on model and loss scale).
        first_last_ratio: also fire when, on ``layer_patience`` sampled steps, the first
            module's grad norm is this multiple of the last one's (AUTOTRAINER beta_3 = 70).
            Default None (off: a structural rule; healthy runs in tests/signatures span 0.08x-6.4x,
            so 70 is safe there, but it is untested on deep CNNs).
        layer_patience: sampled steps for ``first_last_ratio``. Default 2.
    """

    enabled: bool = True
    baseline_steps: int = 50
    min_baseline_steps: int = 20
    confirm_steps: int = 4
    ratio: float = 10.0
    min_grad_norm: float = 1e-3
    max_grad_norm: float | None = None
    first_last_ratio: float | None = None
    layer_patience: int = 2

    def __post_init__(self) -> None:
        for f in ("baseline_steps", "min_baseline_steps", "confirm_steps", "layer_patience"):
            if getattr(self, f) < 1:
                raise ValueError(f"exploding_gradients.{f} must be >= 1")
        if not self.ratio > 1:
            raise ValueError("exploding_gradients.ratio must be > 1")
        if not self.min_grad_norm >= 0:
            raise ValueError("exploding_gradients.min_grad_norm must be >= 0")


@dataclass(frozen=True)
class VanishingConfig:
    """``vanishing_gradients``: gradients too small to move the weights.

    Fires when (a) the global grad norm stayed below ``min_grad_norm`` for ``patience`` steps in a
    row, or (b) on ``layer_patience`` consecutive sampled steps the first module's grad norm is
    below ``first_max`` and below ``first_last_ratio`` times the last module's (AUTOTRAINER's
    vanishing-gradient rule, modules in ``named_modules()`` order); in both cases only while the
    loss is not at its floor (:mod:`.floors`): a tiny gradient at a loss near 0 is convergence
    (issue 21: a run that fit its data, loss 1e-8, was told to change its activations).

    Attributes:
        enabled: run this detector.
        min_grad_norm: global L2 norm floor. Default 1e-7 (SageMaker Debugger
            ``VanishingGradient`` threshold, there on the mean |g|; an L2 norm below it implies
            every |g| below it).
        patience: consecutive steps below ``min_grad_norm``. Default 10.
        first_last_ratio: AUTOTRAINER beta_1 = 1e-3.
        first_max: AUTOTRAINER beta_2 = 1e-4.
        layer_patience: consecutive sampled steps for (b). Default 2.
    """

    enabled: bool = True
    min_grad_norm: float = 1e-7
    patience: int = 10
    first_last_ratio: float = 1e-3
    first_max: float = 1e-4
    layer_patience: int = 2

    def __post_init__(self) -> None:
        if self.patience < 1 or self.layer_patience < 1:
            raise ValueError("vanishing_gradients.patience and layer_patience must be >= 1")
        if not (self.min_grad_norm > 0 and self.first_last_ratio > 0 and self.first_max > 0):
            raise ValueError("vanishing_gradients thresholds must be > 0")


@dataclass(frozen=True)
class MissingGradientsConfig:
    """``missing_gradients``: no gradient at all, or a trainable module without one.

    Fires when (a) the last ``patience`` records have no global grad norm (no parameter got a
    gradient: backward not called, or the loss is detached), or (b) on ``layer_patience``
    consecutive sampled steps a module with trainable parameters has no gradient (None or exactly
    0) while other modules have one (AUTOTRAINER counts all-zero gradients as a symptom too).

    Attributes:
        enabled: run this detector.
        patience: records for (a). Default 3.
        layer_patience: sampled records for (b). Default 2.
    """

    enabled: bool = True
    patience: int = 3
    layer_patience: int = 2

    def __post_init__(self) -> None:
        if self.patience < 1 or self.layer_patience < 1:
            raise ValueError("missing_gradients.patience and layer_patience must be >= 1")




def applied_norms(records: Sequence[StepRecord]) -> list[tuple[int, float]]:
    """(step, grad norm) of the steps the optimizer applied, finite norms only, oldest first."""
    isfinite = math.isfinite
    fast: list[tuple[int, float]] = []
    for r in records:  # fast path for well-formed records; anything odd takes the careful path
        g, step = getattr(r, "grad_norm", None), getattr(r, "step", None)
        if (g is not None and type(g) is not float) or type(step) is not int:
            break
        if g is not None and isfinite(g) and not getattr(r, "optimizer_skipped", False):
            fast.append((step, g))
    else:
        return fast
    out = []
    for r in records:
        if getattr(r, "optimizer_skipped", False):
            continue
        g = finite(getattr(r, "grad_norm", None))
        if g is not None:
            out.append((step_of(r), g))
    return out


def _param_modules(layers: Mapping[str, LayerStats]) -> list[tuple[str, LayerStats]]:
    """Modules with trainable parameters (param_norm reported), in mapping order."""
    out: list[tuple[str, LayerStats]] = []
    try:
        items = list(layers.items())
    except Exception:  # noqa: BLE001
        return out
    for name, st in items:
        if layer_value(st, "param_norm") is not None:
            out.append((str(name), st))
    return out


def _first_last(layers: Mapping[str, LayerStats]) -> tuple[str, float, str, float] | None:
    pairs = [(n, layer_value(st, "grad_norm")) for n, st in _param_modules(layers)]
    mods = [(n, g) for n, g in pairs if g is not None]
    if len(mods) < 2:
        return None
    (fn, fg), (ln, lg) = mods[0], mods[-1]
    return fn, fg, ln, lg


def detect_exploding_gradients(records: Sequence[StepRecord], config: ExplodingConfig,
                               num_classes: int | None = None) -> list[Verdict]:
    """Report a global grad norm far above its recent level (or above ``max_grad_norm``).

    Args:
        records: step records, oldest first.
        config: thresholds.
        num_classes: classes of a classification loss (the floor of :mod:`.floors`), or None.

    Returns:
        One critical verdict, or nothing.
    """
    if not config.enabled:
        return []
    pts = applied_norms(tail(records, config.confirm_steps + config.baseline_steps))
    if len(pts) >= config.confirm_steps:
        recent = pts[-config.confirm_steps:]
        low = min(g for _, g in recent)
        if config.max_grad_norm is not None and low > config.max_grad_norm:
            msg = (f"grad norm above {config.max_grad_norm:g} for {config.confirm_steps} steps "
                   f"from step {recent[0][0]} (now {recent[-1][1]:.4g})")
            return [make_verdict("exploding_gradients", recent[0][0], msg,
                                 {"grad_norm": recent[-1][1], "max_grad_norm": config.max_grad_norm},
                                 EXPLODING_FIX)]
        base = [g for _, g in pts[:-config.confirm_steps]]
        if len(base) >= config.min_baseline_steps and low >= config.min_grad_norm:
            m = median(base)
            if m > 0 and low >= config.ratio * m and not loss_at_floor(records, num_classes):
                msg = (f"grad norm {low:.4g}+ for {config.confirm_steps} steps from step "
                       f"{recent[0][0]}, {low / m:.0f}x the median {m:.4g} of the steps before")
                return [make_verdict("exploding_gradients", recent[0][0], msg,
                                     {"grad_norm": recent[-1][1], "baseline_median": m,
                                      "ratio": low / m}, EXPLODING_FIX)]
    if config.first_last_ratio is not None:
        samples = sampled_layers(records, config.layer_patience)
        if len(samples) == config.layer_patience:
            hits = [_first_last(layers) for _, layers in samples]
            if all(h is not None and h[3] > 0 and h[1] / h[3] > config.first_last_ratio
                   for h in hits):
                fn, fg, ln, lg = hits[-1]  # type: ignore[misc]
                step = step_of(samples[-1][0])
                msg = (f"first module {fn} grad norm {fg:.3g} is {fg / lg:.0f}x the last module "
                       f"{ln}'s ({lg:.3g}) at step {step}")
                return [make_verdict("exploding_gradients", step, msg,
                                     {"first_grad_norm": fg, "last_grad_norm": lg},
                                     EXPLODING_FIX, module=fn)]
    return []


def detect_vanishing_gradients(records: Sequence[StepRecord], config: VanishingConfig,
                               num_classes: int | None = None) -> list[Verdict]:
    """Report gradients too small to train (global floor, or AUTOTRAINER's first/last rule),
    unless the loss is at its floor (converged).

    Args:
        records: step records, oldest first.
        config: thresholds.
        num_classes: classes of a classification loss (the floor of :mod:`.floors`), or None.

    Returns:
        One warning verdict, or nothing.
    """
    if not config.enabled:
        return []
    out = _vanishing(records, config)
    return [] if out and loss_at_floor(records, num_classes) else out


def _vanishing(records: Sequence[StepRecord], config: VanishingConfig) -> list[Verdict]:
    recent = [r for r in tail(records, config.patience)
              if not getattr(r, "optimizer_skipped", False)]
    if len(recent) == config.patience:
        norms = [finite(getattr(r, "grad_norm", None)) for r in recent]
        if all(g is not None and g < config.min_grad_norm for g in norms):
            step = step_of(recent[0])
            msg = (f"global grad norm below {config.min_grad_norm:g} for {config.patience} steps "
                   f"from step {step} (now {norms[-1]:.3g})")
            return [make_verdict("vanishing_gradients", step, msg, {"grad_norm": norms[-1]},
                                 VANISHING_FIX)]
    samples = sampled_layers(records, config.layer_patience)
    if len(samples) < config.layer_patience:
        return []
    hits = [_first_last(layers) for _, layers in samples]
    for h in hits:
        if h is None:
            return []
        fn, fg, ln, lg = h
        if not (fg < config.first_max and lg > 0 and fg / lg < config.first_last_ratio):
            return []
    fn, fg, ln, lg = hits[-1]  # type: ignore[misc]
    step = step_of(samples[-1][0])
    msg = (f"first module {fn} grad norm {fg:.3g} is {fg / lg:.1e} of the last module {ln}'s "
           f"({lg:.3g}) at step {step}")
    return [make_verdict("vanishing_gradients", step, msg,
                         {"first_grad_norm": fg, "last_grad_norm": lg}, VANISHING_FIX, module=fn)]


def detect_missing_gradients(records: Sequence[StepRecord], config: MissingGradientsConfig
                             ) -> list[Verdict]:
    """Report steps with no gradient at all, or trainable modules that never get one.

    Args:
        records: step records, oldest first.
        config: thresholds.

    Returns:
        One critical verdict (no gradient at all), or one per module without gradient, or nothing.
    """
    if not config.enabled or not records:
        return []
    recent = list(tail(records, config.patience))
    if len(recent) == config.patience and all(getattr(r, "grad_norm", None) is None
                                              for r in recent):
        step = step_of(recent[0])
        msg = (f"no parameter has a gradient for {config.patience} steps from step {step}: "
               "backward not called or the loss is detached")
        return [make_verdict("missing_gradients", step, msg, {"steps": config.patience},
                             MISSING_FIX)]
    samples = sampled_layers(records, config.layer_patience)
    if len(samples) < config.layer_patience:
        return []
    missing: set[str] | None = None
    for _, layers in samples:
        mods = _param_modules(layers)
        have = [n for n, st in mods if (layer_value(st, "grad_norm") or 0.0) > 0]
        if not have:
            return []
        lacking = {n for n, st in mods if not (layer_value(st, "grad_norm") or 0.0) > 0
                   and not _nonfinite_grad(st)}
        missing = lacking if missing is None else missing & lacking
        if not missing:
            return []
    step = step_of(samples[-1][0])
    out = []
    for name in sorted(missing or ()):
        st = samples[-1][1].get(name)
        g = getattr(st, "grad_norm", None)
        what = "no gradient" if g is None else "an all-zero gradient"
        msg = (f"module {name} has trainable parameters but {what} on the last "
               f"{config.layer_patience} sampled steps (step {step})")
        out.append(make_verdict("missing_gradients", step, msg,
                                {"grad_norm": g if g is not None else math.nan},
                                MISSING_FIX, module=name))
    return out


def _nonfinite_grad(st: LayerStats) -> bool:
    g = getattr(st, "grad_norm", None)
    return g is not None and finite(g) is None
