"""Encode nested containers of tensors as JSON + a flat tensor list, and back, without pickle.

State dicts (model, optimizer, scheduler, GradScaler) and batches are trees of dict / list / tuple
holding tensors, numbers, strings, bools and None. Captures store the tree's shape as a JSON string
and each tensor as its own HDF5 dataset, so opening a capture never unpickles anything.

Dict keys keep their type (optimizer state is keyed by int), tuples stay tuples, and floats may be
nan/inf. Anything else (a lambda in a scheduler's state, a custom object) raises
:class:`TreeCodecError` naming the path where it sits.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import types
from typing import Any, Callable, Mapping

from .errors import BadInput

__all__ = ["TreeCodecError", "encode", "decode", "map_tensors"]


class TreeCodecError(BadInput, ValueError):
    """A value in the tree has no JSON form (the message names its path) or the JSON is malformed.
    Bad input (exit code 2), and a ``ValueError`` for the callers that catch that."""


def _is_tensor(x: Any) -> bool:
    # Lazy torch check keeps this module importable without torch (the daemon reads captures).
    # ``hasattr(x, "shape")`` raises RuntimeError (not AttributeError) on a strided nested
    # tensor, so the check asks for ``dtype`` and ``dim`` instead: both answer on every layout.
    return type(x).__module__.startswith("torch") and hasattr(x, "dtype") and hasattr(x, "dim")


def encode(tree: Any, tensors: list[Any], path: str = "") -> Any:
    """Return the JSON form of ``tree``; tensors are appended to ``tensors`` and referenced by index.

    Raises:
        TreeCodecError: a leaf is neither a tensor, number, str, bool nor None.
    """
    if _is_tensor(tree):
        if getattr(tree, "is_sparse", False):
            t = tree.detach().coalesce()
            return {"sp": [encode(t.indices(), tensors), encode(t.values(), tensors), list(t.shape)]}
        tensors.append(tree)
        return {"t": len(tensors) - 1}
    if type(tree).__module__ == "numpy" and type(tree).__name__ == "ndarray":
        import torch  # noqa: PLC0415

        tensors.append(torch.from_numpy(tree.copy()))
        return {"np": len(tensors) - 1}
    if tree is None or isinstance(tree, (bool, str)):
        return tree
    if isinstance(tree, int):
        return {"i": int(tree)}
    if isinstance(tree, float):
        return {"f": tree if math.isfinite(tree) else repr(tree)}
    if isinstance(tree, dict):
        return {"d": [[encode(k, tensors, f"{path}/key"), encode(v, tensors, f"{path}/{k}")]
                      for k, v in tree.items()]}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # namedtuple: keep attribute access
        return {"nt": [type(tree).__name__, list(tree._fields),
                       [encode(v, tensors, f"{path}/{f}") for f, v in zip(tree._fields, tree)]]}
    if isinstance(tree, tuple):
        return {"tu": [encode(v, tensors, f"{path}/{i}") for i, v in enumerate(tree)]}
    if isinstance(tree, list):
        return {"l": [encode(v, tensors, f"{path}/{i}") for i, v in enumerate(tree)]}
    if hasattr(tree, "item") and hasattr(tree, "dtype"):  # numpy scalar
        return encode(tree.item(), tensors, path)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        # Rebuilt as a namespace with the same attributes: no user class is imported on decode.
        return {"ns": [type(tree).__name__, {"d": [[f.name, encode(getattr(tree, f.name), tensors, f"{path}/{f.name}")]
                                                   for f in dataclasses.fields(tree)]}]}
    if isinstance(tree, Mapping):  # e.g. a tokenizer's BatchEncoding: stored as a dict
        return encode(dict(tree), tensors, path)
    raise TreeCodecError(f"cannot store {type(tree).__name__} at {path or '/'} in a capture "
                         "(only tensors, numbers, strings, bools, None, dict/list/tuple)")


def decode(obj: Any, tensors: Callable[[int], Any]) -> Any:
    """Inverse of :func:`encode`; ``tensors(i)`` returns the i-th stored tensor.

    Raises:
        TreeCodecError: ``obj`` is not a form :func:`encode` writes.
    """
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, dict) and len(obj) == 1:
        (tag, val), = obj.items()
        if tag == "t":
            return tensors(int(val))
        if tag == "i":
            return int(val)
        if tag == "f":
            return float(val)
        if tag == "d":
            return {_hashable(decode(k, tensors)): decode(v, tensors) for k, v in val}
        if tag == "tu":
            return tuple(decode(v, tensors) for v in val)
        if tag == "l":
            return [decode(v, tensors) for v in val]
        if tag == "np":
            return tensors(int(val)).numpy()
        if tag == "sp":
            import torch  # noqa: PLC0415

            idx, vals, shape = val
            # check_invariants: a hand-edited capture must not make an invalid sparse tensor.
            return torch.sparse_coo_tensor(decode(idx, tensors), decode(vals, tensors), tuple(shape),
                                           check_invariants=True)
        if tag == "nt":
            name, fields, values = val
            cls = collections.namedtuple(str(name), [str(f) for f in fields])  # type: ignore[misc]
            return cls(*(decode(v, tensors) for v in values))
        if tag == "ns":
            _name, attrs = val
            return types.SimpleNamespace(**{str(k): v for k, v in decode(attrs, tensors).items()})
    raise TreeCodecError(f"malformed tree node in capture: {str(obj)[:80]!r}")


def _hashable(key: Any) -> Any:
    if isinstance(key, list):
        return tuple(key)
    return key


def map_tensors(tree: Any, fn: Callable[[Any], Any]) -> Any:
    """Return a copy of ``tree`` with ``fn`` applied to every tensor (containers rebuilt, rest shared)."""
    if _is_tensor(tree):
        return fn(tree)
    if type(tree).__module__ == "numpy" and type(tree).__name__ == "ndarray":
        return tree.copy()  # the loop may reuse its buffer: keep what this step saw
    if isinstance(tree, dict):
        return {k: map_tensors(v, fn) for k, v in tree.items()}
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return dataclasses.replace(tree, **{f.name: map_tensors(getattr(tree, f.name), fn)
                                            for f in dataclasses.fields(tree) if f.init})
    if isinstance(tree, Mapping):
        return {k: map_tensors(v, fn) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # namedtuple
        return type(tree)(*(map_tensors(v, fn) for v in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_tensors(v, fn) for v in tree)
    return tree
