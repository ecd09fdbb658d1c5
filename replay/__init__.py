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
          "Report": "verdict", "render_text": "verdict", "REPORT_SCHEMA_VERSION": "verdict"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        where = _WHERE[name]
        module = "sentineld.contracts.verdict" if where == "verdict" else f"{__name__}.{where}"
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
