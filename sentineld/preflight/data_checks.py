"""Checks 1 and 2 of the method's checklist: the labels and the inputs.

Priority 1 "Wrong labels: print x.shape, range and type of y"; priority 2 "Data not normalized /
abnormal value range: check x.min() / x.max(); image inputs should be in [0,1] or near 0 after
standardization". NaN in the data comes from the NaN/Inf table ("Data itself contains NaN").
"""

from __future__ import annotations

from typing import Any

import torch

from .context import Probe
from .lossinfo import LossInfo
from .result import FAIL, PASS, WARN, Check

__all__ = ["check_labels", "check_inputs", "IGNORE_INDEX"]

#: CrossEntropyLoss's default ignore_index: such labels are not classes.
IGNORE_INDEX = -100
#: Fewer labelled samples than this say nothing about "one class only".
MIN_SAMPLES_FOR_ONE_CLASS = 8
# Input scale bounds. Default inits (Kaiming/Xavier) keep activations near unit variance only when
# the inputs are: an input RMS 10x off shifts every pre-activation 10x, 100x off saturates or
# explodes them at the first layer.
RMS_WARN, RMS_FAIL = 10.0, 100.0


def _gather(probe: Probe, which: int) -> list[torch.Tensor]:
    out = []
    for b in probe.batches:
        t = probe.split(b)[which]
        if isinstance(t, torch.Tensor):
            out.append(t.detach().cpu())
    return out


def _stats(t: torch.Tensor) -> dict[str, Any]:
    f = t.double()
    fin = f[torch.isfinite(f)]
    return {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
            "min": float(fin.min()) if fin.numel() else None,
            "max": float(fin.max()) if fin.numel() else None}


def check_labels(probe: Probe, info: LossInfo) -> Check:
    """Labels against the loss: dtype, range against C, one class only, NaN/Inf.

    C is ``num_classes`` when given, else the class dimension of the traced nll_loss input. When
    the traced forward raised (``info.kind == "unknown"``), integer labels are still checked
    against a given ``num_classes``: an out-of-range label is a common cause of that error.
    """
    ys = _gather(probe, 1)
    if not ys:
        return Check("labels", WARN, "no labels found in the batch (not a tuple (x, y, ...) or a dict "
                     "with 'labels'/'y'/'target')", {}, "pass split=lambda batch: (inputs, labels)")
    y = torch.cat([t.reshape(-1) for t in ys])
    ev = _stats(y) | {"shape": list(ys[0].shape), "loss": info.kind}
    if y.is_floating_point() and not torch.isfinite(y).all():
        return Check("labels", FAIL, "labels contain NaN/Inf", ev, "clean the labels upstream")
    if info.kind == "ce" or (info.kind == "unknown" and probe.num_classes and not y.is_floating_point()):
        return _ce_labels(probe, info, y, ev)
    values = torch.unique(y)
    ev["distinct"] = int(values.numel())
    if info.kind == "bce" and (float(y.min()) < 0 or float(y.max()) > 1):
        return Check("labels", FAIL, f"BCE targets outside [0, 1]: min {ev['min']}, max {ev['max']}", ev,
                     "binary cross-entropy targets are probabilities in [0, 1]")
    if values.numel() == 1 and y.numel() >= MIN_SAMPLES_FOR_ONE_CLASS:
        return Check("labels", FAIL, f"every target is {values.item()}: one class/value only", ev,
                     "visualize a few (x, y) pairs; the label column or the dataset filter is wrong")
    return Check("labels", PASS, f"{ev['dtype']} targets in [{ev['min']}, {ev['max']}]", ev)


def _ce_labels(probe: Probe, info: LossInfo, y: torch.Tensor, ev: dict[str, Any]) -> Check:
    c = probe.num_classes or info.num_classes
    ev["num_classes"] = c
    fix = "labels of a C-class cross-entropy are integer class indices 0..C-1; print y's range and type"
    if probe.num_classes and info.num_classes and probe.num_classes != info.num_classes:
        ev["model_outputs"] = info.num_classes
        return Check("labels", FAIL, f"num_classes is {probe.num_classes} but the loss gets "
                     f"{info.num_classes} class scores per sample", ev,
                     "make the output layer's size the number of classes")
    if y.is_floating_point():
        return Check("labels", FAIL, f"class labels are {ev['dtype']}, not integer indices", ev, fix)
    valid = y[y != IGNORE_INDEX]
    if valid.numel() == 0:
        return Check("labels", FAIL, "every label is ignore_index (-100)", ev, fix)
    lo, hi = int(valid.min()), int(valid.max())
    values = torch.unique(valid)
    ev["distinct"] = int(values.numel())
    ev["counts"] = {int(v): int((valid == v).sum()) for v in values[:20]}
    if lo < 0 or (c is not None and hi >= c):
        return Check("labels", FAIL, f"labels span [{lo}, {hi}] but a {c}-class loss needs 0..{c - 1 if c else '?'}",
                     ev, fix + " (an off-by-one 1..C labelling is common)")
    if values.numel() == 1 and valid.numel() >= MIN_SAMPLES_FOR_ONE_CLASS:
        return Check("labels", FAIL, f"all {valid.numel()} labels seen are class {lo}: one class only", ev,
                     "visualize a few (x, y) pairs; the label column, the dataset filter or the "
                     "sampler is wrong")
    return Check("labels", PASS, f"integer labels in [{lo}, {hi}], {values.numel()} classes seen (C={c})", ev)


def check_inputs(probe: Probe) -> Check:
    """Inputs: NaN/Inf, raw 0..255 pixels, RMS far from 1 (``RMS_WARN``/``RMS_FAIL``), constant features."""
    xs = _gather(probe, 0)
    if not xs:
        return Check("inputs", WARN, "no input tensor found in the batch", {},
                     "pass split=lambda batch: (inputs, labels)")
    x = torch.cat(xs) if all(t.shape[1:] == xs[0].shape[1:] for t in xs) else xs[0]
    ev = _stats(x)
    if not x.is_floating_point():
        if x.dtype == torch.uint8:
            return Check("inputs", FAIL, "inputs are uint8: raw 0..255 pixels", ev,
                         "convert to float, divide by 255 and standardize (x - mean) / std")
        if ev["min"] is not None and ev["min"] < 0:
            return Check("inputs", FAIL, f"integer inputs (ids) are negative (min {ev['min']})", ev,
                         "token/category ids index an embedding: they must be >= 0")
        return Check("inputs", PASS, f"integer inputs (ids) in [{ev['min']}, {ev['max']}]", ev)
    bad = int((~torch.isfinite(x)).sum())
    if bad:
        return Check("inputs", FAIL, f"{bad} NaN/Inf values in the inputs", ev | {"non_finite": bad},
                     "check inputs with torch.isnan(x).any(); clean the data upstream")
    f = x.double()
    rms = float(f.pow(2).mean().sqrt())
    integral = bool((f == f.round()).float().mean() > 0.99)
    ev |= {"rms": rms, "mean": float(f.mean()), "std": float(f.std()) if f.numel() > 1 else 0.0}
    if ev["min"] >= 0 and 20 <= ev["max"] <= 255 and integral:
        return Check("inputs", FAIL, f"inputs look like raw 0..255 pixels (integral values in "
                     f"[{ev['min']:g}, {ev['max']:g}])", ev,
                     "divide by 255 and standardize; image inputs should be in [0,1] or near 0 after "
                     "standardization")
    const = _constant_features(x)
    ev["constant_features"] = const[:20]
    if rms > RMS_FAIL or 0 < rms < 1 / RMS_FAIL:
        return Check("inputs", FAIL, f"input RMS is {rms:.3g}, far from 1", ev,
                     "standardize the inputs: (x - mean) / std with training-set statistics")
    if rms > RMS_WARN or 0 < rms < 1 / RMS_WARN:
        return Check("inputs", WARN, f"input RMS is {rms:.3g}: not near 1", ev,
                     "standardize the inputs: (x - mean) / std with training-set statistics")
    if const:
        n = x.shape[1] if x.dim() >= 2 else 1
        status = FAIL if len(const) == n else WARN
        return Check("inputs", status, f"{len(const)} of {n} input features/channels are constant over "
                     f"{x.shape[0]} samples", ev, "a constant feature carries no information: check "
                     "the feature pipeline (a column filled with a default, a dropped channel)")
    return Check("inputs", PASS, f"finite inputs, RMS {rms:.3g}, range [{ev['min']:.3g}, {ev['max']:.3g}]", ev)


def _constant_features(x: torch.Tensor) -> list[int]:
    """Indices along dim 1 (features, or channels of images) that never vary over the batch."""
    if x.dim() < 2 or x.shape[0] < 2:
        return []
    per = x.transpose(0, 1).reshape(x.shape[1], -1).double()
    return [int(i) for i in torch.nonzero(per.std(dim=1) == 0).reshape(-1)]
