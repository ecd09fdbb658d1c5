"""Reading the RNG states once per step, cheaply: :class:`RngReader`.

:func:`sentineld.contracts.rng.capture_rng` costs about 80 us per call here, nearly all of it in
``np.random.get_state()`` (~65 us: it builds a 624-entry array and a tuple) and
``random.getstate()`` (~12 us: a tuple of 625 ints). Most training loops never draw from NumPy's
or Python's global generator inside a step, so those two states rarely change from one step to
the next. The reader peeks at the raw generator memory (2.5 KB each, about 1 us), and only when
it changed since the last read calls the full getter; otherwise it hands back the state object it
read last time (tuples nobody writes to, so sharing one between steps is safe). Torch's CPU state
(``torch.get_rng_state``, ~1 us) and the CUDA states are read every time as before.

The peek is checked against the full getter at construction; where it does not match (another
NumPy layout, a free-threaded CPython, ...) that generator is simply read in full every step.
The returned dict is exactly what :func:`~sentineld.contracts.rng.capture_rng` returns.
"""

from __future__ import annotations

import ctypes
import logging
import random
import struct
from typing import Any, Callable

import numpy as np
import torch

__all__ = ["RngReader"]

log = logging.getLogger("sentineld.agent")

_MT_N = 624  # MT19937 state words (both NumPy's and CPython's generator)


class _Peek:
    """Full state of one generator, re-read only when its raw memory changed."""

    def __init__(self, full: Callable[[], Any], raw: Callable[[], bytes] | None,
                 check: Callable[[bytes, Any], bool]) -> None:
        self._full, self._raw = full, raw
        self._last_raw = b""
        self._last: Any = None
        if raw is not None:
            try:
                ok = check(raw(), full())
            except Exception:  # noqa: BLE001 - unknown layout: read in full every step
                ok = False
            if not ok:
                self._raw = None

    @property
    def peeking(self) -> bool:
        """True when the raw peek is in use (it matched the full getter at construction)."""
        return self._raw is not None

    def read(self) -> Any:
        if self._raw is None:
            return self._full()
        raw = self._raw()
        if raw != self._last_raw or self._last is None:
            self._last, self._last_raw = self._full(), raw
        return self._last


def _numpy_peek() -> _Peek:
    # The legacy global RandomState's MT19937: ``state_address`` points at numpy's
    # ``mt19937_state {uint32 key[624]; int pos;}``. The Gaussian cache (has_gauss, gauss) is a
    # field of the RandomState object itself and changes without moving ``pos`` (the second
    # value of a pair), so the object's own memory after its header (refcount, type) is
    # compared too: pointers that stay put, the Gaussian and binomial caches.
    rs = np.random.mtrand._rand
    try:
        addr = int(rs._bit_generator.ctypes.state_address)
    except Exception:  # noqa: BLE001
        return _Peek(np.random.get_state, None, lambda raw, full: False)
    size = _MT_N * 4 + 4
    head = object.__basicsize__
    obj_size = type(rs).__basicsize__ - head

    def raw() -> bytes:
        return ctypes.string_at(addr, size) + ctypes.string_at(id(rs) + head, obj_size)

    def check(raw_b: bytes, full: Any) -> bool:
        _name, keys, pos = full[0], full[1], full[2]
        return raw_b[: _MT_N * 4] == np.asarray(keys, dtype=np.uint32).tobytes() and \
            struct.unpack("i", raw_b[_MT_N * 4:size])[0] == int(pos) and obj_size > 0

    return _Peek(np.random.get_state, raw, check)


def _python_peek() -> _Peek:
    # CPython's ``RandomObject {PyObject_HEAD; int index; uint32_t state[624];}`` (Modules/
    # _randommodule.c); ``gauss_next`` is a plain attribute, compared alongside.
    inst = random._inst  # type: ignore[attr-defined]
    head = object.__basicsize__  # PyObject_HEAD: 16 bytes on 64-bit CPython
    size = 4 + _MT_N * 4

    def raw() -> bytes:
        return ctypes.string_at(id(inst) + head, size) + repr(getattr(inst, "gauss_next", None)).encode()

    def check(raw_b: bytes, full: Any) -> bool:
        version, internal, gauss = full
        index = struct.unpack("i", raw_b[:4])[0]
        words = struct.unpack(f"{_MT_N}I", raw_b[4:size])
        return tuple(words) + (index,) == tuple(internal) and raw_b[size:] == repr(gauss).encode()

    return _Peek(random.getstate, raw, check)


class RngReader:
    """``read()`` returns the RNG states as :func:`~sentineld.contracts.rng.capture_rng` does,
    at about a tenth of its cost when NumPy's and Python's generators did not move."""

    def __init__(self) -> None:
        self._numpy = _numpy_peek()
        self._python = _python_peek()
        if not (self._numpy.peeking and self._python.peeking):
            log.debug("sentineld: RNG peek off for %s (read in full every step)",
                      [n for n, p in (("numpy", self._numpy), ("python", self._python)) if not p.peeking])

    def read(self) -> dict[str, Any]:
        """The current RNG states: ``{"torch", "numpy", "python"[, "cuda"]}`` (see capture_rng)."""
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "numpy": self._numpy.read(),
            "python": self._python.read(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state
