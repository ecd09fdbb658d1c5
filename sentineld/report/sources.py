"""Read what a report shows from a run directory and the daemon's state directory.

Every file is read through the project's readers: ``run.json`` by :mod:`sentineld.contracts.rundir`, the
stream by :mod:`sentineld.contracts.stream` and :func:`~sentineld.contracts.records.record_from_json`, captures by
:mod:`sentineld.contracts.capture`, the daemon's outbox notifications by :mod:`sentineld.daemon.outbox`. Nothing
here writes to either directory.
"""

from __future__ import annotations

import errno
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

from sentineld.contracts.capture import CaptureError, open_capture
from sentineld.contracts.records import STEP, StepRecord, record_from_json
from sentineld.contracts.rundir import list_captures, read_run_meta, stream_path
from sentineld.contracts.safeio import read_json
from sentineld.contracts.stream import StreamTail
from sentineld.contracts.verdict_file import verdict_path
from sentineld.daemon import outbox
from sentineld.daemon.outbox import Notification

from . import data as d

__all__ = ["read_records", "read_notifications", "read_verdict", "gather"]

log = logging.getLogger("sentineld.report")

#: Largest verdict or replay record read (a report is a few KiB).
MAX_VERDICT_FILE_BYTES = 8 << 20


def read_records(run_dir: Path, rank: int) -> tuple[list[StepRecord], int]:
    """Step records of rank ``rank``'s stream, and the count of lines skipped as damaged.

    Raises:
        OSError: the stream exists but cannot be read.
    """
    tail = StreamTail(stream_path(run_dir, rank))
    out: list[StepRecord] = []
    bad = 0
    while True:
        for obj in tail.read():
            if obj.get("kind") != STEP:
                continue
            try:
                out.append(record_from_json(obj))
            except (ValueError, TypeError):
                bad += 1
        if not tail.behind:
            return out, bad + tail.bad_lines


def read_notifications(state_dir: Path | None, run_id: str) -> list[Notification]:
    """The daemon's notifications about ``run_id`` (pending and delivered); [] without a state dir."""
    if state_dir is None:
        return []
    # Read-only: an Outbox() would remove a "*.json.tmp" the running daemon is about to rename.
    return [n for n in outbox.read_notifications(state_dir / "outbox") if n.run == run_id]


def _verdict_of(obj: Any) -> dict[str, Any] | None:
    """The replay verdict in ``obj``: the replay's JSON itself, or the daemon's record holding it."""
    if isinstance(obj, dict) and isinstance(obj.get("report"), dict):
        obj = obj["report"]
    if isinstance(obj, dict) and "phase" in obj and "step" in obj:
        return obj
    return None


def read_verdict(path: Path) -> dict[str, Any]:
    """A verdict file: ``sentineld replay --json`` output or a daemon ``replays/*.json`` record.

    Raises:
        ValueError: the file is not JSON, is larger than ``MAX_VERDICT_FILE_BYTES``, or holds no
            verdict (the message says what it expected).
        OSError: it cannot be read.
    """
    try:
        obj = read_json(path, MAX_VERDICT_FILE_BYTES)
    except OSError as exc:
        if exc.errno != errno.EFBIG:
            raise
        # Not "cannot write the report": the command reports an OSError as the page's own write failing.
        raise ValueError(f"{exc.strerror}; a verdict is a few KiB: pass the JSON of `sentineld replay "
                         "--json` or a daemon replays/*.json record") from None
    except UnicodeDecodeError:  # a binary file (an .h5 capture given by mistake): name it
        raise ValueError(f"{path}: not a verdict (a binary file, not JSON text); pass the JSON of "
                         "`sentineld replay --json` or a daemon replays/*.json record") from None
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    v = _verdict_of(obj)
    if v is None:
        raise ValueError(f"{path}: holds no replay verdict (expected the JSON of `sentineld replay "
                         "--json` or a daemon replays/*.json record)")
    return v


def daemon_verdict(state_dir: Path | None, run_id: str, notes: list[Notification]) -> dict[str, Any] | None:
    """The newest verdict the daemon recorded for ``run_id`` (its replays dir, then its outbox)."""
    found = []
    if state_dir is not None and (state_dir / "replays").is_dir():
        for p in (state_dir / "replays").glob("*.json"):
            try:
                v = _verdict_of(read_json(p, MAX_VERDICT_FILE_BYTES))
            except (OSError, ValueError):
                continue
            if v is not None and v.get("run_id") == run_id:
                found.append((p.stat().st_mtime, v))
    if found:
        return max(found, key=lambda t: t[0])[1]
    vs = [n for n in notes if n.kind == "verdict" and _verdict_of(n.data)]
    return _verdict_of(max(vs, key=lambda n: n.created_s).data) if vs else None


def agent_verdict(capture: Path) -> dict[str, Any] | None:
    """The verdict the training process wrote next to ``capture`` (``.verdict.json``), if any.

    A ``failed`` record or an unreadable file gives None (the page then says how to replay).
    """
    try:
        return _verdict_of(read_json(verdict_path(capture), MAX_VERDICT_FILE_BYTES))
    except (OSError, ValueError):
        return None


def capture_info(path: Path) -> tuple[dict[str, Any], list[d.Hist]]:
    """Header of a capture and histograms of the snapshot's floating model tensors.

    Raises:
        CaptureError: the capture cannot be read.
    """
    with open_capture(path) as cap:
        info = {"path": str(path), "trigger": cap.trigger, "first_step": cap.first_step,
                "snapshot_step": cap.snapshot_step, "steps": cap.steps, "message": cap.message}
        model = (cap.snapshot().get("model") or {})
    hists = []
    for name, t in model.items():
        if hasattr(t, "is_floating_point") and t.is_floating_point() and t.numel() > 1:
            hists.append(d.hist(name, t.detach().float().numpy(), str(t.dtype).removeprefix("torch.")))
        if len(hists) >= d.MAX_HISTS:
            break
    return info, hists


def gather(run_dir: Path, *, rank: int = 0, state_dir: Path | None = None,
           verdict: dict[str, Any] | None = None, capture: Path | None = None,
           activations: bool = True, trust: bool = False) -> d.ReportData:
    """Read everything a report shows.

    Args:
        run_dir: the run directory.
        rank: whose stream and captures to show.
        state_dir: the daemon's state dir (alerts and verdicts); None skips them.
        verdict: a replay verdict to show (from ``--verdict`` or ``--replay``); None: the daemon's.
        capture: the capture to show (default: the one the replay would choose).
        activations: run one forward of the captured batch through the recipe.
        trust: import the recipe without ownership checks.

    Raises:
        RunDirError: not a run directory. OSError: the stream cannot be read.
    """
    meta = read_run_meta(run_dir)
    records, bad = read_records(run_dir, rank)
    caps = list_captures(run_dir)
    notes = read_notifications(state_dir, meta.run_id)
    markers = d.capture_markers(caps, rank) + d.alert_markers(notes)
    out = d.ReportData(run_id=meta.run_id, run_dir=str(run_dir), rank=rank, meta=asdict(meta),
                       curves=d.curves(records), markers=markers, alerts=notes,
                       grids=[d.layer_grid(records, "grad_norm"), d.layer_grid(records, "update_ratio"),
                              d.dead_or_saturated_grid(records)])
    if not records:
        out.notes.append(f"rank {rank} has no step records in {stream_path(run_dir, rank).name}")
    if bad:
        out.notes.append(f"{bad} damaged stream lines skipped")
    cap_path = capture or _default_capture(run_dir, caps, rank)
    # The training process's own verdict (loss_fn / forward-only runs) sits next to the capture;
    # without a daemon state dir it is the only verdict there is, so a daemon-less run shows it.
    out.verdict = (verdict or daemon_verdict(state_dir, meta.run_id, notes)
                   or (agent_verdict(cap_path) if cap_path is not None else None))
    if out.verdict is None:
        out.verdict_note = (f"no replay verdict for this run: run `sentineld report {run_dir} --replay`, "
                            f"or `sentineld replay {run_dir} --json > v.json` and "
                            f"`sentineld report {run_dir} --verdict v.json`")
    if cap_path is None:
        out.activations_note = "no capture in this run: nothing to draw weights and activations from"
        return out
    try:
        out.capture, out.weights = capture_info(cap_path)
    except CaptureError as exc:
        out.activations_note = str(exc)
        return out
    if activations:
        from .activations import capture_activations  # noqa: PLC0415 - imports the user's code

        out.activations, out.activations_note = capture_activations(run_dir, meta, cap_path, trust)
    else:
        out.activations_note = "activations not computed (--no-activations)"
    return out


def _default_capture(run_dir: Path, caps: list[tuple[int, int, str, Path]], rank: int) -> Path | None:
    mine = [c for c in caps if c[0] == rank]
    if not mine:
        return None
    incidents = [c for c in mine if c[2] == "nonfinite"] or mine
    return incidents[0][3]

