"""The per-step path's cheap parts give exactly what the plain ones gave: the RNG peek returns the
states ``capture_rng`` returns whatever the loop draws; a tensor that is a forward argument and in
the batch is copied to host once, and again when changed in place; the ring's memory bound is
stated at attach (log line and metric) with the right figure."""

from __future__ import annotations

import logging
import random
import urllib.request

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sentineld.agent import attach
from sentineld.agent.agent_config import AgentConfig
from sentineld.agent.memory import memory_bound
from sentineld.agent.ring import HostCopies
from sentineld.agent.rngread import RngReader
from sentineld.contracts import metric_names as M
from sentineld.contracts.rng import capture_rng


def _same_rng(a: dict, b: dict) -> bool:
    na, nb = a["numpy"], b["numpy"]
    return (a["torch"].equal(b["torch"]) and na[0] == nb[0] and np.array_equal(na[1], nb[1])
            and tuple(na[2:]) == tuple(nb[2:]) and a["python"] == b["python"])


DRAWS = {
    "nothing": lambda: None,
    "numpy uniform": lambda: np.random.rand(),
    "numpy gaussian (cached pair)": lambda: np.random.randn(),
    "numpy 624 draws (a full twist)": lambda: np.random.randint(0, 2**31, 624),
    "numpy seed": lambda: np.random.seed(3),
    "python random": lambda: random.random(),
    "python gauss (gauss_next cache)": lambda: random.gauss(0.0, 1.0),
    "python seed": lambda: random.seed(3),
    "python 624 draws": lambda: [random.getrandbits(32) for _ in range(624)],
    "torch": lambda: torch.rand(3),
}


def test_rng_reader_peeks_on_this_interpreter():
    r = RngReader()
    assert r._numpy.peeking and r._python.peeking


@pytest.mark.parametrize("draw", list(DRAWS), ids=list(DRAWS))
def test_rng_reader_equals_capture_rng_after_any_draw(draw):
    r = RngReader()
    first = r.read()
    assert _same_rng(first, capture_rng())
    for _ in range(3):  # the draw, then nothing, then the draw again: reused and re-read states
        DRAWS[draw]()
        assert _same_rng(r.read(), capture_rng())
        assert _same_rng(r.read(), capture_rng())


def test_rng_reader_set_state_back_is_seen():
    r = RngReader()
    saved_np, saved_py = np.random.get_state(), random.getstate()
    np.random.rand(5)
    random.random()
    r.read()
    np.random.set_state(saved_np)
    random.setstate(saved_py)
    assert _same_rng(r.read(), capture_rng())


def test_host_copies_share_one_copy_per_step_and_recopy_after_in_place_change():
    x, y = torch.randn(4, 3), torch.arange(4)
    hc = HostCopies()
    (args, _kw), n_args = hc.copy(((x,), {}))
    (bx, by), n_batch = hc.copy((x, y))
    assert bx is args[0] and bx is not x and torch.equal(bx, x)
    assert n_args == 4 * 3 * 4 and n_batch == 4 * 3 * 4 + 4 * 8
    x.add_(1.0)  # the loop changed the input between the forward and watch.step
    (bx2, _), _ = hc.copy((x, y))
    assert bx2 is not args[0] and torch.equal(bx2, x) and not torch.equal(args[0], x)
    hc.clear()
    (bx3, _), _ = hc.copy((x, y))
    assert bx3 is not bx2


def test_inference_mode_batch_is_copied_and_recorded(tmp_path):
    """A batch made under torch.inference_mode() has no version counter (``_version`` raises):
    the shared-copy memo raised on it and the agent disabled itself (found in review)."""
    torch.manual_seed(0)
    m = torch.nn.Linear(5, 2)
    o = torch.optim.SGD(m.parameters(), 0.1)
    w = attach(m, o, run_id="inf", runs_dir=tmp_path, metrics_port=0)
    with torch.inference_mode():
        x = torch.randn(3, 5)
    y = torch.tensor([0, 1, 0])
    for _ in range(3):
        o.zero_grad()
        loss = F.cross_entropy(m(x.clone()), y)  # the model needs a normal tensor for autograd
        loss.backward()
        o.step()
        w.step(loss, batch=(x, y))
    assert w.enabled and len(w._ring.entries) == 3
    assert torch.equal(w._ring.entries[-1].batch[0], x) and w._ring.entries[-1].batch[0] is not x
    w.close()
    hc = HostCopies()
    (a,), _ = hc.copy((x,))
    (b,), _ = hc.copy((x,))
    assert a is not b and torch.equal(a, b)


def test_batch_copy_in_the_ring_is_the_forward_argument_copy(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Linear(5, 2)
    o = torch.optim.SGD(m.parameters(), 0.1)
    w = attach(m, o, run_id="share", runs_dir=tmp_path, metrics_port=0)
    x, y = torch.randn(3, 5), torch.tensor([0, 1, 0])
    for _ in range(3):
        o.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        o.step()
        w.step(loss, batch=(x, y))
    x.mul_(2.0)  # later in-place change of the loop's buffer: the kept copies are unaffected
    entry = w._ring.entries[-1]
    _step, args, _kwargs = w._live.calls[-1]
    assert entry.batch[0] is args[0] and torch.equal(entry.batch[0], x / 2)
    w.close()


def test_memory_bound_for_adam_and_for_sgd():
    cfg = AgentConfig(ring_bytes=1 << 20)
    m = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.BatchNorm1d(10))
    pbytes = (10 * 10 + 10 + 10 + 10) * 4  # Linear weight + bias, BN weight + bias (float32)
    bbytes = (10 + 10) * 4 + 8  # BN running mean + var, num_batches_tracked (int64)
    adam = memory_bound(m, torch.optim.Adam(m.parameters()), cfg, forward_only_localizer=True)
    assert adam.snapshot == pbytes + bbytes + pbytes + 2 * pbytes  # state + grads + two moments
    assert adam.total == 2 * (1 << 20) + 2 * adam.snapshot
    sgd = memory_bound(m, torch.optim.SGD(m.parameters(), 0.1), cfg, forward_only_localizer=False)
    assert sgd.snapshot == pbytes + bbytes + pbytes and sgd.total == (1 << 20) + 2 * sgd.snapshot


def test_memory_bound_is_logged_and_exported_at_attach(tmp_path, caplog):
    torch.manual_seed(0)
    m = torch.nn.Linear(64, 64)
    o = torch.optim.Adam(m.parameters())
    with caplog.at_level(logging.INFO, logger="sentineld.agent"):
        w = attach(m, o, run_id="mem", runs_dir=tmp_path, metrics_port=-1, ring_bytes=8 << 20)
    try:
        want = w.memory.total
        assert want == 2 * (8 << 20) + 2 * (64 * 65 * 4) * 4
        assert any("ring host memory at most" in r.getMessage() for r in caplog.records)
        body = urllib.request.urlopen(f"http://127.0.0.1:{w.metrics_port}/metrics", timeout=5).read().decode()
        line = next(ln for ln in body.splitlines() if ln.startswith(M.RING_MEMORY_BOUND + "{"))
        assert float(line.rsplit(" ", 1)[1]) == float(want)
    finally:
        w.close()

