"""sentineld.replay: rebuild the state before an offending step and name where the first
non-finite value was made (module, op, phase), with the evidence.

The names below are loaded on first use (PEP 562), so ``python -m sentineld.replay`` can report
a damaged capture before torch is imported.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["replay_run", "find_capture", "ReplayError", "Report", "render_text", "REPORT_SCHEMA_VERSION"]

_WHERE = {"replay_run": "engine", "find_capture": "engine", "ReplayError": "engine",
          "Report": "report", "render_text": "report", "REPORT_SCHEMA_VERSION": "report"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
