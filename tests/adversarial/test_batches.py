"""Batches of every legitimate shape must be captured, copied at the step, and usable by the replay.

The agent's promise: on a non-finite loss it writes one capture that the replay can use; the batch
is "copied to host memory" at ``watch.step``. Each test trains a tiny model for 6 steps with a
NaN loss at step 3 and a batch of the kind under test.
"""

from __future__ import annotations

import collections
import dataclasses
from collections import UserDict
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sentineld.agent import attach
from sentineld.contracts.capture import open_capture
from sentineld.contracts.recipe import train_step
from sentineld.replay import replay_run

from .conftest import problems

Pair = collections.namedtuple("Pair", "x y")


@dataclasses.dataclass
class DataBatch:
    x: torch.Tensor
    y: torch.Tensor


def _run(tmp_path: Path, make_batch, name: str, nan_at: int = 3):
    """Train 6 steps, NaN loss at ``nan_at``; return (watch, [batch passed at each step])."""
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    w = attach(m, opt, run_id=name, runs_dir=tmp_path / "runs", metrics_port=0, snapshot_every=2)
    passed = []
    g = torch.Generator().manual_seed(1)
    for i in range(6):
        x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        if i == nan_at:
            loss = loss * float("nan")
        loss.backward()
        opt.step()
        batch = make_batch(x, y, i)
        passed.append(batch)
        w.step(loss, batch=batch)
    w.close()
    return w, passed


# ------------------------------------------------------------------ guards (pass today)
@pytest.mark.parametrize("kind", ["dict_with_plain_values", "zero_dim", "non_contiguous",
                                  "channels_last", "bfloat16", "numpy_scalars", "nested_lists"])
def test_builtin_tree_batches_are_captured_and_round_trip(tmp_path, kind):
    makers = {
        "dict_with_plain_values": lambda x, y, i: {"x": x, "y": y, "name": "shard-3", "idx": i,
                                                   "weight": 0.5, "mask": None, "ok": True},
        "zero_dim": lambda x, y, i: (x, torch.tensor(i)),
        "non_contiguous": lambda x, y, i: (x.t(), y[::2]),
        "channels_last": lambda x, y, i: x.reshape(2, 4, 2, 2).contiguous(memory_format=torch.channels_last),
        "bfloat16": lambda x, y, i: (x.bfloat16(), y),
        "numpy_scalars": lambda x, y, i: (x, np.float64(0.25), np.int64(i)),
        "nested_lists": lambda x, y, i: [[x, [y, "s"]], {"k": (None, 1)}],
    }
    w, passed = _run(tmp_path, makers[kind], kind)
    assert not problems(w.run_dir), problems(w.run_dir)
    assert len(w.captures) == 1
    with open_capture(w.captures[0]) as cap:
        got = cap.step(3).batch
    want = passed[3]
    flat_got = torch.utils._pytree.tree_leaves(got)
    flat_want = torch.utils._pytree.tree_leaves(want)
    assert len(flat_got) == len(flat_want)
    for a, b in zip(flat_got, flat_want):
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b)
        else:
            assert a == b


def test_ring_stays_within_ring_bytes_for_huge_batches(tmp_path):
    """Guard: each ~400 KB batch is kept at most while the ring is under ``ring_bytes`` (1 MB)."""
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    w = attach(m, opt, run_id="huge", runs_dir=tmp_path, metrics_port=0, ring_bytes=1 << 20,
               snapshot_every=2)
    for _ in range(12):
        x = torch.randn(8, 4)
        opt.zero_grad()
        loss = F.cross_entropy(m(x), torch.randint(0, 2, (8,)))
        loss.backward()
        opt.step()
        w.step(loss, batch=(x, torch.randn(100_000)))
        assert w._ring.nbytes <= 1 << 20
    assert w.enabled
    w.close()


# ------------------------------------------------------------------ breaks (fail today)
def test_numpy_array_batch_is_copied_at_the_step_and_captured(tmp_path):
    """A batch of numpy arrays (a plain-values loader, the loop reusing one buffer) must still give
    a capture, holding the values of step 3 as they were at step 3.

    Today to_host() leaves ndarrays uncopied (the ring aliases the loop's buffer) and encode()
    calls ndarray.item() on them, so the capture is never written ("can only convert an array of
    size 1 to a Python scalar").
    """
    buf = np.zeros((8, 4), dtype=np.float32)
    snapshots = []

    def make(x, y, i):
        buf[...] = x.numpy()  # the loop reuses one host buffer
        snapshots.append(buf.copy())
        return (buf, y.numpy())

    w, _ = _run(tmp_path, make, "numpy")
    assert len(w.captures) == 1, problems(w.run_dir)
    with open_capture(w.captures[0]) as cap:
        x3 = cap.step(3).batch[0]
    np.testing.assert_array_equal(np.asarray(x3), snapshots[3])


def test_sparse_tensor_batch_is_captured(tmp_path):
    """A sparse COO tensor is a tensor: a batch holding one must still give a capture.

    Today _tensor_to_numpy() calls .contiguous() on it ("unsupported memory format option
    Contiguous") and the capture is dropped.
    """
    w, passed = _run(tmp_path, lambda x, y, i: (x.to_sparse(), y), "sparse")
    assert len(w.captures) == 1, problems(w.run_dir)
    with open_capture(w.captures[0]) as cap:
        x3 = cap.step(3).batch[0]
    assert torch.equal(x3.to_dense(), passed[3][0].to_dense())


@pytest.mark.parametrize("kind", ["dataclass", "mapping"])
def test_non_builtin_container_batch_still_gives_a_capture(tmp_path, kind):
    """Batches as a dataclass, or a Mapping that is not a dict (HF ``BatchEncoding`` is a
    ``UserDict``), are ordinary training code: the incident must still be captured (the batch's
    tensors copied at the step and stored, e.g. by field name), not silently dropped.

    Today map_tensors() passes such objects through uncopied and encode() raises, so the
    nonfinite capture is never written ("cannot store DataBatch at /").
    """
    make = {"dataclass": lambda x, y, i: DataBatch(x, y),
            "mapping": lambda x, y, i: UserDict(x=x, y=y)}[kind]
    w, _ = _run(tmp_path, make, kind)
    assert len(w.captures) == 1, problems(w.run_dir)


NT_RECIPE = '''
import collections
import torch, torch.nn as nn, torch.nn.functional as F
from sentineld.contracts.recipe import Recipe

Pair = collections.namedtuple("Pair", "x y")

def make():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return Recipe(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                  loss_fn=lambda m, b: F.cross_entropy(m(b.x), b.y))
'''


def test_namedtuple_batch_replays_with_attribute_access(project):
    """A namedtuple batch (``loss_fn`` reads ``b.x``) must replay.

    Today the capture stores it as a plain tuple ("tu"), so the replay fails with
    "AttributeError: 'tuple' object has no attribute 'x'" (exit 2) on a perfectly ordinary run.
    """
    p = project(NT_RECIPE)
    rec = p.module.make()
    w = attach(rec.model, rec.optimizer, run_id="nt", runs_dir=p.runs, recipe=p.spec(),
               metrics_port=0, snapshot_every=2)
    g = torch.Generator().manual_seed(0)
    with w:
        for i in range(5):
            x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
            if i == 3:
                x[0, 0] = float("nan")
            b = p.module.Pair(x, y)
            w.step(train_step(rec, b), b)
    report = replay_run(w.run_dir, trust=True)
    assert report.reproduced and report.phase in ("data", "forward")


@pytest.mark.parametrize("nan_at", [8, 25])
def test_large_batches_under_ring_bytes_still_give_a_capture(tmp_path, nan_at):
    """With default cadence (auto, >= 10 steps between snapshots) and batches large against
    ``ring_bytes`` (here 200 KB of a 1 MB ring: 5 steps; at the default 1 GiB that is a batch of
    ~200 MB, e.g. 256 RGB 224x224 float32 images), an incident must still be captured: the agent
    has to snapshot often enough that snapshot..incident..post_steps fits in the ring.

    Today the ring evicts the steps back to the last snapshot and the capture is skipped ("no
    clean snapshot in the ring; capture skipped") for most incident steps.
    """
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    w = attach(m, opt, run_id="bigbatch", runs_dir=tmp_path, metrics_port=0, ring_bytes=1 << 20)
    for i in range(nan_at + 4):
        x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        if i == nan_at:
            loss = loss * float("nan")
        loss.backward()
        opt.step()
        w.step(loss, batch=(x, y, torch.randn(50_000)))
    w.close()
    assert len(w.captures) == 1, problems(w.run_dir)
