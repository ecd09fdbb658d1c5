"""The replay's verdict: its schema (:class:`Report`, a JSON-ready record). Its one renderer is
:func:`sentineld.contracts.render.render_verdict` (title and body, then HTML or markdown with
``format_body``); :func:`render_text` (what ``sentineld replay`` prints) and
:func:`notification_text` (the daemon's notification, what the demo prints) are that renderer.

JSON fields (stable; ``schema_version`` bumps on any change): ``schema_version``, ``run_id``,
``rank``, ``step`` (the offending step), ``requested_step``, ``phase`` (``data`` | ``forward`` |
``backward`` | ``optimizer`` | ``none``), ``module`` (a qualified name from the model's
``named_modules()``, or null), ``where`` (where the value was made, in words; the only place named
when ``module`` is null, e.g. ``loss function, outside the model``), ``module_type``, ``op`` (for
a backward birth the *forward* op whose gradient went non-finite, e.g. ``aten.acos``, or a custom
autograd Function's class name; the primitive inside its derivative is ``evidence.primitive``),
``autograd_node``, ``parameters``, ``reproduced``, ``max_loss_deviation``, ``steps_rebuilt``,
``recorded_nonfinite``, ``cause_class`` (one of :data:`CAUSE_CLASSES`), ``cause``, ``fix``,
``evidence``, ``capture``, ``elapsed_s``, ``rebuild_s`` (loading the capture and re-executing
S..N-1), ``localize_s`` (the instrumented step); a data-parallel run's replay adds
``ranks`` (the ranks where the first non-finite value was born; every rank for an optimizer-step
fault) and ``loss_tolerance`` (largest accepted |rebuilt - recorded| loss; 0 = bit for bit).

``evidence`` keys by phase: ``data``: ``field``, ``samples``, ``fields``; ``forward``:
``op_inputs``, ``op_output``, ``module_call``, ``first_nonfinite_module``, ``micro_batch``;
``backward``: ``op_inputs``, ``op_output``, ``primitive``, ``forward_op``, ``custom_function``,
``where_branch``; ``optimizer``: ``state_entry``, ``optimizer_state``,
``eps``, ``inf_gradient_origin`` (clipping), ``scheduler`` (learning rate); always
``replayed_loss``, ``recorded_loss``, ``rebuilt_losses``, ``births``, ``nan_table_row``,
``precision``, ``torch_flags``; a verdict of the training process itself (``attach(loss_fn=)``,
:mod:`sentineld.contracts.verdict_file`) adds ``in_process`` (``mode``, ``memory_bytes``, ``wall_s``),
and a forward-only one ``not_checked`` (phases it could not check) and ``how_to_enable``.

Counterfactual fields (replay/counterfactual.py, one engine): ``kind`` (``nonfinite`` | ``spike``,
:data:`VERDICT_KINDS`); a spike verdict has ``cause_class`` ``data`` | ``state`` | ``interaction``
| ``not_reproduced``, ``samples`` (indices in the step's batch, most responsible first),
``module`` (or null) and ``evidence.losses`` (the 2x2: ``this_state_this_batch``,
``earlier_state_this_batch``, ``this_state_neighbour_batch``, ``earlier_state_neighbour_batch``),
``evidence.per_sample`` (data) or ``evidence.state`` (the module's update ratio and the quantity:
``lr`` | ``second_moment`` | ``grad_norm``); with ``--what-if``, ``what_if`` (rows
``{"change", "finite", "steps_checked", "loss", "loss_distance", "wall_s"}``, finite first, then
least change) and ``reproducibility`` (``{"class", "repeats", "identical", "ruled_out", ...}``,
:data:`REPRODUCIBILITY_CLASSES`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from .errors import EXIT_NOT_REPRODUCED, EXIT_OK

__all__ = ["REPORT_SCHEMA_VERSION", "CAUSE_CLASSES", "VERDICT_KINDS", "REPRODUCIBILITY_CLASSES",
           "OUTSIDE_MODEL", "PHASES", "Finding", "Replayed", "WhatIf", "CompiledCheck", "Report", "make_report",
           "verdict_outcome", "verdict_exit_code", "OUTCOME_EXIT_CODES",
           "report_problems", "is_verdict", "render_text", "notification_text"]

#: A verdict's ``phase``: where in the step the first non-finite value was made (``none``: nowhere).
PHASES = ("data", "forward", "backward", "optimizer", "none")

#: 2: ``where`` and ``cause_class`` added; ``module`` is null outside the model (was ``"loss"`` /
#: ``"lr_scheduler"``); a backward ``op`` is the forward op (was the derivative's primitive).
#: 3: ``kind``, ``samples``, ``what_if``, ``reproducibility`` added (a spike verdict; what-if rows).
REPORT_SCHEMA_VERSION = 3

#: ``where`` of a value made outside every module of the model (the recipe's loss function).
OUTSIDE_MODEL = "loss function, outside the model"

#: What a verdict's likely cause is, decided from its evidence (``replay/causes.py``), one line each.
CAUSE_CLASSES: dict[str, str] = {
    "data_nonfinite": "the batch holds NaN/Inf",
    "state_nonfinite": "the rebuilt state already held NaN/Inf",
    "lr_too_high": "an update or activation overflowed because the learning rate is too high",
    "lr_schedule": "the learning-rate schedule made a non-finite learning rate",
    "log_zero": "log of an exact zero",
    "domain_error": "an op outside its domain (log/sqrt of a negative number, acos of |x| > 1)",
    "div_zero": "a division by zero",
    "var_one_element": "an unbiased variance over one element (N - 1 = 0)",
    "softmax_all_masked": "a softmax over a fully masked row",
    "mean_empty": "a mean over zero elements",
    "fp16_overflow": "a value above the float16 range",
    "grad_at_singularity": "an op finite at its input whose derivative is not there (sqrt(0), acos(1), x**p at 0)",
    "where_masked_branch": "a non-finite derivative in the branch torch.where / masked_fill did not select",
    "custom_backward": "the backward of a custom autograd Function",
    "grad_explosion": "gradients grew through the chain rule until they overflowed",
    "grad_accumulated": "gradients summed across steps (no zero_grad) until they overflowed",
    "clip_of_inf": "gradient clipping of an Inf gradient (inf * 0 = NaN)",
    "optimizer_eps_lost": "the optimizer's eps is 0 in the parameter dtype",
    "optimizer_div_zero": "a division by zero in the optimizer step",
    "no_birth": "non-finite values appeared without an op making them (hooks or in-place writes)",
    "unknown": "an op made a non-finite value from finite inputs; no rule matched",
    "not_checked": "the phase that went wrong was not checked (forward-only)",
    "finite": "every value was finite",
    "nondeterministic": "the run was non-finite here but the replay is not (non-deterministic step)",
    # a finite loss spike (``kind`` spike, replay/spike.py): the 2x2 of batch and state
    "data": "the step's batch spikes on an earlier state too (named samples)",
    "state": "the state before the step spikes on another batch too (named module and quantity)",
    "interaction": "only this batch on this state spikes",
    "not_reproduced": "the spike does not reproduce from the captured state",
}

#: ``kind`` of a verdict: a non-finite value's origin, or a finite loss spike's cause.
VERDICT_KINDS = ("nonfinite", "spike")

#: ``reproducibility.class`` (replay/reproducibility.py).
REPRODUCIBILITY_CLASSES: dict[str, str] = {
    "software": "reproduces from the captured state in eager float64 too: the code or config",
    "precision": "finite in float64 (or float32 for a half-precision run): a range or rounding fault",
    "compiler": "only the compiled run fails; eager re-execution of the same state is finite",
    "transient": "repeats differ, or the captured state and RNG do not reproduce it: hardware or a "
                 "source outside the capture",
}


@dataclass(frozen=True)
class Finding:
    """What localizing one step found: the phase that went wrong, where and why, with the
    evidence. Each localizer (``replay.localize``, ``replay.forward_only``, ``replay.spike``)
    returns one; the verdict is made from it once, by :func:`make_report`. Fields as in
    :class:`Report` (a spike's finding: ``kind`` spike, ``phase`` none, ``samples``)."""

    step: int
    phase: str = "none"
    module: str | None = None
    where: str | None = None
    module_type: str | None = None
    op: str | None = None
    autograd_node: str | None = None
    parameters: list[str] = field(default_factory=list)
    cause_class: str = ""
    cause: str = ""
    fix: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)
    kind: str = "nonfinite"
    samples: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Replayed:
    """A replay's result before it is a verdict: the step it localized (``found``), what the
    rebuild showed, and the evidence it adds (rebuilt losses, precision, settings in effect).
    Fields as in :class:`Report`."""

    found: Finding
    requested_step: int
    reproduced: bool
    rank: int = 0
    capture: str = ""
    max_loss_deviation: float = 0.0
    steps_rebuilt: int = 0
    recorded_nonfinite: bool = False
    elapsed_s: float = 0.0
    rebuild_s: float = 0.0
    localize_s: float = 0.0
    ranks: list[int] = field(default_factory=list)
    loss_tolerance: float = 0.0
    evidence: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Read-only: what a replay adds is passed in whole (dataclasses.replace for more), so the
        # verdict make_report builds from it is the one the replay found (replay/ddp.py added
        # FSDP evidence to a built one).
        object.__setattr__(self, "evidence", MappingProxyType(dict(self.evidence)))


@dataclass(frozen=True)
class WhatIf:
    """What ``--what-if`` added to a verdict (``replay/cf_replay.py``): the candidate fixes'
    ``rows`` (the verdict's ``what_if``), their ``summary`` (``evidence.what_if``) and the
    ``reproducibility`` class."""

    rows: list[dict[str, Any]]
    summary: dict[str, Any]
    reproducibility: dict[str, Any]


@dataclass(frozen=True)
class CompiledCheck:
    """What the eager replay of a ``torch.compile``'d run showed (``replay/compiled.py``): the
    verdict's ``eager_reproduced`` and ``evidence.compiled``. ``tolerance`` (set when the rebuilt
    losses are within it of the compiled run's, the replay having no bitwise match): the verdict
    is ``reproduced`` under it, its ``loss_tolerance``, with ``max_loss_deviation`` the worst one."""

    eager_reproduced: bool
    evidence: dict[str, Any]
    tolerance: float | None = None
    max_loss_deviation: float = 0.0


@dataclass(frozen=True)
class Report:
    """Where the first non-finite value of a run was made, with the evidence. Made once, by
    :func:`make_report`, and never changed after (frozen)."""

    run_id: str
    rank: int
    step: int
    requested_step: int
    phase: str
    module: str | None = None
    where: str | None = None
    module_type: str | None = None
    op: str | None = None
    autograd_node: str | None = None
    parameters: list[str] = field(default_factory=list)
    reproduced: bool = False
    max_loss_deviation: float = 0.0
    steps_rebuilt: int = 0
    recorded_nonfinite: bool = False
    cause_class: str = ""
    cause: str = ""
    fix: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)
    capture: str = ""
    elapsed_s: float = 0.0
    rebuild_s: float = 0.0
    localize_s: float = 0.0
    ranks: list[int] = field(default_factory=list)
    loss_tolerance: float = 0.0
    kind: str = "nonfinite"
    samples: list[int] = field(default_factory=list)
    what_if: list[dict[str, Any]] = field(default_factory=list)
    reproducibility: dict[str, Any] | None = None
    #: The run trained a ``torch.compile``'d model; the replay ran it eagerly (replay/compiled.py).
    compiled: bool = False
    #: For a compiled run: the eager replay made the run's non-finite value at the same step
    #: (None for an eager run).
    eager_reproduced: bool | None = None
    #: How a sharded (FSDP2) run was replayed: ``"consolidated"`` (every shard loaded into one
    #: process) or ``"relaunched at world size N"`` (torchrun, each rank its shard); None otherwise.
    replayed_as: str | None = None
    schema_version: int = REPORT_SCHEMA_VERSION

    def to_json(self) -> str:
        """Strict JSON (non-finite floats become strings such as ``"nan"``)."""
        return json.dumps(_strict(asdict(self)), indent=2, sort_keys=True)


def make_report(r: Replayed, run_id: str, *, evidence: Mapping[str, Any] | None = None,
                elapsed_s: float | None = None, what_if: WhatIf | None = None,
                compiled: CompiledCheck | None = None, replayed_as: str | None = None) -> Report:
    """The verdict of run ``run_id`` from what its replay found: the one place a :class:`Report`
    is made (never changed after).

    Args:
        r: the replay's result.
        evidence: entries the caller adds (a partial DDP replay, the training process's own run).
        elapsed_s: the whole time the caller took, seconds (default the replay's own).
        what_if: the candidate fixes and reproducibility class (``--what-if``).
        compiled: for a ``torch.compile``'d run, what its eager replay showed.
        replayed_as: for a sharded (FSDP2) run, how it was replayed (:attr:`Report.replayed_as`).
    """
    f = r.found
    reproduced, tolerance, deviation = r.reproduced, r.loss_tolerance, r.max_loss_deviation
    ev = {**f.evidence, **r.evidence, **(evidence or {})}
    if what_if is not None:
        ev["what_if"] = what_if.summary
    if compiled is not None:
        ev["compiled"] = compiled.evidence
        if compiled.tolerance is not None:
            reproduced, tolerance, deviation = True, compiled.tolerance, compiled.max_loss_deviation
    return Report(run_id=run_id, rank=r.rank, step=f.step, requested_step=r.requested_step, phase=f.phase,
                  module=f.module, where=f.where, module_type=f.module_type, op=f.op, autograd_node=f.autograd_node,
                  parameters=list(f.parameters), reproduced=reproduced, max_loss_deviation=deviation,
                  steps_rebuilt=r.steps_rebuilt, recorded_nonfinite=r.recorded_nonfinite, cause_class=f.cause_class,
                  cause=f.cause, fix=f.fix, evidence=ev, capture=r.capture,
                  elapsed_s=r.elapsed_s if elapsed_s is None else elapsed_s,
                  rebuild_s=r.rebuild_s, localize_s=r.localize_s, ranks=list(r.ranks), loss_tolerance=tolerance,
                  kind=f.kind, samples=list(f.samples), what_if=list(what_if.rows) if what_if else [],
                  reproducibility=what_if.reproducibility if what_if else None,
                  compiled=compiled is not None,
                  eager_reproduced=compiled.eager_reproduced if compiled is not None else None,
                  replayed_as=replayed_as)


def verdict_outcome(report: "Mapping[str, Any] | Report") -> str:
    """What a verdict says, in one word (the daemon's ``result`` and metric label): ``localized``
    (a phase named), ``not_localized`` (reproduced, every value finite) or ``not_reproduced``
    (the rebuilt losses differ from the recorded ones). A finite loss spike's verdict
    (``kind: "spike"``) names a cause, not a phase: localized unless its cause is not_reproduced
    (its ``reproduced`` says only whether the rebuilt loss equals the recorded one).

    Args:
        report: a verdict's JSON object, or the :class:`Report` itself.
    """
    def get(key: str, default: Any = None) -> Any:
        return report.get(key, default) if isinstance(report, Mapping) else getattr(report, key, default)
    if get("kind") == "spike":
        return "not_reproduced" if get("cause_class") == "not_reproduced" else "localized"
    if not get("reproduced", False):
        return "not_reproduced"
    return "not_localized" if get("phase") == "none" else "localized"


#: The replay's exit code per :func:`verdict_outcome` (README "Exit codes", ``sentineld replay
#: --help``): the step's fault reproduced (localized, or reproduced with every value finite) is 0.
OUTCOME_EXIT_CODES = {"localized": EXIT_OK, "not_localized": EXIT_OK, "not_reproduced": EXIT_NOT_REPRODUCED}


def verdict_exit_code(report: "Mapping[str, Any] | Report") -> int:
    """The exit code of a command that prints verdict ``report``: its :func:`verdict_outcome`
    through :data:`OUTCOME_EXIT_CODES` (0 localized / not_localized, 1 not_reproduced), so the
    code and the verdict's outcome (the daemon's ``result``) never disagree."""
    return OUTCOME_EXIT_CODES[verdict_outcome(report)]


def report_problems(report: Any, run_id: str | None = None) -> list[str]:
    """What is wrong with a verdict's JSON object against this schema (empty: nothing). The one
    validator (:func:`is_verdict` is its shape part).

    Checks the shape (:func:`is_verdict`) and the fields this module defines the meaning of:
    ``module`` is a string or null, ``where`` a string (required when ``module`` is null in
    ``forward`` / ``backward``), ``cause_class`` one of :data:`CAUSE_CLASSES` (or empty in a
    verdict that names no cause).
    """
    out = _shape_problems(report, run_id)
    if not isinstance(report, Mapping):
        return out
    module, where, cls = report.get("module"), report.get("where"), report.get("cause_class", "")
    if module is not None and not isinstance(module, str):
        out.append(f"module must be a qualified module name or null, got {module!r}")
    if where is not None and not isinstance(where, str):
        out.append(f"where must be a string or null, got {where!r}")
    if module is None and report.get("phase") in ("forward", "backward") and not where:
        out.append("a forward/backward verdict with module null must say where (the 'where' field)")
    if cls and cls not in CAUSE_CLASSES:
        out.append(f"cause_class {cls!r} is none of {sorted(CAUSE_CLASSES)}")
    return out


def is_verdict(report: Any, run_id: str) -> bool:
    """True when ``report`` has the shape of a verdict of run ``run_id``: what the daemon asks of a
    replay subprocess's output before it delivers it. The shape only: a replay that runs with the
    run's own interpreter may be another sentineld release, naming a cause class this one lacks."""
    return not _shape_problems(report, run_id)


def _shape_problems(report: Any, run_id: str | None) -> list[str]:
    """An object; ``schema_version`` and ``step`` integers, ``phase`` one of :data:`PHASES`,
    ``reproduced`` a bool; ``run_id`` equal to ``run_id`` when given."""
    if not isinstance(report, Mapping):
        return [f"a verdict is a JSON object, got {type(report).__name__}"]
    out = []
    for name, types in (("schema_version", int), ("step", int), ("reproduced", bool)):
        v = report.get(name)
        if not isinstance(v, types) or (types is int and isinstance(v, bool)):
            out.append(f"{name} must be {types.__name__}, got {v!r}")
    if report.get("phase") not in PHASES:
        out.append(f"phase must be one of {PHASES}, got {report.get('phase')!r}")
    if run_id is not None and report.get("run_id") != run_id:
        out.append(f"run_id must be {run_id!r}, got {report.get('run_id')!r}")
    return out


def _strict(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return repr(obj)
    if isinstance(obj, dict):
        return {str(k): _strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict(v) for v in obj]
    return obj


def render_text(r: Report | Mapping[str, Any]) -> str:
    """The verdict as ``sentineld replay`` prints it: the title line, then the body of
    :func:`sentineld.contracts.render.render_verdict` (the one renderer; the daemon's
    notification is the same title and body)."""
    from sentineld.contracts.render import render_verdict  # noqa: PLC0415 - render imports this module's users

    title, body = render_verdict(r)
    return f"{title}\n{body}".rstrip("\n")


def notification_text(report: Report | Mapping[str, Any]) -> tuple[str, str]:
    """Title and plain-text body of the daemon's notification of a verdict (``report`` is its
    JSON, as the replay subprocess printed it): :func:`sentineld.contracts.render.render_verdict`."""
    from sentineld.contracts.render import render_verdict  # noqa: PLC0415

    return render_verdict(report)
