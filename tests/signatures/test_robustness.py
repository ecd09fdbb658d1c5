"""Detectors are total: odd windows (nan, inf, None, wrong types, empty) give verdicts or nothing,
never an exception. Checked on each detector directly, without evaluate()'s safety net."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sentineld.contracts.records import LayerStats, StepRecord
from sentineld.signatures import SIGNATURES, SignatureConfig, Verdict, evaluate
from sentineld.signatures import activations, divergence, gradients, liveness, loss, numerics, updates, zero_grad

CFG = SignatureConfig()
ODD_FLOATS = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True),
                       st.sampled_from([0.0, -0.0, 1e-300, -1.0, 1e300, math.nan, math.inf]))
ODD_VALUES = st.one_of(ODD_FLOATS, st.booleans(), st.text(max_size=3), st.integers(-5, 5))

layer_stats = st.builds(LayerStats, grad_norm=ODD_VALUES, param_norm=ODD_VALUES,
                        update_ratio=ODD_VALUES, dead_fraction=ODD_FLOATS,
                        saturated_fraction=ODD_VALUES)


@st.composite
def odd_record(draw: Any, step: int) -> StepRecord:
    layers = draw(st.one_of(st.none(), st.just({}), st.just(["not", "a", "mapping"]),
                            st.dictionaries(st.sampled_from(["", "0", "a.b", "relu"]), layer_stats,
                                            max_size=4)))
    return StepRecord(
        step=draw(st.one_of(st.just(step), st.integers(-3, 10 ** 9))),
        loss=draw(st.floats(allow_nan=True, allow_infinity=True)),
        grad_norm=draw(ODD_FLOATS), lr=draw(ODD_FLOATS), step_s=draw(ODD_VALUES),
        time_s=draw(ODD_VALUES), optimizer_skipped=draw(st.booleans()),
        loss_scale=draw(ODD_FLOATS), grads_carried=draw(st.one_of(st.none(), st.booleans())),
        param_nonfinite=draw(st.one_of(st.none(), st.booleans())),
        input_nonfinite=draw(st.one_of(st.none(), st.booleans())), layers=layers)


@st.composite
def odd_window(draw: Any) -> list[StepRecord]:
    # a few odd records, repeated in a drawn order: long windows at a low generation cost
    pool = [draw(odd_record(i)) for i in range(draw(st.integers(1, 6)))]
    order = draw(st.lists(st.integers(0, 5), max_size=130))
    return [pool[i % len(pool)] for i in order]


DETECTORS = [
    lambda r: numerics.detect_nonfinite(r, CFG.nonfinite),
    lambda r: numerics.detect_loss_scale_collapse(r, CFG.loss_scale_collapse),
    lambda r: divergence.detect_divergence_spike(r, CFG.divergence_spike, 10),
    lambda r: divergence.detect_divergence_growth(r, CFG.divergence_growth, 10),
    lambda r: loss.detect_plateau(r, CFG.plateau, None),
    lambda r: loss.detect_plateau(r, CFG.plateau, 10),
    lambda r: loss.detect_oscillation(r, CFG.oscillation, 3),
    lambda r: loss.detect_initial_loss(r, CFG.initial_loss, 10),
    lambda r: gradients.detect_exploding_gradients(
        r, SignatureConfig.from_mapping(
            {"exploding_gradients": {"first_last_ratio": 70, "max_grad_norm": 5}}
        ).exploding_gradients),
    lambda r: gradients.detect_vanishing_gradients(r, CFG.vanishing_gradients),
    lambda r: gradients.detect_missing_gradients(r, CFG.missing_gradients),
    lambda r: zero_grad.detect_forgotten_zero_grad(r, CFG.forgotten_zero_grad),
    lambda r: updates.detect_gradients_not_applied(r, CFG.gradients_not_applied),
    lambda r: updates.detect_update_ratio(r, CFG.update_ratio),
    lambda r: activations.detect_dead_relu(r, CFG.dead_relu),
    lambda r: activations.detect_saturated_activation(r, CFG.saturated_activation),
    lambda r: liveness.detect_stalled(r, CFG.stalled, 1e9),
]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(window=odd_window())
def test_detectors_never_raise(window: list[StepRecord]) -> None:
    for detect in DETECTORS:
        out = detect(window)
        assert isinstance(out, list)
        for v in out:
            assert isinstance(v, Verdict) and SIGNATURES[v.signature] == v.severity
            assert isinstance(v.step, int) and all(isinstance(x, float) for x in v.numbers.values())


@pytest.mark.parametrize("num_classes", [None, 0, 1, -4, 10, "x", 2.5])
@pytest.mark.parametrize("now_s", [None, math.nan, math.inf, -1.0, "soon"])
def test_odd_arguments(num_classes: Any, now_s: Any) -> None:
    window = [StepRecord(step=i, loss=2.3, grad_norm=1.0, time_s=1.0) for i in range(150)]
    for detect in (lambda: loss.detect_plateau(window, CFG.plateau, num_classes),
                   lambda: loss.detect_oscillation(window, CFG.oscillation, num_classes),
                   lambda: loss.detect_initial_loss(window, CFG.initial_loss, num_classes),
                   lambda: liveness.detect_stalled(window, CFG.stalled, now_s),
                   lambda: evaluate(window, CFG, now_s=now_s, num_classes=num_classes)):
        assert isinstance(detect(), list)
