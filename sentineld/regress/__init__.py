"""``sentineld regress``: turn a captured incident into a permanent pytest regression test.

:func:`assert_steps_finite` is what the written tests call (the one name they import); it is loaded
on first use (PEP 562), so the CLI registers ``sentineld regress`` without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["assert_steps_finite", "write_regression"]

_WHERE = {"assert_steps_finite": "check", "write_regression": "write"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
