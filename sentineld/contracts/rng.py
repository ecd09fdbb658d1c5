"""Capture and restore every random number generator a training step may draw from.

A step that samples dropout masks or noise reproduces only if torch's CPU generator, each CUDA
device's generator, NumPy's global generator and Python's ``random`` are all restored to where they
were at the step's first forward. States are plain data (bytes, ints, lists) so a capture stores
them without pickle.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng", "restore_rng", "rng_to_json", "rng_from_json"]


def capture_rng() -> dict[str, Any]:
    """Return the current RNG states as ``{"torch": uint8 tensor (CPU), "cuda": [uint8 tensor],
    "numpy": (str, uint32 ndarray(624,), int, int, float), "python": tuple}``.

    Reading CUDA generator states does not synchronise the device (the Philox seed and offset live
    on the host).
    """
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set every generator to ``state`` as returned by :func:`capture_rng` (missing parts are skipped)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "python" in state:
        random.setstate(state["python"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rng_to_json(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Split ``state`` into JSON-ready scalars and named arrays for HDF5 datasets."""
    name, keys, pos, has_gauss, cached = state["numpy"]
    version, internal, gauss = state["python"]
    meta = {
        "numpy": [name, int(pos), int(has_gauss), float(cached)],
        "python": [version, gauss],
        "cuda_devices": len(state.get("cuda", [])),
    }
    arrays = {
        "torch": state["torch"].numpy(),
        "numpy_keys": np.asarray(keys, dtype=np.uint32),
        "python_internal": np.asarray(internal, dtype=np.int64),
    }
    for i, s in enumerate(state.get("cuda", [])):
        arrays[f"cuda{i}"] = s.numpy()
    return meta, arrays


def rng_from_json(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """Inverse of :func:`rng_to_json`.

    Raises:
        KeyError: a part is missing (the caller reports the capture as malformed).
    """
    name, pos, has_gauss, cached = meta["numpy"]
    version, gauss = meta["python"]
    state: dict[str, Any] = {
        "torch": torch.from_numpy(np.array(arrays["torch"], dtype=np.uint8)),
        "numpy": (name, np.array(arrays["numpy_keys"], dtype=np.uint32), pos, has_gauss, cached),
        "python": (version, tuple(int(x) for x in arrays["python_internal"]), gauss),
    }
    n = int(meta.get("cuda_devices", 0))
    if n:
        state["cuda"] = [torch.from_numpy(np.array(arrays[f"cuda{i}"], dtype=np.uint8)) for i in range(n)]
    return state
