"""Activations: dead ReLU units and saturated tanh/sigmoid units, per layer, on sampled steps.

The method: "activation distributions should not collapse ... not saturate (for ReLU, the
dead-region ratio should not be excessively high). A large number of neurons consistently at zero
indicates dead ReLU, typically caused by a learning rate that is too large or improper
initialization." The probes (``sentineld.agent.probes``) measure, per activation module and
sampled batch, the share of units never > 0 (``dead_fraction``) and the share of output values
that are saturated (``saturated_fraction``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from sentineld.contracts.records import StepRecord

from .base import Verdict, layer_value, make_verdict, sampled_layers, step_of

__all__ = ["DeadReluConfig", "SaturationConfig", "detect_dead_relu",
           "detect_saturated_activation"]

DEAD_FIX = (
    "Dead ReLU units: lower the learning rate, use He/Kaiming initialisation, add BatchNorm, or "
    "switch to LeakyReLU/GELU; check for a large negative bias.")
SATURATED_FIX = (
    "Saturated tanh/sigmoid units pass almost no gradient: normalise the inputs, use Xavier/"
    "Glorot initialisation, add normalisation layers, lower the learning rate, or use ReLU-family "
    "activations in hidden layers.")


@dataclass(frozen=True)
class DeadReluConfig:
    """``dead_relu``: a ReLU-family layer whose units are mostly never active.

    Fires per module when ``dead_fraction`` is at least ``max_fraction`` on each of the last
    ``patience`` sampled steps.

    Attributes:
        enabled: run this detector.
        max_fraction: default 0.7 (AUTOTRAINER gamma and DeepDiagnosis; SageMaker Debugger
            ``DeadRelu`` uses 50%, but "never > 0 over the batch" depends on the batch size: our
            measurement on batches of 8 in tests/signatures reaches 42% in a healthy run).
        patience: consecutive sampled steps. Default 2 (one sampled batch can be unlucky).
    """

    enabled: bool = True
    max_fraction: float = 0.7
    patience: int = 2

    def __post_init__(self) -> None:
        if not 0 < self.max_fraction <= 1 or self.patience < 1:
            raise ValueError("dead_relu.max_fraction must be in (0, 1], patience >= 1")


@dataclass(frozen=True)
class SaturationConfig:
    """``saturated_activation``: a tanh/sigmoid layer whose outputs are mostly saturated.

    Fires per module when ``saturated_fraction`` is at least ``max_fraction`` on each of the last
    ``patience`` sampled steps. (The probes leave out the activation that produces the model's
    output: a confident sigmoid output is not a fault.)

    Attributes:
        enabled: run this detector.
        max_fraction: default 0.5 (SageMaker Debugger ``SaturatedActivation`` threshold_layer =
            50%; DeepDiagnosis likewise 0.5; healthy tanh runs in tests/signatures stay below 3%).
        patience: consecutive sampled steps. Default 2.
    """

    enabled: bool = True
    max_fraction: float = 0.5
    patience: int = 2

    def __post_init__(self) -> None:
        if not 0 < self.max_fraction <= 1 or self.patience < 1:
            raise ValueError("saturated_activation.max_fraction must be in (0, 1], patience >= 1")


def _per_module(records: Sequence[StepRecord], field: str, threshold: float, patience: int
                ) -> tuple[int, dict[str, list[float]]]:
    samples = sampled_layers(records, patience)
    if len(samples) < patience:
        return 0, {}
    hits: dict[str, list[float]] | None = None
    for _, layers in samples:
        try:
            items = list(layers.items())
        except Exception:  # noqa: BLE001
            return 0, {}
        now = {}
        for name, st in items:
            v = layer_value(st, field)
            if v is not None and v >= threshold:
                now[str(name)] = v
        if hits is None:
            hits = {n: [v] for n, v in now.items()}
        else:
            hits = {n: vs + [now[n]] for n, vs in hits.items() if n in now}
        if not hits:
            return 0, {}
    return step_of(samples[-1][0]), hits or {}


def detect_dead_relu(records: Sequence[StepRecord], config: DeadReluConfig) -> list[Verdict]:
    """Report ReLU-family modules with too many dead units.

    Args:
        records: step records, oldest first (per-layer stats on sampled steps).
        config: thresholds.

    Returns:
        One warning verdict per module, or nothing.
    """
    if not config.enabled:
        return []
    step, hits = _per_module(records, "dead_fraction", config.max_fraction, config.patience)
    out = []
    for name, vals in sorted(hits.items()):
        msg = (f"{vals[-1]:.0%} of {name}'s units never active over the sampled batch at step "
               f"{step} (>= {config.max_fraction:.0%} on {len(vals)} sampled steps)")
        out.append(make_verdict("dead_relu", step, msg, {"dead_fraction": vals[-1]}, DEAD_FIX,
                                module=name))
    return out


def detect_saturated_activation(records: Sequence[StepRecord], config: SaturationConfig
                                ) -> list[Verdict]:
    """Report tanh/sigmoid modules with too many saturated units.

    Args:
        records: step records, oldest first (per-layer stats on sampled steps).
        config: thresholds.

    Returns:
        One warning verdict per module, or nothing.
    """
    if not config.enabled:
        return []
    step, hits = _per_module(records, "saturated_fraction", config.max_fraction, config.patience)
    out = []
    for name, vals in sorted(hits.items()):
        msg = (f"{vals[-1]:.0%} of {name}'s outputs saturated over the sampled batch at step "
               f"{step} (>= {config.max_fraction:.0%} on {len(vals)} sampled steps)")
        out.append(make_verdict("saturated_activation", step, msg,
                                {"saturated_fraction": vals[-1]}, SATURATED_FIX, module=name))
    return out
