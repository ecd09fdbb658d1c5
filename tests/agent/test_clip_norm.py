"""Plain-loop clipping (issue 21): with ``clip_grad_norm=`` the stream records the pre-clip grad
norm and whether the clip applied, so clipping does not hide an explosion. The truth is the total
norm ``torch.nn.utils.clip_grad_norm_`` itself returns (computed before it rescales)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sentineld.agent import attach
from sentineld.contracts.records import StepRecord, record_from_json
from sentineld.contracts.stream import read_stream
from tests.signatures.chain import notifications


def _records(run_dir: Path) -> list[StepRecord]:
    objs, _, _ = read_stream(run_dir / "stream-rank0.jsonl")
    return [record_from_json(o) for o in objs if o.get("kind") == "step"]


def _train(tmp_path: Path, steps: int, *, clip: float | None, scale_x: float = 1.0, accum: int = 1,
           scaler: bool = False, explode_at: int | None = None, lr: float = 1e-3
           ) -> tuple[list[StepRecord], list[float]]:
    torch.manual_seed(0)
    x, y = torch.randn(64, 10) * scale_x, torch.randint(0, 3, (64,))
    m = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))
    opt = torch.optim.Adam(m.parameters(), lr)
    gs = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) if scaler else None
    w = attach(m, opt, run_id="clip", runs_dir=tmp_path, metrics_port=0, localize="off", num_classes=3,
               clip_grad_norm=clip, accumulation_steps=accum, scaler=gs)
    truth = []
    for s in range(steps):
        if s == explode_at:  # a hand-written backward that scales its gradient by 1e3
            m[0].weight.register_hook(lambda g: g * 1e3)
        opt.zero_grad()
        for k in range(accum):
            xb, yb = x[k::accum], y[k::accum]
            loss = F.cross_entropy(m(xb), yb) / accum
            (gs.scale(loss) if gs is not None else loss).backward()
        if gs is not None:
            gs.unscale_(opt)
        total = nn.utils.clip_grad_norm_(m.parameters(), clip if clip is not None else math.inf)
        truth.append(float(total))
        if gs is not None:
            gs.step(opt)
            gs.update()
        else:
            opt.step()
        w.step(loss, (x, y))
    w.close()
    return _records(w.run_dir), truth


@pytest.mark.parametrize("accum, scaler", [(1, False), (3, False), (1, True)], ids=["plain", "accum3", "gradscaler"])
def test_pre_clip_norm_is_recorded_and_clipped_says_so(tmp_path: Path, accum: int, scaler: bool) -> None:
    records, truth = _train(tmp_path, 12, clip=1.0, scale_x=200.0, accum=accum, scaler=scaler)
    assert len(records) == 12
    norms = [r.grad_norm for r in records]
    assert min(truth) > 20  # the true norm is far above the clip (about 50 and up)
    assert norms == pytest.approx(truth, rel=1e-4)
    assert all(r.clipped is True for r in records)


def test_under_the_clip_norm_clipped_is_false(tmp_path: Path) -> None:
    records, truth = _train(tmp_path, 6, clip=1e6)
    assert [r.grad_norm for r in records] == pytest.approx(truth, rel=1e-5)
    assert all(r.clipped is False for r in records)


def test_without_clip_grad_norm_clipped_is_unknown(tmp_path: Path) -> None:
    records, _ = _train(tmp_path, 4, clip=None)
    assert all(r.clipped is None for r in records)


def test_exploding_gradients_fires_under_clipping(tmp_path: Path) -> None:
    """A planted explosion (layer 0's gradient x1e3 from step 60) in a run clipped at 1.0: the
    recorded (pre-clip) norm explodes, the clipped one would be a flat 1.0."""
    records, truth = _train(tmp_path, 90, clip=1.0, explode_at=60, lr=1e-3)
    assert max(truth[:60]) < 5 and min(truth[60:]) > 50
    notes = notifications(records, num_classes=3, ended=False)
    fired = [step for kind, key, step in notes if kind == "alert" and key == "exploding_gradients"]
    assert fired and 60 <= fired[0] <= 63, notes
    assert [r.clipped for r in records[60:]] == [True] * 30
