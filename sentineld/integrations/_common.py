"""What both framework callbacks share: checking attach's keywords when the callback is built,
and JSON-checking the values they write to run.json."""

from __future__ import annotations

import inspect
import json
import logging
from typing import Any

__all__ = ["check_attach_kwargs", "json_or_error", "log"]

log = logging.getLogger("sentineld.integrations")


def check_attach_kwargs(kwargs: dict[str, Any], set_by_callback: set[str]) -> None:
    """Raise ValueError now (when the callback is built), not at the first training batch.

    Raises:
        ValueError: an unknown keyword, or one the callback takes from the trainer.
    """
    from sentineld.agent.agent_config import AgentConfig  # noqa: PLC0415
    from sentineld.agent.watch import Watch  # noqa: PLC0415

    own = set(inspect.signature(Watch.__init__).parameters) - {"self", "model", "optimizer"}
    known = own | set(AgentConfig.__dataclass_fields__)
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"unknown agent setting(s) {unknown}; known: {sorted(known)}")
    taken = sorted(set(kwargs) & set_by_callback)
    if taken:
        raise ValueError(f"{taken} come from the trainer; do not pass them to SentineldCallback")


def json_or_error(value: Any, what: str, hint: str) -> tuple[Any, str | None]:
    """``(value, None)`` when ``value`` is JSON (finite numbers), else ``(None, message)``."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        return None, f"{what} cannot be stored as JSON ({exc}); {hint}"
    return value, None
