"""The replay's verdict: its schema (:class:`Report`, a JSON-ready record). Its one renderer is
:func:`sentineld.contracts.render.render_verdict` (title and body, then HTML or markdown with
``format_body``); :func:`render_text` (what ``sentineld replay`` prints) and
:func:`notification_text` (the daemon's notification, what the demo prints) are that renderer.

JSON fields (stable; ``schema_version`` bumps on any change): ``schema_version``, ``run_id``,
``rank``, ``step`` (the offending step), ``requested_step``, ``phase`` (``data`` | ``forward`` |
``backward`` | ``optimizer`` | ``none``), ``module``, ``module_type``, ``op``, ``autograd_node``,
``parameters``, ``reproduced``, ``max_loss_deviation``, ``steps_rebuilt``, ``recorded_nonfinite``,
``cause``, ``fix``, ``evidence``, ``capture``, ``elapsed_s``, ``rebuild_s`` (loading the capture and
re-executing S..N-1), ``localize_s`` (the instrumented step).

``evidence`` keys by phase: ``data``: ``field``, ``samples``, ``fields``; ``forward``:
``op_inputs``, ``op_output``, ``module_call``, ``first_nonfinite_module``, ``micro_batch``;
``backward``: ``op_inputs``, ``op_output``; ``optimizer``: ``state_entry``, ``optimizer_state``,
``eps``, ``inf_gradient_origin`` (clipping), ``scheduler`` (learning rate); always
``replayed_loss``, ``recorded_loss``, ``rebuilt_losses``, ``births``, ``nan_table_row``,
``precision``, ``torch_flags``; a verdict of the training process itself (``attach(loss_fn=)``,
:mod:`sentineld.contracts.verdict_file`) adds ``in_process`` (``mode``, ``memory_bytes``, ``wall_s``),
and a forward-only one ``not_checked`` (phases it could not check) and ``how_to_enable``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

__all__ = ["REPORT_SCHEMA_VERSION", "Report", "render_text", "notification_text"]

REPORT_SCHEMA_VERSION = 1


@dataclass
class Report:
    """Where the first non-finite value of a run was made, with the evidence."""

    run_id: str
    rank: int
    step: int
    requested_step: int
    phase: str
    module: str | None = None
    module_type: str | None = None
    op: str | None = None
    autograd_node: str | None = None
    parameters: list[str] = field(default_factory=list)
    reproduced: bool = False
    max_loss_deviation: float = 0.0
    steps_rebuilt: int = 0
    recorded_nonfinite: bool = False
    cause: str = ""
    fix: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)
    capture: str = ""
    elapsed_s: float = 0.0
    rebuild_s: float = 0.0
    localize_s: float = 0.0
    schema_version: int = REPORT_SCHEMA_VERSION

    def to_json(self) -> str:
        """Strict JSON (non-finite floats become strings such as ``"nan"``)."""
        return json.dumps(_strict(asdict(self)), indent=2, sort_keys=True)


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
