"""The function-mode half of the activation probe: which torch function calls are activations,
how each is measured (:class:`Rule`), and the ``TorchFunctionMode`` that sees them.

An ``nn.ReLU`` module, ``F.relu`` / ``torch.relu`` / ``x.relu()`` called inside a ``forward``,
``F.gelu``, ``F.silu``, ``torch.tanh``, ``torch.sigmoid`` ...: all end in a torch function call.
While a user's ``forward`` runs on a sampled step, :class:`ActivationMode` looks at those calls
only (:func:`rule_for`) and hands each to the probe that entered it, which measures it and names
it after the innermost running module (:mod:`.acthooks`, the module-hook half: the module stack,
and the activation modules measured by their own hooks, without this mode).

When a unit counts as dead or saturated (one value per unit over the whole sampled batch: all
micro-batches and all calls of the site in the step; what a unit is: :mod:`.acthooks`):

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

Cost: the mode's Python handler runs for every torch function call made while it is on, which
is why the module-hook half turns it on only inside modules whose ``forward`` may call an
activation function (a torch.nn convolution, batch norm or pooling never enters it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["Rule", "EPS", "DEAD_INPUT", "SATURATION_BAND", "rule_for", "ActivationMode", "probe_mode_active"]

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
SMOOTH = {k: Rule(k.replace("_tanh", ""), "dead", True, v) for k, v in DEAD_INPUT.items()}
SATURATING = {k: Rule(k, "saturated", band=b) for k, b in SATURATION_BAND.items()}


def gelu_rule(a: tuple[Any, ...], k: dict[str, Any]) -> Rule:
    return SMOOTH["gelu_tanh" if _arg(a, k, 1, "approximate", "none") == "tanh" else "gelu"]


def elu_rule(a: tuple[Any, ...], k: dict[str, Any]) -> Rule | None:
    alpha = _float(_arg(a, k, 1, "alpha", 1.0), 1.0)
    return Rule("elu", "dead", True, math.log(EPS / alpha)) if alpha > 0 else None


def celu_rule(a: tuple[Any, ...], k: dict[str, Any]) -> Rule | None:
    alpha = _float(_arg(a, k, 1, "alpha", 1.0), 1.0)
    return Rule("celu", "dead", True, alpha * math.log(EPS)) if alpha > 0 else None


def hardtanh_rule(a: tuple[Any, ...], k: dict[str, Any]) -> Rule | None:
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
        table[f] = hardtanh_rule
    table[F.gelu] = gelu_rule
    for f in (F.silu,):
        table[f] = _const(SMOOTH["silu"])
    for f in (F.mish,):
        table[f] = _const(SMOOTH["mish"])
    for f in (F.selu, torch.selu, torch.selu_):
        table[f] = _const(SMOOTH["selu"])
    for f in (F.hardswish,):
        table[f] = _const(SMOOTH["hardswish"])
    for f in (F.elu, F.elu_):
        table[f] = elu_rule
    for f in (F.celu, torch.celu, torch.celu_):
        table[f] = celu_rule
    for f in (torch.tanh, torch.tanh_, T.tanh, T.tanh_):
        table[f] = _const(SATURATING["tanh"])
    for f in (torch.sigmoid, torch.sigmoid_, T.sigmoid, T.sigmoid_, torch.special.expit):
        table[f] = _const(SATURATING["sigmoid"])
    return table


_RULES = _table()


def rule_for(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Rule | None:
    """The :class:`Rule` for one torch function call, or None when it is no activation we measure."""
    try:
        resolve = _RULES.get(func)
    except TypeError:                    # an unhashable callable
        return None
    return resolve(args, kwargs) if resolve is not None else None



class Measurer(Protocol):
    """What :class:`ActivationMode` hands a call to (:class:`.acthooks.ActivationProbe`)."""

    def looks_at_calls(self) -> bool: ...

    def before(self, rule: Rule, x: Any) -> torch.Tensor | None: ...

    def after(self, rule: Rule, pre: torch.Tensor | None, out: Any) -> None: ...


class ActivationMode(TorchFunctionMode):
    """Passes every torch function call through; an activation call (:func:`rule_for`) made while
    ``probe.looks_at_calls()`` is measured: ``probe.before`` on its input, ``probe.after`` on
    its output."""

    def __init__(self, probe: Measurer) -> None:
        super().__init__()
        self.probe = probe

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        # Inside an activation module (its hooks measure it) or a quiet one whose entry could not
        # leave the mode (another mode above ours): pass through.
        if not self.probe.looks_at_calls():
            return func(*args, **kwargs)
        rule = rule_for(func, args, kwargs)
        if rule is None:
            return func(*args, **kwargs)
        x = args[0] if args else kwargs.get("input")
        pre = self.probe.before(rule, x)
        out = func(*args, **kwargs)
        self.probe.after(rule, pre, out)
        return out


def on_top(mode: TorchFunctionMode) -> bool:
    """True when ``mode`` is the innermost entry of torch's function mode stack (it can be left)."""
    n = torch._C._len_torch_function_stack()
    return bool(n) and torch._C._get_function_stack_at(n - 1) is mode


def probe_mode_active() -> bool:
    """True when an activation probe's mode is already on torch's function mode stack."""
    try:
        n = torch._C._len_torch_function_stack()
        return any(isinstance(torch._C._get_function_stack_at(i), ActivationMode) for i in range(n))
    except Exception:  # noqa: BLE001 - a torch without these internals: assume none
        return False
