"""The result of one preflight check: a plain, JSON-ready value with no torch in it."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Literal

__all__ = ["Check", "Status", "PASS", "WARN", "FAIL", "SKIP", "overall_ok", "to_json_dict"]

Status = Literal["PASS", "WARN", "FAIL", "SKIP"]
PASS: Status = "PASS"
WARN: Status = "WARN"
FAIL: Status = "FAIL"
#: Not run: an earlier failed check makes this one fail the same way (its evidence says which).
SKIP: Status = "SKIP"


@dataclass(frozen=True)
class Check:
    """One check's verdict.

    Attributes:
        name: the check's short name (``labels``, ``inputs``, ``output_vs_loss`` ...), in the
            method's priority order in the list :func:`sentineld.preflight.check` returns.
        status: ``PASS``, ``WARN`` (look at it, training may still work), ``FAIL`` (a bug the
            method names; fix it before a long run) or ``SKIP`` (could not run because of an
            earlier failed check, named in ``evidence["blocked_by"]``: fix that one first).
        message: one sentence saying what was seen.
        evidence: the numbers behind the verdict (JSON-ready: str, int, float, lists, dicts).
        fix: what the method says to do, empty on PASS.
    """

    name: str
    status: Status
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)
    fix: str = ""

    def __post_init__(self) -> None:
        if self.status not in (PASS, WARN, FAIL, SKIP):
            raise ValueError(f"status must be PASS, WARN, FAIL or SKIP, got {self.status!r}")

    def to_dict(self) -> dict[str, Any]:
        """The check as a JSON-ready dict (keys: name, status, message, evidence, fix)."""
        return asdict(self)


def overall_ok(checks: Iterable[Check]) -> bool:
    """True when no check failed (warnings do not fail a preflight; a skipped check has a failed blocker)."""
    return all(c.status != FAIL for c in checks)


def _jsonable(v: Any) -> Any:
    """Strict-JSON values: NaN/Inf become the strings "nan"/"inf"/"-inf", tuples lists."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    return str(v)


def to_json_dict(checks: list[Check]) -> dict[str, Any]:
    """``{"ok": bool, "checks": [...]}`` as ``sentineld preflight --json`` prints it (strict JSON)."""
    return {"ok": overall_ok(checks), "checks": [_jsonable(c.to_dict()) for c in checks]}
