"""Per-step records: the one data shape shared by the agent, the stream and the signatures.

A :class:`StepRecord` is what the agent knows about one optimizer step once its device values have
been read back. It is written as one JSON line to the run's metrics stream
(``stream-rank<R>.jsonl``) and read back by the daemon; signatures are pure functions over a window
of them.

Units are in the field names (``_s`` = seconds). Floats may be ``nan``/``inf``: that is the point.

The stream's other lines are typed here too, each with its ``kind``: :class:`StartLine` (the
process began), :class:`EndLine` (it finished, crashed or was stopped) and :class:`AgentNotice`
(the agent switched itself off, or a capture was not written) and :class:`ReplicaDivergence` (DDP
replicas differ, ``agent/replicas.py``). The agent writes them with
``to_json()``; readers match a line's ``kind`` against these constants, never a bare string.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from sentineld.contracts.triggers import REPLICA_DIVERGENCE

__all__ = ["StepRecord", "LayerStats", "record_from_json", "record_to_json", "STEP", "START", "END",
           "AGENT_ERROR", "AGENT_WARNING", "AGENT_NOTICES", "StartLine", "EndLine", "AgentNotice",
           "REPLICA_DIVERGENCE", "ReplicaDivergence"]

#: The ``kind`` of each stream line.
STEP, START, END, AGENT_ERROR, AGENT_WARNING = "step", "start", "end", "agent_error", "agent_warning"
#: What the agent says about itself: ``agent_error`` (it switched off), ``agent_warning``.
AGENT_NOTICES = (AGENT_ERROR, AGENT_WARNING)


@dataclass(frozen=True)
class LayerStats:
    """Sampled statistics of one module at one step (taken every ``layer_every`` steps).

    Attributes:
        grad_norm: L2 norm of the module's own parameters' gradients (``recurse=False``), or None.
        param_norm: L2 norm of those parameters.
        update_ratio: ||delta w|| / ||w|| over the optimizer step (Karpathy's ~1e-3 rule of thumb).
        dead_fraction: share (0-1) of output units never > 0 over the sampled batch (ReLU family).
        saturated_fraction: share (0-1) of output units saturated (|tanh| > 0.99, sigmoid < 0.01 or
            > 0.99) over the sampled batch.
        activation: the activation call the two fractions were measured on (``"relu"``,
            ``"gelu"``, ``"tanh"``, ...; ``"relu#2"`` for the module's second ``relu`` call in
            one forward; ``"relu/tanh"`` when they come from two calls), or None. Absent from
            streams written before it existed (read as None).
    """

    grad_norm: float | None = None
    param_norm: float | None = None
    update_ratio: float | None = None
    dead_fraction: float | None = None
    saturated_fraction: float | None = None
    activation: str | None = None


@dataclass(frozen=True)
class StepRecord:
    """What one optimizer step looked like.

    Attributes:
        step: optimizer step index, 0-based, as counted by the agent.
        loss: loss as passed to ``Watch.step`` (last micro-batch's when accumulating); may be nan/inf.
        grad_norm: global L2 norm over all parameter gradients before the optimizer step, after
            GradScaler unscaling; before clipping when the agent knows the loop clips
            (``clip_grad_norm=`` in a plain loop, the trainer's setting in Lightning and HF),
            else after whatever the loop did first; None if no gradient.
        lr: learning rate of the first parameter group after the step; None if absent.
        step_s: wall time of the step in seconds (previous ``Watch.step`` call to this one).
        time_s: Unix time in seconds when the step was recorded.
        optimizer_skipped: True when the optimizer step did not run (GradScaler found inf/nan).
        loss_scale: GradScaler scale, or None without a scaler.
        rank: torch.distributed rank (0 without distributed).
        grads_carried: True when gradients from an earlier step were still present at the first
            forward of this step (no ``zero_grad`` / ``set_to_none``) and no accumulation was
            declared; None when not checked.
        param_nonfinite: True when a parameter held nan/inf after the step (checked on sampled
            steps only; None otherwise).
        input_nonfinite: True when a floating tensor of the batch held nan/inf (every step; None
            when the batch has no floating tensor).
        layers: per-module :class:`LayerStats` on sampled steps, keyed by qualified module name.
        clipped: True when gradient clipping rescaled this step's gradients (the pre-clip
            ``grad_norm`` was above the max norm), False when it did not, None when the agent
            does not know that the loop clips. Absent from streams written before it existed.
        replicas: never in a step line: the daemon sets it on the newest record of a rank's
            window when the stream says the DDP replicas differ (a :data:`REPLICA_DIVERGENCE`
            line, :class:`ReplicaDivergence`), so the pure ``replica_divergence`` signature sees
            it in the window. None otherwise.
    """

    step: int
    loss: float
    grad_norm: float | None = None
    lr: float | None = None
    step_s: float = 0.0
    time_s: float = 0.0
    optimizer_skipped: bool = False
    loss_scale: float | None = None
    rank: int = 0
    grads_carried: bool | None = None
    param_nonfinite: bool | None = None
    input_nonfinite: bool | None = None
    layers: Mapping[str, LayerStats] | None = field(default=None, compare=False)
    clipped: bool | None = None
    replicas: ReplicaDivergence | None = field(default=None, compare=False)

    @property
    def nonfinite(self) -> bool:
        """True when the loss or the global grad norm is nan or inf."""
        if not math.isfinite(self.loss):
            return True
        return self.grad_norm is not None and not math.isfinite(self.grad_norm)


_SCALAR_FIELDS = tuple(f for f in StepRecord.__dataclass_fields__ if f not in ("layers", "replicas"))


def record_to_json(record: StepRecord) -> dict[str, Any]:
    """A JSON-ready dict of ``record`` (nan/inf stay floats: Python's json writes NaN/Infinity)."""
    # Field by field, not dataclasses.asdict: this runs every step in the training process and
    # asdict's recursive deep copy cost ~0.1 ms of it (our measurement).
    out = {f: getattr(record, f) for f in _SCALAR_FIELDS}
    out["kind"] = STEP
    if record.layers is not None:
        out["layers"] = {name: asdict(stats) for name, stats in record.layers.items()}
    return out


def record_from_json(obj: Mapping[str, Any]) -> StepRecord:
    """Build a :class:`StepRecord` from one stream line's dict.

    Raises:
        ValueError: a required field (``step``, ``loss``) is missing or of the wrong type.
    """
    try:
        step = int(obj["step"])
        loss = float(obj["loss"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"stream record lacks a valid step/loss: {exc!r}") from None
    layers = obj.get("layers")
    known = {f for f in StepRecord.__dataclass_fields__} - {"step", "loss", "layers", "replicas"}
    kwargs = {k: obj[k] for k in known if k in obj}
    if isinstance(layers, Mapping):
        lf = set(LayerStats.__dataclass_fields__)
        kwargs["layers"] = {
            str(name): LayerStats(**{k: v for k, v in stats.items() if k in lf})
            for name, stats in layers.items()
            if isinstance(stats, Mapping)
        }
    return StepRecord(step=step, loss=loss, **kwargs)


@dataclass(frozen=True)
class StartLine:
    """A rank's process began writing the stream (``time_s``: wall clock, seconds)."""

    run_id: str
    rank: int
    pid: int
    host: str
    time_s: float

    def to_json(self) -> dict[str, Any]:
        return {"kind": START, **asdict(self)}


@dataclass(frozen=True)
class EndLine:
    """The rank ended: ``reason`` (``finished``, ``crashed``, ...), after ``steps`` steps."""

    reason: str
    steps: int
    time_s: float

    def to_json(self) -> dict[str, Any]:
        return {"kind": END, **asdict(self)}


@dataclass(frozen=True)
class AgentNotice:
    """The agent about itself: ``kind`` is :data:`AGENT_ERROR` (it switched off) or
    :data:`AGENT_WARNING`; ``step`` where it happened, None when no step applies."""

    kind: str
    message: str
    step: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in AGENT_NOTICES:
            raise ValueError(f"an agent notice's kind is one of {AGENT_NOTICES}, got {self.kind!r}")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "message": self.message}
        if self.step is not None:
            out["step"] = self.step
        return out


@dataclass(frozen=True)
class ReplicaDivergence:
    """DDP replicas differ after the optimizer step of ``step`` (``agent/replicas.py``): the ranks
    ``ranks`` hold other parameter values than the majority (with two ranks, both), first in
    parameter ``parameter`` (``named_parameters`` name). Every rank writes the same line."""

    step: int
    ranks: tuple[int, ...]
    parameter: str
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"kind": REPLICA_DIVERGENCE, "step": self.step, "ranks": list(self.ranks),
                "parameter": self.parameter, "message": self.message}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ReplicaDivergence:
        """Parse a :data:`REPLICA_DIVERGENCE` stream line (another process wrote it: checked).

        Raises:
            ValueError: ``step`` is not an int, ``ranks`` not a list of ints or ``parameter``
                not a string.
        """
        step, ranks, param = obj.get("step"), obj.get("ranks"), obj.get("parameter")
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError(f"replica_divergence line without an int step: {step!r}")
        if not isinstance(ranks, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
            raise ValueError(f"replica_divergence line without a list of int ranks: {ranks!r}")
        if not isinstance(param, str):
            raise ValueError(f"replica_divergence line without a parameter name: {param!r}")
        return cls(step, tuple(ranks), param[:500], str(obj.get("message", ""))[:2000])
