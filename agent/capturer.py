"""The capture writer: a capture (snapshot S, steps S..N, their records) is written to HDF5 on
its own thread, so the training thread only hands over references to host copies it already
made. A failure (disk full, ...) is logged and put in the stream; training goes on. With an
in-process localizer (:mod:`.localize_live`) the capture holds its recorded forward calls, and the
same thread localizes the capture once written.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import torch

from sentineld.contracts.capture import CaptureStep, write_capture
from sentineld.contracts.dcpstate import dcp_errors
from sentineld.contracts.records import AGENT_WARNING, AgentNotice
from sentineld.contracts.rundir import RunDir
from sentineld.contracts.stream import StreamWriter
from sentineld.contracts.triggers import CRASH

from .exporter import Latest
from .localize_live import LiveLocalizer
from .ring import RingEntry, Snapshot

__all__ = ["CaptureWriter"]

log = logging.getLogger("sentineld.agent")


class CaptureWriter:
    """Writes this rank's captures in background threads.

    Attributes:
        captures: paths written so far.
        crash_captured: a ``crash`` capture was written.
    """

    def __init__(self, run_dir: Path, run_id: str, rank: int, device: torch.device,
                 stream: StreamWriter, latest: Latest, localizer: LiveLocalizer | None = None) -> None:
        self.run_dir, self.run_id, self.rank, self.device = run_dir, run_id, rank, device
        self.stream, self.latest, self.localizer = stream, latest, localizer
        self.captures: list[Path] = []
        self.sharded: Any = None  # a ShardedSaver (agent/sharded.py) for an FSDP2 model
        self.crash_captured = False
        self._threads: list[threading.Thread] = []
        self._written: list[threading.Event] = []

    def start(self, trigger: str, step: int, snap: Snapshot, entries: list[RingEntry],
              message: str) -> None:
        """Start writing ``capture-rank<R>-step<step>-<trigger>.h5`` from ``snap`` and ``entries``."""
        path = RunDir(self.run_dir).capture(self.rank, step, trigger)
        written = threading.Event()
        args = (path, trigger, step, snap, entries, message, written)
        t = threading.Thread(target=self._write, args=args, name="sentineld-capture", daemon=True)
        self._threads.append(t)
        self._written.append(written)
        t.start()

    def join(self, deadline: float, localize_s: float | None = None) -> None:
        """Wait for the captures being written, until ``deadline`` (``time.monotonic``); for the
        localizations that follow them at most ``localize_s`` more (None: until ``deadline``)."""
        for ev in self._written:
            ev.wait(max(0.0, deadline - time.monotonic()))
        end = deadline if localize_s is None else min(deadline, time.monotonic() + localize_s)
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))

    def _write(self, path: Path, trigger: str, step: int, snap: Snapshot,
               entries: list[RingEntry], message: str, written: threading.Event) -> None:
        try:
            self._write_capture(path, trigger, step, snap, entries, message)
        finally:
            written.set()
        if path in self.captures and self.localizer is not None:
            self.localizer.after_capture(path, trigger, step, snap, entries)

    def _write_capture(self, path: Path, trigger: str, step: int, snap: Snapshot,
                       entries: list[RingEntry], message: str) -> None:
        try:
            snap.wait()
            if self.device.type == "cuda":
                torch.cuda.synchronize()  # blocks this thread only: batch copies must have landed
            state, sharded_dir = snap.state, None
            if self.sharded is not None:  # every rank's shards into one DCP checkpoint, together
                state, sharded_dir = self.sharded.save(self.run_dir, step, trigger, snap.step, state)
            write_capture(
                path, run_id=self.run_id, rank=self.rank, trigger=trigger, first_step=step,
                snapshot_step=snap.step, snapshot=state, sharded_state=sharded_dir,
                steps=[CaptureStep(e.step, e.batch, e.rng) for e in entries],
                records=[e.record for e in entries if e.record is not None],
                message=message, forward_calls=self.localizer.calls_for(entries) if self.localizer else None)
        # DCP's CheckpointException (a peer's save failed) is a BaseException: without it the
        # capture thread died with a traceback, no notice in the stream.
        except dcp_errors() as exc:  # disk full etc.: training goes on
            log.warning("sentineld: capture %s not written: %s (training continues)", path.name, exc)
            self.stream.put(AgentNotice(AGENT_WARNING, f"capture not written: {exc}", step).to_json(), urgent=True)
            return
        self.captures.append(path)
        self.crash_captured |= trigger == CRASH
        self.latest.captures_total += 1
