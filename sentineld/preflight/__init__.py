"""``sentineld preflight``: the method's checklist and Rule #1, run before a long training run.

``check(model, optimizer, loss_fn, batches)`` returns a list of :class:`Check` in the method's
priority order; it works on copies and leaves the caller's objects and RNG states unchanged.
torch is imported on first use, so the CLI stays fast to start.
"""

from __future__ import annotations

from typing import Any

from .result import FAIL, PASS, SKIP, WARN, Check, overall_ok, to_json_dict

__all__ = ["check", "check_recipe", "Check", "PASS", "WARN", "FAIL", "SKIP", "overall_ok", "to_json_dict"]


def __getattr__(name: str) -> Any:
    if name in ("check", "check_recipe"):
        from . import runner  # noqa: PLC0415

        return getattr(runner, name)
    raise AttributeError(name)
