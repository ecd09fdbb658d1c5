"""Activation probe: dead and saturated units wherever an activation is computed, on sampled steps.

An ``nn.ReLU`` module, ``F.relu`` / ``torch.relu`` / ``x.relu()`` called inside a ``forward``,
``F.gelu``, ``F.silu``, ``torch.tanh``, ``torch.sigmoid`` ...: all end in a torch function call.
On a sampled step the probe runs the model's forward under a ``TorchFunctionMode`` that looks
at those calls only, and names each one after the innermost module whose ``forward`` made it (a
stack kept by module forward hooks, registered for the sampled step only). ``nn.ReLU`` modules
need no special case: their ``forward`` calls ``F.relu``, so the innermost module is the ReLU.

What a unit is, and when it counts as dead or saturated (one value per unit over the whole
sampled batch: all micro-batches and all calls of the site in the step):

- A unit is a feature: dim 1 of (B, F) and (B, C, H, W...), the last dim of (B, T, F).
- ReLU-family, piecewise-linear (relu, relu6 = hardtanh(0, 6)): dead when the output is never
  above its floor (0): its gradient is exactly 0 for the whole batch.
- ReLU-family, smooth (GELU, SiLU, Mish, ELU, CELU, SELU, Hardswish): these pass gradient
  below 0, so "never > 0" would call learning units dead. A unit is dead when its input stays in
  the flat negative region, where the activation's slope is below :data:`EPS` (1% of the slope
  of a live ReLU unit) for every input of the batch: GELU x < -3.07, SiLU/Mish x < -6.26, ELU
  x < ln(0.01/alpha) (-4.61), SELU x < -5.17, CELU x < alpha ln 0.01, Hardswish x <= -3 (slope
  exactly 0). The thresholds are where |f'(x)| first reaches 0.01 coming from -inf
  (tests/signatures/test_dead_onset.py checks each against autograd). The method ("a large
  number of neurons consistently at zero indicates dead ReLU", "the dead-region ratio should not
  be excessively high") names the region; 1% is the same order as the saturation band below
  (tanh' < 0.02 where |tanh| > 0.99, sigmoid' < 0.01 where sigmoid < 0.01 or > 0.99).
- Tanh / Sigmoid: saturated output values over the batch (|tanh| > 0.99, sigmoid < 0.01 or
  > 0.99: DeepDiagnosis's measure, SageMaker Debugger's ``SaturatedActivation``).

Only calls whose input requires grad, with grad mode on, are looked at (an activation computed on
a constant or in an evaluation pass is no unit being trained). The activation whose output is
the model's output is left out (a confident sigmoid prediction is not a fault).

Cost: nothing on other steps (no hook, no mode). On a sampled step, activation modules
(``nn.ReLU``, ``nn.GELU``, ``nn.Tanh`` ...) are measured by the module stack's own hooks, and
the function mode is on only while the innermost running module is one whose ``forward`` may call
an activation function (a user's module; not the torch.nn layers that compute none, such as
``nn.Conv2d``, ``nn.BatchNorm2d``, ``nn.MaxPool2d``, ``nn.Linear``, ``nn.Sequential``: see
:func:`module_kind`). A model built from torch.nn layers alone never enters the mode; before,
every convolution, batch-norm and pooling call of a sampled forward went through the mode's
Python handler, about one whole extra step on a CNN. Each activation call adds one max
reduction per unit (two for saturation) on its device; nothing is read back here (the caller
reads all figures in one transfer).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["ActivationProbe", "Rule", "EPS", "DEAD_INPUT", "rule_for"]

#: Slope under which a smooth activation's unit passes no useful gradient (see the module doc).
EPS = 0.01
#: Input below which |f'(x)| < EPS for every smaller x, per smooth activation (default params).
DEAD_INPUT: dict[str, float] = {"gelu": -3.0675, "gelu_tanh": -3.0529, "silu": -6.2614,
                                "mish": -6.264, "selu": -5.1695, "hardswish": -3.0}
SATURATION_BAND: dict[str, tuple[float, float]] = {"tanh": (-0.99, 0.99), "sigmoid": (0.01, 0.99)}


@dataclass(frozen=True)
class Rule:
    """How one activation call is measured.

    Attributes:
        op: the activation's name, e.g. ``"relu"``, ``"gelu"``, ``"tanh"``.
        kind: ``"dead"`` or ``"saturated"``.
        on_input: dead test on the input (smooth activations) rather than the output.
        level: dead: input threshold (on_input) or output floor; unused for saturated.
        band: saturated: output values outside (lo, hi) count as saturated.
    """

    op: str
    kind: str
    on_input: bool = False
    level: float = 0.0
    band: tuple[float, float] = (0.0, 0.0)


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str, default: Any) -> Any:
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def _float(v: Any, default: float) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return default


RELU = Rule("relu", "dead")
_SMOOTH = {k: Rule(k.replace("_tanh", ""), "dead", True, v) for k, v in DEAD_INPUT.items()}
_SAT = {k: Rule(k, "saturated", band=b) for k, b in SATURATION_BAND.items()}


def _gelu(a: tuple[Any, ...], k: dict[str, Any]) -> Rule:
    return _SMOOTH["gelu_tanh" if _arg(a, k, 1, "approximate", "none") == "tanh" else "gelu"]


def _elu(a: tuple[Any, ...], k: dict[str, Any]) -> Rule | None:
    alpha = _float(_arg(a, k, 1, "alpha", 1.0), 1.0)
    return Rule("elu", "dead", True, math.log(EPS / alpha)) if alpha > 0 else None


def _celu(a: tuple[Any, ...], k: dict[str, Any]) -> Rule | None:
    alpha = _float(_arg(a, k, 1, "alpha", 1.0), 1.0)
    return Rule("celu", "dead", True, alpha * math.log(EPS)) if alpha > 0 else None


def _hardtanh(a: tuple[Any, ...], k: dict[str, Any]) -> Rule | None:
    lo = _float(_arg(a, k, 1, "min_val", -1.0), -1.0)
    hi = _float(_arg(a, k, 2, "max_val", 1.0), 1.0)
    if lo < 0:
        return None                     # a clamp to [-1, 1], not a unit that can die
    return Rule("relu6" if (lo, hi) == (0.0, 6.0) else "hardtanh", "dead", level=lo)


def _const(rule: Rule) -> Callable[[tuple[Any, ...], dict[str, Any]], Rule]:
    return lambda a, k: rule


def _table() -> dict[Any, Callable[[tuple[Any, ...], dict[str, Any]], Rule | None]]:
    T = torch.Tensor
    table: dict[Any, Callable[[tuple[Any, ...], dict[str, Any]], Rule | None]] = {}
    for f in (F.relu, F.relu_, torch.relu, torch.relu_, T.relu, T.relu_):
        table[f] = _const(RELU)
    for f in (F.relu6,):
        table[f] = _const(Rule("relu6", "dead"))
    for f in (F.hardtanh, F.hardtanh_):
        table[f] = _hardtanh
    table[F.gelu] = _gelu
    for f in (F.silu,):
        table[f] = _const(_SMOOTH["silu"])
    for f in (F.mish,):
        table[f] = _const(_SMOOTH["mish"])
    for f in (F.selu, torch.selu, torch.selu_):
        table[f] = _const(_SMOOTH["selu"])
    for f in (F.hardswish,):
        table[f] = _const(_SMOOTH["hardswish"])
    for f in (F.elu, F.elu_):
        table[f] = _elu
    for f in (F.celu, torch.celu, torch.celu_):
        table[f] = _celu
    for f in (torch.tanh, torch.tanh_, T.tanh, T.tanh_):
        table[f] = _const(_SAT["tanh"])
    for f in (torch.sigmoid, torch.sigmoid_, T.sigmoid, T.sigmoid_, torch.special.expit):
        table[f] = _const(_SAT["sigmoid"])
    return table


_RULES = _table()


def rule_for(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Rule | None:
    """The :class:`Rule` for one torch function call, or None when it is no activation we measure."""
    try:
        resolve = _RULES.get(func)
    except TypeError:                    # an unhashable callable
        return None
    return resolve(args, kwargs) if resolve is not None else None


def _unit_dims(t: torch.Tensor) -> tuple[int, ...] | None:
    """Dims to reduce so one value per unit (feature) remains; None for a scalar."""
    if t.dim() == 0:
        return None
    if t.dim() == 1:
        return ()
    if t.dim() == 3:
        return (0, 1)
    return tuple(d for d in range(t.dim()) if d != 1)


def _module_rules() -> dict[type, Callable[[Any], Rule | None]]:
    """The activation modules measured by their own forward hooks (no function mode): their
    ``forward`` is one call of the functional the mode would see, with the module's settings."""
    out: dict[type, Callable[[Any], Rule | None]] = {
        nn.ReLU: lambda m: RELU, nn.ReLU6: lambda m: Rule("relu6", "dead"),
        nn.Hardtanh: lambda m: _hardtanh((None, m.min_val, m.max_val), {}),
        nn.GELU: lambda m: _gelu((None, m.approximate), {}),
        nn.SiLU: lambda m: _SMOOTH["silu"], nn.Mish: lambda m: _SMOOTH["mish"],
        nn.SELU: lambda m: _SMOOTH["selu"], nn.Hardswish: lambda m: _SMOOTH["hardswish"],
        nn.ELU: lambda m: _elu((None, m.alpha), {}), nn.CELU: lambda m: _celu((None, m.alpha), {}),
        nn.Tanh: lambda m: _SAT["tanh"], nn.Sigmoid: lambda m: _SAT["sigmoid"]}
    return out


_MODULE_RULES = _module_rules()

#: torch.nn classes (exact types) whose ``forward`` computes no activation the probe measures:
#: the function mode is left while one of them runs, so their ops (convolution, batch norm,
#: pooling ...) skip the mode's Python handler, the probe's whole cost on a CNN before. A
#: subclass (its own ``forward``) is not in here and is looked at as any user module.
_QUIET_NAMES = (
    "Identity Linear Bilinear LazyLinear Conv1d Conv2d Conv3d ConvTranspose1d ConvTranspose2d "
    "ConvTranspose3d LazyConv1d LazyConv2d LazyConv3d LazyConvTranspose1d LazyConvTranspose2d "
    "LazyConvTranspose3d BatchNorm1d BatchNorm2d BatchNorm3d LazyBatchNorm1d LazyBatchNorm2d "
    "LazyBatchNorm3d SyncBatchNorm LayerNorm GroupNorm RMSNorm LocalResponseNorm InstanceNorm1d "
    "InstanceNorm2d InstanceNorm3d LazyInstanceNorm1d LazyInstanceNorm2d LazyInstanceNorm3d "
    "Dropout Dropout1d Dropout2d Dropout3d AlphaDropout FeatureAlphaDropout Embedding EmbeddingBag "
    "MaxPool1d MaxPool2d MaxPool3d AvgPool1d AvgPool2d AvgPool3d AdaptiveAvgPool1d AdaptiveAvgPool2d "
    "AdaptiveAvgPool3d AdaptiveMaxPool1d AdaptiveMaxPool2d AdaptiveMaxPool3d LPPool1d LPPool2d "
    "Flatten Unflatten ZeroPad1d ZeroPad2d ZeroPad3d ConstantPad1d ConstantPad2d ConstantPad3d "
    "ReflectionPad1d ReflectionPad2d ReflectionPad3d ReplicationPad1d ReplicationPad2d "
    "ReplicationPad3d CircularPad1d CircularPad2d CircularPad3d Upsample UpsamplingNearest2d "
    "UpsamplingBilinear2d PixelShuffle PixelUnshuffle ChannelShuffle Softmax LogSoftmax Softmax2d "
    "Softmin LeakyReLU PReLU RReLU Softplus Softsign Threshold GLU MultiheadAttention Sequential "
    "ModuleList ModuleDict ParameterList ParameterDict TransformerEncoder TransformerDecoder "
    "Transformer TransformerEncoderLayer TransformerDecoderLayer").split()
#: torch.nn layers whose feed-forward block calls a function activation on ``linear1``'s output
#: (``linear2(dropout(activation(linear1(x))))``): quiet, and measured on that output instead
#: (the activation's input, attributed to the layer as the mode attributed the call).
_FF_LAYERS = ("TransformerEncoderLayer", "TransformerDecoderLayer")
_QUIET: frozenset[type] = frozenset(t for t in (getattr(nn, n, None) for n in _QUIET_NAMES)
                                    if isinstance(t, type))

OPEN, QUIET, ACT = 0, 1, 2   # how a module's forward is looked at (see _Frame)


def module_kind(module: nn.Module) -> int:
    """``ACT``: an activation module, measured by its hooks; ``QUIET``: a torch.nn module that
    computes no measured activation (the function mode is off inside it); ``OPEN``: anything
    else (a user's ``forward`` may call ``F.relu`` ...: the function mode looks at it)."""
    t = type(module)
    if t in _MODULE_RULES:
        return ACT
    return QUIET if t in _QUIET else OPEN


def _live_units(t: torch.Tensor, level: float) -> torch.Tensor | None:
    """Per unit (see :func:`_unit_dims`), True when some value over the batch is above ``level``:
    one max reduction (``amax(t) > level`` is ``any(t > level)`` without the full boolean
    tensor; a unit with a NaN value reads as not live). None for a scalar."""
    dims = _unit_dims(t)
    if dims is None:
        return None
    if not dims:
        return t > level
    return torch.amax(t, dim=dims) > level


class _Frame:
    __slots__ = ("module", "name", "counts", "kind", "rule", "pre")

    def __init__(self, module: nn.Module, name: str, kind: int) -> None:
        self.module, self.name, self.kind = module, name, kind
        self.counts: dict[str, int] = {}
        self.rule: Rule | None = None
        self.pre: torch.Tensor | None = None


class _Mode(TorchFunctionMode):
    def __init__(self, probe: "ActivationProbe") -> None:
        super().__init__()
        self.probe = probe

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        frames = self.probe._frames
        # Inside an activation module (its hooks measure it) or a quiet one whose entry could not
        # leave the mode (another mode above ours): pass through.
        if not frames or frames[-1].kind != OPEN:
            return func(*args, **kwargs)
        rule = rule_for(func, args, kwargs)
        if rule is None:
            return func(*args, **kwargs)
        x = args[0] if args else kwargs.get("input")
        pre = self.probe.before(rule, x)
        out = func(*args, **kwargs)
        self.probe.after(rule, pre, out)
        return out


Site = tuple[str, str, int]   # (module name, op, index of that op's call in the module's forward)


class ActivationProbe:
    """Measures every activation call of the model's forwards between :meth:`start` and :meth:`stop`.

    Args:
        model: the model; sites are named after ``model.named_modules()``.

    Attributes:
        error: the exception of a failed measurement, else None. Measuring then stops (the
            training call itself goes on); the owner reads it after the step, outside any
            forward, where the function mode can be left safely.
    """

    def __init__(self, model: nn.Module) -> None:
        self._root = model
        self._names = {id(m): n for n, m in model.named_modules()}
        self._kinds = {id(m): module_kind(m) for _, m in model.named_modules()}
        self._ff: dict[int, tuple[nn.Module, Rule]] = {}   # id(linear1) -> (its layer, the rule)
        for _, m in model.named_modules():
            if type(m) in {getattr(nn, n, None) for n in _FF_LAYERS} and \
                    isinstance(getattr(m, "linear1", None), nn.Module):
                act = getattr(m, "activation", None)
                rule = rule_for(act, (None,), {})
                if rule is not None:
                    self._ff[id(m.linear1)] = (m, rule)
                elif not isinstance(act, nn.Module):      # (a module activation is measured as one)
                    self._kinds[id(m)] = OPEN               # some other callable: the mode looks
        self._hooks: list[Any] = []
        self._mode: _Mode | None = None
        self._thread = 0
        self.error: BaseException | None = None
        self._reset()

    def _reset(self) -> None:
        self._frames: list[_Frame] = []
        self.live: dict[Site, torch.Tensor] = {}
        self.sat: dict[Site, tuple[torch.Tensor, int]] = {}
        self.bad_shape: set[Site] = set()
        self.outputs: set[Site] = set()
        self._last: tuple[Site, torch.Tensor] | None = None
        self.ops: dict[Site, Rule] = {}

    # ---------------------------------------------------------------- life cycle
    def root_hooks(self) -> list[Any]:
        """Permanent hooks on the root module (they return at once unless :meth:`start` ran), so
        a forward whose pre-hooks were already listed when the step began still counts."""
        return [self._root.register_forward_pre_hook(self._push),
                self._root.register_forward_hook(self._pop, always_call=True)]

    def start(self) -> None:
        """Measure from now on (a sampled step begins): module stack hooks for every module."""
        self.stop()
        self.error = None
        self._thread = threading.get_ident()
        reg = nn.modules.module
        self._hooks = [reg.register_module_forward_pre_hook(self._push),
                       reg.register_module_forward_hook(self._pop, always_call=True)]

    def stop(self) -> None:
        """Stop measuring (the figures stay until :meth:`clear`)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        while self._frames:                    # a forward that never returned to us
            self._frames.pop()
        self._exit_mode()

    def clear(self) -> None:
        """Drop the figures of the last sampled step."""
        self._reset()

    @property
    def running(self) -> bool:
        return bool(self._hooks)

    # --------------------------------------------------------------- module stack
    def _push(self, module: nn.Module, args: Any) -> None:
        if not self._hooks or threading.get_ident() != self._thread:
            return
        if self._frames and self._frames[-1].module is module:
            return                              # the root's own and the global pre-hook
        name = self._names.get(id(module))
        if name is None:
            return                              # not the model's: its calls go to the caller
        if not self._frames and not torch.is_grad_enabled():
            return      # an evaluation pass: nothing to measure, and no mode to change its path
        frame = _Frame(module, name, self._kinds.get(id(module), OPEN))
        self._frames.append(frame)
        if frame.kind == ACT:
            try:
                frame.rule = _MODULE_RULES[type(module)](module)
                if frame.rule is not None:
                    frame.pre = self.before(frame.rule, args[0] if args else None)
            except Exception as exc:  # noqa: BLE001 - never break training
                self._fail(exc)
        self._sync_mode()

    def _pop(self, module: nn.Module, args: Any, out: Any) -> None:
        if not self._frames or self._frames[-1].module is not module \
                or threading.get_ident() != self._thread:
            return
        frame = self._frames.pop()
        ff = self._ff.get(id(module)) if self._ff else None
        if ff is not None and self._frames and self._frames[-1].module is ff[0]:
            rule = ff[1]
            self.after(rule, self.before(rule, out) if rule.on_input else out, out, self._frames[-1])
        if frame.rule is not None:
            # named after the activation module itself, as the mode named the F.relu call in
            # nn.ReLU.forward (its innermost module)
            pre, frame.pre = frame.pre, None
            self.after(frame.rule, pre, out, frame)
        if not self._frames:
            self._exit_mode()
            last, self._last = self._last, None
            if module is self._root and last is not None and last[1] is out:
                self.outputs.add(last[0])
        else:
            self._sync_mode()

    def _sync_mode(self) -> None:
        """The function mode on exactly while the innermost module is an ``OPEN`` one."""
        want = self._frames[-1].kind == OPEN
        if want and self._mode is None:
            if _probe_mode_active():
                # (a second watch on the same model: the first one's probe measures this forward;
                # two probe modes would interleave and the stack check would fail)
                return
            self._mode = _Mode(self)
            self._mode.__enter__()
        elif not want and self._mode is not None:
            n = torch._C._len_torch_function_stack()
            if n and torch._C._get_function_stack_at(n - 1) is self._mode:
                mode, self._mode = self._mode, None
                mode.__exit__(None, None, None)
            # else another mode is above ours: leave both; ours passes this module's calls through

    def _exit_mode(self) -> None:
        mode, self._mode = self._mode, None
        if mode is None:
            return
        n = torch._C._len_torch_function_stack()
        if n and torch._C._get_function_stack_at(n - 1) is mode:
            mode.__exit__(None, None, None)
        else:      # another mode entered inside the forward and still open: leave the stack be
            self._fail(RuntimeError("function mode stack changed under the activation probe"))

    # ---------------------------------------------------------------- measuring
    def before(self, rule: Rule, x: Any) -> torch.Tensor | None:
        """The input-side live units of a smooth activation, taken before an in-place call."""
        if not self._frames or self.error is not None or not isinstance(x, torch.Tensor) \
                or not x.is_floating_point() or not x.requires_grad or not torch.is_grad_enabled() \
                or x.layout != torch.strided or x.is_nested:
            return None                         # sparse/nested: no comparison kernels (it switched all probes off)
        try:
            if rule.kind != "dead" or not rule.on_input:
                return x                        # measured on the output
            return _live_units(x.detach(), rule.level)
        except Exception as exc:  # noqa: BLE001 - never break training
            self._fail(exc)
            return None

    def after(self, rule: Rule, pre: torch.Tensor | None, out: Any, frame: _Frame | None = None) -> None:
        """Accumulate one call's figures into its site (``frame``'s module; default the innermost)."""
        if frame is None:
            frame = self._frames[-1] if self._frames else None
        if pre is None or frame is None or self.error is not None \
                or not isinstance(out, torch.Tensor) or out.layout != torch.strided or out.is_nested:
            return
        try:
            k = frame.counts.get(rule.op, 0)
            frame.counts[rule.op] = k + 1
            site = (frame.name, rule.op, k)
            self.ops[site] = rule
            with torch.no_grad():
                y = out.detach()
                if rule.kind == "dead":
                    self._dead(site, pre if rule.on_input else _live_units(y, rule.level))
                else:
                    lo, hi = rule.band
                    sat = ((y < lo) | (y > hi)).sum()
                    prev, n = self.sat.get(site, (None, 0))
                    self.sat[site] = (sat if prev is None else prev + sat, n + y.numel())
            self._last = (site, out)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def _dead(self, site: Site, live: torch.Tensor | None) -> None:
        if live is None:
            return
        prev = self.live.get(site)
        if prev is None:
            self.live[site] = live
        elif prev.shape == live.shape:
            prev.logical_or_(live)
        else:
            self.bad_shape.add(site)

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc

    # ---------------------------------------------------------------- results
    def fractions(self) -> list[tuple[Site, str, torch.Tensor]]:
        """``(site, kind, fraction as a 0-dim device tensor)`` of every measured site, the
        model's output activation left out."""
        out = []
        for site, live in self.live.items():
            if site not in self.bad_shape and site not in self.outputs and live.numel() > 0:
                out.append((site, "dead", 1.0 - live.float().mean()))
        for site, (sat, n) in self.sat.items():
            if site not in self.outputs and n > 0:
                out.append((site, "saturated", sat.float() / n))
        return out


def _probe_mode_active() -> bool:
    """True when an activation probe's mode is already on torch's function mode stack."""
    try:
        n = torch._C._len_torch_function_stack()
        return any(isinstance(torch._C._get_function_stack_at(i), _Mode) for i in range(n))
    except Exception:  # noqa: BLE001 - a torch without these internals: assume none
        return False
