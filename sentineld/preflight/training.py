"""Check 10 (Rule #1: overfit one batch) and check 11 (the learning-rate range test).

Rule #1: "take 5-50 samples (typically one batch) and train until training loss approaches 0 ...
If you can't: there's a bug in model capacity, data shapes, or the forward/loss/gradient chain."
Range testing: "too large causes divergence, too small makes loss crawl".
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import torch

from sentineld.contracts.safeio import write_atomic

from .context import Probe
from .result import FAIL, PASS, WARN, Check

__all__ = ["check_overfit", "check_lr_range", "lr_sweep", "suggest_lr", "OVERFIT_TARGET", "OVERFIT_STALL"]

#: "Near zero": the loss fell to this fraction of its first value (0.023 for 10-class CE from
#: ln 10; the method's "order of 0.001" is reached with a longer budget).
OVERFIT_TARGET = 0.01
#: Above this fraction of the first loss at the end of the budget the batch was not learned at
#: all (a loss that fell by less than 10%); in between it is a WARN: learning, but too slowly.
OVERFIT_STALL = 0.9
#: The sweep suggests an lr only when its smoothed loss fell by at least this fraction (a slow
#: learner such as SGD on a small CNN falls ~6% in a 100-step sweep of one batch).
SWEEP_MIN_DROP = 0.03
#: Steps of the sweep.
SWEEP_STEPS = 100
#: Sweep points skipped before looking for the steepest descent.
SWEEP_SKIP = 10
#: A loss above this multiple of the first one, or non-finite, is divergence.
DIVERGE = 3.0
CHECKLIST = ("the checklist, in order: wrong labels, inputs not normalized, output layer vs loss, "
             "learning rate, gradients not applied, initial loss vs ln C, layer output shapes")


def _lr(opt: torch.optim.Optimizer) -> float:
    lr = opt.param_groups[0].get("lr", float("nan"))
    return float(lr.item() if isinstance(lr, torch.Tensor) else lr)


def check_overfit(probe: Probe, steps: int = 300) -> Check:
    """Train a copy on one batch (<= 32 samples) with the user's optimizer until the loss is near zero.

    Args:
        steps: the step budget; training stops early at ``OVERFIT_TARGET`` x the first loss.
    """
    model, opt = probe.fresh()
    curve: list[float] = []
    first = float(probe.loss_fn(model, probe.batch).detach())
    target = OVERFIT_TARGET * first
    status, why = None, ""
    for _ in range(steps):
        loss = float(probe.step(model, opt, probe.batch))
        curve.append(loss)
        if not math.isfinite(loss) or loss > DIVERGE * max(first, 1e-12):
            status, why = FAIL, f"the loss diverged to {loss:.4g} after {len(curve)} steps (lr {_lr(opt):g} too high?)"
            break
        if loss <= target:
            break
    final = curve[-1] if curve else first
    ev = {"steps": len(curve), "budget": steps, "first_loss": first, "final_loss": final,
          "best_loss": min(curve, default=first), "target": target, "lr": _lr(opt),
          "samples": _samples(probe), "curve": curve[:: max(1, len(curve) // 25)]}
    if status is None:
        if final <= target:
            return Check("overfit_one_batch", PASS, f"one batch overfit to {final:.3g} (from {first:.3g}) "
                         f"in {len(curve)} steps", ev)
        status = FAIL if final > OVERFIT_STALL * first else WARN
        why = f"after {len(curve)} steps the loss is {final:.3g} (from {first:.3g}); near zero is <= {target:.3g}"
    cause = f"the bug is in capacity, data shapes or the forward/loss/gradient chain; look at {CHECKLIST}"
    fix = "one batch that cannot be overfit means " + cause
    if status == WARN:
        fix = ("the loss falls but too slowly: raise the step budget (--steps) or the learning rate "
               "(too small a learning rate makes the loss crawl); if it still stalls, " + cause)
    return Check("overfit_one_batch", status, why, ev, fix)


def _samples(probe: Probe) -> int | None:
    x, _ = probe.split(probe.batch)
    return int(x.shape[0]) if isinstance(x, torch.Tensor) and x.dim() else None


def lr_sweep(probe: Probe, lr_min: float = 1e-7, lr_max: float = 10.0, steps: int = 100
             ) -> tuple[list[float], list[float]]:
    """Exponentially growing lr, one step each, on Rule #1's batch; stops at divergence.

    Returns:
        ``(lrs, smoothed_losses)``: EMA (beta 0.9, bias-corrected) of the loss at each lr.
    """
    model, opt = probe.fresh()
    lrs, smooth, avg, best = [], [], 0.0, math.inf
    # One fixed batch: the loss differences between lrs are then the lr's doing, not the batch's.
    for i, batch in enumerate([probe.batch] * steps):
        lr = lr_min * (lr_max / lr_min) ** (i / max(1, steps - 1))
        for g in opt.param_groups:
            g["lr"] = lr
        loss = float(probe.step(model, opt, batch))
        if not math.isfinite(loss):
            break
        avg = 0.9 * avg + 0.1 * loss
        value = avg / (1 - 0.9 ** (i + 1))
        lrs.append(lr)
        smooth.append(value)
        best = min(best, value)
        # fastai's stop rule (4x the best smoothed loss); for losses that go negative (NLL of
        # probabilities), a rise of 3x the first loss's magnitude above the best.
        if (value > 4 * best) if best > 0 else (value - best > 3 * abs(smooth[0])):
            break
    return lrs, smooth


def suggest_lr(lrs: list[float], losses: list[float]) -> float | None:
    """The lr where the smoothed loss falls fastest per decade (steepest negative slope), capped at
    a tenth of the lr of the lowest loss (Smith's rule; the EMA's lag can put the steepest point
    past the minimum, on the cliff)."""
    if len(lrs) < 5 or min(losses) > (1 - SWEEP_MIN_DROP) * losses[0]:
        return None  # the loss never fell: no lr is "good" (gradients not applied, or no signal)
    logs = [math.log10(x) for x in lrs]
    # central differences; the first points are skipped as fastai does (the EMA is still warming up)
    idx = range(max(1, min(SWEEP_SKIP, len(lrs) - 3)), len(lrs) - 1)
    slope = {i: (losses[i + 1] - losses[i - 1]) / (logs[i + 1] - logs[i - 1]) for i in idx}
    lowest = lrs[min(range(len(losses)), key=losses.__getitem__)]
    return min(lrs[min(slope, key=slope.__getitem__)], lowest / 10)


def check_lr_range(probe: Probe, plot_path: str | Path | None = None) -> Check:
    """LR range test on a copy: a suggested lr, the lr where the loss diverges, and a plot.

    Args:
        plot_path: PNG or SVG file for the plot (default ``preflight-lr-range.png`` in the cwd).
    """
    user_lr = _lr(probe.optimizer)
    # fastai's range (1e-7..10, 100 steps), widened to 10x the user's lr so a too-high lr is inside it
    lr_max = max(10.0, 10 * user_lr) if math.isfinite(user_lr) else 10.0
    lrs, losses = lr_sweep(probe, lr_min=1e-7, lr_max=lr_max, steps=SWEEP_STEPS)
    suggested = suggest_lr(lrs, losses)
    best_i = min(range(len(losses)), key=losses.__getitem__) if losses else None
    diverged = lrs[-1] if lrs and lrs[-1] < lr_max * 0.99 else None
    path = Path(plot_path) if plot_path else Path.cwd() / "preflight-lr-range.png"
    plot: str | None = str(path)
    try:
        _plot(lrs, losses, suggested, user_lr, path)
    except OSError as exc:  # unwritable, or a link / someone else's file there: the figures still count
        plot = f"not written: {exc}"
    ev: dict[str, Any] = {"suggested_lr": suggested, "your_lr": user_lr, "diverges_at_lr": diverged,
                          "min_loss_lr": lrs[best_i] if best_i is not None else None, "plot": plot,
                          "points": len(lrs)}
    fix = f"use a learning rate near the suggested {suggested:.2g}" if suggested else ""
    if suggested is None:
        return Check("lr_range", WARN, "the loss did not fall during the sweep: no learning rate to "
                     "suggest", ev, "fix the failing checks above first (gradients, loss), then rerun")
    if diverged is not None and user_lr >= diverged:
        return Check("lr_range", FAIL, f"your lr {user_lr:g} is at or above where the loss diverges "
                     f"({diverged:.2g}); suggested {suggested:.2g}", ev, "lower the learning rate; " + fix)
    if user_lr > 10 * suggested and best_i is not None and user_lr > lrs[best_i]:
        return Check("lr_range", WARN, f"your lr {user_lr:g} is past the loss minimum of the sweep; "
                     f"suggested {suggested:.2g}", ev, fix)
    return Check("lr_range", PASS, f"suggested lr {suggested:.2g} (yours {user_lr:g}); plot {path}", ev)


def _plot(lrs: list[float], losses: list[float], suggested: float | None, user_lr: float, path: Path) -> None:
    try:
        import matplotlib  # noqa: PLC0415 - only the --lr-range path needs it
    except ImportError:
        raise RuntimeError("the LR range plot needs matplotlib: pip install 'sentineld[preflight]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(lrs, losses, label="smoothed loss")
    if suggested:
        ax.axvline(suggested, color="green", linestyle="--", label=f"suggested {suggested:.2g}")
    ax.axvline(user_lr, color="red", linestyle=":", label=f"yours {user_lr:.2g}")
    ax.set(xscale="log", xlabel="learning rate", ylabel="loss", title="sentineld preflight: LR range test")
    if losses and losses[0] > 0:  # the diverging tail would flatten the curve that matters
        low = min(losses)
        ax.set_ylim(low - 0.05 * abs(low), min(max(losses), 2 * losses[0]) * 1.05)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, format=path.suffix.lstrip(".").lower() or "png", bbox_inches="tight")
    plt.close(fig)
    # The safe writer, not savefig(path): the default ./preflight-lr-range.png is a predictable
    # name, and in a folder others may write (/tmp) savefig would write through her link there.
    write_atomic(path, buf.getvalue(), mode=0o644, durable=False)
