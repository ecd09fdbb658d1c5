"""The module-hook half of the activation probe: dead and saturated units wherever an activation
is computed, on sampled steps, named after the module that computed it.

On a sampled step (:meth:`ActivationProbe.start` .. :meth:`ActivationProbe.stop`) global module
forward hooks keep a stack of the model's running modules. Activation modules (``nn.ReLU``,
``nn.GELU``, ``nn.Tanh`` ...) are measured by those hooks themselves, with the module's settings;
while the innermost running module is one whose ``forward`` may call an activation function (a
user's module: ``OPEN``, see :func:`module_kind`), the function mode of :mod:`.actmode` is on and
hands each activation call (``F.relu``, ``torch.tanh`` ...) back here, named after that module.
What counts as dead or saturated per activation: :mod:`.actmode`.

A unit is a feature: dim 1 of (B, F) and (B, C, H, W...), the last dim of (B, T, F).

Only calls whose input requires grad, with grad mode on, are looked at (an activation computed on
a constant or in an evaluation pass is no unit being trained). The activation whose output is
the model's output is left out (a confident sigmoid prediction is not a fault).

Cost: nothing on other steps (no hook, no mode). On a sampled step the function mode is on only
inside ``OPEN`` modules: the torch.nn layers that compute no activation (``nn.Conv2d``,
``nn.BatchNorm2d``, ``nn.MaxPool2d``, ``nn.Linear``, ``nn.Sequential`` ...) are ``QUIET``, so a
model built from torch.nn layers alone never enters the mode; before, every convolution,
batch-norm and pooling call of a sampled forward went through the mode's Python handler, about
one whole extra step on a CNN. Each activation call adds one max reduction per unit (two for
saturation) on its device; nothing is read back here (the caller reads all figures in one
transfer).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch
from torch import nn

from .actmode import (
    RELU,
    SATURATING,
    SMOOTH,
    ActivationMode,
    Rule,
    celu_rule,
    elu_rule,
    gelu_rule,
    hardtanh_rule,
    on_top,
    probe_mode_active,
    rule_for,
)

__all__ = ["ActivationProbe", "module_kind", "OPEN", "QUIET", "ACT"]


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
        nn.Hardtanh: lambda m: hardtanh_rule((None, m.min_val, m.max_val), {}),
        nn.GELU: lambda m: gelu_rule((None, m.approximate), {}),
        nn.SiLU: lambda m: SMOOTH["silu"], nn.Mish: lambda m: SMOOTH["mish"],
        nn.SELU: lambda m: SMOOTH["selu"], nn.Hardswish: lambda m: SMOOTH["hardswish"],
        nn.ELU: lambda m: elu_rule((None, m.alpha), {}), nn.CELU: lambda m: celu_rule((None, m.alpha), {}),
        nn.Tanh: lambda m: SATURATING["tanh"], nn.Sigmoid: lambda m: SATURATING["sigmoid"]}
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
        self._mode: ActivationMode | None = None
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
            if probe_mode_active():
                # (a second watch on the same model: the first one's probe measures this forward;
                # two probe modes would interleave and the stack check would fail)
                return
            self._mode = ActivationMode(self)
            self._mode.__enter__()
        elif not want and self._mode is not None:
            if on_top(self._mode):
                mode, self._mode = self._mode, None
                mode.__exit__(None, None, None)
            # else another mode is above ours: leave both; ours passes this module's calls through

    def _exit_mode(self) -> None:
        mode, self._mode = self._mode, None
        if mode is None:
            return
        if on_top(mode):
            mode.__exit__(None, None, None)
        else:      # another mode entered inside the forward and still open: leave the stack be
            self._fail(RuntimeError("function mode stack changed under the activation probe"))

    # ---------------------------------------------------------------- measuring
    def looks_at_calls(self) -> bool:
        """True while the innermost running module is an ``OPEN`` one (the function mode measures
        its activation calls); False inside an activation module (its hooks measure it) or a
        quiet one whose entry could not leave the mode (another mode above ours)."""
        frames = self._frames
        return bool(frames) and frames[-1].kind == OPEN

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

