"""The regression fixture: a trimmed capture holding only what the offending step needs.

It is a capture file (same writer and reader, :mod:`sentineld.contracts.capture`): the snapshot before step
S, and the batches and RNG states of steps S..N, N being the offending step. Steps after N and the
recorded gradients are left out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sentineld.contracts.capture import CaptureError, open_capture, write_capture
from sentineld.contracts.safeio import SafeDir
from sentineld.contracts.triggers import REGRESS

__all__ = ["write_fixture"]


def write_fixture(capture: Path, out: Path, step: int | None = None, at: SafeDir | None = None) -> dict[str, Any]:
    """Write the fixture of ``step`` (default: the capture's incident step) from ``capture``.

    Returns:
        ``{"step", "snapshot_step", "rank", "run_id", "bytes"}`` of what was written.

    Raises:
        CaptureError: the capture is unreadable, or ``step`` is not among its replayable steps
            (the message lists them).
        OSError: ``out`` cannot be written.

    ``at``: the opened folder of ``out`` to write it through (default: opened by path).
    """
    with open_capture(capture) as cap:
        n = cap.first_step if step is None else step
        s = cap.snapshot_step
        have = cap.steps
        if n < s or n not in have:
            span = f"{s}..{have[-1]}" if have else "none"
            raise CaptureError(f"step {n} is not replayable from {capture.name}: it holds steps {span} "
                               f"from a snapshot at step {s}; pass --step in that range")
        steps = [cap.step(k) for k in range(s, n + 1)]
        records = [r for r in cap.records() if isinstance(r, dict) and s <= r.get("step", -1) <= n]
        write_capture(out, run_id=cap.run_id, rank=cap.rank, trigger=REGRESS, first_step=n,
                      snapshot_step=s, snapshot=cap.snapshot(), steps=steps, records=records,
                      message=f"regression fixture of step {n} from {capture.name}", at=at)
        return {"step": n, "snapshot_step": s, "rank": cap.rank, "run_id": cap.run_id,
                "bytes": (at.lstat(out.name) if at else out.stat()).st_size}
