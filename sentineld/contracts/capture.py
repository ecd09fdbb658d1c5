"""The capture file: everything needed to rebuild and re-run the steps around an incident (HDF5).

Layout (schema version 1)::

    /                      attrs: schema_version, run_id, rank, trigger, first_step (N),
                           snapshot_step (S), created_s, message, torch_version
    /snapshot/tree         JSON string: {"model", "optimizer", "scheduler", "scaler"} state dicts,
                           tensors replaced by {"t": i}
    /snapshot/<i>          tensor i (attr torch_dtype)
    /steps/<step>/batch_tree, /steps/<step>/batch/<i>     the batch of that step
    /steps/<step>/rng_meta, /steps/<step>/rng/<name>      RNG states at that step's first forward
    /records               JSON string: list of StepRecord dicts for S..N (and any after N)
    /forward/<step>/tree, /forward/<step>/<i>   the model's top-level forward call of that step,
                           ``{"args": [...], "kwargs": {...}}`` (optional: forward-only runs)

A sharded (FSDP2) run's snapshot holds placeholders ``{"__dcp__": key}`` where its DTensors sit;
the root attribute ``sharded_state`` names the run directory's DCP checkpoint that holds them
(:mod:`sentineld.contracts.dcpstate`). Absent for every other run.

Snapshot S is the state *before* step S ran, so re-executing steps S..N-1 gives the state before N.
The gradients at N are not stored: the replay makes them again, bit for bit, from S and the batches
(captures written before this change may hold a ``/grads`` group; readers ignore it).
Nothing is pickled: trees are JSON and tensors are datasets. A capture is written to a
fresh ``<name>.<hex>.h5.tmp`` (:mod:`sentineld.contracts.safeio`), fsynced and renamed, so a
capture on disk is whole or absent.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from sentineld.contracts.capture_data import (
    CaptureError,
    CrcPool,
    numpy_to_tensor,
    put_dataset,
    read_dataset,
    read_str,
    storable,
    tensor_to_numpy,
    torch_module,
)
from sentineld.contracts.h5write import tree_bytes, write_h5_atomic
from sentineld.contracts.safeio import SafeDir, open_pinned
from sentineld.contracts.treecodec import TreeCodecError, decode, encode

log = logging.getLogger("sentineld.capture")

__all__ = [
    "SCHEMA_VERSION",
    "CaptureError",
    "CaptureStep",
    "EncodedTree",
    "EncodedRng",
    "EncodedStep",
    "write_capture",
    "Capture",
    "open_capture",
    "write_step",
    "write_snapshot",
]

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class EncodedTree:
    """A tree already in the capture's stored form, written without torch (ring recovery).

    Attributes:
        tree: its JSON-ready encoding (:func:`sentineld.contracts.treecodec.encode`, tensor i
            as ``{"t": i}``).
        tensors: ``(array, torch_dtype)`` for each tensor i, as :func:`tensor_to_numpy` gives.
    """

    tree: Any
    tensors: Sequence[tuple[np.ndarray, str]]


@dataclass(frozen=True)
class EncodedRng:
    """An RNG state in stored form: ``(meta, arrays)`` as :func:`sentineld.contracts.rng.rng_to_json` gives."""

    meta: Mapping[str, Any]
    arrays: Mapping[str, np.ndarray]


@dataclass(frozen=True)
class CaptureStep:
    """One recorded step: its index, batch (tree of CPU tensors) and RNG state (see sentineld.contracts.rng)."""

    step: int
    batch: Any
    rng: Mapping[str, Any] | None


@dataclass(frozen=True)
class EncodedStep:
    """A step to write in stored form (ring recovery): batch and RNG state already encoded."""

    step: int
    batch: EncodedTree
    rng: EncodedRng | None


def _write_tree(group: Any, tree: Any, crc: CrcPool | None = None) -> None:
    if isinstance(tree, EncodedTree):
        put_dataset(group, "tree", json.dumps(tree.tree))
        pairs: Iterable[tuple[np.ndarray, str]] = tree.tensors
    else:
        tensors: list[Any] = []
        put_dataset(group, "tree", json.dumps(encode(tree, tensors)))
        pairs = (tensor_to_numpy(t) for t in tensors)
    for i, (arr, dtype) in enumerate(pairs):
        ds = put_dataset(group, str(i), arr, crc)
        ds.attrs["torch_dtype"] = dtype


def write_step(group: Any, st: CaptureStep | EncodedStep) -> None:
    """Write one step's batch and RNG state into an HDF5 group (layout of ``/steps/<step>``);
    a batch leaf that cannot be stored is replaced by a note (:func:`~sentineld.contracts.capture_data.storable`)."""
    try:
        _write_tree(group.create_group("batch"), st.batch)
    except Exception as exc:  # TreeCodecError, or a tensor layout numpy cannot take
        if isinstance(st.batch, EncodedTree):
            raise
        log.warning("sentineld: step %s: batch stored without what a capture cannot hold (%s)",
                    group.name.rsplit("/", 1)[-1], exc)
        del group["batch"]
        _write_tree(group.create_group("batch"), storable(st.batch))
    if st.rng is None:
        return
    if isinstance(st.rng, EncodedRng):
        meta, arrays = st.rng.meta, st.rng.arrays
    else:
        from sentineld.contracts.rng import rng_to_json  # noqa: PLC0415

        meta, arrays = rng_to_json(dict(st.rng))
    put_dataset(group, "rng_meta", json.dumps(meta))
    rg = group.create_group("rng")
    for name, arr in arrays.items():
        put_dataset(rg, name, arr)


def write_snapshot(group: Any, snapshot: Mapping[str, Any] | EncodedTree, crc: CrcPool | None = None) -> None:
    """Write a state snapshot into an HDF5 group (layout of ``/snapshot``); ``crc``: see put_dataset."""
    _write_tree(group, snapshot if isinstance(snapshot, EncodedTree) else dict(snapshot), crc)


def _read_tree(group: Any) -> Any:
    tree = json.loads(read_str(group["tree"]))

    def tensor(i: int) -> Any:
        ds = group[str(i)]
        return numpy_to_tensor(read_dataset(ds), str(ds.attrs["torch_dtype"]))

    return decode(tree, tensor)


def write_capture(
    path: str | os.PathLike[str],
    *,
    run_id: str,
    rank: int,
    trigger: str,
    first_step: int,
    snapshot_step: int,
    snapshot: Mapping[str, Any] | EncodedTree,
    steps: Iterable[CaptureStep | EncodedStep],
    records: Iterable[Mapping[str, Any]],
    message: str = "",
    forward_calls: Mapping[int, Any] | None = None,
    estimate_bytes: int | None = None,
    torch_version: str | None = None,
    sharded_state: str | None = None,
    at: SafeDir | None = None,
) -> Path:
    """Write a capture atomically (temp name, fsync, rename) and return its final path.

    Args:
        snapshot: ``{"model": state_dict, "optimizer": state_dict, "scheduler": ..., "scaler": ...}``
            holding CPU tensors; the state before ``snapshot_step`` ran.
        steps: the steps ``snapshot_step..first_step`` (at least), with batches and RNG states.
        records: per-step scalar records (JSON-ready dicts).
        forward_calls: step -> ``{"args": tuple, "kwargs": dict}`` of the model's top-level forward
            (recorded for runs with neither loss_fn nor recipe; optional). A call holding a value
            with no JSON form is left out, never the capture.
        estimate_bytes: about how many bytes the data takes (for the free-space check); None
            counts the tensors of ``snapshot`` and ``steps`` (encoded data needs it given:
            ValueError otherwise). Given, ``steps`` is iterated once,
            so it may be a generator that loads each step as it is written (ring recovery).
        torch_version: recorded in the file; None = the running torch's. With it given, an
            :class:`EncodedTree` snapshot and :class:`EncodedStep` steps are written without
            importing torch.
        sharded_state: the DCP checkpoint directory (a name in the run directory) holding the
            snapshot's sharded leaves (FSDP2; see :mod:`sentineld.contracts.dcpstate`).
        at: ``path``'s directory, opened and checked by the caller (ring recovery); None opens it.

    Raises:
        OSError: the file cannot be written (permissions; a full disk gives ``errno.ENOSPC`` and a
            message saying so); the temp file is removed.
        TreeCodecError: a state dict holds an object that has no JSON form.
        ValueError: encoded data without ``estimate_bytes``.
    """
    path = Path(path)
    records = list(records)
    if estimate_bytes is None:
        steps = list(steps)
        if isinstance(snapshot, EncodedTree) or any(isinstance(st, EncodedStep) for st in steps):
            raise ValueError("write_capture: encoded data (EncodedTree, EncodedStep) needs estimate_bytes")
        estimate_bytes = (tree_bytes(dict(snapshot)) + sum(tree_bytes(st.batch) for st in steps)
                          + tree_bytes(dict(forward_calls or {})))

    def fill(f: Any) -> None:
        f.attrs.update(
            schema_version=SCHEMA_VERSION, run_id=run_id, rank=rank, trigger=trigger,
            first_step=first_step, snapshot_step=snapshot_step, created_s=time.time(), message=message,
            torch_version=str(torch_module().__version__) if torch_version is None else torch_version,
        )
        if sharded_state:
            f.attrs["sharded_state"] = sharded_state
        crc = CrcPool()
        try:
            write_snapshot(f.create_group("snapshot"), snapshot, crc)
        finally:
            crc.finish()
        sg = f.create_group("steps")
        for st in steps:
            write_step(sg.create_group(str(st.step)), st)
        put_dataset(f, "records", json.dumps(records))
        if forward_calls:
            _write_forward(f.create_group("forward"), forward_calls)

    write_h5_atomic(path, fill, estimate_bytes, durable=True, what="capture", at=at)
    return path


def _write_forward(group: Any, calls: Mapping[int, Any]) -> None:
    """``/forward/<step>/tree`` + tensors, like a batch; calls that cannot be encoded are skipped."""
    for step, call in calls.items():
        tensors: list[Any] = []
        try:
            text = json.dumps(encode(call, tensors))
        except (TreeCodecError, TypeError, ValueError):
            continue
        g = group.create_group(str(step))
        put_dataset(g, "tree", text)
        for i, t in enumerate(tensors):
            arr, dtype = tensor_to_numpy(t)
            put_dataset(g, str(i), arr).attrs["torch_dtype"] = dtype


class Capture:
    """An open capture (read-only). Use :func:`open_capture`; close with ``with`` or :meth:`close`.

    Attributes:
        path, run_id, rank, trigger, first_step (N), snapshot_step (S), message, schema_version.
        sharded_state: the DCP checkpoint directory of a sharded run's snapshot, else None.
    """

    def __init__(self, path: Path, h5: Any, fd: int = -1) -> None:
        self.path = path
        self._f = h5
        self._fd = fd  # the descriptor HDF5 opened it by (open_pinned); closed with the file
        try:
            a = h5.attrs
            self.schema_version = int(a["schema_version"])
            self.run_id = str(a["run_id"])
            self.rank = int(a["rank"])
            self.trigger = str(a["trigger"])
            self.first_step = int(a["first_step"])
            self.snapshot_step = int(a["snapshot_step"])
            self.message = str(a.get("message", ""))
            self.created_s = float(a.get("created_s", 0.0))
            self.sharded_state = str(a["sharded_state"]) if "sharded_state" in a else None
        except KeyError as exc:
            raise CaptureError(f"{path}: not a sentineld capture (missing attribute {exc}); "
                               "pass a capture-*.h5 written by sentineld.agent") from None
        except Exception as exc:  # noqa: BLE001 - h5py/numpy on a damaged file raise many types
            raise CaptureError(f"{path}: not a readable sentineld capture ({type(exc).__name__}: "
                               f"{exc}); the file is damaged, use another capture of this run") from None

    def __enter__(self) -> "Capture":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the HDF5 file."""
        self._f.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    @property
    def steps(self) -> list[int]:
        """Recorded step indices, ascending.

        Raises:
            CaptureError: the steps group is damaged.
        """
        return self._guard(lambda: sorted(int(k) for k in self._f["steps"].keys()), "steps")

    def snapshot(self) -> dict[str, Any]:
        """The state dicts before ``snapshot_step`` (CPU tensors)."""
        return self._guard(lambda: _read_tree(self._f["snapshot"]), "snapshot")

    def step(self, step: int) -> CaptureStep:
        """Batch and RNG state of ``step``.

        Raises:
            CaptureError: the step is not in this capture (the message lists the steps that are).
        """
        if not self._guard(lambda: str(step) in self._f["steps"], "steps"):
            have = self.steps
            span = f"{have[0]}..{have[-1]}" if have else "none"
            raise CaptureError(f"step {step} is not in capture {self.path.name}; it holds steps {span}")

        def load() -> CaptureStep:
            g = self._f["steps"][str(step)]
            batch = _read_tree(g["batch"])
            rng = None
            if "rng_meta" in g:
                from sentineld.contracts.rng import rng_from_json  # noqa: PLC0415

                meta = json.loads(read_str(g["rng_meta"]))
                rng = rng_from_json(meta, {k: read_dataset(v) for k, v in g["rng"].items()})
            return CaptureStep(step=step, batch=batch, rng=rng)

        return self._guard(load, f"step {step}")

    def records(self) -> list[dict[str, Any]]:
        """Per-step scalar records stored with the capture."""
        return self._guard(lambda: json.loads(read_str(self._f["records"])), "records")

    def forward_calls(self) -> dict[int, Any]:
        """step -> ``{"args": tuple, "kwargs": dict}`` of the model's recorded top-level forward
        calls ({} when the run recorded none)."""
        if not self._guard(lambda: "forward" in self._f, "forward"):
            return {}
        return self._guard(lambda: {int(k): _read_tree(g) for k, g in self._f["forward"].items()}, "forward")

    def _guard(self, fn: Any, what: str) -> Any:
        try:
            return fn()
        except CaptureError:
            raise
        except Exception as exc:  # noqa: BLE001 - h5py/numpy on a damaged file raise many types
            # Our datasets carry no filter but fletcher32, so a failing filter is a checksum.
            text = str(exc).lower()
            if "checksum" in text or "fletcher32" in text or "filter returned failure" in text:
                raise CaptureError(f"{self.path}: {what} is corrupted (checksum mismatch); the capture "
                                   "was altered after it was written: use another capture of this run") from None
            raise CaptureError(f"{self.path}: {what} is unreadable ({type(exc).__name__}: {exc}); "
                               "the capture is damaged, use another capture of this run") from None


def _reaches_out(f: Any) -> str | None:
    """The first external or soft link in HDF5 file ``f`` (HDF5 opens the file an external link
    names; soft links may loop), or None. One C-level walk of the links (``H5Lvisit``: recurses
    into hard-linked groups only, each once, resolving nothing). Datasets that keep their data in
    another file are refused where they are read (``read_dataset``)."""
    import h5py  # noqa: PLC0415

    found: list[bytes] = []

    def check(name: bytes, info: Any) -> int | None:
        if info.type != h5py.h5l.TYPE_HARD:
            found.append(name)
            return 1  # stops the walk
        return None

    f.id.links.visit(check, info=True)
    if not found:
        return None
    name = found[0].decode("utf-8", "replace")
    link = f.get(name, getlink=True)
    if isinstance(link, h5py.ExternalLink):
        return f"/{name} is an external link to {str(link.filename)[:200]}"
    return f"/{name} is a {type(link).__name__} to {str(getattr(link, 'path', '?'))[:200]}"


def open_capture(path: str | os.PathLike[str]) -> Capture:
    """Open a capture for reading and check its schema version.

    Raises:
        CaptureError: missing, not HDF5, truncated, or written by an unknown schema version.
    """
    import h5py  # noqa: PLC0415

    path = Path(path)
    try:
        # Opened once as a regular file (no link, FIFO or device) and handed to HDF5 by that
        # descriptor: a file swapped after a check is never what HDF5 opens (open_pinned).
        fd, name = open_pinned(path)
    except (FileNotFoundError, NotADirectoryError):
        raise CaptureError(f"{path}: no such capture file") from None
    except OSError as exc:
        raise CaptureError(f"{path}: cannot be read ({exc})") from None
    try:
        f = h5py.File(name, "r")
    except Exception as exc:  # noqa: BLE001 - OSError mostly; h5py raises others on odd files
        os.close(fd)
        raise CaptureError(f"{path}: cannot open as HDF5 ({exc}); the file is truncated or not a "
                           "capture. Captures are written atomically, so a damaged one was altered "
                           "after writing: use another capture of this run") from None
    try:
        cap = Capture(path, f, fd)
        if cap.schema_version != SCHEMA_VERSION:
            raise CaptureError(f"{path}: capture schema version {cap.schema_version} is not "
                               f"supported (this sentineld reads version {SCHEMA_VERSION}); "
                               "replay it with the sentineld version that wrote it")
        try:
            has_groups = "steps" in f and "snapshot" in f
        except Exception as exc:  # noqa: BLE001
            raise CaptureError(f"{path}: capture is damaged ({type(exc).__name__}: {exc})") from None
        if not has_groups:
            raise CaptureError(f"{path}: capture lacks its snapshot or steps group; it is damaged")
        try:
            out = _reaches_out(f)
        except Exception as exc:  # noqa: BLE001 - h5py raises RuntimeError on a damaged link table
            raise CaptureError(f"{path}: capture is damaged ({type(exc).__name__}: {exc}); use another "
                               "capture of this run") from None
        if out:
            raise CaptureError(f"{path}: {out}; sentineld writes self-contained captures, so this one "
                               "was crafted: it is not read (HDF5 would open that file: a FIFO there "
                               "blocks for good, another file is read as if it were this one)")
    except BaseException:
        try:
            f.close()
        except Exception:  # noqa: BLE001
            pass
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    return cap


def first_rank_capture(same_step: Sequence[tuple[int, int, str, Path]]) -> Path:
    """Among captures ``(rank, step, trigger, path)`` of one incident step, the rank that made it.

    In data-parallel training every rank's gradient is non-finite after the all-reduce, but only
    the rank whose own forward went non-finite has a non-finite loss at that step; fall back to
    the lowest rank.

    Raises:
        ValueError: ``same_step`` is empty.
    """
    if not same_step:
        raise ValueError("no capture to choose from")
    for _rank, step, _trigger, path in sorted(same_step):
        try:
            with open_capture(path) as cap:
                rec = next((r for r in cap.records() if r.get("step") == step), None)
        except CaptureError:
            continue
        loss = rec.get("loss") if isinstance(rec, dict) else None
        if isinstance(loss, (int, float)) and not math.isfinite(loss):
            return path
    return sorted(same_step)[0][3]
