"""Per-sample loss and gradient norm of one batch on one state: which samples carry a spike.

``torch.func`` first (``vmap`` over ``grad_and_value`` of the recipe's loss on one sample, the
parameters held fixed through ``functional_call``), and a loop over single-sample batches when
the model is not functorch-compatible (in-place buffer updates such as BatchNorm's running
statistics in train mode, data-dependent control flow), then the same loop in eval mode when a
single sample cannot go through the train-mode model at all (BatchNorm1d over one sample).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from sentineld.contracts.recipe import Recipe
from sentineld.contracts.treecodec import map_tensors

from .counterfactual import batch_size

__all__ = ["per_sample", "responsible"]


class _LossOf(torch.nn.Module):
    """``batch -> loss_fn(model, batch)`` as a module, so ``functional_call`` can swap parameters."""

    def __init__(self, model: torch.nn.Module, loss_fn: Any) -> None:
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, batch: Any) -> torch.Tensor:
        return self.loss_fn(self.model, batch)


def _autocast(rec: Recipe) -> Any:
    if rec.autocast_dtype is None:
        return contextlib.nullcontext()
    dev = next((p.device.type for p in rec.model.parameters()), "cpu")
    return torch.autocast(dev, dtype=rec.autocast_dtype)


def _vmap(rec: Recipe, batch: Any, n: int) -> tuple[list[float], list[float]]:
    from torch.func import functional_call, grad_and_value, vmap  # noqa: PLC0415

    wrap = _LossOf(rec.model, rec.loss_fn)
    params = {f"model.{k}": v.detach() for k, v in rec.model.named_parameters() if v.requires_grad}
    leaves, spec = tree_flatten(batch)
    dims = tuple(0 if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == n else None for t in leaves)

    def loss_one(p: dict[str, torch.Tensor], *xs: Any) -> torch.Tensor:
        one = [x.unsqueeze(0) if d == 0 else x for x, d in zip(xs, dims)]
        with _autocast(rec):
            return functional_call(wrap, p, (tree_unflatten(one, spec),)).float()

    grads, losses = vmap(grad_and_value(loss_one), in_dims=(None, *dims), randomness="different")(params, *leaves)
    sq = sum(g.float().pow(2).reshape(n, -1).sum(1) for g in grads.values())
    return [float(v) for v in losses], [float(v) for v in torch.as_tensor(sq).sqrt()]


def _row(t: torch.Tensor, i: int, n: int) -> torch.Tensor:
    return t[i:i + 1] if t.dim() >= 1 and t.shape[0] == n else t


def _loop(rec: Recipe, batch: Any, n: int) -> tuple[list[float], list[float]]:
    params = [p for p in rec.model.parameters() if p.requires_grad]
    losses, norms = [], []
    for i in range(n):
        one = map_tensors(batch, functools.partial(_row, i=i, n=n))
        with _autocast(rec):
            loss = rec.loss_fn(rec.model, one)
        gs = torch.autograd.grad(loss, params, allow_unused=True)
        losses.append(float(loss.detach().float()))
        norms.append(math.sqrt(sum(float(g.detach().float().pow(2).sum()) for g in gs if g is not None)))
    return losses, norms


def per_sample(rec: Recipe, batch: Any) -> dict[str, Any]:
    """Per-sample loss and grad norm of ``batch`` on ``rec``'s current state (nothing is updated).

    Returns:
        ``{"method": "vmap" | "loop" | "loop_eval", "losses": [...], "grad_norms": [...],
        "grad_share": [...]}`` (``grad_share`` = a sample's grad norm over the sum of all of
        them), or ``{"method": None, "error": ...}`` when no method ran (an accumulating step's
        list of micro-batches, a loss that is not a mean over dim 0).
    """
    n = batch_size(batch)
    if n is None or n < 2:
        return {"method": None, "error": "the batch has no batch dimension to split"}
    if isinstance(batch, list) and len(batch) > 1 and all(batch_size(b) for b in batch) and rec.accumulation_steps > 1:
        return {"method": None, "error": "an accumulating step (micro-batches): per-sample not computed"}
    device = next((p.device for p in rec.model.parameters()), torch.device("cpu"))
    batch = map_tensors(batch, lambda t: t.to(device))
    errors = []
    for method, fn in (("vmap", _vmap), ("loop", _loop), ("loop_eval", _loop)):
        modes = [m.training for m in rec.model.modules()]
        try:
            if method == "loop_eval":
                rec.model.eval()
            losses, norms = fn(rec, batch, n)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - user code not fit for this method
            errors.append(f"{method}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        finally:
            for m, flag in zip(rec.model.modules(), modes):
                m.training = flag
        total = sum(v for v in norms if math.isfinite(v)) or 1.0
        return {"method": method, "losses": losses, "grad_norms": norms,
                "grad_share": [v / total if math.isfinite(v) else 1.0 for v in norms],
                **({"fallback_because": errors} if errors else {})}
    return {"method": None, "error": "; ".join(errors)}


def responsible(ps: dict[str, Any], most: int = 16, k: float = 6.0) -> list[int]:
    """Indices of the samples that carry the batch's excess loss, most responsible first.

    A sample counts when its loss is ``k`` robust sigmas above the batch's median (spread floored
    at 1% of the median, so a batch of equal losses names nobody) or non-finite; order: loss
    excess, then grad-norm share. The single worst sample is named when none passes.
    """
    losses: list[float] = ps.get("losses") or []
    if not losses:
        return []
    share: list[float] = ps.get("grad_share") or [0.0] * len(losses)
    fin = sorted(v for v in losses if math.isfinite(v))
    med = fin[len(fin) // 2] if fin else 0.0
    mad = sorted(abs(v - med) for v in fin)[len(fin) // 2] * 1.4826 if fin else 0.0
    spread = max(mad, 0.01 * abs(med), 1e-12)

    def excess(i: int) -> float:
        return math.inf if not math.isfinite(losses[i]) else losses[i] - med
    order = sorted(range(len(losses)), key=lambda i: (-excess(i), -share[i]))
    named = [i for i in order if excess(i) / spread >= k][:most]
    return named or order[:1]
