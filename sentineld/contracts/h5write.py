"""Writing an HDF5 file whole or not at all (temp file, optional fsync, rename), with a clean
``OSError(ENOSPC)`` on a full disk: used for captures (:mod:`sentineld.contracts.capture`) and crash
captures assembled from an on-disk ring (:mod:`sentineld.daemon.ring_recovery`)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import os
import shutil
from pathlib import Path
from typing import Any

from sentineld.contracts.safeio import SafeDir
from sentineld.contracts.treecodec import map_tensors

__all__ = ["IN_MEMORY_MAX_BYTES", "disk_full_error", "tree_bytes", "write_h5_atomic"]


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
#: first here, speed (issue 13's "no slower than torch.save") from 256 MiB on. Used only where
#: the file system cannot reserve the file's space up front (:func:`_reserve`, the normal path).
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


def _reserve(out: Any, need: int) -> bool:
    """Reserve ``need`` bytes of disk for the open temp file ``out`` before any data is written.

    Linux ``fallocate(FALLOC_FL_KEEP_SIZE)`` either reserves the whole estimate (the HDF5 writes
    that follow cannot meet a full disk, so its state never breaks: the h5py crash
    :data:`IN_MEMORY_MAX_BYTES` guards against needs ENOSPC *during* a write) or fails at once
    with a clean ``OSError`` (ENOSPC; EFBIG under ``RLIMIT_FSIZE``) before anything is written
    (issue 23: the in-memory image's two extra copies made a 96 MiB capture 2x torch.save +
    fsync). KEEP_SIZE: the file stays empty, so HDF5 never reads back what it has not written
    (the temp file is write-only); the blocks past the end are released by a truncate to the
    final size.

    Returns:
        True when reserved; False where the system cannot reserve space (not Linux, a file
        system without fallocate): the caller then writes another way.

    Raises:
        OSError: the disk has no room (or the file size limit is below ``need``).
    """
    fallocate = _libc_fallocate()
    if fallocate is None:
        return False
    if fallocate(out.fileno(), 1, 0, need) != 0:      # 1 = FALLOC_FL_KEEP_SIZE
        err = ctypes.get_errno()
        if err in _NO_RESERVE:
            return False
        raise OSError(err, os.strerror(err))
    return True


def _libc_fallocate() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.fallocate64 if hasattr(libc, "fallocate64") else libc.fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


def write_h5_atomic(path: Path, fill: Any, estimate_bytes: int, *, durable: bool, what: str,
                    at: SafeDir | None = None) -> int:
    """Write an HDF5 file via ``fill(h5file)`` to a fresh temp file, then rename it to ``path`` (0600),
    through :meth:`sentineld.contracts.safeio.SafeDir.create`.

    Args:
        estimate_bytes: about how big the file will be (tensor bytes); decides in-memory
            building (see :data:`IN_MEMORY_MAX_BYTES`) and the free-space check.
        durable: fsync the file and its directory (a capture); without, the file still survives
            the death of the process (page cache), only not a power loss.
        what: what it is, for error messages.
        at: ``path``'s directory already opened and checked (ring recovery writing into a run dir
            another user owns: the path could be re-pointed after the check); None opens it.

    Returns:
        The file's size in bytes.

    Raises:
        OSError: not written (``errno.ENOSPC`` with a clear message on a full disk); nothing is
            left behind.
    """
    import h5py  # noqa: PLC0415

    need = int(estimate_bytes * 1.05) + (1 << 20)
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        free = None
    if free is not None and free < need:
        raise OSError(errno.ENOSPC, f"no space left on device in {path.parent} ({free} bytes free, "
                                    f"about {need} needed for this {what})")
    try:
        # Through the one safe writer: an O_EXCL temp file of an unpredictable name, opened by
        # descriptor relative to the directory, renamed in it (never through a planted link).
        with contextlib.ExitStack() as stack:
            d = at or stack.enter_context(SafeDir.open(path.parent, follow=True))
            out = stack.enter_context(d.create(path.name, durable=durable))
            if _reserve(out, need):
                # HDF5 writes into the reserved file directly (one copy of the data, as
                # torch.save): no write can meet a full disk, no in-memory image needed
                with h5py.File(out, "w") as f:
                    fill(f)
                out.seek(0, os.SEEK_END)
                size = out.tell()
                out.truncate(size)              # release the reserved blocks past the end
            elif estimate_bytes <= IN_MEMORY_MAX_BYTES:
                name = f"sentineld-mem-{os.getpid()}-{next(_mem_files)}.h5"  # never touches the disk
                # One allocation of about the final size (the core driver grows by 64 KiB otherwise).
                block = max(1 << 20, min(need, IN_MEMORY_MAX_BYTES + (1 << 20)))
                with h5py.File(name, "w", driver="core", backing_store=False, block_size=block) as f:
                    fill(f)
                    f.flush()
                    image = f.id.get_file_image()
                view = memoryview(image)
                while view:
                    view = view[os.write(out.fileno(), view):]
                size = len(image)
            else:
                # HDF5 writes into the file object we created (h5py's fileobj driver), so it never
                # opens a name: nothing in the run dir can be swapped under it.
                with h5py.File(out, "w") as f:
                    fill(f)
                out.seek(0, os.SEEK_END)
                size = out.tell()
    except BaseException as exc:
        full = disk_full_error(exc, path.parent)
        if full is not None and full is not exc:
            raise full from None
        raise
    return size
