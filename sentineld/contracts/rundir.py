"""The run directory: the contract between the agent, the daemon and the replay.

``<runs_dir>/<run_id>/`` holds

- ``run.json``: run metadata (:class:`RunMeta`), written once by each rank (same content but pid).
- ``stream-rank<R>.jsonl``: one JSON object per line (see :mod:`sentineld.contracts.stream`).
- ``capture-rank<R>-step<N>-<trigger>.h5``: captures (see :mod:`sentineld.contracts.capture`).

Directories are created 0700 and files 0600: a run directory holds batches of training data and
names code that replay will import.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sentineld.contracts.errors import BadInput
from sentineld.contracts.safeio import MAX_RUN_JSON_BYTES, is_regular, read_json, write_atomic

__all__ = [
    "RUN_SCHEMA_VERSION",
    "RunDirError",
    "RunMeta",
    "make_private_dir",
    "runs_dir_problem",
    "write_run_meta",
    "read_run_meta",
    "resolve_run",
    "RunDir",
    "stream_path",
    "capture_name",
    "list_captures",
    "parse_capture_name",
    "valid_run_id",
]

RUN_SCHEMA_VERSION = 1
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class RunDirError(BadInput):
    """A run directory or its ``run.json`` is missing or malformed (the message says which and why)."""


@dataclass(frozen=True)
class RunMeta:
    """What the daemon and the replay need to know about a run.

    Attributes:
        run_id: the run's name (letters, digits, ``._-``; at most 128 characters).
        recipe: ``"module:function"`` returning a :class:`sentineld.recipe.Recipe`, imported by the
            replay from ``cwd``; None when the run gave none (replay then needs ``--recipe``).
        recipe_args: keyword arguments (JSON values) the replay passes to the recipe function.
        python: interpreter that ran training (the replay runs with the same one).
        cwd: training's working directory (the user's model code lives there).
        host, pid, rank, world_size: where the run lives.
        torch_version, num_threads: replay checks these to explain a mismatch.
        num_classes: classes of a classification loss, for the ln(C) first-loss check (optional).
        started_s: Unix time the agent attached.
        extra: free-form user metadata (strings, numbers).
    """

    run_id: str
    recipe: str | None = None
    recipe_args: dict[str, Any] = field(default_factory=dict)
    python: str = field(default_factory=lambda: sys.executable)
    cwd: str = field(default_factory=os.getcwd)
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    rank: int = 0
    world_size: int = 1
    torch_version: str = ""
    num_threads: int = 1
    num_classes: int | None = None
    started_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    schema_version: int = RUN_SCHEMA_VERSION


#: The JSON types each run.json field may have (bool is excluded where an int is meant).
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "run_id": (str,), "recipe": (str, type(None)), "recipe_args": (dict,), "python": (str,), "cwd": (str,),
    "host": (str,), "pid": (int,), "rank": (int,), "world_size": (int,), "torch_version": (str,),
    "num_threads": (int,), "num_classes": (int, type(None)), "started_s": (int, float), "extra": (dict,),
    "schema_version": (int,),
}


def _wrong_types(meta: RunMeta) -> list[str]:
    """``name (got type)`` for each field whose value is not of its declared JSON type."""
    out = []
    for name, types in _FIELD_TYPES.items():
        v = getattr(meta, name)
        if (isinstance(v, bool) and bool not in types) or not isinstance(v, types):
            out.append(f"{name} ({type(v).__name__} {str(v)[:40]!r})")
    if isinstance(meta.world_size, int) and not isinstance(meta.world_size, bool) and meta.world_size < 1:
        out.append(f"world_size ({meta.world_size} < 1)")
    return out


def valid_run_id(run_id: str) -> bool:
    """True when ``run_id`` is a safe directory name."""
    return bool(_RUN_ID.match(run_id)) and run_id not in {".", ".."}


def make_private_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` (and parents) with mode 0700; return it. A folder that already exists keeps
    its mode: it may be a runs dir shared with other users (chmod-ing a 1777 dir to 0700 would
    switch their agents off), and what we did not create is not ours to change.

    Raises:
        RunDirError: ``path`` (or a parent) is a file, or cannot be created (the message says which).

    Missing parents are created 0700 too (``Path.mkdir(parents=True)`` would give them the
    umask's mode, e.g. 0755, and leave the list of runs readable by everyone).
    """
    p = Path(path)
    missing = []
    q = p
    try:
        while not q.exists() and q.parent != q:
            missing.append(q)
            q = q.parent
        for d in reversed(missing):
            try:
                d.mkdir(mode=0o700)
                os.chmod(d, 0o700)  # mkdir's mode is masked by the umask; this folder is ours
            except FileExistsError:
                pass  # created meanwhile by another rank or process
        if not p.is_dir():
            raise FileExistsError(p)
    except FileExistsError:
        raise RunDirError(f"{p} exists and is not a directory; point it at a directory "
                          "(e.g. SENTINELD_RUNS_DIR or --runs-dir)") from None
    except OSError as exc:
        raise RunDirError(f"cannot create directory {str(p)[:200]}: {exc.strerror or exc}") from None
    return p


def runs_dir_problem(path: str | os.PathLike[str]) -> str | None:
    """Why the runs dir ``path`` cannot be trusted to hold run dirs, or None when it can.

    A runs dir may be shared: owned by us or root and either private or sticky (mode 1777, like
    ``/tmp``: others may add their run dirs but cannot rename or replace ours). One that another
    user owns, or that others may write without the sticky bit, lets them swap a run dir for a
    link after it was checked; the agent and the daemon refuse it (the message says what to do).
    """
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"cannot open runs dir {path}: {exc.strerror or exc}"
    if not stat.S_ISDIR(st.st_mode):
        return f"runs dir {path} is not a directory"
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        return (f"runs dir {path} is owned by uid {st.st_uid}, not by you (uid {me}) or root: that user "
                "could replace the run dirs in it. Use a runs dir of your own (SENTINELD_RUNS_DIR / "
                "--runs-dir), or have root create a shared one with mode 1777")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        return (f"runs dir {path} is writable by others without the sticky bit (mode "
                f"{stat.S_IMODE(st.st_mode):o}): another user could replace the run dirs in it. Run "
                f"`chmod +t {path}` (a shared runs dir is 1777, like /tmp) or `chmod go-w {path}`")
    return None


def write_run_meta(run_dir: Path, meta: RunMeta) -> Path:
    """Write ``run.json`` atomically with mode 0600 (rank 0 wins; other ranks write
    ``run-rank<R>.json``), through the safe writer (:mod:`sentineld.contracts.safeio`)."""
    path = run_dir / RunDir.meta_name(meta.rank)
    write_atomic(path, json.dumps(asdict(meta), indent=1), durable=False)
    return path


def read_run_meta(run_dir: str | os.PathLike[str]) -> RunMeta:
    """Read and validate ``run.json`` (falls back to the lowest ``run-rank<R>.json``).

    Raises:
        RunDirError: missing, not JSON, unknown schema version, or a field of the wrong type.
    """
    run_dir = Path(run_dir)
    path = run_dir / RunDir.RUN_JSON
    if not path.exists():
        others = sorted(run_dir.glob("run-rank*.json"))
        if not others:
            raise RunDirError(f"{run_dir}: no run.json; is this a run directory written by "
                              "sentineld.agent?")
        path = others[0]
    try:
        obj = read_json(path, MAX_RUN_JSON_BYTES)
    except (OSError, ValueError) as exc:
        raise RunDirError(f"{path}: unreadable run metadata ({exc})") from None
    except RecursionError:
        raise RunDirError(f"{path}: run metadata nested too deeply to be a run.json") from None
    if not isinstance(obj, dict):
        raise RunDirError(f"{path}: run metadata must be a JSON object")
    version = obj.get("schema_version")
    if version != RUN_SCHEMA_VERSION:
        raise RunDirError(f"{path}: run schema version {version!r} is not supported "
                          f"(expected {RUN_SCHEMA_VERSION})")
    known = set(RunMeta.__dataclass_fields__)
    unknown = set(obj) - known
    if unknown:
        raise RunDirError(f"{path}: unknown fields {sorted(unknown)}")
    try:
        meta = RunMeta(**obj)
    except TypeError as exc:
        raise RunDirError(f"{path}: {exc}") from None
    bad = _wrong_types(meta)
    if bad:
        raise RunDirError(f"{path}: fields of the wrong type: {', '.join(bad)}")
    if not isinstance(meta.run_id, str) or not valid_run_id(meta.run_id):
        raise RunDirError(f"{path}: run_id {meta.run_id!r} is not a valid run id")
    if meta.recipe is not None and (not isinstance(meta.recipe, str) or ":" not in meta.recipe):
        raise RunDirError(f"{path}: recipe must be 'module:function', got {meta.recipe!r}")
    return meta


def resolve_run(run: str, runs_dir: str | os.PathLike[str] | None) -> Path:
    """Turn a run id or a run directory path into the run directory.

    Raises:
        RunDirError: neither a directory nor a run id under ``runs_dir``.
    """
    p = Path(run)
    try:
        if p.is_dir():
            return p
        if runs_dir is not None and valid_run_id(run) and (Path(runs_dir) / run).is_dir():
            return Path(runs_dir) / run
    except OSError as exc:  # a name over the OS limit (ENAMETOOLONG), a folder we may not enter
        raise RunDirError(f"no run {run[:80]!r}{'...' if len(run) > 80 else ''}: {exc.strerror or exc}; "
                          "pass a run directory or a run id (list them with `sentineld runs`)") from None
    if p.is_absolute() or os.sep in run or run.startswith("."):
        # A path was meant: speak of that path, not of the runs dir it was never looked up in.
        what = "is not a directory" if p.exists() else "does not exist"
        raise RunDirError(f"run directory {run} {what}: pass an existing run directory or a run id "
                          "(list them with `sentineld runs`)")
    where = f" under {runs_dir}" if runs_dir else ""
    raise RunDirError(f"no run {run!r}{where}: pass a run directory or a run id "
                      "(list them with `sentineld runs`)")


def default_runs_dir() -> Path:
    """Parent of run directories by default, for the agent, the daemon and the replay alike:
    ``$SENTINELD_RUNS_DIR``, else ``<user state dir>/sentineld/runs`` (platformdirs)."""
    env = os.environ.get("SENTINELD_RUNS_DIR")
    if env:
        return Path(env).expanduser()   # a quoted "~/runs" in a unit file or .env is not expanded by a shell
    import platformdirs  # noqa: PLC0415

    return Path(platformdirs.user_state_dir("sentineld")) / "runs"


class RunDir:
    """Every name in a run directory, and the patterns that recognise them: the one place they are
    spelled (agent, daemon, recovery and replay all ask this object).

    Args:
        path: the run directory.
    """

    RUN_JSON = "run.json"
    STREAM = re.compile(r"^stream-rank(\d+)\.jsonl$")
    CAPTURE = re.compile(r"^capture-rank(\d+)-step(\d+)-([a-z_]+)\.h5$")
    RING_PREFIX = "ring-rank"
    RING = re.compile(r"^ring-rank(\d+)-(\d+)(?:-\d+)?$")

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @staticmethod
    def meta_name(rank: int) -> str:
        """``run.json`` for rank 0, ``run-rank<R>.json`` for the others."""
        return RunDir.RUN_JSON if rank == 0 else f"run-rank{rank}.json"

    def stream(self, rank: int) -> Path:
        """Rank ``rank``'s metrics stream, ``stream-rank<R>.jsonl``."""
        return self.path / f"stream-rank{rank}.jsonl"

    @staticmethod
    def capture_name(rank: int, step: int, trigger: str) -> str:
        """``capture-rank<R>-step<N>-<trigger>.h5`` (sorts by rank, then step)."""
        return f"capture-rank{rank}-step{step:09d}-{trigger}.h5"

    def capture(self, rank: int, step: int, trigger: str) -> Path:
        """Path of a capture (see :meth:`capture_name`)."""
        return self.path / self.capture_name(rank, step, trigger)

    def unfinished_captures(self, rank: int) -> list[Path]:
        """Rank ``rank``'s ``*.h5.tmp`` files: captures a killed process never finished."""
        return list(self.path.glob(f"capture-rank{rank}-*.h5.tmp"))

    def ring_name(self, rank: int, pid: int, n: int = 0) -> str:
        """Name of an on-disk ring directory (``ring-rank<R>-<pid>[-<n>]``)."""
        base = f"{self.RING_PREFIX}{rank}-{pid}"
        return base if n == 0 else f"{base}-{n}"

    def ring_dirs(self) -> list[Path]:
        """On-disk ring directories in this run directory, sorted (none when unreadable)."""
        try:
            return sorted(p for p in self.path.iterdir()
                          if p.name.startswith(self.RING_PREFIX) and p.is_dir() and not p.is_symlink())
        except OSError:
            return []

    @classmethod
    def stream_rank(cls, name: str) -> int | None:
        """The rank of a stream file name, or None if it is not one."""
        m = cls.STREAM.match(name)
        return int(m.group(1)) if m else None

    @classmethod
    def parse_capture_name(cls, name: str) -> tuple[int, int, str] | None:
        """``(rank, step, trigger)`` of a capture file name, or None if it is not one."""
        m = cls.CAPTURE.match(name)
        return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None

    def captures(self) -> list[tuple[int, int, str, Path]]:
        """Finished captures as ``(rank, step, trigger, path)`` sorted by step, then rank.

        Raises:
            OSError: the directory cannot be listed.
        """
        out = []
        for p in self.path.iterdir():
            parsed = self.parse_capture_name(p.name)
            if parsed and is_regular(p):  # a symlink or FIFO named like a capture is none
                out.append((*parsed, p))
        return sorted(out, key=lambda t: (t[1], t[0]))


def stream_path(run_dir: Path, rank: int) -> Path:
    """Path of rank ``rank``'s metrics stream (:meth:`RunDir.stream`)."""
    return RunDir(run_dir).stream(rank)


def capture_name(rank: int, step: int, trigger: str) -> str:
    """File name of a capture (:meth:`RunDir.capture_name`)."""
    return RunDir.capture_name(rank, step, trigger)


def list_captures(run_dir: Path) -> list[tuple[int, int, str, Path]]:
    """Finished captures as ``(rank, step, trigger, path)`` sorted by step, then rank (temp files skipped)."""
    return RunDir(run_dir).captures()


def parse_capture_name(name: str) -> tuple[int, int, str] | None:
    """``(rank, step, trigger)`` of a capture file name, or None if it is not one."""
    return RunDir.parse_capture_name(name)
