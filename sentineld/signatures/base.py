"""What every signature shares: the :class:`Verdict` it returns and small, total helpers.

A signature (detector) is a pure function ``(records, config, ...) -> list[Verdict]`` over a window
of :class:`~sentineld.contracts.records.StepRecord`, oldest first. It does no I/O, imports no torch and never
raises: odd input (nan, None fields, an empty window, a record without layers) yields no verdict
rather than an exception. The helpers here are what makes that cheap to honour.

Verdict semantics: a detector reports a condition that holds *in the window it was given*; the
daemon calls it again on every new record with a sliding window, so a condition keeps being
reported while it lasts. ``(signature, module)`` identifies the condition; ``step`` is the step the
evidence points at (the first bad step for events such as a non-finite loss, the latest evidence
for states such as a plateau).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Iterator, Literal, Mapping, Sequence

from sentineld.contracts.records import LayerStats, StepRecord

__all__ = ["Verdict", "Severity", "SIGNATURES", "make_verdict", "as_float", "finite", "median",
           "positive_ints", "chance_loss", "tail_chunk_medians",
           "robust_sigma", "finite_losses", "chunk_medians", "tail", "trailing", "sampled_layers",
           "layer_value", "step_of"]

Severity = Literal["critical", "warning"]

#: Every signature id this package can return, with its severity. The daemon's
#: ``sentineld_signature_active`` gauge and the Alertmanager rules are keyed by these ids.
SIGNATURES: Mapping[str, Severity] = {
    "nonfinite": "critical",
    "divergence_spike": "critical",
    "divergence_growth": "critical",
    "loss_spike": "warning",
    "exploding_gradients": "critical",
    "vanishing_gradients": "warning",
    "dead_relu": "warning",
    "saturated_activation": "warning",
    "plateau": "warning",
    "oscillation": "warning",
    "gradients_not_applied": "critical",
    "missing_gradients": "critical",
    "forgotten_zero_grad": "critical",
    "update_ratio": "warning",
    "initial_loss": "warning",
    "loss_scale_collapse": "critical",
    "stalled": "critical",
    "replica_divergence": "critical",
}


@dataclass(frozen=True)
class Verdict:
    """One signature firing on a window of step records.

    Example::

        Verdict(signature="nonfinite", severity="critical", step=48112,
                message="loss is nan at step 48112", numbers={"loss": nan},
                fix="Lower the learning rate; ...")

    Attributes:
        signature: id from :data:`SIGNATURES`, e.g. ``"divergence_spike"``.
        severity: ``"critical"`` (training is broken or wasting compute) or ``"warning"``
            (training runs but something the method flags is off).
        step: optimizer step the evidence points at.
        message: one line for a human, with the figures.
        numbers: the figures that triggered the verdict (floats; may be nan/inf).
        fix: what the method (reference/debugging-and-diagnosis.txt) says to do about it.
        module: qualified module name (``named_modules()``) for per-layer verdicts, else None.
    """

    signature: str
    severity: Severity
    step: int
    message: str
    numbers: Mapping[str, float] = field(default_factory=dict, hash=False)
    fix: str = ""
    module: str | None = None


def make_verdict(signature: str, step: int, message: str, numbers: Mapping[str, Any], fix: str,
                 module: str | None = None) -> Verdict:
    """A :class:`Verdict` with the severity of ``signature`` and ``numbers`` coerced to floats."""
    clean = {}
    for k, v in numbers.items():
        f = as_float(v)
        if f is not None:
            clean[k] = f
    return Verdict(signature=signature, severity=SIGNATURES[signature], step=int(step),
                   message=message, numbers=clean, fix=fix, module=module)


def as_float(value: Any) -> float | None:
    """``value`` as a float (nan/inf kept), or None when it is None, a bool or not a number."""
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return None


def finite(value: Any) -> float | None:
    """``value`` as a finite float, else None."""
    f = as_float(value)
    return f if f is not None and math.isfinite(f) else None


def median(values: Sequence[float]) -> float:
    """Median of ``values`` (nan for an empty sequence)."""
    n = len(values)
    if n == 0:
        return math.nan
    s = sorted(values)
    mid = n // 2
    return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])


def robust_sigma(values: Sequence[float], center: float) -> float:
    """1.4826 x median absolute deviation: a standard deviation that ignores outliers."""
    if not values:
        return math.nan
    return 1.4826 * median([abs(v - center) for v in values])


def finite_losses(records: Sequence[StepRecord]) -> list[tuple[int, float]]:
    """``(step, loss)`` of the records whose loss is finite, in window order."""
    isfinite = math.isfinite
    fast: list[tuple[int, float]] = []
    for r in records:  # fast path for well-formed records; anything odd takes the careful path
        loss, step = getattr(r, "loss", None), getattr(r, "step", None)
        if type(loss) is not float or type(step) is not int:
            break
        if isfinite(loss):
            fast.append((step, loss))
    else:
        return fast
    out = []
    for r in records:
        v = finite(getattr(r, "loss", None))
        if v is not None:
            out.append((_step(r), v))
    return out


def chunk_medians(values: Sequence[float], chunk: int) -> list[float]:
    """Medians of consecutive chunks of ``chunk`` values, aligned to the end (a short head is
    dropped), oldest first."""
    if chunk <= 0:
        return []
    n = len(values) // chunk
    start = len(values) - n * chunk
    return [median(values[start + i * chunk:start + (i + 1) * chunk]) for i in range(n)]


def tail(records: Sequence[StepRecord], n: int) -> Sequence[StepRecord]:
    """The last ``n`` records, oldest first (works for lists, tuples and deques)."""
    if n <= 0:
        return []
    if isinstance(records, (list, tuple)):
        return records[-n:]
    out = list(islice(trailing(records), n))
    out.reverse()
    return out


def trailing(records: Sequence[StepRecord]) -> Iterator[StepRecord]:
    """Records newest first (no copy)."""
    for i in range(len(records) - 1, -1, -1):
        yield records[i]


def sampled_layers(records: Sequence[StepRecord], count: int, need: str = "param_norm"
                   ) -> list[tuple[StepRecord, Mapping[str, LayerStats]]]:
    """The last ``count`` records that carry per-layer norms and whose optimizer step ran,
    oldest first. Scans back only as far as needed. A record whose layers hold activation
    figures only (the agent's activation-only samples, ``agent/sampling.py`` ``norms_at``) is no
    sample of per-layer norms and is passed over.

    ``need``: the :class:`LayerStats` field a record's layers must report (some module not
    None) to count: ``"param_norm"`` for the norm rules; ``"update_ratio"`` for the update
    rules, which only the agent's full samples measure (``agent/sampling.py`` ``full_at``)."""
    out: list[tuple[StepRecord, Mapping[str, LayerStats]]] = []
    if count <= 0:
        return out
    for r in trailing(records):
        layers = getattr(r, "layers", None)
        if not layers or not isinstance(layers, Mapping) or getattr(r, "optimizer_skipped", False):
            continue
        if not any(getattr(st, need, None) is not None for st in layers.values()):
            continue
        out.append((r, layers))
        if len(out) == count:
            break
    out.reverse()
    return out


def layer_value(stats: Any, name: str) -> float | None:
    """A finite float attribute of a :class:`LayerStats` (or None)."""
    return finite(getattr(stats, name, None))


def _step(record: Any) -> int:
    try:
        return int(getattr(record, "step", 0))
    except (TypeError, ValueError, OverflowError):
        return 0


def step_of(record: Any) -> int:
    """``record.step`` as an int (0 when unusable)."""
    return _step(record)


def positive_ints(cfg: object, name: str, *fields: str) -> None:
    """Raise ValueError unless each named field of a config is an int >= 1."""
    for f in fields:
        v = getattr(cfg, f)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}.{f} must be an int >= 1, got {v!r}")


def chance_loss(num_classes: int | None) -> float | None:
    """ln(C), the cross-entropy of a uniform guess over C >= 2 classes, else None."""
    try:
        c = int(num_classes) if num_classes is not None else 0
    except (TypeError, ValueError, OverflowError):
        return None
    return math.log(c) if c >= 2 else None


def tail_chunk_medians(records: Sequence[StepRecord], span: int, chunk: int, min_chunks: int
                       ) -> tuple[list[tuple[int, float]], list[float]] | None:
    """The finite losses of the last ``span`` records and their medians per ``chunk`` steps, or
    None when under 90% of the span is finite or fewer than ``min_chunks`` chunks result (the
    curve rules of :mod:`.loss` and :mod:`.divergence` judge nothing on less)."""
    pts = finite_losses(tail(records, span))
    if len(pts) < span * 0.9:
        return None
    meds = chunk_medians([v for _, v in pts], chunk)
    return (pts, meds) if len(meds) >= min_chunks else None
