"""Sharded (FSDP2) snapshots: the DTensor part of a capture, stored with torch.distributed.checkpoint.

A model sharded with ``torch.distributed.fsdp.fully_shard`` holds each parameter (and Adam's
``exp_avg``/``exp_avg_sq``) as a DTensor: every rank owns one shard. A capture of such a run is
two parts:

- every rank's HDF5 capture (:mod:`.capture`) holds its batches, RNG states, records and the
  snapshot's *unsharded* leaves (Adam's ``step``, param groups, buffers, scheduler, scaler); each
  sharded leaf is replaced there by a placeholder ``{"__dcp__": key}``, and the file's attribute
  ``sharded_state`` names the checkpoint directory;
- one DCP checkpoint per incident step, ``capture-step<N>-<trigger>-snap<S>.dcp/`` in the run
  directory, written by every rank together (``.metadata`` + one ``__<rank>_0.distcp`` per rank),
  holding the sharded leaves under their keys (``model/fc1.weight``,
  ``optimizer/state/0/exp_avg``), each with its global shape and each shard's offsets. DCP
  reshards at load, so the checkpoint reloads at any world size: consolidated into one process
  (:func:`load_consolidated`) or into a sharded model of another world size (``dcp.load`` with
  that model's DTensors under the same keys).

:func:`split_sharded` and :func:`fill_sharded` need no torch; the DCP readers import it lazily.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

__all__ = ["PLACEHOLDER", "SHARDED_ATTR", "dcp_dir_name", "split_sharded", "placeholders",
           "fill_sharded", "checkpoint_bytes", "load_consolidated", "dcp_errors", "describe_dcp_error"]

#: The key of a placeholder leaf in a capture's snapshot tree.
PLACEHOLDER = "__dcp__"
#: The capture's root attribute naming the checkpoint directory (relative to the run directory).
SHARDED_ATTR = "sharded_state"

_DIR = re.compile(r"^capture-step(\d+)-([a-z_]+)-snap(\d+)\.dcp$")


def dcp_dir_name(step: int, trigger: str, snapshot_step: int) -> str:
    """The checkpoint directory of the incident at ``step`` whose snapshot is ``snapshot_step``."""
    return f"capture-step{step}-{trigger}-snap{snapshot_step}.dcp"


def _walk(tree: Any, path: str, leaf: Callable[[Any, str], Any]) -> Any:
    if isinstance(tree, dict):
        return {k: _walk(v, f"{path}/{k}" if path else str(k), leaf) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_walk(v, f"{path}/{i}", leaf) for i, v in enumerate(tree)]
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return tuple(_walk(v, f"{path}/{i}", leaf) for i, v in enumerate(tree))
    return leaf(tree, path)


def split_sharded(state: Any, is_sharded: Callable[[Any], bool]) -> tuple[Any, dict[str, Any]]:
    """``(state with each sharded leaf replaced by a placeholder, {key: sharded leaf})``.

    Args:
        state: a snapshot tree (dicts, lists, tuples).
        is_sharded: True for a leaf that goes to the checkpoint (a DTensor).

    The key is the leaf's path, ``/``-joined (dict keys as ``str``: optimizer state's int ids
    become ``"0"``); it is both the placeholder's value and the DCP key.
    """
    out: dict[str, Any] = {}

    def leaf(x: Any, path: str) -> Any:
        if is_sharded(x):
            out[path] = x
            return {PLACEHOLDER: path}
        return x

    return _walk(state, "", leaf), out


def _key(x: Any) -> str | None:
    if isinstance(x, dict) and len(x) == 1 and isinstance(x.get(PLACEHOLDER), str):
        return str(x[PLACEHOLDER])
    return None


def placeholders(tree: Any) -> list[str]:
    """Keys of the placeholders in a snapshot tree read from a capture."""
    keys: list[str] = []

    def visit(x: Any) -> None:
        k = _key(x)
        if k is not None:
            keys.append(k)
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)

    visit(tree)
    return keys


def fill_sharded(tree: Any, values: Mapping[str, Any]) -> Any:
    """``tree`` with each placeholder replaced by ``values[key]``.

    Raises:
        KeyError: a placeholder whose key ``values`` lacks (the checkpoint does not match the capture).
    """

    def fill(x: Any) -> Any:
        k = _key(x)
        if k is not None:
            if k not in values:
                raise KeyError(f"sharded state {k!r} is not in the checkpoint")
            return values[k]
        if isinstance(x, dict):
            return {kk: fill(v) for kk, v in x.items()}
        if isinstance(x, list):
            return [fill(v) for v in x]
        if isinstance(x, tuple) and not hasattr(x, "_fields"):
            return tuple(fill(v) for v in x)
        return x

    return fill(tree)


def dcp_errors() -> tuple[type[BaseException], ...]:
    """What DCP raises on a damaged or foreign checkpoint, for an ``except`` clause.

    Its ``CheckpointException`` (a shard that failed to read on some rank: truncated, replaced)
    derives from ``BaseException``, so ``except Exception`` lets it through as a traceback.
    """
    try:
        from torch.distributed.checkpoint.api import CheckpointException  # noqa: PLC0415
    except ImportError:  # a torch built without distributed: only Exception can come
        return (Exception,)
    return (Exception, CheckpointException)


def describe_dcp_error(exc: BaseException) -> str:
    """``exc`` in one line: for DCP's ``CheckpointException``, each failing rank's own error
    (its ``str`` is every rank's whole traceback), else ``Type: message``. At most 500 characters."""
    def line(e: BaseException) -> str:  # torch.load's unpickler errors run to a page: the first line says it
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
        return f"{type(e).__name__}: {first[:200]}".rstrip(": ")

    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        text = "; ".join(f"rank {rank}: {line(pair[0] if isinstance(pair, tuple) and pair else pair)}"
                         for rank, pair in sorted(failures.items()))
    else:
        text = line(exc)
    return text[:500]


def _metadata(path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader  # noqa: PLC0415

    return FileSystemReader(str(path)).read_metadata()


def checkpoint_bytes(path: str | Path) -> int:
    """Bytes the checkpoint's tensors take once consolidated (the sum of their global sizes)."""
    import torch  # noqa: PLC0415

    total = 0
    for md in _metadata(Path(path)).state_dict_metadata.values():
        size = getattr(md, "size", None)
        if size is None:
            continue
        n = 1
        for d in size:
            n *= int(d)
        total += n * torch.empty((), dtype=md.properties.dtype).element_size()
    return total


def load_consolidated(path: str | Path) -> dict[str, Any]:
    """Every sharded leaf of the checkpoint at ``path`` as one whole CPU tensor, by key.

    DCP's own load, without a process group (``no_dist``): each key's full-size tensor is
    allocated from the checkpoint's metadata and every rank's shard is read into its offsets,
    so the result is what the run's tensors were, unsharded, whatever the world size was.

    Raises:
        FileNotFoundError / ValueError: ``path`` is not a DCP checkpoint (missing ``.metadata``).
    """
    import torch  # noqa: PLC0415
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    p = Path(path)
    if not (p / ".metadata").is_file():
        raise FileNotFoundError(f"{p}: no DCP checkpoint here (its .metadata is missing)")
    sd: dict[str, Any] = {}
    for key, md in _metadata(p).state_dict_metadata.items():
        size = getattr(md, "size", None)
        if size is not None:
            sd[key] = torch.empty(tuple(size), dtype=md.properties.dtype)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load(sd, checkpoint_id=str(p), no_dist=True)
    return sd


def parse_dir_name(name: str) -> tuple[int, str, int] | None:
    """``(step, trigger, snapshot step)`` of a checkpoint directory name, or None."""
    m = _DIR.match(name)
    return (int(m.group(1)), m.group(2), int(m.group(3))) if m else None
