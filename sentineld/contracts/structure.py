"""The live training objects as JSON: what rebuilds a run attached with ``loss_fn=`` and no recipe.

A run attached with ``attach(model, optimizer, loss_fn=...)`` names no function that builds its
model. What the agent can record instead, at attach, is the *structure* of the live objects: for
the model, every module's class (``module`` + ``qualname``, plus the training script's path for a
class of ``__main__``), its plain attributes (ints, floats, strings, tuples, dtypes, ...), its
children and the shapes and dtypes of its parameters and buffers; for the optimizer, its class,
plain attributes and param groups by parameter name; for the loss function, where it is defined
(a lambda by its file and line). No tensor data, no pickles: the tensors come from the capture's
snapshot, and the only code that runs at a rebuild is the classes' and functions' own modules,
imported after the replay's ownership checks (:mod:`replay.live_recipe`).

The rebuild does not call the classes' constructors (whose arguments the run never recorded): an
object is made with ``cls.__new__`` and given the recorded attributes, as ``copy.deepcopy`` does.
An attribute that is not plain data (an open file, an object of an unrecorded class) is listed
under ``opaque``; the rebuild refuses such a module and says which attribute it was.

Torch is imported; nothing of sentineld's sides is.
"""

from __future__ import annotations

import ast
import math
import sys
import types
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

__all__ = ["encode_value", "decode_value", "module_tree", "optimizer_tree", "scheduler_tree",
           "function_ref", "object_ref", "StructureError", "build_module", "build_optimizer",
           "build_scheduler", "MODULE_INTERNALS", "optimizer_internals", "unguarded_statements", "problems"]


class StructureError(ValueError):
    """A recorded structure cannot be rebuilt (the message names the module and attribute)."""


#: Attributes every ``nn.Module`` sets in ``__init__``: rebuilt by ``Module.__init__``, not recorded.
MODULE_INTERNALS = frozenset(vars(torch.nn.Module()).keys())


def optimizer_internals() -> frozenset[str]:
    """Attributes ``Optimizer.__init__`` sets (hook dicts, state, param_groups, defaults)."""
    probe = torch.optim.Optimizer([torch.zeros(1, requires_grad=True)], {})
    return frozenset(vars(probe).keys())


def object_ref(obj: Any) -> dict[str, Any]:
    """``{"module", "qualname", "script"}`` of a class or function; ``script`` (an absolute path)
    only for one defined in ``__main__`` (the training script), else None."""
    module = getattr(obj, "__module__", None) or ""
    script = None
    if module == "__main__":
        code = getattr(obj, "__code__", None)
        main = sys.modules.get("__main__")
        path = getattr(main, "__file__", None) or (code.co_filename if code is not None else None)
        script = str(Path(path).resolve()) if path else None
    return {"module": module, "qualname": getattr(obj, "__qualname__", type(obj).__qualname__),
            "script": script}


def function_ref(fn: Any) -> dict[str, Any]:
    """Where the function ``fn`` is defined, as JSON.

    A top-level function is ``module`` + ``qualname``; a lambda or a function defined inside
    another also records its source file, first line and argument names (the rebuild compiles
    that expression from the file) and its free variables (``freevars``: a closure cannot be
    rebuilt, the replay says so). Anything else (a bound method, a callable object) gets
    ``unrecordable`` with the reason.
    """
    if isinstance(fn, types.MethodType) or not isinstance(fn, types.FunctionType):
        return {"unrecordable": f"loss_fn is a {type(fn).__name__}, not a function defined in a module or "
                                "script (a def or a lambda)"}
    code = fn.__code__
    ref = object_ref(fn)
    if code.co_name == "<lambda>" or "<locals>" in fn.__qualname__:
        ref.update(file=str(Path(code.co_filename).resolve()), line=code.co_firstlineno,
                   args=list(code.co_varnames[:code.co_argcount]), freevars=list(code.co_freevars),
                   name=code.co_name)
    return ref


def encode_value(v: Any) -> tuple[bool, Any]:
    """``(True, json)`` for plain data (None, bool, int, float, str, tuple/list/dict of those,
    dtype, device, a class or top-level function), else ``(False, None)``."""
    if v is None or isinstance(v, (bool, int, str)):
        return True, v
    if isinstance(v, float):
        return True, v if math.isfinite(v) else {"__float__": repr(v)}
    if isinstance(v, torch.dtype):
        return True, {"__dtype__": str(v).removeprefix("torch.")}
    if isinstance(v, torch.device):
        return True, {"__device__": str(v)}
    if isinstance(v, (list, tuple)):
        items = [encode_value(x) for x in v]
        if not all(ok for ok, _ in items):
            return False, None
        vals = [x for _, x in items]
        return True, vals if isinstance(v, list) else {"__tuple__": vals}
    if isinstance(v, dict) and type(v) is dict and all(isinstance(k, str) for k in v):
        enc = {k: encode_value(x) for k, x in v.items()}
        if not all(ok for ok, _ in enc.values()):
            return False, None
        return True, {"__dict__": {k: x for k, (_, x) in enc.items()}}
    if isinstance(v, (set, frozenset)) and all(isinstance(x, (str, int)) for x in v):
        return True, {"__set__": sorted(v, key=repr), "frozen": isinstance(v, frozenset)}
    if isinstance(v, type) or (isinstance(v, types.FunctionType) and v.__name__ != "<lambda>"
                               and "<locals>" not in v.__qualname__):
        return True, {"__ref__": object_ref(v)}
    if isinstance(v, types.BuiltinFunctionType) and getattr(v, "__module__", None):
        return True, {"__ref__": {"module": v.__module__, "qualname": v.__qualname__, "script": None}}
    return False, None


def decode_value(v: Any, load: Callable[[dict[str, Any]], Any]) -> Any:
    """The value :func:`encode_value` recorded; ``load`` imports a ``__ref__``."""
    if isinstance(v, list):
        return [decode_value(x, load) for x in v]
    if not isinstance(v, dict):
        return v
    if "__tuple__" in v:
        return tuple(decode_value(x, load) for x in v["__tuple__"])
    if "__dict__" in v:
        return {k: decode_value(x, load) for k, x in v["__dict__"].items()}
    if "__set__" in v:
        return (frozenset if v.get("frozen") else set)(v["__set__"])
    if "__float__" in v:
        return float(v["__float__"])
    if "__dtype__" in v:
        dt = getattr(torch, str(v["__dtype__"]), None)
        if not isinstance(dt, torch.dtype):
            raise StructureError(f"unknown dtype {v['__dtype__']!r}")
        return dt
    if "__device__" in v:
        return torch.device(str(v["__device__"]))
    if "__ref__" in v:
        return load(v["__ref__"])
    raise StructureError(f"unknown recorded value {sorted(v)[:3]}")


def _attrs(obj: Any, skip: frozenset[str],
           special: Mapping[str, Callable[[Any], tuple[bool, Any]]] | None = None) -> tuple[dict[str, Any], list[str]]:
    """``obj``'s plain attributes encoded (``special[name]`` encodes that one), and the names of
    those that cannot be (``opaque``), in ``vars(obj)`` order."""
    attrs, opaque = {}, []
    for k, v in list(vars(obj).items()):
        if k in skip:
            continue
        ok, enc = special[k](v) if special and k in special else encode_value(v)
        if ok:
            attrs[k] = enc
        else:
            opaque.append(f"{k} ({type(v).__name__})")
    return attrs, opaque


def module_tree(model: torch.nn.Module) -> dict[str, Any]:
    """The structure of ``model`` (see the module docstring); tied parameters once (``tied``)."""
    seen: dict[int, str] = {}

    def node(m: torch.nn.Module, prefix: str) -> dict[str, Any]:
        attrs, opaque = _attrs(m, MODULE_INTERNALS)
        params: dict[str, Any] = {}
        for name, p in m._parameters.items():
            full = prefix + name
            if p is None:
                params[name] = None
            elif id(p) in seen:
                params[name] = {"tied": seen[id(p)]}
            else:
                seen[id(p)] = full
                params[name] = {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch."),
                                "requires_grad": bool(p.requires_grad), "device": str(p.device)}
        buffers = {name: None if b is None else {"shape": list(b.shape), "dtype": str(b.dtype).removeprefix("torch."),
                                                  "device": str(b.device),
                                                  "persistent": name not in m._non_persistent_buffers_set}
                   for name, b in m._buffers.items()}
        children = {name: None if c is None else node(c, f"{prefix}{name}.") for name, c in m._modules.items()}
        return {"cls": object_ref(type(m)), "attrs": attrs, "opaque": opaque, "training": m.training,
                "params": params, "buffers": buffers, "children": children}

    return node(model, "")


def optimizer_tree(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, Any]:
    """The optimizer's class, plain attributes, defaults and param groups by parameter name
    (not the callables others patched onto it: an LR scheduler's ``step`` wrapper).

    Raises:
        StructureError: the optimizer holds a tensor that is not a parameter of the model.
    """
    patched = frozenset(k for k, v in vars(optimizer).items() if callable(v)) | {"_opt_called"}
    attrs, opaque = _attrs(optimizer, optimizer_internals() | patched)
    groups = []
    for g in optimizer.param_groups:
        missing = [tuple(p.shape) for p in g["params"] if id(p) not in names]
        if missing:
            raise StructureError(f"the optimizer holds tensors that are not parameters of the model "
                                 f"(shapes {missing[:4]})")
        hyper: dict[str, Any] = {}
        bad: list[str] = []
        for k, v in g.items():
            if k == "params":
                continue
            ok, enc = encode_value(v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v)
            if ok:
                hyper[k] = enc
            else:
                bad.append(k)
        opaque += [f"param_groups[].{k}" for k in bad]
        groups.append({"params": [names[id(p)] for p in g["params"]], "hyper": hyper})
    ok, defaults = encode_value({k: v for k, v in optimizer.defaults.items()
                                 if encode_value(v)[0]})
    return {"cls": object_ref(type(optimizer)), "attrs": attrs, "opaque": opaque, "groups": groups,
            "defaults": defaults if ok else {"__dict__": {}}}


def _lr_lambdas(v: Any) -> tuple[bool, Any]:
    if isinstance(v, list):
        return True, {"__functions__": [function_ref(f) for f in v]}
    return encode_value(v)


def scheduler_tree(scheduler: Any) -> dict[str, Any]:
    """An LR scheduler's class and plain attributes (its ``optimizer`` is the rebuilt one; its
    ``lr_lambdas`` recorded as functions)."""
    attrs, opaque = _attrs(scheduler, frozenset({"optimizer"}), {"lr_lambdas": _lr_lambdas})
    return {"cls": object_ref(type(scheduler)), "attrs": attrs, "opaque": opaque}


#: Top-level statements that do not train (defs, imports, constants, guarded blocks).
_DEFINING = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.If,
             ast.Try, ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Pass, ast.Assert)
_TRAINS = ("attach", "main", "train", "fit")


def unguarded_statements(source: str) -> list[int]:
    """Lines of a script's top-level statements that would do work when it is loaded as a module
    (loops, ``with`` blocks, bare calls such as ``main()``, an assignment calling ``attach`` or
    ``fit``). Empty when the training is under ``if __name__ == "__main__":``.

    Raises:
        SyntaxError: ``source`` is not Python.
    """
    bad = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # a docstring
        calls = ([n.func for n in ast.walk(node) if isinstance(n, ast.Call)]
                 if isinstance(node, (ast.Assign, ast.AnnAssign)) else [])
        trains = any((isinstance(f, ast.Name) and f.id in _TRAINS) or
                     (isinstance(f, ast.Attribute) and f.attr in _TRAINS) for f in calls)
        if not isinstance(node, _DEFINING) or trains:
            bad.append(node.lineno)
    return bad


def problems(args: dict[str, Any]) -> list[str]:
    """Why a recorded live recipe (``{"model", "optimizer", "loss_fn", "scheduler"}``) cannot be
    rebuilt, found without importing anything: opaque attributes, an unrecordable or closure
    loss_fn, a training script that trains at its top level. Empty when it looks rebuildable."""
    out: list[str] = []
    scripts: set[str] = set()

    def walk(node: Any, where: str) -> None:
        if not isinstance(node, dict):
            return
        if node.get("opaque"):
            out.append(f"{where} holds attributes that are not plain data: {', '.join(node['opaque'][:4])}")
        ref = node.get("cls") or {}
        if ref.get("script"):
            scripts.add(str(ref["script"]))
        for name, child in (node.get("children") or {}).items():
            walk(child, f"{where}.{name}" if where != "the model" else name)

    walk(args.get("model"), "the model")
    walk(args.get("optimizer"), "the optimizer")
    walk(args.get("scheduler"), "the LR scheduler")
    fn = args.get("loss_fn") or {}
    if "unrecordable" in fn:
        out.append(str(fn["unrecordable"]))
    elif fn.get("freevars"):
        out.append(f"loss_fn is a closure (uses {', '.join(fn['freevars'])} of the function it was made in)")
    if fn.get("script"):
        scripts.add(str(fn["script"]))
    for script in sorted(scripts):
        try:
            lines = unguarded_statements(Path(script).read_text(encoding="utf-8", errors="replace"))
        except (OSError, SyntaxError, ValueError) as exc:
            out.append(f"the training script {script} cannot be read: {exc}")
            continue
        if lines:
            out.append(f"the training script {Path(script).name} trains at its top level (line(s) "
                       f"{', '.join(map(str, lines[:5]))}): put the training under "
                       "`if __name__ == \"__main__\":` so its classes and loss_fn can be loaded")
    return out


# ------------------------------------------------------------------ rebuild

def _refuse_opaque(where: str, cls: Any, opaque: list[str]) -> None:
    if opaque:
        raise StructureError(f"{where} ({getattr(cls, '__qualname__', cls)}) holds attribute(s) that are not "
                             f"plain data and were not recorded: {', '.join(opaque[:6])}; pass "
                             "recipe='module:function' to attach (a function that builds the model)")


def build_module(tree: dict[str, Any], load: Callable[[dict[str, Any]], Any],
                 device: str | None = None) -> torch.nn.Module:
    """A module of the recorded structure with uninitialised tensors (the snapshot fills them).

    Args:
        load: imports a class or function from its ref (after the trust checks).
        device: put every tensor here (default: the recorded device, CPU when it is not available).

    Raises:
        StructureError: an opaque attribute, or a class that is not an ``nn.Module``.
    """
    tensors: dict[str, torch.nn.Parameter] = {}
    pending: list[tuple[torch.nn.Module, str, str]] = []

    def dev(recorded: str) -> torch.device:
        d = torch.device(device or recorded)
        return torch.device("cpu") if d.type == "cuda" and not torch.cuda.is_available() else d

    def make(node: dict[str, Any], prefix: str) -> torch.nn.Module:
        cls = load(node["cls"])
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            raise StructureError(f"{node['cls'].get('qualname')} is not a torch.nn.Module class")
        _refuse_opaque(f"module {prefix.rstrip('.') or '(the model)'}", cls, list(node.get("opaque") or []))
        m = cls.__new__(cls)
        torch.nn.Module.__init__(m)
        for k, v in (node.get("attrs") or {}).items():
            object.__setattr__(m, k, decode_value(v, load))
        m.training = bool(node.get("training", True))
        for name, spec in (node.get("params") or {}).items():
            if spec is None:
                m._parameters[name] = None
            elif "tied" in spec:
                pending.append((m, name, str(spec["tied"])))
            else:
                dt = decode_value({"__dtype__": spec["dtype"]}, load)
                p = torch.nn.Parameter(torch.empty(spec["shape"], dtype=dt, device=dev(spec.get("device", "cpu"))),
                                       requires_grad=bool(spec.get("requires_grad", True)))
                m._parameters[name] = tensors[prefix + name] = p
        for name, spec in (node.get("buffers") or {}).items():
            if spec is None:
                m._buffers[name] = None
                continue
            dt = decode_value({"__dtype__": spec["dtype"]}, load)
            m._buffers[name] = torch.empty(spec["shape"], dtype=dt, device=dev(spec.get("device", "cpu")))
            if not spec.get("persistent", True):
                m._non_persistent_buffers_set.add(name)
        for name, child in (node.get("children") or {}).items():
            m._modules[name] = None if child is None else make(child, f"{prefix}{name}.")
        return m

    model = make(tree, "")
    for m, name, target in pending:
        if target not in tensors:
            raise StructureError(f"tied parameter {name} points at {target}, which was not recorded")
        m._parameters[name] = tensors[target]
    return model


def build_optimizer(tree: dict[str, Any], model: torch.nn.Module,
                    load: Callable[[dict[str, Any]], Any]) -> torch.optim.Optimizer:
    """An optimizer of the recorded class over ``model``'s parameters, without calling its
    constructor (so a required constructor argument need not be known).

    Raises:
        StructureError: a group names a parameter the model lacks, or an opaque attribute.
    """
    cls = load(tree["cls"])
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise StructureError(f"{tree['cls'].get('qualname')} is not a torch.optim.Optimizer class")
    _refuse_opaque("the optimizer", cls, list(tree.get("opaque") or []))
    params = dict(model.named_parameters(remove_duplicate=False))
    groups = []
    for g in tree.get("groups") or []:
        missing = [n for n in g["params"] if n not in params]
        if missing:
            raise StructureError(f"the optimizer's parameters {missing[:4]} are not in the rebuilt model")
        groups.append({**{k: decode_value(v, load) for k, v in (g.get("hyper") or {}).items()},
                       "params": [params[n] for n in g["params"]]})
    opt = cls.__new__(cls)
    for k, v in (tree.get("attrs") or {}).items():
        object.__setattr__(opt, k, decode_value(v, load))
    torch.optim.Optimizer.__init__(opt, groups, decode_value(tree.get("defaults") or {"__dict__": {}}, load))
    return opt


def build_scheduler(tree: dict[str, Any], optimizer: torch.optim.Optimizer,
                    load: Callable[[dict[str, Any]], Any], load_function: Callable[[dict[str, Any]], Any]) -> Any:
    """The recorded LR scheduler bound to ``optimizer`` (its state comes from the snapshot).

    Raises:
        StructureError: an opaque attribute.
    """
    cls = load(tree["cls"])
    _refuse_opaque("the LR scheduler", cls, list(tree.get("opaque") or []))
    sched = cls.__new__(cls)
    for k, v in (tree.get("attrs") or {}).items():
        if isinstance(v, dict) and "__functions__" in v:
            object.__setattr__(sched, k, [load_function(f) for f in v["__functions__"]])
        else:
            object.__setattr__(sched, k, decode_value(v, load))
    sched.optimizer = optimizer
    return sched
