"""Opening files another process wrote, without letting them hang, flood or redirect the reader.

A run directory is written by the training process, and in a shared runs dir possibly by another
user. The daemon, ``sentineld runs`` and the replay read it, so what they open must not be able to
block them (a FIFO as ``run.json``), feed them without end (a symlink to ``/dev/zero``) or send
them elsewhere (a symlink out of the run dir). Every reader of a run-dir file opens it through
:func:`open_regular`: no symlink is followed, only a regular file is accepted, and reads are bounded
by the caller's limit.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

__all__ = ["open_regular", "read_regular", "is_regular", "MAX_RUN_JSON_BYTES"]

#: Largest ``run.json`` read. The agent writes a few KiB (recipe args, a model config for the
#: framework callbacks); 4 MiB leaves room for a large HF config and stops a runaway file.
MAX_RUN_JSON_BYTES = 4 << 20

_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def open_regular(path: str | os.PathLike[str]) -> BinaryIO:
    """Open ``path`` for binary reading if it is a regular file and not a symlink.

    Raises:
        OSError: missing; a symlink (``ELOOP``); a FIFO, device, socket or directory (``EINVAL``),
            with a message naming the file and what it is.
    """
    try:
        fd = os.open(path, _FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, f"{path} is a symbolic link; sentineld reads only regular "
                                       "files written into the run dir") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode)
                    or stat.S_ISBLK(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode) else "not a file")
            raise OSError(errno.EINVAL, f"{path} is {kind}, not a regular file; sentineld does not read it")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike[str], limit: int) -> bytes:
    """The whole content of a regular file of at most ``limit`` bytes.

    Raises:
        OSError: as :func:`open_regular`, or ``EFBIG`` when the file is larger than ``limit``.
    """
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise OSError(errno.EFBIG, f"{path} is {size} bytes, over the {limit}-byte limit for it")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"{path} grew past the {limit}-byte limit for it")
    return data


def is_regular(path: Path) -> bool:
    """True when ``path`` itself (not a link's target) is a regular file."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False
