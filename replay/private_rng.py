"""Random numbers for a replay that runs inside the training process, without touching training's.

The training process localizes an incident in a thread of its own while training goes on. The
re-executed steps must draw the recorded random numbers (dropout masks, noise), but setting torch's
default generator would change the numbers training draws next. So this thread gets generators of
its own: a ``TorchDispatchMode`` (thread-local, like every dispatch mode) hands every random aten op
that was called without a generator one of these private generators, loaded with the recorded
state at the step's first forward (:func:`replay.rebuild.rng_restorer`). On CPU,
``F.dropout`` is ``bernoulli_`` + ``mul``, so it is covered; ops that draw from the default
generator with no way to pass another (CUDA ``native_dropout``, fused attention dropout) are
listed in :attr:`PrivateRNG.unisolated` and make the verdict say so; the bitwise loss check then
tells whether it mattered.

NumPy's and Python's global generators cannot be made private: a model or loss function that draws
from them replays with different numbers here (``reproduced`` comes out False).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .rebuild import rng_restorer

__all__ = ["PrivateRNG", "private_rng"]

# Overloads without a generator argument -> their twin that takes one (e.g. aten.randn.default ->
# aten.randn.generator).
_TWIN = {"default": "generator", "low": "low_generator", "names": "generator_with_names",
         "out": "generator_out", "low_out": "low_generator_out"}
# Random ops with no generator argument at all (they draw from the device's default generator).
_NO_GENERATOR = ("aten.native_dropout", "aten._scaled_dot_product_flash_attention",
                 "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_cudnn_attention")


class PrivateRNG(TorchDispatchMode):
    """Give random ops of this thread private generators (one per device).

    Attributes:
        unisolated: names of random ops seen that cannot take a private generator.
    """

    def __init__(self) -> None:
        super().__init__()
        self.gens: dict[str, torch.Generator] = {}
        self.unisolated: set[str] = set()

    def gen(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self.gens:
            self.gens[key] = torch.Generator(device=device)
        return self.gens[key]

    def set_state(self, rng: dict[str, Any]) -> None:
        """Load a recorded state (:func:`sentineld.contracts.rng.capture_rng`'s layout) into the private
        generators; NumPy and Python parts are left alone (see the module docstring)."""
        if rng.get("torch") is not None:
            self.gen(torch.device("cpu")).set_state(rng["torch"])
        for i, st in enumerate(rng.get("cuda") or []):
            if torch.cuda.is_available() and i < torch.cuda.device_count():
                self.gen(torch.device("cuda", i)).set_state(st)

    def _device(self, args: Any, kwargs: dict[str, Any]) -> torch.device:
        dev = kwargs.get("device")
        if dev is not None:
            return torch.device(dev)
        for x in tree_flatten(args)[0]:
            if isinstance(x, torch.Tensor):
                return x.device
        return torch.device("cpu")

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        schema = func._schema
        if any(a.name == "generator" for a in schema.arguments):
            if kwargs.get("generator") is None:
                kwargs["generator"] = self.gen(self._device(args, kwargs))
            return func(*args, **kwargs)
        packet = func.overloadpacket
        twin = _TWIN.get(func._overloadname)
        if twin is not None and _nondeterministic(func) and twin in packet.overloads():
            kwargs["generator"] = self.gen(self._device(args, kwargs))
            return getattr(packet, twin)(*args, **kwargs)
        name = str(packet)
        if name.startswith(_NO_GENERATOR) and _draws(name, args, kwargs):
            self.unisolated.add(name)
        return func(*args, **kwargs)


def _nondeterministic(func: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())


def _draws(name: str, args: Any, kwargs: dict[str, Any]) -> bool:
    if name == "aten.native_dropout":
        return bool(args[2] if len(args) > 2 else kwargs.get("train", True))
    p = kwargs.get("dropout_p", args[3] if len(args) > 3 and isinstance(args[3], float) else 0.0)
    return bool(p)


@contextlib.contextmanager
def private_rng() -> Iterator[PrivateRNG]:
    """In this thread: random ops draw from private generators, and the replay's RNG restores go
    into them. Yields the mode (read :attr:`PrivateRNG.unisolated` after)."""
    mode = PrivateRNG()
    with rng_restorer(mode.set_state), mode:
        yield mode
