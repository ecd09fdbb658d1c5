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

Two kinds of sampled step. A *full* sample (:func:`full_at`) measures everything below; the
steps of the dense head other than 0, 1, 2, 4, 8 measure the activations only (dead and
saturated units: one max reduction per activation call, no parameter copy and no norms), which
is what an early death needs seen soon.

When a step is sampled: every step for the first ``dense`` steps of the run (16 by default),
then every 2, 4, 8 ... steps (the gap doubles each time the step count doubles), until the gap
reaches ``every``; from then on every ``every`` steps (``step % every == 0``). So a unit that
dies early (a too-high learning rate kills units within a few steps) is seen within a few
steps of its death: the gap at step s is at most max(1, s / dense), capped at ``every``
(:func:`sampled_at`). The dense head costs ``dense`` + ~``dense`` log2(every / 2) extra
sampled steps once per run (bench/probes_cost.py).

What is measured on a sampled step, per module from ``named_modules()``:

- Activations wherever they are computed (``nn.ReLU`` modules, ``F.relu`` / ``torch.relu`` /
  ``F.gelu`` / ``torch.tanh`` ... inside a ``forward``), attributed to the innermost module
  that made the call (``sentineld.agent.acthooks``, ``sentineld.agent.actmode``): ``dead_fraction`` for the ReLU family
  (units never active over the batch: never > 0 for ReLU, input always in the flat negative
  region for GELU/SiLU/...), ``saturated_fraction`` for tanh/sigmoid (DeepDiagnosis's measure),
  and ``activation``, the call they were measured on. With several calls in one module, the
  worst one is reported. The activation whose output is the model's output is left out.
- Modules with their own trainable parameters (``recurse=False``): ``grad_norm`` (L2, taken in
  the optimizer's step pre-hook, i.e. after GradScaler unscaling and clipping; at ``collect`` for
  parameters no attached optimizer stepped), ``param_norm`` (L2, after the step), and
  ``update_ratio`` = ||w_after - w_before|| / ||w_before|| around ``optimizer.step()``
  (snapshot in the step pre-hook, compared in the post hook; 0.0 when no attached optimizer
  stepped, e.g. GradScaler skipped the step or the loop never calls ``step()``).

Cost: on other steps every hook returns at its first line and nothing touches a tensor, so no
host-device synchronisation is added (the activation probe's module hooks and function mode
exist only during sampled steps). On a sampled step the probes copy the optimizer's
parameters once (memory: one extra copy of them until the step ends) and ``collect`` reads all
figures back in one transfer (one synchronisation on CUDA). bench/probes_cost.py measures it.

Errors: a probe never raises into the training loop; an internal error is logged once and the
probes switch themselves off (``collect`` returns None from then on).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from sentineld.contracts.records import LayerStats

from .acthooks import ActivationProbe
from .readback import GradNorms
from .sampling import DENSE_STEPS, full_at, norms_at, sampled_at
from .sharded import local

__all__ = ["ProbeHandle", "attach_probes", "sampled_at", "full_at", "norms_at", "DENSE_STEPS"]

log = logging.getLogger("sentineld.agent")

def _wide(device: torch.device) -> torch.dtype:
    """The dtype a norm is re-taken in when its fast value overflowed: float64 where the device
    has it, float32 elsewhere (MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


def _norms(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """L2 norm of each tensor as a 0-dim tensor on its device (fused ``_foreach_norm`` per device
    and dtype, in the tensor's own precision; float16/bfloat16 accumulate in float32).

    Fast, but a float32 tensor with elements near 1e20 has a float32 norm of inf although every
    element is finite (its square overflows): :meth:`ProbeHandle._collect` re-takes every inf
    it reads back in :func:`_wide` precision from the tensor itself (:func:`_exact`), so a norm
    is inf only when an element is, nan when one is nan. Not float64 here: on CPU a float64
    ``_foreach_norm`` of float32 tensors is ~13x slower than the float32 one (3.5 vs 0.26 ms for
    the 0.83M-parameter MLP of bench/overhead.py), and a full sample takes four of them."""
    tensors = [local(t) for t in tensors]  # FSDP2: the rank's shard, no collective (agent/sharded.py)
    out: list[torch.Tensor | None] = [None] * len(tensors)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        if t.is_sparse:
            out[i] = torch.linalg.vector_norm(t.coalesce()._values(), dtype=_wide(t.device))
        else:
            groups.setdefault((t.device, t.dtype), []).append(i)
    for (_, dtype), idx in groups.items():
        ts = [tensors[i] for i in idx]
        low = dtype in (torch.float16, torch.bfloat16)
        ns: Any
        try:
            ns = torch._foreach_norm(ts, 2, dtype=torch.float32) if low else torch._foreach_norm(ts)
        except (RuntimeError, AttributeError, TypeError):
            ns = [torch.linalg.vector_norm(t, dtype=torch.float32 if low else None) for t in ts]
        for i, n in zip(idx, ns):
            out[i] = n
    return out  # type: ignore[return-value]


def _exact(t: torch.Tensor) -> float:
    """The L2 norm of ``t`` in :func:`_wide` precision (the rare path: a fast norm read inf)."""
    t = local(t)  # FSDP2: the rank's shard, no collective
    if t.is_sparse:
        t = t.coalesce()._values()
    return float(torch.linalg.vector_norm(t, dtype=_wide(t.device)))


class ProbeHandle:
    """Hooks attached by :func:`attach_probes`; sampled every ``every`` steps.

    Attributes:
        every: sampling period in steps (declared at attach).
        enabled: False once :meth:`remove` ran or an internal error switched the probes off.
    """

    def __init__(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
                 every: int, dense: int = DENSE_STEPS) -> None:
        self.every = every
        self.dense = dense
        self.enabled = True
        #: Why the probes switched themselves off (one line), or None; the recorder streams it once.
        self.failure: str | None = None
        self._active = False
        self._norms_on = False      # this sampled step also takes per-module grad/param norms
        self._full = False          # ... and update ratios (a parameter copy around the step)
        self._step: int | None = None
        self._first: int | None = None
        self._optimizers = list(optimizers)
        # modules with their own trainable parameters
        self._param_mods: list[tuple[str, list[nn.Parameter]]] = []
        self._tracked: set[int] = set()
        self._acts = ActivationProbe(model)
        self._hooks: list[Any] = self._acts.root_hooks()
        self._reset()

        for name, module in model.named_modules():
            params = [p for p in module.parameters(recurse=False) if p.requires_grad]
            params = [p for p in params if id(p) not in self._tracked]
            if params:
                self._param_mods.append((name, params))
                self._tracked.update(id(p) for p in params)
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
            True when this step is sampled (:func:`sampled_at`, counted from the first step
            declared, so a resumed run samples densely again).
        """
        if self._active:
            self._reset()          # a sampled step whose collect() never came
        if self._first is None or step < self._first:
            self._first = step
        self._step = step
        self._active = self.enabled and sampled_at(step, self.every, self.dense, self._first)
        self._norms_on = self._active and norms_at(step, self.every, self.dense, self._first)
        self._full = self._norms_on and full_at(step, self.every, self.dense, self._first)
        if self._active:
            try:
                self._acts.start()
            except Exception as exc:  # noqa: BLE001 - never break training
                self._fail(exc)
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
            return self._collect(self._norms_on, self._full)
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

    def grad_norms(self) -> GradNorms | None:
        """On a step that takes per-module norms (:func:`norms_at`), the dict the agent's global
        grad norm fills with its per-parameter norms (:func:`~.readback.grad_norm`, taken in the
        optimizer's step pre-hook before this handle's): the probes reuse those of the gradients
        still unchanged. None on other steps."""
        if not self._norms_on:
            return None
        self._shared.clear()
        return self._shared

    # ------------------------------------------------------------------- hooks

    def _on_pre_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._norms_on:
            return
        try:
            params = [p for g in opt.param_groups for p in g["params"]
                      if id(p) in self._tracked and id(p) not in self._seen]
            self._seen.update(id(p) for p in params)   # a second step() of the step: not again
            with torch.no_grad():
                grads = [(p, p.grad) for p in params if p.grad is not None]
                shared, need = self._shared, []
                for p, g in grads:
                    # the global grad norm's own per-parameter value, when it was taken of this
                    # very gradient, unchanged since (same tensor, same version): the same
                    # float32 norm, without a second pass over the gradient
                    hit = shared.get(id(p)) if g is not None and not g.is_inference() else None
                    if hit is not None and hit[0] is g and hit[1] == g._version:
                        self._gnorm[id(p)] = hit[2]
                        self._gsrc[id(p)] = g
                    else:
                        need.append((p, g))
                for (p, g), n in zip(need, _norms([g for _, g in need])):
                    self._gnorm[id(p)] = n
                    self._gsrc[id(p)] = g          # kept until collect: an inf norm is re-taken
                if not self._full:
                    return                         # norms only: no copy, no update ratio
                for p, n in zip(params, _norms([p.detach() for p in params])):
                    self._wbefore[id(p)] = n
                for p in params:
                    self._before[id(p)] = p.detach().clone()
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def _on_post_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._full:
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
                # in place: the copy becomes w_before - w_after (no second copy); kept until
                # collect, where it also gives w_before back should a norm need re-taking
                try:
                    torch._foreach_sub_(before, after)
                except (RuntimeError, TypeError):      # mixed devices/dtypes: one by one
                    for b, a in zip(before, after):
                        b.sub_(a)
                for p, n in zip(params, _norms(before)):
                    self._delta[id(p)] = n
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    # ------------------------------------------------------------------ helpers
    def _reset(self) -> None:
        self._acts.stop()
        self._acts.clear()
        self._gnorm: dict[int, torch.Tensor] = {}
        self._wbefore: dict[int, torch.Tensor] = {}
        self._before: dict[int, torch.Tensor] = {}
        self._delta: dict[int, torch.Tensor] = {}
        self._gsrc: dict[int, torch.Tensor] = {}
        self._seen: set[int] = set()   # parameters the step pre-hook measured this step
        self._shared: GradNorms = {}   # filled by the global grad norm (grad_norms)
        self._stepped = False
        self._full = False
        self._norms_on = False

    def _before_of(self, p: torch.Tensor) -> Callable[[], torch.Tensor] | None:
        """w_before of ``p`` on demand: its copy holds w_before - w_after once the step ran."""
        if id(p) not in self._wbefore:
            return lambda: p.detach()
        diff = self._before.get(id(p))
        if diff is None:
            return None
        if id(p) in self._delta:
            return lambda: diff + p.detach()
        return lambda: diff                    # the step never ran: still the copy itself

    def _fail(self, exc: BaseException) -> None:
        if self.enabled:
            # The first line only: torch's dispatcher errors list every backend (several kB).
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            self.failure = f"layer probes switched off after an internal error: {type(exc).__name__}: {first}"
            log.warning("sentineld: %s", self.failure)
        self.enabled = False
        self._active = False
        self._reset()

    def _collect(self, norms: bool, full: bool) -> dict[str, LayerStats]:
        vals: list[torch.Tensor] = []   # every figure, read back in one transfer
        srcs: list[Callable[[], torch.Tensor] | None] = []   # the tensor a norm was taken of

        def slot(t: torch.Tensor | None, src: Callable[[], torch.Tensor] | None = None) -> int:
            if t is None:
                return -1
            vals.append(t)
            srcs.append(src)
            return len(vals) - 1

        def of(t: torch.Tensor | None) -> Callable[[], torch.Tensor] | None:
            return None if t is None else (lambda: t)

        with torch.no_grad():
            self._acts.stop()
            if self._acts.error is not None:
                raise self._acts.error
            act_slots = [(site, kind, slot(frac)) for site, kind, frac in self._acts.fractions()]
            mod_slots = []
            param_mods = self._param_mods if norms else []   # activations only on the other steps
            missing = [p for _, ps in param_mods for p in ps
                       if id(p) not in self._gnorm and p.grad is not None]
            late = dict(zip((id(p) for p in missing), _norms([p.grad for p in missing])))  # type: ignore[misc]
            all_params = [p for _, ps in param_mods for p in ps]
            now_norms = iter(_norms([p.detach() for p in all_params]))   # one fused call
            for name, params in param_mods:
                g = [(self._gnorm.get(id(p), late.get(id(p))), self._gsrc.get(id(p), p.grad)) for p in params]
                w = [next(now_norms) for _ in params]
                entry = {"grad": [slot(x, of(src)) for x, src in g if x is not None],
                         "w": [slot(x, of(p.detach())) for p, x in zip(params, w)]}
                if self._optimizers and full:
                    entry["wb"] = [slot(self._wbefore.get(id(p), wn), self._before_of(p))
                                   for p, wn in zip(params, w)]
                    entry["d"] = [slot(self._delta.get(id(p)), of(self._before.get(id(p)))) for p in params]
                mod_slots.append((name, entry))
            host: list[float] = []
            if vals:
                dev = vals[0].device
                wide = _wide(dev)
                groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
                for i, v in enumerate(vals):
                    groups.setdefault((v.device, v.dtype), []).append(i)
                # one stack and one conversion per device and dtype (not one per value)
                order = [i for idx in groups.values() for i in idx]
                flat = torch.cat([torch.stack([vals[i] for i in idx]).to(dev, wide)
                                  for idx in groups.values()]).tolist()  # the one device-to-host transfer
                host = [0.0] * len(vals)
                for i, x in zip(order, flat):
                    host[i] = x
                for i, x in enumerate(host):
                    src = srcs[i]
                    if x == math.inf and src is not None:
                        # a fast (float32) norm that overflowed: re-taken wide, from the tensor
                        # (a second transfer on CUDA, only on this rare path)
                        host[i] = _exact(src())

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
        for name, (dead, sat) in _worst_sites(act_slots, host).items():
            prev = out.get(name, LayerStats())
            ops = "/".join(label for _, label in (dead, sat) if label)
            out[name] = LayerStats(prev.grad_norm, prev.param_norm, prev.update_ratio,
                                   dead_fraction=dead[0], saturated_fraction=sat[0],
                                   activation=ops or None)
        return out


def _worst_sites(slots: list[tuple[tuple[str, str, int], str, int]], host: list[float]
                 ) -> dict[str, tuple[tuple[float | None, str], tuple[float | None, str]]]:
    """Per module, the worst dead and the worst saturated site: ``((fraction, label), ...)``.

    A site's label is its op, with ``#k`` (1-based) when the module made more than one call of it.
    """
    calls: dict[tuple[str, str], int] = {}
    for (name, op, k), _, _ in slots:
        calls[(name, op)] = max(calls.get((name, op), 0), k + 1)
    best: dict[str, dict[str, tuple[float, str]]] = {}
    for (name, op, k), kind, i in slots:
        label = op if calls[(name, op)] == 1 else f"{op}#{k + 1}"
        cur = best.setdefault(name, {}).get(kind)
        if cur is None or host[i] > cur[0]:
            best[name][kind] = (host[i], label)
    none: tuple[float | None, str] = (None, "")
    return {name: (kinds.get("dead", none), kinds.get("saturated", none))
            for name, kinds in best.items()}


def attach_probes(model: nn.Module,
                  optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None,
                  every: int, dense: int = DENSE_STEPS) -> ProbeHandle:
    """Attach per-layer probes to ``model`` and ``optimizer``, sampled every ``every`` steps.

    Args:
        model: the model; module names in the results come from ``model.named_modules()``.
        optimizer: the optimizer that updates the model, or a list of them (e.g. one per
            parameter group of a GAN: pass all, or parameters of the others read as not updated),
            or None (no update ratios).
        every: sample one step in ``every`` (>= 1) once the run is past its dense head.
        dense: steps sampled one after the other at the start (>= 0; 0 = none), then backing
            off geometrically to ``every`` (:func:`sampled_at`).

    Returns:
        The :class:`ProbeHandle`; call ``begin_step``/``collect`` each step, ``remove`` at the end.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or ``optimizer`` not an optimizer.
        ValueError: ``every`` is not an int >= 1, or ``dense`` not an int >= 0.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be an int >= 1, got {every!r}")
    if isinstance(dense, bool) or not isinstance(dense, int) or dense < 0:
        raise ValueError(f"dense must be an int >= 0, got {dense!r}")
    if optimizer is None:
        opts: list[torch.optim.Optimizer] = []
    elif isinstance(optimizer, torch.optim.Optimizer):
        opts = [optimizer]
    else:
        opts = list(optimizer)
    for o in opts:
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(o).__name__}")
    return ProbeHandle(model, opts, every, dense)
