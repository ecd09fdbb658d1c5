"""Truth tables: each detector on small synthetic windows, firing exactly where it should."""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Callable

import pytest

from sentineld.contracts.records import LayerStats, StepRecord
from sentineld.signatures import (SIGNATURES, SignatureConfig, Verdict, detect_dead_relu,
                                  detect_divergence_growth, detect_divergence_spike,
                                  detect_exploding_gradients, detect_forgotten_zero_grad,
                                  detect_gradients_not_applied, detect_initial_loss,
                                  detect_loss_scale_collapse, detect_missing_gradients,
                                  detect_nonfinite, detect_oscillation, detect_plateau,
                                  detect_saturated_activation, detect_stalled,
                                  detect_update_ratio, detect_vanishing_gradients, evaluate)

from sentineld.signatures.numerics import DATA_NONFINITE_FIX

NAN, INF = math.nan, math.inf
CFG = SignatureConfig()


def recs(losses: list[float], **series: Any) -> list[StepRecord]:
    """Records with the given losses; each keyword is a list (per step) or a scalar."""
    out = []
    for i, loss in enumerate(losses):
        kw = {k: (v[i] if isinstance(v, list) else v) for k, v in series.items()}
        kw.setdefault("grad_norm", 1.0)
        kw.setdefault("lr", 1e-3)
        kw.setdefault("time_s", 1000.0 + i)
        kw.setdefault("step_s", 1.0)
        out.append(StepRecord(step=kw.pop("step", i), loss=loss, **kw))
    return out


def noisy(n: int, level: float = 1.0, amp: float = 0.1, seed: int = 0) -> list[float]:
    """Deterministic pseudo-noise around ``level`` (relative amplitude ``amp``)."""
    x, out = seed + 1, []
    for _ in range(n):
        x = (1103515245 * x + 12345) % (2 ** 31)
        out.append(level * (1 + amp * (2 * x / 2 ** 31 - 1)))
    return out


def fired(verdicts: list[Verdict], signature: str) -> list[Verdict]:
    return [v for v in verdicts if v.signature == signature]


def with_layers(records: list[StepRecord], every: int,
                make: Callable[[int], dict[str, LayerStats]]) -> list[StepRecord]:
    out = []
    for r in records:
        layers = make(r.step) if r.step % every == 0 else None
        out.append(StepRecord(**{**r.__dict__, "layers": layers}))
    return out


# --------------------------------------------------------------------------------- nonfinite
@pytest.mark.parametrize("case, bad_step, data_fix", [
    (dict(), None, False),
    (dict(loss_at={5: NAN}), 5, False),
    (dict(loss_at={7: INF}), 7, False),
    (dict(grad_at={3: INF}), 3, False),
    (dict(grad_at={3: NAN}, skipped_at={3}), None, False),      # GradScaler skipped it: normal
    (dict(input_at={4}), 4, True),
    (dict(param_at={6}), 6, False),
    (dict(layer_nan_at={2}), 2, False),
    (dict(loss_at={3: NAN, 8: NAN}), 3, False),                  # first bad step reported
])
def test_nonfinite(case: dict, bad_step: int | None, data_fix: bool) -> None:
    rs = []
    for i in range(10):
        rs.append(StepRecord(
            step=i, loss=case.get("loss_at", {}).get(i, 1.0),
            grad_norm=case.get("grad_at", {}).get(i, 1.0),
            optimizer_skipped=i in case.get("skipped_at", set()),
            input_nonfinite=i in case.get("input_at", set()),
            param_nonfinite=i in case.get("param_at", set()),
            layers={"fc": LayerStats(param_norm=NAN)} if i in case.get("layer_nan_at", ()) else None))
    out = detect_nonfinite(rs, CFG.nonfinite)
    if bad_step is None:
        assert out == []
    else:
        (v,) = out
        assert (v.signature, v.severity, v.step) == ("nonfinite", "critical", bad_step)
        assert (v.fix == DATA_NONFINITE_FIX) == data_fix


# ------------------------------------------------------------------------ loss_scale_collapse
def _scaler_run(n: int, skip_at: set[int], start: float = 2.0 ** 16, growth: int = 2000
                ) -> list[StepRecord]:
    scale, clean, out = start, 0, []
    for i in range(n):
        skipped = i in skip_at
        if skipped:
            scale, clean = scale / 2, 0
        else:
            clean += 1
            if clean == growth:
                scale, clean = scale * 2, 0
        out.append(StepRecord(step=i, loss=1.0, grad_norm=INF if skipped else 1.0,
                              optimizer_skipped=skipped, loss_scale=scale))
    return out


@pytest.mark.parametrize("name, records, fires", [
    ("no scaler", recs([1.0] * 50), False),
    ("start-up burst of 5", _scaler_run(100, set(range(5))), False),
    ("occasional skips, regrowth", _scaler_run(200, set(range(0, 200, 20)), growth=10), False),
    ("10 skips in a row", _scaler_run(60, set(range(40, 50))), True),
    ("9 skips in a row", _scaler_run(60, set(range(40, 49))), False),
    ("scale below 1", _scaler_run(30, set(range(0, 30, 2)), start=2.0 ** 10), True),
    ("steady fall, clean steps between", _scaler_run(100, set(range(0, 100, 5)),
                                                    start=2.0 ** 30), True),
])
def test_loss_scale_collapse(name: str, records: list[StepRecord], fires: bool) -> None:
    out = detect_loss_scale_collapse(records, CFG.loss_scale_collapse)
    assert bool(out) == fires, name
    assert all(v.severity == "critical" for v in out)


# --------------------------------------------------------------------------- divergence_spike
@pytest.mark.parametrize("tail, fires", [
    ([1.0] * 3, False),
    ([10.0] * 3, True),                   # x10 for 3 steps
    ([1.0, 1.0, 10.0], False),            # one hard batch
    ([1.0, 10.0, 10.0], False),           # not yet confirmed
    ([10.0, 1.0, 10.0], False),           # dipped back
    ([2.5] * 3, False),                   # below ratio 3
    ([NAN, 10.0, 10.0], False),           # nan is nonfinite's; only 2 finite highs
])
def test_divergence_spike(tail: list[float], fires: bool) -> None:
    rs = recs(noisy(60, 1.0, 0.1) + tail)
    out = detect_divergence_spike(rs, CFG.divergence_spike)
    assert bool(out) == fires
    if fires:
        assert out[0].step == 60 and out[0].numbers["baseline_median"] == pytest.approx(1.0, 0.1)


def test_divergence_spike_needs_history() -> None:
    assert detect_divergence_spike(recs(noisy(10) + [50.0] * 3), CFG.divergence_spike) == []


@pytest.mark.parametrize("num_classes, fires", [(10, False), (None, False), (2, False)])
def test_divergence_spike_ignores_near_zero_losses(num_classes: int | None, fires: bool) -> None:
    rs = recs(noisy(60, 1e-4, 0.1) + [5e-3] * 3)         # x50, but a converged run's noise
    assert bool(detect_divergence_spike(rs, CFG.divergence_spike, num_classes)) == fires


# -------------------------------------------------------------------------- divergence_growth
@pytest.mark.parametrize("losses, num_classes, fires", [
    ([0.5 * 1.05 ** i for i in range(80)], 10, True),          # steady climb 0.5 -> 24
    ([2.0 * 0.98 ** i for i in range(80)], 10, False),         # decreasing
    ([0.01 * 1.05 ** i for i in range(80)], 10, False),        # climb among near-zero losses
    ([0.01 * 1.05 ** i for i in range(80)], None, False),
    ([1.0 + 0.3 * math.sin(i) for i in range(80)], 10, False),  # noise
    ([0.5 * 1.05 ** i for i in range(40)], 10, False),          # too short a window
])
def test_divergence_growth(losses: list[float], num_classes: int | None, fires: bool) -> None:
    out = detect_divergence_growth(recs(losses), CFG.divergence_growth, num_classes)
    assert bool(out) == fires


# ------------------------------------------------------------------------ exploding_gradients
@pytest.mark.parametrize("tail, skipped, fires", [
    ([20.0] * 4, False, True),
    ([20.0] * 3, False, False),
    ([5.0] * 4, False, False),
    ([INF] * 4, False, False),          # non-finite norms are nonfinite's
    ([20.0] * 4, True, False),          # skipped steps do not count
])
def test_exploding_gradients(tail: list[float], skipped: bool, fires: bool) -> None:
    grads = noisy(60, 1.0, 0.2) + tail
    rs = recs([1.0] * len(grads), grad_norm=grads,
              optimizer_skipped=[False] * 60 + [skipped] * len(tail))
    assert bool(detect_exploding_gradients(rs, CFG.exploding_gradients)) == fires


def test_exploding_gradients_absolute_ceiling() -> None:
    cfg = SignatureConfig.from_mapping({"exploding_gradients": {"max_grad_norm": 100.0}})
    rs = recs([1.0] * 10, grad_norm=[150.0] * 10)     # no baseline needed
    (v,) = detect_exploding_gradients(rs, cfg.exploding_gradients)
    assert v.numbers["max_grad_norm"] == 100.0


def test_exploding_gradients_first_last_rule_opt_in() -> None:
    def lay(step: int) -> dict[str, LayerStats]:
        return {"in": LayerStats(grad_norm=100.0, param_norm=1.0),
                "out": LayerStats(grad_norm=1.0, param_norm=1.0)}
    rs = with_layers(recs([1.0] * 20), 5, lay)
    assert detect_exploding_gradients(rs, CFG.exploding_gradients) == []
    cfg = SignatureConfig.from_mapping({"exploding_gradients": {"first_last_ratio": 70}})
    (v,) = detect_exploding_gradients(rs, cfg.exploding_gradients)
    assert v.module == "in"


# ------------------------------------------------------------------------ vanishing_gradients
@pytest.mark.parametrize("n_small, fires", [(10, True), (9, False), (0, False)])
def test_vanishing_global(n_small: int, fires: bool) -> None:
    grads = [1.0] * (30 - n_small) + [1e-9] * n_small
    rs = recs([1.0] * 30, grad_norm=grads)
    assert bool(detect_vanishing_gradients(rs, CFG.vanishing_gradients)) == fires


@pytest.mark.parametrize("first, last, fires", [
    (1e-8, 0.5, True),      # AUTOTRAINER: first < 1e-4 and first/last < 1e-3
    (1e-5, 1e-3, False),    # ratio 1e-2
    (5e-4, 10.0, False),    # first above 1e-4
])
def test_vanishing_first_last(first: float, last: float, fires: bool) -> None:
    def lay(step: int) -> dict[str, LayerStats]:
        return {"0": LayerStats(grad_norm=first, param_norm=1.0), "act": LayerStats(dead_fraction=0),
                "5": LayerStats(grad_norm=last, param_norm=1.0)}
    rs = with_layers(recs([1.0] * 20), 5, lay)
    out = detect_vanishing_gradients(rs, CFG.vanishing_gradients)
    assert bool(out) == fires
    if fires:
        assert out[0].module == "0" and out[0].severity == "warning"


# -------------------------------------------------------------------------- missing_gradients
@pytest.mark.parametrize("n_none, fires", [(3, True), (2, False)])
def test_missing_gradients_global(n_none: int, fires: bool) -> None:
    rs = recs([1.0] * 10, grad_norm=[1.0] * (10 - n_none) + [None] * n_none)
    out = detect_missing_gradients(rs, CFG.missing_gradients)
    assert bool(out) == fires
    if fires:
        assert out[0].module is None and out[0].severity == "critical"


@pytest.mark.parametrize("stats, expect", [
    (LayerStats(grad_norm=None, param_norm=1.0), ["enc"]),     # trainable, no gradient
    (LayerStats(grad_norm=0.0, param_norm=1.0), ["enc"]),      # all-zero gradient
    (LayerStats(grad_norm=0.3, param_norm=1.0), []),
    (LayerStats(grad_norm=None, param_norm=None), []),         # frozen: not reported
    (LayerStats(grad_norm=NAN, param_norm=1.0), []),           # nan is nonfinite's
])
def test_missing_gradients_per_module(stats: LayerStats, expect: list[str]) -> None:
    def lay(step: int) -> dict[str, LayerStats]:
        return {"enc": stats, "head": LayerStats(grad_norm=0.5, param_norm=2.0)}
    rs = with_layers(recs([1.0] * 12), 5, lay)
    assert [v.module for v in detect_missing_gradients(rs, CFG.missing_gradients)] == expect


def test_missing_gradients_needs_two_samples() -> None:
    def lay(step: int) -> dict[str, LayerStats]:
        return {"enc": LayerStats(param_norm=1.0), "head": LayerStats(grad_norm=0.5, param_norm=2.0)}
    assert detect_missing_gradients(with_layers(recs([1.0] * 5), 5, lay),
                                    CFG.missing_gradients) == []


# ------------------------------------------------------------------------ forgotten_zero_grad
@pytest.mark.parametrize("carried, grads, fires", [
    ([False] * 18 + [True, True], [1.0] * 20, True),
    ([False] * 19 + [True], [1.0] * 20, False),
    ([True, True] + [False] * 18, [1.0] * 20, False),              # not at the end
    ([None] * 20, [1.0 + 0.5 * i for i in range(20)], True),       # unchecked: linear climb
    ([False] * 20, [1.0 + 0.5 * i for i in range(20)], False),     # checked: zeroed, so no
    ([None] * 20, [1.0 + 0.1 * i for i in range(20)], False),      # climb too small
    ([None] * 20, noisy(20, 2.0, 0.5), False),
])
def test_forgotten_zero_grad(carried: list, grads: list[float], fires: bool) -> None:
    rs = recs([1.0] * 20, grads_carried=carried, grad_norm=grads)
    assert bool(detect_forgotten_zero_grad(rs, CFG.forgotten_zero_grad)) == fires


# ---------------------------------------------------------------------- gradients_not_applied
@pytest.mark.parametrize("records, fires", [
    (recs([1.0] * 10, optimizer_skipped=[False] * 7 + [True] * 3), True),
    (recs([1.0] * 10, optimizer_skipped=[False] * 8 + [True] * 2), False),
    (recs([1.0] * 10, optimizer_skipped=[False] * 7 + [True] * 3, loss_scale=1024.0), False),
    (recs([1.0] * 30, lr=[1e-3] * 10 + [0.0] * 20), True),
    (recs([1.0] * 30, lr=[0.0] + [1e-3] * 29), False),              # warmup from 0
    (recs([1.0] * 30, lr=[1e-3] * 10 + [0.0] * 20, grad_norm=0.0), False),
])
def test_gradients_not_applied_records(records: list[StepRecord], fires: bool) -> None:
    out = detect_gradients_not_applied(records, CFG.gradients_not_applied)
    assert bool(out) == fires
    assert all(v.module is None for v in out)


@pytest.mark.parametrize("ratios, expect", [
    ({"a": 0.0, "b": 0.0}, [None]),          # nothing moved: the whole model
    ({"a": 0.0, "b": 1e-3}, ["a"]),          # one module left out of the optimizer
    ({"a": 1e-3, "b": 1e-3}, []),
])
def test_gradients_not_applied_layers(ratios: dict[str, float], expect: list) -> None:
    def lay(step: int) -> dict[str, LayerStats]:
        return {n: LayerStats(grad_norm=0.5, param_norm=1.0, update_ratio=u)
                for n, u in ratios.items()}
    rs = with_layers(recs([1.0] * 12), 5, lay)
    out = detect_gradients_not_applied(rs, CFG.gradients_not_applied)
    assert [v.module for v in out] == expect


# ------------------------------------------------------------------------------ update_ratio
@pytest.mark.parametrize("ratios, fires", [
    ({"a": 1e-3, "b": 2e-3, "c": 1e-3}, False),
    ({"a": 5.0, "b": 8.0, "c": 3.0}, True),                      # model-wide too large
    ({"a": 1e-3, "b": 1e-3, "gamma": 500.0}, False),             # LayerScale-like outlier
    ({"a": 1e-11, "b": 1e-10, "c": 1e-12}, True),                 # far too small
    ({"a": 0.0, "b": 0.0}, False),                                # zeros: not_applied's
])
def test_update_ratio(ratios: dict[str, float], fires: bool) -> None:
    def lay(step: int) -> dict[str, LayerStats]:
        return {n: LayerStats(grad_norm=0.5, param_norm=1.0, update_ratio=u)
                for n, u in ratios.items()}
    rs = with_layers(recs([1.0] * 16), 5, lay)
    out = detect_update_ratio(rs, CFG.update_ratio)
    assert bool(out) == fires
    assert all(v.module is None for v in out)


# ------------------------------------------------------------------- dead_relu / saturation
@pytest.mark.parametrize("fractions, fires", [
    ([0.9, 0.9], True),
    ([0.9, 0.1], False),        # the latest sample recovered
    ([0.1, 0.9], False),        # only one sample so far
    ([0.6, 0.6], False),        # below 0.7
])
def test_dead_relu(fractions: list[float], fires: bool) -> None:
    samples = iter(fractions)

    def lay(step: int) -> dict[str, LayerStats]:
        return {"act1": LayerStats(dead_fraction=next(samples))}
    rs = with_layers(recs([1.0] * 10), 5, lay)
    out = detect_dead_relu(rs, CFG.dead_relu)
    assert [v.module for v in out] == (["act1"] if fires else [])


@pytest.mark.parametrize("fractions, fires", [([0.6, 0.6], True), ([0.4, 0.6], False),
                                               ([0.4, 0.4], False)])
def test_saturated_activation(fractions: list[float], fires: bool) -> None:
    samples = iter(fractions)

    def lay(step: int) -> dict[str, LayerStats]:
        return {"tanh": LayerStats(saturated_fraction=next(samples))}
    rs = with_layers(recs([1.0] * 10), 5, lay)
    assert bool(detect_saturated_activation(rs, CFG.saturated_activation)) == fires


# ------------------------------------------------------------------------------------ plateau
@pytest.mark.parametrize("losses, num_classes, first_step, fires", [
    (noisy(120, 2.3, 0.02), 10, 0, True),              # stuck at ln(10)
    ([2.3 * 0.99 ** i for i in range(120)], 10, 0, False),
    (noisy(90, 2.3, 0.02), 10, 0, False),              # not yet `patience` steps
    (noisy(120, 40.0, 0.02), 10, 0, False),            # far above: divergence, not plateau
    (noisy(120, 0.7, 0.02), None, 0, True),            # no classes: step-0 reference
    (noisy(120, 0.7, 0.02), None, 500, False),         # ... only while step 0 is in the window
    (noisy(120, 2.3, 0.02), 10, 500, True),            # ln(C) reference works anywhere
])
def test_plateau(losses: list[float], num_classes: int | None, first_step: int,
                 fires: bool) -> None:
    rs = recs(losses, step=[first_step + i for i in range(len(losses))])
    assert bool(detect_plateau(rs, CFG.plateau, num_classes)) == fires


# -------------------------------------------------------------------------------- oscillation
def _square(n: int, lo: float, hi: float, period: int) -> list[float]:
    return [hi if (i // (period // 2)) % 2 else lo for i in range(n)]


@pytest.mark.parametrize("losses, num_classes, fires", [
    (_square(100, 0.5, 3.0, 20), 10, True),
    (_square(100, 0.01, 0.06, 20), 10, False),          # converged: swings are noise
    (_square(100, 0.5, 3.0, 20), None, True),
    ([3.0 * 0.97 ** i * (2 if i % 10 < 5 else 1) for i in range(100)], 10, False),  # progress
    (_square(100, 1.0, 1.5, 20), 10, False),            # swings below 2x
    (_square(60, 0.5, 3.0, 20), 10, False),             # too short
])
def test_oscillation(losses: list[float], num_classes: int | None, fires: bool) -> None:
    assert bool(detect_oscillation(recs(losses), CFG.oscillation, num_classes)) == fires


# ------------------------------------------------------------------------------- initial_loss
@pytest.mark.parametrize("loss0, num_classes, first_step, fires", [
    (2.35, 10, 0, False),
    (7.0, 10, 0, True),
    (0.5, 10, 0, False),  # far below ln C: a pretrained model (fine-tuning), not an init fault
    (7.0, None, 0, False),
    (7.0, 10, 3, False),
    (0.72, 2, 0, False),
    (NAN, 10, 0, False),
])
def test_initial_loss(loss0: float, num_classes: int | None, first_step: int,
                      fires: bool) -> None:
    rs = recs([loss0] + [1.0] * 4, step=[first_step + i for i in range(5)])
    out = detect_initial_loss(rs, CFG.initial_loss, num_classes)
    assert bool(out) == fires
    if fires:
        assert out[0].step == 0 and out[0].numbers["expected"] == pytest.approx(math.log(10))


def test_initial_loss_low_side_when_asked() -> None:
    cfg = SignatureConfig.from_mapping({"initial_loss": {"low_ratio": 0.5}})
    rs = recs([0.5] + [1.0] * 4, step=list(range(5)))
    assert detect_initial_loss(rs, cfg.initial_loss, 10)


# ------------------------------------------------------------------------------------ stalled
@pytest.mark.parametrize("gap_s, overrides, fires", [
    (10.0, {}, False),
    (1799.0, {}, False),
    (1801.0, {}, True),                                   # SageMaker's 1800 s
    (90.0, {"step_multiple": 50.0}, True),                # 50 x 1 s steps, floor 60 s
    (55.0, {"step_multiple": 50.0}, False),
    (None, {}, False),                                    # no clock: never
])
def test_stalled(gap_s: float | None, overrides: dict, fires: bool) -> None:
    cfg = SignatureConfig.from_mapping({"stalled": overrides}).stalled
    rs = recs([1.0] * 10)
    now = None if gap_s is None else rs[-1].time_s + gap_s
    out = detect_stalled(rs, cfg, now)
    assert bool(out) == fires
    if fires:
        assert out[0].step == 9 and out[0].severity == "critical"


# ------------------------------------------------------------------------------------ general
def test_evaluate_orders_critical_first_and_takes_any_sequence() -> None:
    rs = recs(noisy(120, 2.3, 0.02))
    rs[100] = StepRecord(step=100, loss=NAN, time_s=1100.0)
    for window in (rs, tuple(rs), deque(rs, maxlen=200), iter(rs)):
        out = evaluate(window, CFG, now_s=rs[-1].time_s + 1, num_classes=10)
        assert [v.signature for v in out] == ["nonfinite", "plateau"]


def test_evaluate_empty_and_healthy_window() -> None:
    assert evaluate([], now_s=0.0) == []
    assert evaluate(recs([2.3 * 0.98 ** i for i in range(200)]), now_s=1200.0,
                    num_classes=10) == []


def test_verdict_shape() -> None:
    (v,) = detect_nonfinite(recs([1.0, NAN]), CFG.nonfinite)
    assert SIGNATURES[v.signature] == v.severity
    assert (v.signature, v.module) == ("nonfinite", None)
    assert math.isnan(v.numbers["loss"]) and isinstance(v.fix, str) and v.fix
    hash(v)  # frozen and hashable, numbers excluded from the hash
    with pytest.raises(AttributeError):
        v.step = 3  # type: ignore[misc]


def test_every_signature_has_a_config() -> None:
    assert set(SIGNATURES) == set(SignatureConfig.__dataclass_fields__)


def test_numpy_scalars_and_int_losses_take_the_careful_path() -> None:
    np = pytest.importorskip("numpy")
    base = noisy(60, 1.0, 0.1) + [10.0] * 3
    plain = detect_divergence_spike(recs(base), CFG.divergence_spike)
    as_numpy = detect_divergence_spike(recs([np.float64(v) for v in base]), CFG.divergence_spike)
    assert [v.step for v in plain] == [v.step for v in as_numpy] == [60]
    grads = [np.float32(g) for g in noisy(60, 1.0, 0.2) + [20.0] * 4]
    assert detect_exploding_gradients(recs([1.0] * 64, grad_norm=grads), CFG.exploding_gradients)
