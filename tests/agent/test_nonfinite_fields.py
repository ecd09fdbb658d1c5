"""``StepRecord.input_nonfinite`` and ``param_nonfinite`` are produced by the agent (issue 9: the
fields existed and signatures branched on them, but no agent ever set them), from a real training
run: a nan in one batch is named as the input at that very step (so the data-specific fix is
given), and a sampled step's nan parameter sets ``param_nonfinite``."""

from __future__ import annotations

import json
import math

import torch
import torch.nn.functional as F

from sentineld.agent import attach
from sentineld.agent.incidents import batch_check, params_nonfinite
from sentineld.contracts.records import LayerStats, record_from_json
from sentineld.contracts.rundir import list_captures
from sentineld.signatures import evaluate
from sentineld.signatures.numerics import DATA_NONFINITE_FIX


def _records(run_dir):
    lines = [json.loads(x) for x in (run_dir / "stream-rank0.jsonl").read_text().splitlines()]
    return [record_from_json(o) for o in lines if o.get("kind") == "step"]


def test_nan_batch_is_named_as_the_input_at_its_step(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(m.parameters(), 0.1)
    g = torch.Generator().manual_seed(1)
    with attach(m, opt, run_id="nan-batch", runs_dir=tmp_path, metrics_port=0, localize="off",
                layer_every=0, capture_on_sigterm=False) as watch:
        for i in range(8):
            x, y = torch.randn(5, 4, generator=g), torch.randint(0, 2, (5,), generator=g)
            if i == 4:
                x[2, 1] = float("inf")
            opt.zero_grad()
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            watch.step(loss, batch=(x, y))  # y is integer: skipped by the check
    records = _records(watch.run_dir)
    assert [r.input_nonfinite for r in records] == [False] * 4 + [True] + [False] * 3
    assert [(c[1], c[2]) for c in list_captures(watch.run_dir)] == [(4, "nonfinite")]
    (v,) = [v for v in evaluate(records) if v.signature == "nonfinite"]
    assert v.step == 4 and v.message.startswith("non-finite input batch") and v.fix == DATA_NONFINITE_FIX


def test_sampled_nan_parameter_sets_param_nonfinite(tmp_path):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(m.parameters(), 0.1)
    with attach(m, opt, run_id="nan-param", runs_dir=tmp_path, metrics_port=0, localize="off",
                layer_every=2, capture_on_sigterm=False) as watch:
        for i in range(6):
            opt.zero_grad()
            loss = m(torch.ones(3, 4)).sum()
            loss.backward()
            opt.step()
            if i == 4:
                with torch.no_grad():
                    m[2].bias[0] = float("nan")
            watch.step(loss, batch=torch.ones(3, 4))
    flags = [r.param_nonfinite for r in _records(watch.run_dir)]
    # every step of the first 16 is sampled (dense early sampling, agent/probes.py); steps
    # 0, 1, 2, 4 are full samples (norms: the flag), step 3 measures activations only (no
    # flag: unknown); the NaN bias set after step 4's update shows in step 4's sample
    assert flags[:5] == [False, False, False, None, True]


def test_batch_check_rule():
    nan, inf = float("nan"), float("inf")
    assert batch_check({"ids": torch.arange(3)}) is None
    assert batch_check([torch.empty(0)]) is None
    assert float(batch_check((torch.tensor([1.0, -7.0]), torch.tensor([2.0], dtype=torch.float16)))) == -4.0
    assert float(batch_check(torch.full((2000,), 60000.0, dtype=torch.float16))) == 1.2e8  # no fp16 overflow
    assert math.isnan(float(batch_check([[torch.zeros(2)], [torch.tensor([nan])]])))  # micro-batches
    assert float(batch_check({"x": torch.tensor([-inf], dtype=torch.bfloat16)})) == -inf
    assert math.isnan(float(batch_check((torch.tensor([inf]), torch.tensor([-inf])))))  # inf - inf
    assert params_nonfinite(None) is None and params_nonfinite({"a": LayerStats()}) is None
    assert params_nonfinite({"a": LayerStats(param_norm=1.0), "b": LayerStats(param_norm=nan)}) is True


def test_huge_but_finite_parameters_are_not_called_non_finite(tmp_path):
    # Regression (`sentineld demo --fault lr`): weights near 1e20 made the float32 L2 norm of the
    # module inf, so the alert said "parameters of fc1, fc2, head" were non-finite while every
    # element was finite (the replay showed fc2's weight all finite, up to 9e23).
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    opt = torch.optim.SGD(m.parameters(), 0.0)
    with attach(m, opt, run_id="huge", runs_dir=tmp_path, metrics_port=0, localize="off",
                capture_on_sigterm=False) as watch:
        for i in range(4):
            opt.zero_grad()
            loss = m(torch.ones(3, 4)).sum() * 0.0  # finite, whatever the weights
            loss.backward()
            opt.step()
            if i == 1:
                with torch.no_grad():
                    m[0].weight.fill_(1e20)  # finite; squared it overflows float32
            watch.step(loss, batch=torch.ones(3, 4))
        with torch.no_grad():
            m[2].bias[0] = float("inf")  # an element that is inf: this one counts
        opt.zero_grad()
        watch.step(m(torch.ones(3, 4)).sum().detach(), batch=torch.ones(3, 4))  # a sampled forward
    recs = _records(watch.run_dir)
    # step 3 measures activations only (agent/probes.py full_at): no norms, no flag; the norms
    # are fast float32 ones, re-taken in float64 when one reads inf (step 2's 1e20 weights)
    assert [r.param_nonfinite for r in recs[:4]] == [False, False, False, None]
    assert math.isfinite(recs[2].layers["0"].param_norm) and recs[2].layers["0"].param_norm > 1e21
    assert recs[4].param_nonfinite is True
