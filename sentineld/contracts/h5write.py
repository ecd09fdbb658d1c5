"""Writing an HDF5 file whole or not at all (temp file, optional fsync, rename), with a clean
``OSError(ENOSPC)`` on a full disk: used for captures (:mod:`sentineld.contracts.capture`) and crash
captures assembled from an on-disk ring (:mod:`sentineld.daemon.ring_recovery`)."""

from __future__ import annotations

import errno
import itertools
import os
import shutil
from pathlib import Path
from typing import Any

from sentineld.contracts.treecodec import map_tensors

__all__ = ["IN_MEMORY_MAX_BYTES", "fsync_path", "disk_full_error", "tree_bytes", "write_h5_atomic"]


def fsync_path(path: Path) -> None:
    """fsync a file or directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def disk_full_error(exc: BaseException, where: Path) -> OSError | None:
    """A clear ``OSError(ENOSPC)`` for an h5py/OS error caused by a full disk, else None."""
    if not isinstance(exc, OSError):
        return None
    text = str(exc)
    if exc.errno == errno.ENOSPC and exc.strerror and exc.strerror.startswith("no space left on device in"):
        return exc  # already ours
    if exc.errno != errno.ENOSPC and "No space left" not in text and "errno = 28" not in text:
        return None
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        free = -1
    return OSError(errno.ENOSPC, f"no space left on device in {where} ({free} bytes free)")


#: HDF5 files up to this size are built in memory and written with plain ``write()`` calls, so a
#: full disk fails a syscall with a clean ``OSError``: an HDF5 write that fails on ENOSPC leaves
#: the library's file state broken, and h5py 3.16 then crashes the process (seen in
#: tests/reliability/test_disk_full.py). Bigger files are written by HDF5 itself, after a check
#: that the disk has room for them. 256 MiB: the in-memory image costs two extra copies of the data
#: (a 96 MiB capture took 1.13 s that way against 0.50 s direct, torch.save 0.30 s;
#: bench/capture_write.py), but a capture below this size never meets the h5py crash when the disk
#: fills during the write, and the agent must never crash the training it watches: reliability
#: first here, speed (issue 13's "no slower than torch.save") from 256 MiB on.
IN_MEMORY_MAX_BYTES = 256 << 20

_mem_files = itertools.count()


def tree_bytes(tree: Any) -> int:
    """Bytes held by the tensors (and numpy arrays) of a tree, for size estimates."""
    total = 0

    def add(t: Any) -> Any:
        nonlocal total
        total += int(t.numel()) * int(t.element_size())
        return t

    map_tensors(tree, add)
    return total


#: errnos of a file system that cannot reserve space (then the in-memory image is used).
_NO_RESERVE = {errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}


def _fill_reserved(tmp: Path, fill: Any, need: int) -> bool:
    """Let HDF5 write ``tmp`` itself, into ``need`` bytes reserved on disk before any data.

    ``posix_fallocate`` of the open file's descriptor either reserves the whole estimate (the
    writes that follow cannot meet a full disk, so the HDF5 state never breaks: the h5py crash
    :data:`IN_MEMORY_MAX_BYTES` guards against needs ENOSPC *during* a write) or fails at once
    with a clean ``OSError`` (ENOSPC; EFBIG under ``RLIMIT_FSIZE``) before anything is written.
    No in-memory image: one copy of the data (to the page cache), as ``torch.save``; the
    reserved tail past HDF5's end of allocation is cut off before close.

    Returns:
        True when written; False (nothing left at ``tmp``) when the file system cannot reserve
        space: the caller writes another way.

    Raises:
        OSError: the reservation failed (full disk, file size limit) or the write failed.
    """
    import h5py  # noqa: PLC0415

    with h5py.File(tmp, "w") as f:
        fd = f.id.get_vfd_handle()
        try:
            os.posix_fallocate(fd, 0, need)
        except OSError as exc:
            if exc.errno not in _NO_RESERVE:
                raise
            reserve_failed = True
        else:
            reserve_failed = False
            fill(f)
            f.flush()
            # the reserved tail past HDF5's end of allocation: HDF5 leaves it (its driver never
            # wrote there), so it is cut here, with everything HDF5 wrote flushed below it
            os.ftruncate(fd, f.id.get_filesize())
    if reserve_failed:
        tmp.unlink(missing_ok=True)
        return False
    return True


def write_h5_atomic(path: Path, fill: Any, estimate_bytes: int, *, durable: bool, what: str) -> int:
    """Write an HDF5 file via ``fill(h5file)`` to ``<path>.tmp``, then rename it to ``path`` (0600).

    Args:
        estimate_bytes: about how big the file will be (tensor bytes); decides in-memory
            building (see :data:`IN_MEMORY_MAX_BYTES`) and the free-space check.
        durable: fsync the file and its directory (a capture); without, the file still survives
            the death of the process (page cache), only not a power loss.
        what: what it is, for error messages.

    Returns:
        The file's size in bytes.

    Raises:
        OSError: not written (``errno.ENOSPC`` with a clear message on a full disk); nothing is
            left behind.
    """
    import h5py  # noqa: PLC0415

    tmp = path.with_name(path.name + ".tmp")
    need = int(estimate_bytes * 1.05) + (1 << 20)
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        free = None
    if free is not None and free < need:
        raise OSError(errno.ENOSPC, f"no space left on device in {path.parent} ({free} bytes free, "
                                    f"about {need} needed for this {what})")
    try:
        reserved = _fill_reserved(tmp, fill, need)
        if reserved:
            if durable:
                fsync_path(tmp)
            size = tmp.stat().st_size
        elif estimate_bytes <= IN_MEMORY_MAX_BYTES:
            name = f"sentineld-mem-{os.getpid()}-{next(_mem_files)}.h5"  # never touches the disk
            # One allocation of about the final size (the core driver grows by 64 KiB otherwise).
            block = max(1 << 20, min(need, IN_MEMORY_MAX_BYTES + (1 << 20)))
            with h5py.File(name, "w", driver="core", backing_store=False, block_size=block) as f:
                fill(f)
                f.flush()
                image = f.id.get_file_image()
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                view = memoryview(image)
                while view:
                    view = view[os.write(fd, view):]
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            size = len(image)
        else:
            with h5py.File(tmp, "w") as f:
                fill(f)
            if durable:
                fsync_path(tmp)
            size = tmp.stat().st_size
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
        if durable:
            fsync_path(path.parent)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        full = disk_full_error(exc, path.parent)
        if full is not None and full is not exc:
            raise full from None
        raise
    return size
