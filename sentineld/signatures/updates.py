"""Parameter updates: gradients that are never applied, and update/weight ratios out of range.

The method's checklist item 5, "gradients not being applied": compare the parameters before and
after the step; check for a forgotten ``optimizer.step()``. Karpathy's rule of thumb for the size
of an update: ||delta w|| / ||w|| around 1e-3 per step; far larger means the learning rate is too
high, far smaller that it is too low.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from sentineld.contracts.records import StepRecord

from .base import Verdict, finite, layer_value, make_verdict, median, sampled_layers, step_of, trailing
from .floors import loss_at_floor

__all__ = ["NotAppliedConfig", "UpdateRatioConfig", "detect_gradients_not_applied",
           "detect_update_ratio"]

NOT_APPLIED_FIX = (
    "Gradients are computed but the parameters do not change: check the four-step loop "
    "(zero_grad, forward+loss, backward, optimizer.step()); that the optimizer was built over "
    "model.parameters() after every layer was added (and after .to(device) replaced nothing); "
    "and that the learning rate is not 0.")
UPDATE_RATIO_FIX = (
    "Update/weight ratio far from ~1e-3 (Karpathy): too large - lower the learning rate (or add "
    "warmup); too small - raise it (range test), check the scheduler and weight decay.")


@dataclass(frozen=True)
class NotAppliedConfig:
    """``gradients_not_applied``: gradients exist but parameters do not change.

    Fires when (a) the optimizer step did not run on ``skip_steps`` consecutive records of a run
    without GradScaler (``optimizer_skipped`` with no ``loss_scale``: nothing legitimately skips
    it), (b) on ``layer_patience`` consecutive sampled steps every module with a non-zero gradient
    had update ratio exactly 0, or a given module did while others moved (its parameters are not
    in the optimizer), or (c) the learning rate was exactly 0 for ``zero_lr_steps`` steps in a row
    while gradients were non-zero. (b) is not judged while the loss is at its floor
    (:mod:`.floors`): there a converged model's update rounds to exactly 0 in float32 against
    its weights (issue 21's memorised run, Adam at loss 0).

    Attributes:
        enabled: run this detector.
        skip_steps: default 3.
        layer_patience: default 2.
        zero_lr_steps: default 20 (a warmup from 0 spends 1 step there).
    """

    enabled: bool = True
    skip_steps: int = 3
    layer_patience: int = 2
    zero_lr_steps: int = 20

    def __post_init__(self) -> None:
        if min(self.skip_steps, self.layer_patience, self.zero_lr_steps) < 1:
            raise ValueError("gradients_not_applied.skip_steps, layer_patience and "
                             "zero_lr_steps must be >= 1")


@dataclass(frozen=True)
class UpdateRatioConfig:
    """``update_ratio``: the model's ||delta w|| / ||w|| per step far from Karpathy's ~1e-3.

    Judged on the median over modules (modules with a non-zero gradient and update), so one
    module that legitimately starts near zero (zero-initialised heads, LayerScale gammas of 1e-6)
    does not fire it: a learning rate is a model-wide setting. Fires when that median on the latest
    sampled step is above ``max_ratio`` (one such step already rewrote the weights, and the ratio
    falls by itself afterwards as they blow up), or when it stayed below ``min_ratio`` on the last
    ``patience`` sampled steps while the loss is not at its floor (:mod:`.floors`: a converged
    model's updates are ~0 by right). Exact zeros are ``gradients_not_applied``'s.

    Attributes:
        enabled: run this detector.
        max_ratio: default 1.0: the step moved the weights by more than their own norm
            (SageMaker Debugger ``WeightUpdateRatio`` large_threshold is 10; our measurement:
            healthy runs in tests/signatures peak at 0.18, the noisy SGD run; Adam at lr=2
            gives 8.3).
        min_ratio: default 1e-8 (SageMaker Debugger ``WeightUpdateRatio`` small_threshold).
        patience: sampled steps for ``min_ratio``. Default 3.
    """

    enabled: bool = True
    max_ratio: float = 1.0
    min_ratio: float = 1e-8
    patience: int = 3

    def __post_init__(self) -> None:
        if not 0 < self.min_ratio < self.max_ratio:
            raise ValueError("update_ratio needs 0 < min_ratio < max_ratio")
        if self.patience < 1:
            raise ValueError("update_ratio.patience must be >= 1")


def detect_gradients_not_applied(records: Sequence[StepRecord], config: NotAppliedConfig,
                                 num_classes: int | None = None) -> list[Verdict]:
    """Report gradients that are computed but never change the parameters.

    Three tells, most direct first: (a) ``optimizer.step()`` not running, in a run that has no
    GradScaler to explain it; (b) a learning rate of exactly zero while gradients flow; (c) on
    the sampled steps, modules whose update ratio is 0 although their gradients are non-zero.

    Args:
        records: step records, oldest first.
        config: thresholds.
        num_classes: classes of a classification loss (the floor of :mod:`.floors`), or None.

    Returns:
        One critical verdict for the whole model, or one per module not updated, or nothing.
    """
    if not config.enabled or not records:
        return []
    out = _optimizer_not_stepping(records, config) or _zero_lr(records, config)
    if out:
        return out
    out = _modules_not_updated(records, config)
    return [] if out and loss_at_floor(records, num_classes) else out


def _trailing_run(records: Sequence[StepRecord], pred: Callable[[StepRecord], bool], cap: int
                  ) -> tuple[int, StepRecord | None]:
    """Length (at most ``cap``) and first record of the run of trailing records where ``pred`` holds."""
    run, first = 0, None
    for r in trailing(records):
        if not pred(r):
            break
        run, first = run + 1, r
        if run >= cap:
            break
    return run, first


def _optimizer_not_stepping(records: Sequence[StepRecord], config: NotAppliedConfig) -> list[Verdict]:
    run, first = _trailing_run(
        records, lambda r: bool(getattr(r, "optimizer_skipped", False))
        and finite(getattr(r, "loss_scale", None)) is None, config.skip_steps)
    if run < config.skip_steps or first is None:
        return []
    step = step_of(first)
    msg = (f"optimizer.step() did not run on {run} steps in a row from step {step} "
           "(no GradScaler to skip it)")
    return [make_verdict("gradients_not_applied", step, msg, {"skipped_steps": run}, NOT_APPLIED_FIX)]


def _zero_lr(records: Sequence[StepRecord], config: NotAppliedConfig) -> list[Verdict]:
    def flowing_at_zero_lr(r: StepRecord) -> bool:
        g = finite(getattr(r, "grad_norm", None))
        return finite(getattr(r, "lr", None)) == 0.0 and g is not None and g > 0

    run, first = _trailing_run(records, flowing_at_zero_lr, config.zero_lr_steps)
    if run < config.zero_lr_steps or first is None:
        return []
    step = step_of(first)
    msg = f"learning rate is 0 on {run} steps in a row from step {step} while gradients flow"
    return [make_verdict("gradients_not_applied", step, msg, {"lr": 0.0, "steps": run}, NOT_APPLIED_FIX)]


def _modules_not_updated(records: Sequence[StepRecord], config: NotAppliedConfig) -> list[Verdict]:
    samples = sampled_layers(records, config.layer_patience, need="update_ratio")
    if len(samples) < config.layer_patience:
        return []
    frozen: set[str] | None = None
    every_module = True
    for _, layers in samples:
        try:
            items = list(layers.items())
        except Exception:  # noqa: BLE001
            return []
        with_grad = [(str(n), st) for n, st in items
                     if (layer_value(st, "grad_norm") or 0.0) > 0
                     and layer_value(st, "update_ratio") is not None]
        if not with_grad:
            return []
        still = {n for n, st in with_grad if layer_value(st, "update_ratio") == 0.0}
        every_module = every_module and len(still) == len(with_grad)
        frozen = still if frozen is None else frozen & still
        if not frozen:
            return []
    step = step_of(samples[-1][0])
    if every_module:
        msg = (f"no parameter changed over the optimizer step on the last "
               f"{config.layer_patience} sampled steps (step {step}) although gradients are non-zero")
        return [make_verdict("gradients_not_applied", step, msg,
                             {"modules": len(frozen or ())}, NOT_APPLIED_FIX)]
    out = []
    for name in sorted(frozen or ()):
        msg = (f"module {name} has non-zero gradients but its parameters did not change on the "
               f"last {config.layer_patience} sampled steps (step {step}): not in the optimizer?")
        g = layer_value(samples[-1][1].get(name), "grad_norm")
        out.append(make_verdict("gradients_not_applied", step, msg,
                                {"grad_norm": g, "update_ratio": 0.0}, NOT_APPLIED_FIX,
                                module=name))
    return out


def _moving_ratios(layers: object) -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        items = list(layers.items())  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001
        return out
    for name, st in items:
        u = layer_value(st, "update_ratio")
        g = layer_value(st, "grad_norm")
        if u is not None and u > 0 and g is not None and g > 0:
            out[str(name)] = u
    return out


def detect_update_ratio(records: Sequence[StepRecord], config: UpdateRatioConfig,
                        num_classes: int | None = None) -> list[Verdict]:
    """Report a model-wide update/weight ratio far outside the healthy band.

    Args:
        records: step records, oldest first.
        config: thresholds.
        num_classes: classes of a classification loss (the floor of :mod:`.floors`), or None.

    Returns:
        One warning verdict (module None; the numbers name the extreme module), or nothing.
    """
    if not config.enabled:
        return []
    samples = sampled_layers(records, config.patience, need="update_ratio")
    if not samples:
        return []
    per_sample = [_moving_ratios(layers) for _, layers in samples]
    step = step_of(samples[-1][0])
    last = per_sample[-1]
    if last and median(list(last.values())) > config.max_ratio:
        m = median(list(last.values()))
        worst = max(last, key=lambda n: last[n])
        msg = (f"update/weight ratio {m:.3g} (median over {len(last)} modules; {worst}: "
               f"{last[worst]:.3g}) at step {step} is above {config.max_ratio:g}: the step "
               f"rewrote the weights; healthy is about 1e-3")
        return [make_verdict("update_ratio", step, msg,
                             {"update_ratio": m, "max_module_ratio": last[worst],
                              "bound": config.max_ratio}, UPDATE_RATIO_FIX)]
    if len(per_sample) < config.patience or not all(per_sample):
        return []
    meds = [median(list(d.values())) for d in per_sample]
    if all(m < config.min_ratio for m in meds) and not loss_at_floor(records, num_classes):
        msg = (f"update/weight ratio {meds[-1]:.3g} (median over modules) below "
               f"{config.min_ratio:g} on the last {config.patience} sampled steps (step {step}); "
               "healthy is about 1e-3")
        return [make_verdict("update_ratio", step, msg,
                             {"update_ratio": meds[-1], "bound": config.min_ratio},
                             UPDATE_RATIO_FIX)]
    return []
