"""Issue 21's cases, through the daemon's chain (signatures, then policy): the false alarms on a
converging run, and the RESOLVED notices for things that did not resolve. Each fails on 49179bb
(checked: see the branch's report) and passes now; each has a control that still alerts or
resolves, so the floors and the holding rule do not blind the rules."""

from __future__ import annotations

import math
import random

from sentineld.contracts.records import StepRecord
from tests.signatures.chain import notifications

NAN = float("nan")
LN3, LN10 = math.log(3), math.log(10)


def _records(losses: list[float], norms: list[float | None], start: int = 0, t0: float = 1.7e9
             ) -> list[StepRecord]:
    return [StepRecord(step=start + i, loss=loss, grad_norm=g, lr=1e-3, step_s=0.1, time_s=t0 + 0.1 * i)
            for i, (loss, g) in enumerate(zip(losses, norms))]


def _noise(n: int, scale: float, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [1.0 + scale * rng.uniform(-1, 1) for _ in range(n)]


def _kinds(notes: list[tuple[str, str, int]]) -> list[tuple[str, str]]:
    return [(kind, key) for kind, key, _ in notes]


# ------------------------------------------------------------------ a converged run, no alarms
def test_tiny_grad_norm_jump_at_a_converged_loss_is_not_an_explosion() -> None:
    """Issue 21: "grad norm 6.486e-05 ... 215x the median 3.015e-07" at a loss of ~1e-5, CRITICAL
    exploding_gradients on 49179bb. A loss near its floor and a norm under the absolute floor."""
    n1, n2 = 60, 40
    losses = [1e-8 * x for x in _noise(n1, 0.2)] + [1e-5 * x for x in _noise(n2, 0.2, 1)]
    norms = [3e-7 * x for x in _noise(n1, 0.2, 2)] + [6.5e-5 * x for x in _noise(n2, 0.2, 3)]
    records = _records(losses, norms, start=1000)  # late in a run that fit its data
    assert notifications(records, num_classes=3) == []
    assert notifications(records, num_classes=None) == []


def test_tiny_gradients_at_a_converged_loss_are_not_vanishing() -> None:
    """Loss from ln 3 to ~1e-8 with the norm below 1e-7: WARNING vanishing_gradients on 49179bb."""
    losses = [LN3 * 0.5 ** i for i in range(30)] + [1e-8] * 100
    norms = [1.0 * 0.5 ** i for i in range(30)] + [3e-8] * 100
    assert notifications(_records(losses, norms), num_classes=3) == []
    assert notifications(_records(losses, norms), num_classes=None) == []


def test_controls_explosion_and_vanishing_still_alert_at_a_live_loss() -> None:
    """The same shapes at a loss that is not at its floor still alert."""
    losses = [0.5 * x for x in _noise(100, 0.1)]
    norms = [0.3 * x for x in _noise(60, 0.1)] + [300.0 * x for x in _noise(40, 0.1, 1)]
    assert ("alert", "exploding_gradients") in _kinds(notifications(_records(losses, norms), 10))
    tiny = [1e-9] * 100
    assert ("alert", "vanishing_gradients") in _kinds(notifications(_records(losses, tiny), 10))


def test_control_a_loss_rescaled_by_1e9_is_not_convergence() -> None:
    """A loss divided by 1e9 (a unit bug) is tiny too, but it got there in one step: vanishing."""
    losses = [0.5 * x for x in _noise(50, 0.1)] + [0.5e-9 * x for x in _noise(50, 0.1, 1)]
    norms = [0.3 * x for x in _noise(50, 0.1)] + [0.3e-9 * x for x in _noise(50, 0.1, 1)]
    assert ("alert", "vanishing_gradients") in _kinds(notifications(_records(losses, norms), 10))


# ------------------------------------------------------------------ RESOLVED only when resolved
def test_vanishing_is_not_resolved_by_a_run_gone_nan() -> None:
    """Issue 21: vanishing_gradients "RESOLVED" on a run NaN from step 60 on (a NaN grad norm is
    not "below 1e-7"). Alerts: vanishing, then nonfinite; never a RESOLVED for vanishing."""
    losses = [LN10 * x for x in _noise(60, 0.05)] + [NAN] * 70
    norms = [1e-9] * 60 + [NAN] * 70
    notes = notifications(_records(losses, norms), num_classes=10, ended=False)
    assert _kinds(notes) == [("alert", "vanishing_gradients"), ("alert", "nonfinite")]


def test_nonfinite_resolves_and_vanishing_only_once_shown_over() -> None:
    """Control: NaN for 10 steps, then finite with healthy norms: nonfinite resolves after its
    re-arm window, vanishing once its norms are back above the floor on finite data."""
    losses = [LN10 * x for x in _noise(60, 0.05)] + [NAN] * 10 + [LN10 * x for x in _noise(60, 0.05, 1)]
    norms = [1e-9] * 60 + [NAN] * 10 + [0.5] * 60
    notes = notifications(_records(losses, norms), num_classes=10, ended=False)
    assert ("alert", "vanishing_gradients") in _kinds(notes)
    resolved = [(key, step) for kind, key, step in notes if kind == "resolved"]
    assert sorted(k for k, _ in resolved) == ["nonfinite", "vanishing_gradients"]
    assert all(step >= 80 for _, step in resolved)  # 10 finite steps after the NaNs at least


def test_plateau_is_not_resolved_while_the_loss_stays_in_its_band() -> None:
    """Issue 21: plateau "RESOLVED as of step 206" while the loss stayed at ln 3 from step 103
    to 299 (num_classes unknown: the reference, step 0's loss, left the 200-record window)."""
    losses = [LN3 * x for x in _noise(300, 0.01)]
    notes = notifications(_records(losses, [0.2] * 300), num_classes=None, ended=False)
    assert _kinds(notes) == [("alert", "plateau")]


def test_control_plateau_resolves_when_the_loss_leaves_its_band() -> None:
    losses = [LN3 * x for x in _noise(150, 0.01)] + [0.3 * LN3 * x for x in _noise(60, 0.01, 1)]
    notes = notifications(_records(losses, [0.2] * 210), num_classes=None, ended=False)
    assert _kinds(notes) == [("alert", "plateau"), ("resolved", "plateau")]
    assert notes[1][2] >= 150
