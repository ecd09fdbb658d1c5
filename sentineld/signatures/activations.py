"""Activations: dead ReLU units and saturated tanh/sigmoid units, per layer, on sampled steps.

The method: "activation distributions should not collapse ... not saturate (for ReLU, the
dead-region ratio should not be excessively high). A large number of neurons consistently at zero
indicates dead ReLU, typically caused by a learning rate that is too large or improper
initialization." The probes (``sentineld.agent.probes``) measure, per module and sampled
batch, wherever the activation is computed (``nn.ReLU``, ``F.relu`` inside a ``forward``,
``F.gelu`` ...), the share of units never active (``dead_fraction``) and the share of output
values that are saturated (``saturated_fraction``). Early steps are sampled one after the other,
so the onset the verdicts name is within a few steps of the true one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

from sentineld.contracts.records import StepRecord

from .base import Verdict, layer_value, make_verdict, step_of, trailing

__all__ = ["DeadReluConfig", "SaturationConfig", "detect_dead_relu",
           "detect_saturated_activation", "onsets"]

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

    A module's units are *dead from step s* when the sample at s starts ``patience`` consecutive
    sampled steps with ``dead_fraction`` >= ``max_fraction``, and no later sample fell below
    ``release_fraction``. The verdict names that onset step s (not the latest sample), so it
    reads the same whether the stream arrived in one read or line by line.

    Attributes:
        enabled: run this detector.
        max_fraction: default 0.7 (AUTOTRAINER gamma and DeepDiagnosis; SageMaker Debugger
            ``DeadRelu`` uses 50%, but "never > 0 over the batch" depends on the batch size: our
            measurement on batches of 8 in tests/signatures reaches 42% in a healthy run).
        patience: consecutive sampled steps. Default 2 (one sampled batch can be unlucky).
        release_fraction: a dead layer counts as revived only once a sample falls below this.
            Default 0.5, SageMaker Debugger ``DeadRelu``'s own threshold: under it no tool calls
            the layer dead. The band between it and ``max_fraction`` keeps a layer hovering
            around 70% one condition with one onset instead of a new alert per crossing.
    """

    enabled: bool = True
    max_fraction: float = 0.7
    patience: int = 2
    release_fraction: float = 0.5

    def __post_init__(self) -> None:
        if not 0 < self.max_fraction <= 1 or self.patience < 1 \
                or not 0 < self.release_fraction <= self.max_fraction:
            raise ValueError("dead_relu.max_fraction must be in (0, 1], patience >= 1, "
                             "release_fraction in (0, max_fraction]")


@dataclass(frozen=True)
class SaturationConfig:
    """``saturated_activation``: a tanh/sigmoid layer whose outputs are mostly saturated.

    Same rule as :class:`DeadReluConfig` on ``saturated_fraction``: onset at the first of
    ``patience`` consecutive samples >= ``max_fraction``, held until a sample falls below
    ``release_fraction``. (The probes leave out the activation that produces the model's
    output: a confident sigmoid output is not a fault.)

    Attributes:
        enabled: run this detector.
        max_fraction: default 0.5 (SageMaker Debugger ``SaturatedActivation`` threshold_layer =
            50%; DeepDiagnosis likewise 0.5; healthy tanh runs in tests/signatures stay below 3%).
        patience: consecutive sampled steps. Default 2.
        release_fraction: default 0.4: a band of 0.1 under ``max_fraction``, wider than the
            spread of one saturated layer's figure between sampled batches
            (tests/signatures/test_dead_onset.py measures it).
    """

    enabled: bool = True
    max_fraction: float = 0.5
    patience: int = 2
    release_fraction: float = 0.4

    def __post_init__(self) -> None:
        if not 0 < self.max_fraction <= 1 or self.patience < 1 \
                or not 0 < self.release_fraction <= self.max_fraction:
            raise ValueError("saturated_activation.max_fraction must be in (0, 1], patience >= 1, "
                             "release_fraction in (0, max_fraction]")


def _value(layers: Mapping[str, Any], name: str, field: str) -> float | None:
    st = layers.get(name)
    return layer_value(st, field) if st is not None else None


def _sampled_newest_first(records: Sequence[StepRecord]) -> Iterator[tuple[int, Mapping[str, Any]]]:
    for r in trailing(records):
        layers = getattr(r, "layers", None)
        if layers and isinstance(layers, Mapping) and not getattr(r, "optimizer_skipped", False):
            yield step_of(r), layers


def onsets(records: Sequence[StepRecord], field: str, threshold: float, release: float,
           patience: int) -> dict[str, tuple[int, int, float, Any]]:
    """Modules in the condition now, with its onset.

    Walks back from the latest sample over the samples with ``field`` >= ``release`` (a sample
    without the figure, or a record without the module, ends the walk); within that stretch the
    onset is the first sample that starts ``patience`` consecutive samples >= ``threshold``.

    Args:
        records: step records, oldest first; only sampled ones (``layers`` set, optimizer step
            run) count.
        field: ``"dead_fraction"`` or ``"saturated_fraction"``.
        threshold, release, patience: see :class:`DeadReluConfig`.

    Returns:
        ``{module: (onset step, latest step, latest value, latest LayerStats)}``; empty when
        nothing holds. Pure: the same records give the same answer however they were read.
    """
    it = _sampled_newest_first(records)
    first = next(it, None)
    if first is None:
        return {}
    latest_step, latest = first
    stretch: dict[str, list[tuple[int, float]]] = {}
    for name in list(latest.keys()):
        v = _value(latest, name, field)
        if v is not None and v >= release:
            stretch[str(name)] = [(latest_step, v)]
    open_ = set(stretch)
    for step, layers in it:           # newest first, only as far back as a stretch goes on
        if not open_:
            break
        for name in list(open_):
            v = _value(layers, name, field)
            if v is None or v < release:
                open_.discard(name)
            else:
                stretch[name].append((step, v))
    out: dict[str, tuple[int, int, float, Any]] = {}
    for name, back in stretch.items():
        run = 0
        for i in range(len(back) - 1, -1, -1):      # oldest first
            run = run + 1 if back[i][1] >= threshold else 0
            if run == patience:
                out[name] = (back[i + patience - 1][0], latest_step, back[0][1], latest.get(name))
                break
    return out


def _where(name: str, stats: Any) -> str:
    op = getattr(stats, "activation", None)
    who = repr(name) if name else "the model's own forward"
    return f"{who} ({op})" if isinstance(op, str) and op else who


def detect_dead_relu(records: Sequence[StepRecord], config: DeadReluConfig) -> list[Verdict]:
    """Report ReLU-family activations with too many dead units, at the step they died.

    Args:
        records: step records, oldest first (per-layer stats on sampled steps).
        config: thresholds.

    Returns:
        One warning verdict per module, ``step`` = the onset (see :func:`onsets`), or nothing.
    """
    if not config.enabled:
        return []
    found = onsets(records, "dead_fraction", config.max_fraction, config.release_fraction,
                   config.patience)
    out = []
    for name, (onset, last, frac, stats) in sorted(found.items()):
        msg = (f"units of {_where(name, stats)} dead since step {onset}: {frac:.0%} never active "
               f"over the sampled batch at step {last} (>= {config.max_fraction:.0%} on "
               f"{config.patience} sampled steps in a row)")
        out.append(make_verdict("dead_relu", onset, msg,
                                {"dead_fraction": frac, "onset_step": onset, "latest_step": last},
                                DEAD_FIX, module=name))
    return out


def detect_saturated_activation(records: Sequence[StepRecord], config: SaturationConfig
                                ) -> list[Verdict]:
    """Report tanh/sigmoid activations with too many saturated units, at the step they saturated.

    Args:
        records: step records, oldest first (per-layer stats on sampled steps).
        config: thresholds.

    Returns:
        One warning verdict per module, ``step`` = the onset (see :func:`onsets`), or nothing.
    """
    if not config.enabled:
        return []
    found = onsets(records, "saturated_fraction", config.max_fraction, config.release_fraction,
                   config.patience)
    out = []
    for name, (onset, last, frac, stats) in sorted(found.items()):
        msg = (f"outputs of {_where(name, stats)} saturated since step {onset}: {frac:.0%} "
               f"saturated over the sampled batch at step {last} (>= "
               f"{config.max_fraction:.0%} on {config.patience} sampled steps in a row)")
        out.append(make_verdict("saturated_activation", onset, msg,
                                {"saturated_fraction": frac, "onset_step": onset,
                                 "latest_step": last}, SATURATED_FIX, module=name))
    return out
