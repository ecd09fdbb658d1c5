"""The datasets of a capture file: tensors <-> numpy arrays, checksummed writes and bounded reads.

One way capture data is written (:func:`put_dataset`, a ``crc32`` attribute per dataset) and read
(:func:`read_dataset`, the checksum verified and the declared size bounded by the file's), shared
by the capture writer and reader (:mod:`.capture`) and the on-disk ring's format (:mod:`.ringformat`).
torch is imported only where tensors are converted, so the daemon reads captures without it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

try:
    # ISA-L's CRC-32 is zlib's (same polynomial, same values: old captures verify), about 3x
    # faster here (96 MiB: 0.05 vs 0.15 s), and it releases the GIL; it is the capture write's
    # second biggest cost after the write itself. Optional: `pip install sentineld[fast]`.
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - the extra is not installed
    from zlib import crc32

from sentineld.contracts.errors import BadInput
from sentineld.contracts.treecodec import encode

__all__ = ["storable", "CaptureError", "torch_module", "CrcPool", "put_dataset", "read_dataset", "read_str",
           "tensor_to_numpy",
           "numpy_to_tensor", "DECLARED_BYTES_PER_FILE_BYTE", "MIN_DATASET_LIMIT_BYTES"]


class CaptureError(BadInput):
    """A capture cannot be read: truncated, not HDF5, unknown schema, or missing a step.

    The message says what is wrong and what to do; the CLI maps it to exit code 2.
    """


def torch_module() -> Any:
    """torch, imported at first use."""
    import torch  # noqa: PLC0415 - the daemon lists captures without importing torch

    return torch


_NUMPY_UNSUPPORTED = {"bfloat16": "int16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}


def tensor_to_numpy(t: Any) -> tuple[np.ndarray, str]:
    """A tensor as a contiguous CPU numpy array and its torch dtype name (bfloat16/float8 as same-size ints)."""
    torch = torch_module()
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_sparse:  # sparse gradients (SparseAdam): evidence, stored dense
        t = t.to_dense()
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype in _NUMPY_UNSUPPORTED:
        t = t.view(getattr(torch, _NUMPY_UNSUPPORTED[dtype]))
    return t.contiguous().numpy(), dtype


def numpy_to_tensor(arr: np.ndarray, dtype: str) -> Any:
    """The tensor :func:`tensor_to_numpy` made ``arr`` from (``dtype`` its torch dtype name)."""
    torch = torch_module()
    a = np.asarray(arr)
    if not a.flags.writeable:  # h5py returns fresh writable arrays: copy only when it did not
        a = a.copy()
    t = torch.from_numpy(a)
    if dtype in _NUMPY_UNSUPPORTED:
        t = t.view(getattr(torch, dtype))
    return t


#: A dataset may declare at most this many bytes per byte of its file (and at least 64 MiB in
#: all): the agent writes uncompressed data, so a capture's datasets add up to about its size; a
#: 721 kB file declaring an unwritten 60000x60000 gzip dataset once drove a replay to 14.4 GB.
DECLARED_BYTES_PER_FILE_BYTE = 16
MIN_DATASET_LIMIT_BYTES = 64 << 20


class CrcPool:
    """CRC-32 of big arrays on a second thread while HDF5 writes the next one (crc32
    releases the GIL): the checksum then costs little wall time beyond the write itself.
    :meth:`finish` waits and stores each ``crc32`` attribute, on the calling thread."""

    #: Arrays smaller than this are checksummed inline (a thread hop costs more than their CRC).
    MIN_BYTES = 1 << 20

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

        self._ex = ThreadPoolExecutor(1, thread_name_prefix="sentineld-crc")
        self._pending: list[tuple[Any, Any]] = []

    def add(self, ds: Any, view: Any) -> None:
        """Checksum ``view`` (kept alive until :meth:`finish`) into ``ds.attrs["crc32"]``."""
        self._pending.append((ds, self._ex.submit(crc32, view)))

    def finish(self) -> None:
        """Store every pending checksum; then the pool is closed."""
        try:
            for ds, fut in self._pending:
                ds.attrs["crc32"] = fut.result()
        finally:
            self._pending.clear()
            self._ex.shutdown(wait=True)


def put_dataset(group: Any, name: str, data: Any, crc: CrcPool | None = None) -> Any:
    """Create dataset ``name`` in ``group`` with a checksum, the one way capture data is written.

    Every dataset gets a ``crc32`` attribute (zlib's CRC-32 of its bytes), checked by
    :func:`read_dataset`: a flipped bit is then reported as corruption, not replayed as data.
    Arrays are stored contiguous and unfiltered: the HDF5 fletcher32 filter this replaced needs
    chunked storage and cost about twice a plain write (bench/capture_write.py); a capture
    written with it still reads (HDF5 checks its filter on read). With ``crc``, a big array's
    checksum is computed on the pool's thread and stored at ``crc.finish()``.
    """
    arr = np.asarray(data) if not isinstance(data, (str, bytes)) else None
    if arr is not None and arr.ndim >= 1 and arr.size > 0 and arr.dtype.kind in "biufc":
        arr = np.ascontiguousarray(arr)
        ds = group.create_dataset(name, data=arr)
        view = arr.view(np.uint8).reshape(-1).data  # a memoryview: no copy
        if crc is not None and arr.nbytes >= CrcPool.MIN_BYTES:
            crc.add(ds, view)
        else:
            ds.attrs["crc32"] = crc32(view)
        return ds
    ds = group.create_dataset(name, data=data)
    ds.attrs["crc32"] = crc32(_raw(ds[()]))
    return ds


def _raw(val: Any) -> Any:
    """The bytes a checksum covers: a bytes-like view, no copy for arrays."""
    if isinstance(val, bytes):
        return val
    if isinstance(val, str):
        return val.encode()
    arr = np.ascontiguousarray(val)
    return arr.view(np.uint8).reshape(-1).data if arr.ndim else arr.tobytes()


def _name(ds: Any) -> str:
    """The capture's path for messages (HDF5 opened it as ``/proc/self/fd/N``: safeio.open_pinned)."""
    name = str(ds.file.filename)
    if name.startswith("/proc/self/fd/"):
        try:
            return os.readlink(name)
        except OSError:
            pass
    return name


def read_dataset(ds: Any) -> Any:
    """The value of a capture dataset, its checksum verified.

    Raises:
        CaptureError: the stored checksum does not match (the file was altered after writing).
    """
    if ds.external or ds.is_virtual:  # HDF5 would read (or block on) another file for it
        raise CaptureError(f"{_name(ds)}: dataset {ds.name} keeps its data in another file; sentineld "
                           "writes self-contained captures, so this one was crafted: it is not read")
    declared = int(ds.size or 0) * int(ds.dtype.itemsize or 1)
    file_bytes = os.path.getsize(ds.file.filename)
    if declared > max(MIN_DATASET_LIMIT_BYTES, DECLARED_BYTES_PER_FILE_BYTE * file_bytes):
        raise CaptureError(f"{_name(ds)}: dataset {ds.name} declares {declared} bytes, far more than "
                           f"the {file_bytes}-byte file can hold; the capture was altered or crafted, "
                           "it is not read (use another capture of this run)")
    val = ds[()]
    want = ds.attrs.get("crc32")
    if want is not None and crc32(_raw(val)) != int(want):
        raise CaptureError(f"{_name(ds)}: dataset {ds.name} is corrupted (checksum mismatch); "
                           "the capture was altered after it was written: use another capture of this run")
    return val


def read_str(ds: Any) -> str:
    """A string dataset's value, checksum verified."""
    val = read_dataset(ds)
    return val.decode() if isinstance(val, bytes) else str(val)


def storable(tree: Any, path: str = "") -> Any:
    """``tree`` with each leaf a capture cannot hold (an enum dict key, bytes, a set, a CSR,
    nested or quantized tensor) replaced by a ``"<not stored: ...>"`` string naming it.

    One such leaf made the whole capture fail (model state and records of the incident lost
    with it); the replay of a batch that lost a leaf fails at that leaf, and says why.
    """
    if isinstance(tree, dict) and type(tree) is dict:
        return {(k if _leaf_ok(k) else f"<not stored: {type(k).__name__} key>"): storable(v, f"{path}/{k}")
                for k, v in tree.items()}
    if type(tree) in (list, tuple):
        return type(tree)(storable(v, f"{path}/{i}") for i, v in enumerate(tree))
    if _leaf_ok(tree):
        return tree
    return f"<not stored: {type(tree).__name__} at {path or '/'}>"


def _leaf_ok(leaf: Any) -> bool:
    try:
        tensors: list[Any] = []
        json.dumps(encode(leaf, tensors))
        for t in tensors:
            tensor_to_numpy(t)
    except Exception:  # noqa: BLE001 - whatever the leaf's type raises: it is not storable
        return False
    return True
