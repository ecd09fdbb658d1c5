"""Per-layer probes, sampled every N steps: dead/saturated units, per-module norms, update ratios.

Usage (the agent does this; a plain loop can too)::

    probes = attach_probes(model, optimizer, every=50)
    for step, (x, y) in enumerate(loader):
        probes.begin_step(step)              # before the step's first forward
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        layers = probes.collect()            # dict[str, LayerStats] on sampled steps, else None
    probes.remove()                          # model and optimizer exactly as before

What is measured on a sampled step (``step % every == 0``), per module from ``named_modules()``:

- ReLU-family outputs (ReLU, ReLU6, GELU, SiLU, ELU, CELU, SELU, Mish, Hardswish):
  ``dead_fraction``, the share of units never > 0 over the whole batch (all micro-batches and
  calls of the step). A unit is a feature: dim 1 of (B, F) and (B, C, H, W...), the last dim of
  (B, T, F).
- Tanh / Sigmoid outputs: ``saturated_fraction``, the share of output values over the batch that
  are saturated (|tanh| > 0.99, sigmoid < 0.01 or > 0.99; DeepDiagnosis's measure). The
  activation whose output is the model's output is left out (a confident sigmoid prediction is
  not a fault).
- Modules with their own trainable parameters (``recurse=False``): ``grad_norm`` (L2, taken in
  the optimizer's step pre-hook, i.e. after GradScaler unscaling and clipping; at ``collect`` for
  parameters no attached optimizer stepped), ``param_norm`` (L2, after the step), and
  ``update_ratio`` = ||w_after - w_before|| / ||w_before|| around ``optimizer.step()``
  (snapshot in the step pre-hook, compared in the post hook; 0.0 when no attached optimizer
  stepped, e.g. GradScaler skipped the step or the loop never calls ``step()``).

Cost: on other steps every hook returns at its first line and nothing touches a tensor, so no
host-device synchronisation is added. On a sampled step the probes copy the optimizer's
parameters once (memory: one extra copy of them until the step ends) and ``collect`` reads all
figures back in one transfer (one synchronisation on CUDA). bench/probes_cost.py measures it.

Errors: a probe never raises into the training loop; an internal error is logged once and the
probes switch themselves off (``collect`` returns None from then on).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from sentineld.contracts.records import LayerStats

__all__ = ["ProbeHandle", "attach_probes", "RELU_FAMILY", "SATURATING"]

log = logging.getLogger("sentineld.agent")

#: Activation modules whose units can die (output never > 0).
RELU_FAMILY: tuple[type[nn.Module], ...] = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.ELU, nn.CELU,
                                            nn.SELU, nn.Mish, nn.Hardswish)
#: Activation modules that saturate, with the band outside which an output counts as saturated.
SATURATING: dict[type[nn.Module], tuple[float, float]] = {nn.Tanh: (-0.99, 0.99),
                                                          nn.Sigmoid: (0.01, 0.99)}


def _unit_reduce_dims(t: torch.Tensor) -> tuple[int, ...] | None:
    """Dims to reduce so one value per unit (feature) remains; None for a scalar."""
    if t.dim() == 0:
        return None
    if t.dim() == 1:
        return ()
    if t.dim() == 3:
        return (0, 1)
    return tuple(d for d in range(t.dim()) if d != 1)


def _norms(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """L2 norm of each tensor as a float32 0-dim tensor on its device (fused where possible)."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        if t.is_sparse:
            out[i] = torch.linalg.vector_norm(t.coalesce()._values().float())
        else:
            groups.setdefault((t.device, t.dtype), []).append(i)
    for idx in groups.values():
        ts = [tensors[i] for i in idx]
        ns: Any
        try:
            ns = torch._foreach_norm(ts, 2, dtype=torch.float32)
        except (RuntimeError, AttributeError, TypeError):
            ns = [torch.linalg.vector_norm(t, dtype=torch.float32) for t in ts]
        for i, n in zip(idx, ns):
            out[i] = n.float()
    return out  # type: ignore[return-value]


class ProbeHandle:
    """Hooks attached by :func:`attach_probes`; sampled every ``every`` steps.

    Attributes:
        every: sampling period in steps (declared at attach).
        enabled: False once :meth:`remove` ran or an internal error switched the probes off.
    """

    _last_out: tuple[str, Any] | None

    def __init__(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
                 every: int) -> None:
        self.every = every
        self.enabled = True
        self._active = False
        self._step: int | None = None
        self._optimizers = list(optimizers)
        self._hooks: list[Any] = []
        # activation modules: name -> (kind, band)
        self._acts: dict[str, tuple[str, tuple[float, float] | None]] = {}
        # modules with their own trainable parameters
        self._param_mods: list[tuple[str, list[nn.Parameter]]] = []
        self._tracked: set[int] = set()
        self._reset()

        for name, module in model.named_modules():
            if isinstance(module, RELU_FAMILY):
                self._acts[name] = ("dead", None)
            else:
                band = next((b for cls, b in SATURATING.items() if isinstance(module, cls)), None)
                if band is not None:
                    self._acts[name] = ("saturated", band)
            if name in self._acts:
                self._hooks.append(module.register_forward_hook(self._make_act_hook(name)))
            params = [p for p in module.parameters(recurse=False) if p.requires_grad]
            params = [p for p in params if id(p) not in self._tracked]
            if params:
                self._param_mods.append((name, params))
                self._tracked.update(id(p) for p in params)
        if self._acts:
            self._hooks.append(model.register_forward_hook(self._on_model_output))
        for opt in self._optimizers:
            self._hooks.append(opt.register_step_pre_hook(self._on_pre_step))
            self._hooks.append(opt.register_step_post_hook(self._on_post_step))

    # ------------------------------------------------------------------ public
    @property
    def sampled(self) -> bool:
        """True between :meth:`begin_step` of a sampled step and :meth:`collect`."""
        return self._active

    def begin_step(self, step: int) -> bool:
        """Declare the step about to run (call before its first forward).

        Args:
            step: optimizer step index, 0-based.

        Returns:
            True when this step is sampled (``step % every == 0``).
        """
        if self._active:
            self._reset()          # a sampled step whose collect() never came
        self._step = step
        self._active = self.enabled and step % self.every == 0
        return self._active

    def collect(self) -> dict[str, LayerStats] | None:
        """Per-module stats of the step begun last (call after ``optimizer.step()``).

        Returns:
            ``{module name: LayerStats}`` on a sampled step; None on other steps, after an
            internal error, or after :meth:`remove`. Reads device values back in one transfer.
        """
        if not self._active:
            return None
        self._active = False
        try:
            return self._collect()
        except Exception as exc:  # noqa: BLE001 - never break training
            self._fail(exc)
            return None
        finally:
            self._reset()

    def remove(self) -> None:
        """Detach every hook; model and optimizer are left exactly as before attaching."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.enabled = False
        self._active = False
        self._reset()

    def __enter__(self) -> "ProbeHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # ------------------------------------------------------------------- hooks
    def _make_act_hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            if not self._active:
                return
            try:
                self._on_activation(name, out)
            except Exception as exc:  # noqa: BLE001
                self._fail(exc)
        return hook

    def _on_activation(self, name: str, out: Any) -> None:
        if not isinstance(out, torch.Tensor) or not out.is_floating_point() \
                or not torch.is_grad_enabled():
            return
        dims = _unit_reduce_dims(out)
        if dims is None:
            return
        kind, band = self._acts[name]
        with torch.no_grad():
            y = out.detach()
            if kind == "dead":
                live = y > 0
                if dims:
                    live = live.any(dim=dims)
                prev = self._live.get(name)
                if prev is None:
                    self._live[name] = live
                elif prev.shape == live.shape:
                    prev.logical_or_(live)
                else:
                    self._bad_shape.add(name)
            else:
                lo, hi = band  # type: ignore[misc]
                sat = ((y < lo) | (y > hi)).sum()
                prev_sat, prev_n = self._sat.get(name, (None, 0))
                self._sat[name] = (sat if prev_sat is None else prev_sat + sat, prev_n + y.numel())
        self._last_out = (name, out)

    def _on_model_output(self, module: nn.Module, args: Any, out: Any) -> None:
        if not self._active:
            return
        last, self._last_out = self._last_out, None
        if last is not None and last[1] is out:
            self._outputs.add(last[0])

    def _on_pre_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._active:
            return
        try:
            params = [p for g in opt.param_groups for p in g["params"]
                      if id(p) in self._tracked and id(p) not in self._before]
            with torch.no_grad():
                grads = [(p, p.grad) for p in params if p.grad is not None]
                for p, n in zip([p for p, _ in grads], _norms([g for _, g in grads])):
                    self._gnorm[id(p)] = n
                for p, n in zip(params, _norms([p.detach() for p in params])):
                    self._wbefore[id(p)] = n
                for p in params:
                    self._before[id(p)] = p.detach().clone()
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def _on_post_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._active:
            return
        try:
            params = [p for g in opt.param_groups for p in g["params"]
                      if id(p) in self._before and id(p) not in self._delta]
            if not params:
                return
            self._stepped = True
            with torch.no_grad():
                before = [self._before[id(p)] for p in params]
                after = [p.detach() for p in params]
                diffs: Any
                try:
                    diffs = torch._foreach_sub(after, before)
                except (RuntimeError, TypeError):      # mixed devices/dtypes: one by one
                    diffs = [a - b for a, b in zip(after, before)]
                for p, n in zip(params, _norms(diffs)):
                    self._delta[id(p)] = n
            for p in params:
                del self._before[id(p)]  # free the copy as soon as it has served
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    # ------------------------------------------------------------------ helpers
    def _reset(self) -> None:
        self._live: dict[str, torch.Tensor] = {}
        self._sat: dict[str, tuple[torch.Tensor, int]] = {}
        self._bad_shape: set[str] = set()
        self._outputs: set[str] = set()
        self._last_out: tuple[str, Any] | None = None
        self._gnorm: dict[int, torch.Tensor] = {}
        self._wbefore: dict[int, torch.Tensor] = {}
        self._before: dict[int, torch.Tensor] = {}
        self._delta: dict[int, torch.Tensor] = {}
        self._stepped = False

    def _fail(self, exc: BaseException) -> None:
        if self.enabled:
            log.warning("sentineld: layer probes switched off after an internal error: %r", exc)
        self.enabled = False
        self._active = False
        self._reset()

    def _collect(self) -> dict[str, LayerStats]:
        vals: list[torch.Tensor] = []   # every figure, read back in one transfer

        def slot(t: torch.Tensor | None) -> int:
            if t is None:
                return -1
            vals.append(t)
            return len(vals) - 1

        with torch.no_grad():
            act_slots = {name: slot(1.0 - live.float().mean()) for name, live in self._live.items()
                         if name not in self._bad_shape and name not in self._outputs
                         and live.numel() > 0}
            act_slots.update({name: slot(sat.float() / n) for name, (sat, n) in self._sat.items()
                              if name not in self._outputs and n > 0})
            mod_slots = []
            missing = [p for _, ps in self._param_mods for p in ps
                       if id(p) not in self._gnorm and p.grad is not None]
            late = dict(zip((id(p) for p in missing), _norms([p.grad for p in missing])))  # type: ignore[misc]
            all_params = [p for _, ps in self._param_mods for p in ps]
            now_norms = iter(_norms([p.detach() for p in all_params]))   # one fused call
            for name, params in self._param_mods:
                g = [self._gnorm.get(id(p), late.get(id(p))) for p in params]
                g = [x for x in g if x is not None]
                w = [next(now_norms) for _ in params]
                entry = {"grad": [slot(x) for x in g], "w": [slot(x) for x in w]}
                if self._optimizers:
                    entry["wb"] = [slot(self._wbefore.get(id(p), wn)) for p, wn in zip(params, w)]
                    entry["d"] = [slot(self._delta.get(id(p))) for p in params]
                mod_slots.append((name, entry))
            host: list[float] = []
            if vals:
                dev = vals[0].device
                if any(v.device != dev or v.dtype != torch.float32 for v in vals):
                    vals = [v.to(dev, torch.float32) for v in vals]
                host = torch.stack(vals).tolist()     # the one device-to-host transfer

        def l2(idx: list[int]) -> float | None:
            xs = [host[i] for i in idx if i >= 0]
            return math.sqrt(sum(x * x for x in xs)) if xs else None

        out: dict[str, LayerStats] = {}
        for name, entry in mod_slots:
            grad = l2(entry["grad"])
            pnorm = l2(entry["w"])
            ratio = None
            if "d" in entry:
                before = l2(entry["wb"])
                delta = l2(entry["d"]) if self._stepped else 0.0
                if delta is None:
                    delta = 0.0
                if before is not None and before > 0:
                    ratio = delta / before
            out[name] = LayerStats(grad_norm=grad, param_norm=pnorm, update_ratio=ratio)
        for name, i in act_slots.items():
            frac = host[i]
            kind = self._acts[name][0]
            prev = out.get(name, LayerStats())
            if kind == "dead":
                out[name] = LayerStats(prev.grad_norm, prev.param_norm, prev.update_ratio,
                                       dead_fraction=frac)
            else:
                out[name] = LayerStats(prev.grad_norm, prev.param_norm, prev.update_ratio,
                                       saturated_fraction=frac)
        return out


def attach_probes(model: nn.Module,
                  optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None,
                  every: int) -> ProbeHandle:
    """Attach per-layer probes to ``model`` and ``optimizer``, sampled every ``every`` steps.

    Args:
        model: the model; module names in the results come from ``model.named_modules()``.
        optimizer: the optimizer that updates the model, or a list of them (e.g. one per
            parameter group of a GAN: pass all, or parameters of the others read as not updated),
            or None (no update ratios).
        every: sample one step in ``every`` (>= 1).

    Returns:
        The :class:`ProbeHandle`; call ``begin_step``/``collect`` each step, ``remove`` at the end.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or ``optimizer`` not an optimizer.
        ValueError: ``every`` is not an int >= 1.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be an int >= 1, got {every!r}")
    if optimizer is None:
        opts: list[torch.optim.Optimizer] = []
    elif isinstance(optimizer, torch.optim.Optimizer):
        opts = [optimizer]
    else:
        opts = list(optimizer)
    for o in opts:
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(o).__name__}")
    return ProbeHandle(model, opts, every)
