"""``loss_spike``: one step's loss (and grad norm) far above its trailing level, while finite.

The most common failure of long runs: the loss jumps for a step or a few and then either recovers
or diverges. The rule is a robust z-score against a trailing window, with absolute floors so that
the noise of a converged run (a loss of 1e-5 that "jumps" to 1e-3) is not a spike:

    z_loss = (loss - median) / max(sigma, 1e-3 * |median|),  sigma = 1.4826 * MAD

over the ``window`` finite losses before the step, and the same for the global grad norm. A step
spikes when all of these hold:

- ``z_loss >= k``, and its excess ``loss - median`` is at least ``min_excess`` and at least
  ``min_rel_excess * |median|`` (the floors);
- the excess is at least ``record_ratio`` x the largest excess in the window (a spike goes past
  everything the window has seen: in a small-batch run the heaviest batch of the last 128 steps
  is the noise scale, which the MAD of a heavy-tailed loss underestimates);
- the grad norm agrees: ``z_grad >= grad_k``, at least ``grad_ratio`` x its median and at least
  ``grad_record`` x the window's largest grad norm. Our measurement on the healthy runs of
  ``tests/signatures``: a hard batch of SGD lr 0.3 on batches of 8 reaches a loss 44x its median
  (7x the window's largest excess) but its grad norm stays within 1.4x the window's largest; the
  planted faults' grad norms are 3-5x past it. A step that records no grad norm needs
  ``z_loss >= strong_k`` instead.

Defaults and where they come from:

- OLMo-core's ``SkipStepOptimizer`` skips a step whose loss (or grad norm) is more than 6 standard
  deviations above the mean of the last 128 steps. We keep its 6 and its 128, but with the median
  and MAD (the mean and standard deviation of a window that holds a spike are pulled up by the
  spike itself, and minibatch losses are heavy-tailed), with a 32-step minimum history (OLMo-core
  waits for a full window) and with the floors above (OLMo-core has none: a converged run's tiny
  losses would trip it).
- llm-foundry's ``LossSpikeIntervention`` acts when the loss is above 2x the running mean for 5
  steps: a divergence rule (``divergence_spike`` here does that). We want the step itself, within 3
  steps, so one step suffices; its 2x survives as ``grad_ratio`` for the gradient, and the loss
  needs 25% above its median (``min_rel_excess``; a 2x rule misses a language model's spike from
  2.5 to 4).
- ``min_excess`` 0.1 assumes a cross-entropy-like scale (as ``divergence_spike.min_loss``): set it
  for a loss of another scale (an MSE of 1e-3).

One rule, two callers (:class:`SpikeRule` is its only definition): every step is tested against
the baselines of the finite values before it, recomputed at the first step of each block of
``refresh_steps`` steps (``step // refresh_steps`` changes), so a step costs a few comparisons and
the baseline lags by at most ``refresh_steps - 1`` steps. The agent feeds its steps one by one
through :class:`SpikeTracker`; the daemon calls :func:`detect_loss_spike` once per read of a
stream with ``new`` = the records read since it last evaluated that rank, and every one of them
is tested (issue 21: a run stepping 20 steps/s put more than ``hold_steps`` records in one poll
and its spike was never among the ones tested). Pure: no torch, no I/O.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from sentineld.contracts.records import StepRecord

from .base import Verdict, finite, make_verdict, median, positive_ints, tail

__all__ = ["LossSpikeConfig", "Baseline", "baseline", "spike_numbers", "detect_loss_spike",
           "SpikeRule", "SpikeTracker", "SPIKE_FIX"]

SPIKE_FIX = ("A finite loss spike: the replay of its capture says whether the batch (data), the "
             "state before it (lr, Adam's second moment, a norm) or only the pair caused it "
             "(sentineld replay RUN --step N); skip or drop the named samples, lower the lr or clip.")


@dataclass(frozen=True)
class LossSpikeConfig:
    """Settings of ``loss_spike`` (see the module docstring for where each default comes from).

    Attributes:
        enabled: run this detector.
        window: finite steps the baseline median/MAD is taken over (OLMo-core: 128).
        min_history: fewer finite losses than this before the step: no verdict (warm-up).
        k: robust z of the loss needed (OLMo-core: 6).
        grad_k: robust z of the grad norm needed (OLMo-core: 6).
        grad_ratio: the grad norm must also be at least this multiple of its median (llm-foundry: 2).
        strong_k: without a recorded grad norm, the loss must be this many robust sigmas out.
        record_ratio: the excess must be this multiple of the window's largest excess.
        grad_record: the grad norm must be this multiple of the window's largest grad norm.
        min_excess: loss - median at least this (loss units; cross-entropy scale).
        min_rel_excess: loss - median at least this share of |median|.
        hold_steps: the daemon keeps reporting a spike while it is among the last this many
            records (besides testing every new one); the agent re-arms after this many steps
            without a spike.
        refresh_steps: the baselines are recomputed at the first step of each block of this
            many steps (``step // refresh_steps``), by the agent and the daemon alike.
    """

    enabled: bool = True
    window: int = 128
    min_history: int = 32
    k: float = 6.0
    grad_k: float = 6.0
    grad_ratio: float = 2.0
    strong_k: float = 20.0
    record_ratio: float = 2.0
    grad_record: float = 1.5
    min_excess: float = 0.1
    min_rel_excess: float = 0.25
    hold_steps: int = 8
    refresh_steps: int = 32

    def __post_init__(self) -> None:
        positive_ints(self, "loss_spike", "window", "min_history", "hold_steps", "refresh_steps")
        if not (self.k > 0 and self.grad_k > 0 and self.strong_k >= self.k and self.grad_ratio >= 1
                and self.record_ratio >= 0 and self.grad_record >= 0):
            raise ValueError("loss_spike: k and grad_k must be > 0, strong_k >= k, grad_ratio >= 1, "
                             "record_ratio and grad_record >= 0")
        if self.min_excess < 0 or self.min_rel_excess < 0:
            raise ValueError("loss_spike: min_excess and min_rel_excess must be >= 0")


@dataclass(frozen=True)
class Baseline:
    """Median, robust sigma (1.4826 x MAD) and maximum of a trailing window of ``n`` finite values."""

    median: float
    sigma: float
    n: int
    max: float

    def z(self, value: float) -> float:
        """Robust z of ``value``; the spread is floored at 1e-3 x |median| (a window of identical
        values would make every change infinitely significant)."""
        spread = max(self.sigma, 1e-3 * abs(self.median), 1e-12)
        return (value - self.median) / spread


def baseline(values: Sequence[float]) -> Baseline | None:
    """:class:`Baseline` of ``values`` (finite floats), or None when empty."""
    if not values:
        return None
    s = sorted(values)
    n = len(s)
    mid = n // 2
    med = s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])
    return Baseline(med, 1.4826 * median([abs(v - med) for v in s]), n, s[-1])


def spike_numbers(loss: float, grad_norm: float | None, lbase: Baseline | None, gbase: Baseline | None,
                  cfg: LossSpikeConfig) -> dict[str, float] | None:
    """The figures of a spiking step, or None when the step does not spike (the one test).

    Args:
        loss: the step's loss (finite, else None is returned: non-finite is ``nonfinite``'s).
        grad_norm: its global grad norm (pre-clip where recorded so), or None.
        lbase, gbase: baselines of the trailing losses and grad norms before the step.
    """
    if lbase is None or lbase.n < cfg.min_history or not math.isfinite(loss):
        return None
    excess = loss - lbase.median
    z = lbase.z(loss)
    if z < cfg.k or excess < cfg.min_excess or excess < cfg.min_rel_excess * abs(lbase.median) \
            or excess < cfg.record_ratio * (lbase.max - lbase.median):
        return None
    out = {"loss": loss, "loss_median": lbase.median, "loss_sigma": lbase.sigma, "loss_z": z}
    g = finite(grad_norm)
    if g is not None and gbase is not None and gbase.n >= cfg.min_history:
        gz = gbase.z(g)
        out.update(grad_norm=g, grad_norm_median=gbase.median, grad_norm_z=gz)
        if gz < cfg.grad_k or g < cfg.grad_ratio * gbase.median or g < cfg.grad_record * gbase.max:
            return None
    elif z < cfg.strong_k:
        return None
    return out


def _message(step: int, n: dict[str, float]) -> str:
    msg = (f"loss spike at step {step}: loss {n['loss']:.4g} is {n['loss_z']:.1f} robust sigmas above "
           f"its trailing median {n['loss_median']:.4g}")
    if "grad_norm" in n:
        msg += f"; grad norm {n['grad_norm']:.4g} ({n['grad_norm_z']:.1f} sigmas, median {n['grad_norm_median']:.4g})"
    return msg


def spike_verdict(step: int, numbers: dict[str, float]) -> Verdict:
    """The ``loss_spike`` :class:`Verdict` of a spiking step."""
    return make_verdict("loss_spike", step, _message(step, numbers), numbers, SPIKE_FIX)


def _finite(v: object) -> float | None:
    """:func:`finite` with a fast path for the floats every well-formed record holds."""
    if type(v) is float:
        return v if math.isfinite(v) else None
    return finite(v)


class SpikeRule:
    """The ``loss_spike`` test with its refresh schedule: the one definition the agent
    (:class:`SpikeTracker`) and the daemon (:func:`detect_loss_spike`) both run.

    Feed it a rank's steps in order with :meth:`feed`. It keeps the last ``window`` finite losses
    and grad norms; at the first step of each block of ``refresh_steps`` steps it takes them as the
    baselines of that block (a snapshot copy, ~1 us; the two sorts, ~13 us each on this project's
    2-core box, are done on the block's first judged step, so history fed only to fill the window
    costs no sort). A step is judged against its block's baselines: the values before the block,
    never the step itself.
    """

    def __init__(self, cfg: LossSpikeConfig) -> None:
        self.cfg = cfg
        self._losses: deque[float] = deque(maxlen=cfg.window)
        self._grads: deque[float] = deque(maxlen=cfg.window)
        self._block: int | None = None
        self._snapshot: tuple[list[float], list[float]] | None = None
        self._lbase: Baseline | None = None
        self._gbase: Baseline | None = None

    def feed(self, step: int, loss: float | None, grad_norm: float | None,
             judge: bool = True) -> dict[str, float] | None:
        """Take one step (``loss``/``grad_norm`` None or non-finite when not recorded or not
        finite); with ``judge``, its :func:`spike_numbers` (None: not a spike). ``judge=False``
        only adds the step to the history."""
        block = step // self.cfg.refresh_steps
        if block != self._block:  # a new block (or steps went back: a resumed run)
            self._block = block
            self._snapshot = (list(self._losses), list(self._grads))
        out = None
        lv, gv = _finite(loss), _finite(grad_norm)
        if judge and lv is not None:
            if self._snapshot is not None:
                self._lbase, self._gbase = baseline(self._snapshot[0]), baseline(self._snapshot[1])
                self._snapshot = None
            out = spike_numbers(lv, gv, self._lbase, self._gbase, self.cfg)
        if lv is not None:
            self._losses.append(lv)
        if gv is not None:
            self._grads.append(gv)
        return out


def detect_loss_spike(records: Sequence[StepRecord], cfg: LossSpikeConfig | None = None,
                      new: int = 0) -> list[Verdict]:
    """``loss_spike`` over a window of records (oldest first): the first of its last
    ``max(new, hold_steps)`` records that spikes, each judged by :class:`SpikeRule` against the
    baselines of the records before it (the same verdicts as the agent's :class:`SpikeTracker`
    given the same steps).

    Args:
        records: a rank's most recent step records, oldest first.
        cfg: thresholds; None uses the defaults.
        new: records at the end of ``records`` the caller has not evaluated yet (the daemon: read
            since its last evaluation of the rank); all of them are judged, however many (more
            than ``len(records)`` judges all). The last ``hold_steps`` are judged in any case, so
            a spike keeps being reported for that many records after it.

    Returns:
        At most one warning :class:`Verdict`, ``step`` the spiking step; none on a short window
        (fewer than ``min_history`` finite losses before the step), on non-finite steps
        (``nonfinite`` covers them) or when disabled.

    Cost: the judged records plus ``window + refresh_steps`` of history, one baseline pair per
    block of ``refresh_steps`` judged: 0.5 ms for 100 new records in a 200-record window on this
    project's loaded 2-core box (``tests/signatures/test_spike.py``, ``-s``).
    """
    cfg = cfg or LossSpikeConfig()
    if not cfg.enabled:
        return []
    judged = max(int(new), cfg.hold_steps)
    # enough history that the first judged record's block starts with a full window behind it
    recs = tail(records, judged + cfg.window + cfg.refresh_steps)
    first = max(0, len(recs) - judged)
    rule = SpikeRule(cfg)
    for i, r in enumerate(recs):
        n = rule.feed(int(getattr(r, "step", 0)), getattr(r, "loss", None), getattr(r, "grad_norm", None),
                      judge=i >= first)
        if n is not None:
            return [spike_verdict(int(getattr(r, "step", 0)), n)]
    return []


class SpikeTracker:
    """The agent's per-step ``loss_spike`` test: :class:`SpikeRule`, as :func:`detect_loss_spike`.

    Keeps the last ``window`` finite losses and grad norms; the baselines are recomputed at the
    first step of each block of ``refresh_steps`` steps (two baselines of at most 128 floats,
    ~12.6 us each on this project's 2-core box when idle), so a step costs a few float comparisons
    and a deque append plus that amortized: 2 us per step measured idle, 9-12 us under load 7-11
    (``tests/signatures/test_spike.py``, run with ``-s``).
    The baseline then lags by up to ``refresh_steps`` steps, which only makes it more conservative
    in a falling loss. After a spike no other fires until ``hold_steps``
    steps passed without one (one capture per spike, not one per step of it).
    """

    def __init__(self, cfg: LossSpikeConfig | None = None) -> None:
        self.cfg = cfg or LossSpikeConfig()
        self._rule = SpikeRule(self.cfg)
        self._quiet = self.cfg.hold_steps  # steps since the last spike

    def observe(self, step: int, loss: float, grad_norm: float | None) -> Verdict | None:
        """Take one step's loss and grad norm; a :class:`Verdict` when the step opens a spike."""
        cfg = self.cfg
        if not cfg.enabled:
            return None
        n = self._rule.feed(step, loss, grad_norm)
        if n is None:
            if math.isfinite(loss):
                self._quiet += 1
            return None
        out = spike_verdict(step, n) if self._quiet >= cfg.hold_steps else None
        self._quiet = 0
        return out
