"""The one way sentineld touches a run dir or its state dir: through a checked directory descriptor.

A run directory is written by the training process, and in a shared runs dir possibly by another
user; the daemon (often root), ``sentineld report`` and the replay read it and sometimes write into
it (ring recovery, a report). Whatever sits in such a directory may be a trap: a symlink named like
the temp file we are about to write (we would write through it, wherever it points), a FIFO named
``meta.json`` (we would block), a link to ``/dev/zero`` (we would read without end). So:

- A directory is opened once (:meth:`SafeDir.open`: ``O_DIRECTORY | O_NOFOLLOW``, then ``fstat``
  checks its owner and mode) and every file is opened *relative to that descriptor*, never by a
  path that could be re-resolved through a swapped folder.
- Files are opened with ``O_NOFOLLOW``; reads only accept a regular file (opened ``O_NONBLOCK`` so
  a FIFO cannot block the open, then ``fstat``/``S_ISREG``) and are bounded by the caller's limit.
- Writes go to a temp file created with ``O_EXCL`` under an unpredictable name
  (``secrets.token_hex``) in the same directory, are fsynced, and renamed with ``os.replace``
  within the same descriptor. The target is replaced only when it is absent or a regular file
  owned by the writer (never someone else's file, never a link or a FIFO); with
  ``replace=False`` an existing target is never touched (``link`` then ``unlink``: no-replace).

A symlink or temp file planted by another user is therefore never followed, opened or replaced;
the worst it can do is make a write fail (which every caller reports, none is fatal).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import stat
from pathlib import Path
from typing import IO, Any, BinaryIO, Iterator

__all__ = ["SafeDir", "UnsafeDirError", "open_regular", "open_pinned", "read_regular", "read_json", "is_regular",
           "write_atomic", "require_free", "MAX_RUN_JSON_BYTES", "MAX_JSON_DEPTH", "json_depth_ok"]

#: Largest ``run.json`` read. The agent writes a few KiB (recipe args, a model config for the
#: framework callbacks); 4 MiB leaves room for a large HF config and stops a runaway file.
MAX_RUN_JSON_BYTES = 4 << 20

#: Deepest JSON nesting accepted from a file (run.json, a verdict, state files). Ours nest under
#: 20 levels; the stdlib parser recurses per level, so a file nested 200k deep would raise
#: RecursionError (or worse, exhaust the C stack) before this check, which runs on the raw text.
MAX_JSON_DEPTH = 100

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_READ = os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | _CLOEXEC
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_BRACKET = re.compile(rb"[\[\]{}]")
_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW | _CLOEXEC


class UnsafeDirError(OSError):
    """A directory that is not what the caller may trust (a symlink, not ours, writable by others)."""


def _kind(mode: int) -> str:
    return ("a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a directory" if stat.S_ISDIR(mode) else "a symbolic link" if stat.S_ISLNK(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "not a file")


class SafeDir:
    """An open directory whose owner and mode were checked; files are opened relative to it.

    Use as a context manager (closes the descriptor). ``path`` is for messages only.
    """

    def __init__(self, fd: int, path: Path, st: os.stat_result) -> None:
        self.fd, self.path, self.st = fd, path, st

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, owners: tuple[int, ...] | None = None,
             private: bool = False, parent: "SafeDir | None" = None, follow: bool = False) -> "SafeDir":
        """Open directory ``path`` without following a symlink at its last component.

        Args:
            owners: uids the directory must be owned by (None: anyone, for a reader that only
                reads, or a writer protected by the temp-file rules alone).
            private: also refuse a directory group or others may write (a run dir the agent
                writes into).
            parent: open ``path``'s name relative to this directory instead of by path.
            follow: accept a symlink to a directory (a path the user typed, not one found in a
                directory someone else may write).

        Raises:
            UnsafeDirError: a symlink, not a directory, wrong owner, or writable by others (the
                message says which and what to do); other ``OSError`` as ``os.open``.
        """
        p = Path(path)
        try:
            flags = _DIR & ~_NOFOLLOW if follow else _DIR
            fd = os.open(p.name, flags, dir_fd=parent.fd) if parent else os.open(p, flags)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                kind = "a symbolic link" if os.path.islink(p) or exc.errno == errno.ELOOP else "not a directory"
                raise UnsafeDirError(exc.errno, f"{p} is {kind}; sentineld opens only real directories") from None
            raise
        st = os.fstat(fd)
        why = None
        if owners is not None and st.st_uid not in owners:
            why = f"{p} is owned by uid {st.st_uid}, not by uid {' or '.join(map(str, owners))}"
        elif private and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            why = (f"{p} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); "
                   f"another user could plant files in it (`chmod go-w {p}`)")
        if why:
            os.close(fd)
            raise UnsafeDirError(errno.EPERM, why)
        return cls(fd, p, st)

    def __enter__(self) -> "SafeDir":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the descriptor (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # ---------------------------------------------------------------- reading
    def open_regular(self, name: str) -> BinaryIO:
        """Open ``name`` for binary reading if it is a regular file, not a link, FIFO or device.

        Raises:
            OSError: missing; a symlink (``ELOOP``); anything but a regular file (``EINVAL``).
        """
        where = self.path / name
        try:
            fd = os.open(name, _READ, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise OSError(errno.ELOOP, f"{where} is a symbolic link; sentineld reads only regular "
                                           "files written into the directory") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, f"{where} is {_kind(st.st_mode)}, not a regular file; "
                                            "sentineld does not read it")
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise

    def read(self, name: str, limit: int) -> bytes:
        """The whole content of regular file ``name`` of at most ``limit`` bytes.

        Raises:
            OSError: as :meth:`open_regular`, or ``EFBIG`` over ``limit``.
        """
        with self.open_regular(name) as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise OSError(errno.EFBIG, f"{self.path / name} is {size} bytes, over the {limit}-byte limit for it")
            data = f.read(limit + 1)
        if len(data) > limit:
            raise OSError(errno.EFBIG, f"{self.path / name} grew past the {limit}-byte limit for it")
        return data

    def lstat(self, name: str) -> os.stat_result:
        """``lstat`` of ``name`` in this directory (never follows a link)."""
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)

    def names(self) -> list[str]:
        """The entries of this directory, sorted."""
        return sorted(os.listdir(self.fd))

    def unlink(self, name: str) -> None:
        """Remove entry ``name`` (a link itself, never its target); missing is fine."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)

    # ---------------------------------------------------------------- writing
    @contextlib.contextmanager
    def create(self, name: str, *, mode: int = 0o600, durable: bool = True,
               replace: bool = True) -> Iterator[IO[bytes]]:
        """Write ``name`` whole or not at all: yields a binary file on a fresh temp file.

        The temp file is ``<stem>.<32 hex>.<ext>.tmp`` (still matched by ``capture-*.h5.tmp``),
        created ``O_EXCL | O_NOFOLLOW`` (no planted file or link can be it); on a clean exit it is
        flushed, fsynced (``durable``), given ``mode`` and renamed to ``name`` in this directory
        (then the directory is fsynced). On an error it is removed and nothing else changed.

        Args:
            replace: False: never touch an existing ``name`` (``FileExistsError``). True: replace
                it only when it is a regular file owned by us.

        Raises:
            OSError: the write failed, or ``name`` exists and is not ours to replace (``EEXIST``).
        """
        self._check_target(name, replace)
        stem, dot, ext = name[:180].partition(".")
        tmp = f"{stem}.{secrets.token_hex(16)}{dot}{ext}.tmp"  # capture-...h5 -> capture-....<hex>.h5.tmp
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600, dir_fd=self.fd)
        try:
            with os.fdopen(fd, "w+b") as f:
                yield f
                f.flush()
                os.fchmod(f.fileno(), mode)
                if durable:
                    os.fsync(f.fileno())
            self._check_target(name, replace)
            if replace:
                os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            else:
                os.link(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd, follow_symlinks=False)
                self.unlink(tmp)
            if durable:
                os.fsync(self.fd)
        except BaseException:
            self.unlink(tmp)
            raise

    def rename(self, src: str, dst: str) -> None:
        """Rename ``src`` to ``dst`` within this directory; an existing ``dst`` is replaced only
        when it is a regular file owned by us (as :meth:`create`).

        Raises:
            OSError: ``dst`` is not ours to replace (``EEXIST``), or the rename failed.
        """
        self._check_target(dst, True)
        os.replace(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def _check_target(self, name: str, replace: bool) -> None:
        try:
            st = self.lstat(name)
        except FileNotFoundError:
            return
        if not replace:
            raise FileExistsError(errno.EEXIST, f"{self.path / name} exists; sentineld does not replace it")
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise OSError(errno.EEXIST, f"{self.path / name} is {_kind(st.st_mode)} owned by uid "
                                        f"{st.st_uid}; sentineld replaces only files it wrote itself")

    def write(self, name: str, data: bytes | str, **kw: Any) -> int:
        """Write ``data`` (text is UTF-8) as ``name`` atomically (see :meth:`create`); its size."""
        raw = data.encode() if isinstance(data, str) else data
        with self.create(name, **kw) as f:
            f.write(raw)
        return len(raw)

    def write_json(self, name: str, obj: Any, **kw: Any) -> int:
        """Write ``obj`` as strict JSON (see :meth:`write`)."""
        return self.write(name, json.dumps(obj, allow_nan=False), **kw)


def require_free(where: int | str | os.PathLike[str], need: int, what: str, shown: object = None) -> None:
    """Fail before writing when the file system of ``where`` (an open directory's descriptor, or a
    path) has fewer than ``need`` bytes free for unprivileged writers: a full disk then fails
    cleanly, before any byte is written, instead of in the middle of a file.

    Args:
        what: what is to be written, for the message; ``shown``: the place named in it (default
            ``where``).

    Raises:
        OSError: ``errno.ENOSPC``, "no space left on device in <shown> (<free> bytes free, about
            <need> needed for <what>)" (:func:`sentineld.contracts.h5write.disk_full_error` keeps
            such a message as it is).
    """
    st = os.fstatvfs(where) if isinstance(where, int) else os.statvfs(where)
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise OSError(errno.ENOSPC, f"no space left on device in {where if shown is None else shown} ({free} bytes "
                                    f"free, about {need} needed for {what})")


def write_atomic(path: str | os.PathLike[str], data: bytes | str, **kw: Any) -> int:
    """Write ``path`` atomically through its directory (see :meth:`SafeDir.create`); its size."""
    p = Path(path)
    # The folder is one the caller chose (a config, a CLI argument), so a link to it is followed;
    # what protects the write is the temp file and rename relative to its descriptor.
    with SafeDir.open(p.parent, follow=True) as d:
        return d.write(p.name, data, **kw)


def json_depth_ok(text: bytes | str, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when the JSON text nests at most ``limit`` arrays/objects deep (brackets inside
    strings do not count). Runs on the raw text before ``json.loads``, whose recursion a deep file
    would exhaust (``RecursionError``, or a crash of the C stack)."""
    raw = _STRING.sub(b'""', text.encode() if isinstance(text, str) else text)
    depth = 0
    for m in _BRACKET.finditer(raw):
        depth += 1 if m.group() in (b"[", b"{") else -1
        if depth > limit:
            return False
    return True


def read_json(path: str | os.PathLike[str], limit: int, depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse a regular file of at most ``limit`` bytes nesting at most ``depth`` levels.

    Raises:
        OSError: as :func:`read_regular`.
        ValueError: not JSON (``json.JSONDecodeError``), not UTF-8, or nested too deeply.
    """
    data = read_regular(path, limit)
    if not json_depth_ok(data, depth):
        raise ValueError(f"{path} nests deeper than {depth} levels; not a file sentineld wrote")
    return json.loads(data)


def _parent(path: str | os.PathLike[str]) -> tuple[SafeDir, str]:
    p = Path(path)
    return SafeDir.open(p.parent, follow=True), p.name


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """Open ``path`` for binary reading if it is a regular file and not a symlink (nor is the
    folder holding it).

    Raises:
        OSError: missing; a symlink (``ELOOP``); a FIFO, device, socket or directory (``EINVAL``),
            with a message naming the file and what it is.
    """
    d, name = _parent(path)
    with d:
        return d.open_regular(name)


def open_pinned(path: str | os.PathLike[str]) -> tuple[int, str]:
    """Open regular file ``path`` (as :func:`open_regular`) for a library that takes only a path.

    Returns ``(fd, name)``: ``name`` reopens exactly the file behind ``fd`` (``/proc/self/fd/<fd>``
    where the system has it, else ``path``); close ``fd`` once the library is done with the file.
    HDF5 opens by name, and a name checked first is re-resolved when HDF5 opens it: another user
    who owns the directory can swap a FIFO in between (the open then blocks for good: the daemon's
    main loop did, reading her crash captures) or a link to a file of ours.

    Raises:
        OSError: as :func:`open_regular`.
    """
    with open_regular(path) as f:
        fd = os.dup(f.fileno())
    pinned = f"/proc/self/fd/{fd}"
    return fd, pinned if os.path.exists(pinned) else os.fspath(path)


def read_regular(path: str | os.PathLike[str], limit: int) -> bytes:
    """The whole content of a regular file of at most ``limit`` bytes (see :meth:`SafeDir.read`).

    Raises:
        OSError: as :func:`open_regular`, or ``EFBIG`` when the file is larger than ``limit``.
    """
    d, name = _parent(path)
    with d:
        return d.read(name, limit)


def is_regular(path: Path) -> bool:
    """True when ``path`` itself (not a link's target) is a regular file."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False
