"""The replay's verdict: a JSON-ready record and its one-paragraph text form.

JSON fields (stable; ``schema_version`` bumps on any change): ``schema_version``, ``run_id``,
``rank``, ``step`` (the offending step), ``requested_step``, ``phase`` (``data`` | ``forward`` |
``backward`` | ``optimizer`` | ``none``), ``module``, ``module_type``, ``op``, ``autograd_node``,
``parameters``, ``reproduced``, ``max_loss_deviation``, ``steps_rebuilt``, ``recorded_nonfinite``,
``cause``, ``fix``, ``evidence``, ``capture``, ``elapsed_s``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["REPORT_SCHEMA_VERSION", "Report", "render_text"]

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
    schema_version: int = REPORT_SCHEMA_VERSION

    def to_json(self) -> str:
        """Strict JSON (non-finite floats become strings such as ``"nan"``)."""
        return json.dumps(_strict(asdict(self)), indent=2, sort_keys=True)

    @property
    def localized(self) -> bool:
        """True when a culprit phase other than ``none`` was named."""
        return self.phase != "none"


def _strict(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return repr(obj)
    if isinstance(obj, dict):
        return {str(k): _strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict(v) for v in obj]
    return obj


def render_text(r: Report) -> str:
    """One short paragraph a person reads first, then the evidence keys."""
    where = ""
    if r.module:
        where = f" in module '{r.module}' ({r.module_type})"
    op = f", op {r.op}" if r.op else ""
    node = f" [{r.autograd_node}]" if r.autograd_node else ""
    params = f"\n  parameters: {', '.join(r.parameters[:8])}" if r.parameters else ""
    repro = ("reproduced bit for bit" if r.reproduced and r.max_loss_deviation == 0
             else f"reproduced (max loss deviation {r.max_loss_deviation:.3g})" if r.reproduced
             else f"NOT reproduced (max loss deviation {r.max_loss_deviation:.3g})")
    if r.phase == "none":
        head = f"step {r.step}: replay found every value finite"
    elif r.phase == "data":
        head = f"step {r.step}: the batch holds non-finite values ({r.evidence.get('field', '?')})"
    else:
        head = f"step {r.step}: first non-finite value made in {r.phase}{where}{op}{node}"
    return (f"{head}\n  {repro} over {r.steps_rebuilt} rebuilt steps{params}\n"
            f"  likely cause: {r.cause}\n  fix: {r.fix}")
