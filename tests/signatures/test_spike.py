"""``loss_spike``: the rule on synthetic series with known answers, the agent's tracker agreeing
with the daemon's detector, and its per-step cost."""

from __future__ import annotations

import math
import random
import time

import pytest

from sentineld.contracts.records import StepRecord
from sentineld.signatures import SignatureConfig
from sentineld.signatures.spike import LossSpikeConfig, SpikeTracker, baseline, detect_loss_spike


def _series(n: int, level: float = 1.0, noise: float = 0.05, seed: int = 0, grad: float = 1.0
            ) -> list[StepRecord]:
    rnd = random.Random(seed)
    return [StepRecord(step=i, loss=level * (1 + noise * rnd.gauss(0, 1)),
                       grad_norm=grad * (1 + noise * rnd.gauss(0, 1))) for i in range(n)]


def _daemon(records: list[StepRecord], cfg: LossSpikeConfig | None = None) -> list[tuple[int, int]]:
    """(record index, verdict step) of every firing, evaluated per record as the daemon does."""
    out = []
    for i in range(len(records)):
        for v in detect_loss_spike(records[max(0, i - 199):i + 1], cfg):
            out.append((i, v.step))
    return out


def test_spike_fires_at_its_step_and_nowhere_else() -> None:
    recs = _series(200)
    recs[150] = StepRecord(step=150, loss=5.0, grad_norm=8.0)
    fired = _daemon(recs)
    assert fired and fired[0] == (150, 150)  # seen on the spike's own record: latency 0
    assert {s for _, s in fired} == {150}


def test_warm_up_and_early_descent_are_not_spikes() -> None:
    # loss falling from 2.3 to 0.1 with noise, a step-8 bump: under min_history, then descent
    rnd = random.Random(1)
    recs = [StepRecord(step=i, loss=0.1 + 2.2 * math.exp(-i / 20) * (1 + 0.1 * rnd.gauss(0, 1)),
                       grad_norm=3 * math.exp(-i / 40) + 0.1) for i in range(200)]
    recs[8] = StepRecord(step=8, loss=4.0, grad_norm=9.0)
    assert _daemon(recs) == []


def test_converged_run_floors() -> None:
    # a memorized task: loss ~1e-5 jumping 100x to 1e-3 is noise, not a spike (absolute floor)
    recs = _series(200, level=1e-5, noise=0.3, grad=1e-6)
    recs[150] = StepRecord(step=150, loss=1e-3, grad_norm=1e-3)
    assert _daemon(recs) == []


def test_grad_norm_must_agree() -> None:
    # a hard batch: the loss jumps, the grad norm stays within what the window has seen
    recs = _series(200)
    recs[150] = StepRecord(step=150, loss=5.0, grad_norm=1.1)
    assert _daemon(recs) == []
    # no grad norm recorded: the loss alone, at strong_k
    recs = [StepRecord(step=r.step, loss=r.loss) for r in _series(200)]
    recs[150] = StepRecord(step=150, loss=5.0)
    assert [s for _, s in _daemon(recs)][:1] == [150]


def test_tracker_agrees_with_detector() -> None:
    recs = _series(400, seed=3)
    for s in (150, 300):
        recs[s] = StepRecord(step=s, loss=6.0, grad_norm=9.0)
    tracker = SpikeTracker()
    agent = [v.step for r in recs if (v := tracker.observe(r.step, r.loss, r.grad_norm)) is not None]
    daemon = sorted({s for _, s in _daemon(recs)})
    assert agent == daemon == [150, 300]


def test_tracker_skips_nonfinite_and_latches() -> None:
    tracker = SpikeTracker()
    recs = _series(100)
    for r in recs:
        tracker.observe(r.step, r.loss, r.grad_norm)
    assert tracker.observe(100, math.nan, math.inf) is None
    assert tracker.observe(101, 6.0, 9.0) is not None
    assert tracker.observe(102, 6.0, 9.0) is None  # the same spike, not a second one


def test_config_checks_and_mapping() -> None:
    with pytest.raises(ValueError):
        LossSpikeConfig(window=0)
    with pytest.raises(ValueError):
        LossSpikeConfig(k=6, strong_k=3)
    cfg = SignatureConfig.from_mapping({"loss_spike": {"k": 8, "enabled": False}})
    assert cfg.loss_spike.k == 8.0 and detect_loss_spike(_series(100), cfg.loss_spike) == []
    assert baseline([]) is None and baseline([1.0, 3.0]).median == 2.0


def test_tracker_cost_per_step_is_microseconds() -> None:
    """The agent's per-step cost (the figure in the report: printed with -s)."""
    recs = _series(5000, seed=5)
    tracker = SpikeTracker()
    t0 = time.perf_counter()
    for r in recs:
        tracker.observe(r.step, r.loss, r.grad_norm)
    us = (time.perf_counter() - t0) / len(recs) * 1e6
    print(f"loss_spike tracker: {us:.2f} us per step")
    assert us < 50  # generous on a shared 2-core box; measured ~3 us


# --- every record read is judged (issue 21) -------------------------------------------------
# On main at 86d47d4 detect_loss_spike judged only the last hold_steps (8) records of the window it
# was given; the daemon evaluates once per read of a stream, so a run writing more than 8 records
# between two reads (20 steps/s) had its spike captured by the agent and never alerted.


def _firsts(recs: list[StepRecord], cfg: LossSpikeConfig | None = None) -> dict[int, dict]:
    """What the agent's tracker fires: ``{step: numbers}``."""
    tracker = SpikeTracker(cfg)
    return {v.step: v.numbers for r in recs if (v := tracker.observe(r.step, r.loss, r.grad_norm)) is not None}


def test_spike_fifty_records_back_is_judged_when_new() -> None:
    recs = _series(300, seed=7)
    recs[249] = StepRecord(step=249, loss=6.0, grad_norm=9.0)  # 50 records before the end
    window = recs[-200:]  # what the daemon holds
    got = detect_loss_spike(window, new=60)
    assert [v.step for v in got] == [249]
    # with window + refresh_steps records of history before the judged ones (160), the agent's
    # verdict figure for figure (the 200-record window leaves step 249's block 124 of 128)
    full = detect_loss_spike(recs[-(60 + 160):], new=60)
    assert [v.step for v in full] == [249] and full[0].numbers == _firsts(recs)[249]
    # judging only the hold tail (main's behaviour) misses it: 50 records back is not among them
    assert detect_loss_spike(window, new=8) == []
    assert detect_loss_spike(window) == []


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_reads_of_any_size_give_the_trackers_verdicts(seed: int) -> None:
    """Reads of 8..150 records over the whole series, each evaluated once with ``new`` = its size:
    the spikes reported are the agent's tracker's, at the same steps with the same numbers."""
    rnd = random.Random(seed)
    recs = _series(1500, seed=seed)
    for s in (300, 520, 900, 1260):
        recs[s] = StepRecord(step=s, loss=5.0 + rnd.random(), grad_norm=8.0 + rnd.random())
    agent = _firsts(recs)
    assert sorted(agent) == [300, 520, 900, 1260]
    daemon: dict[int, dict] = {}
    end = 0
    while end < len(recs):
        k = rnd.randint(8, 150)
        end = min(len(recs), end + k)
        for v in detect_loss_spike(recs[:end], new=k):
            daemon.setdefault(v.step, v.numbers)
    assert daemon == agent


def test_daemon_window_and_read_size_judge_every_position() -> None:
    """The daemon's shape: a window of 200 records, reads of up to 100 (``window // 2``). A spike
    at any position of a read is reported by the evaluation of that read."""
    base = _series(400, seed=21)
    for pos in range(100):
        recs = list(base)
        at = 300 + pos
        recs[at] = StepRecord(step=at, loss=6.0, grad_norm=9.0)
        assert [v.step for v in detect_loss_spike(recs[200:400], new=100)] == [at], pos
        # the read before it, ending at 300, saw nothing
        assert detect_loss_spike(recs[100:300], new=100) == []


def test_backlog_cost_is_bounded() -> None:
    """A backlog of 100k records: as one call judging all of them, and as the daemon reads it
    (1000 evaluations of a 200-record window, 100 new each). Figures printed with -s."""
    recs = _series(100_000, seed=31)
    recs[77_777] = StepRecord(step=77_777, loss=6.0, grad_norm=9.0)
    t0 = time.perf_counter()
    got = detect_loss_spike(recs, new=len(recs))
    one_call = time.perf_counter() - t0
    assert [v.step for v in got] == [77_777]
    t0 = time.perf_counter()
    found = [v.step for end in range(100, len(recs) + 1, 100)
             for v in detect_loss_spike(recs[max(0, end - 200):end], new=100)]
    sliced = time.perf_counter() - t0
    assert found == [77_777]
    print(f"loss_spike over a 100k backlog: one call {one_call * 1e3:.0f} ms, "
          f"as 1000 daemon reads {sliced * 1e3:.0f} ms")
    assert one_call < 3.0 and sliced < 3.0  # generous on a loaded 2-core box; measured ~0.3 s
