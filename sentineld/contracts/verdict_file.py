"""The verdict file the training process writes itself (``attach(..., loss_fn=)``, or with neither
``loss_fn`` nor a recipe: forward-only), next to the capture it explains:
``capture-rank<R>-step<N>-<trigger>.verdict.json``.

Its content is either the report of ``sentineld replay --json`` (:class:`~sentineld.contracts.verdict.Report`)
or ``{"result": "failed", "reason": ...}``. Such a run says so in ``run.json`` (``extra.localize``,
one of :data:`LOCALIZE_MODES`). The agent writes it (:mod:`sentineld.agent.localize_live`), the
daemon reads it (:mod:`sentineld.daemon.inprocess`), the replay points to it; torch-free.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .safeio import write_atomic
from .triggers import CRASH, NONFINITE

__all__ = ["verdict_path", "write_verdict", "LOCALIZE_MODES", "LOCALIZED_TRIGGERS"]

#: ``attach(localize=)`` values: ``process`` localizes in a child process started by the training
#: process (rebuilt from the run's recorded live objects: a ``loss_fn`` that holds the GIL or hangs
#: cannot stall training); ``thread`` in a background thread of the training process; ``auto``
#: (the default) is ``process`` when the live objects can be rebuilt, else ``thread``; ``off``
#: leaves it to the daemon's replay. run.json records the mode chosen.
LOCALIZE_MODES = ("auto", "process", "thread", "off")
#: Capture triggers the training process localizes (a manual capture is a checkpoint).
LOCALIZED_TRIGGERS = (NONFINITE, CRASH)


def verdict_path(capture: Path) -> Path:
    """Where the training process writes its verdict for ``capture`` (``.h5`` -> ``.verdict.json``)."""
    return capture.with_name(capture.name.removesuffix(".h5") + ".verdict.json")


def write_verdict(capture: Path, payload: dict[str, Any] | str) -> Path:
    """Write the verdict for ``capture`` atomically (the safe writer: temp file, fsync, rename; 0600).

    Args:
        payload: the report's strict JSON text, or a dict (``{"result": "failed", "reason": ...}``).

    Returns:
        The verdict's path (:func:`verdict_path`).

    Raises:
        OSError: the run directory cannot be written.
    """
    dest = verdict_path(capture)
    text = payload if isinstance(payload, str) else json.dumps(payload, allow_nan=False)
    write_atomic(dest, text)
    return dest
