"""The replay rebuilds unusual-but-legitimate runs bit for bit (regression guards).

Each recipe module holds ``make()`` (the Recipe) and ``batches()``; training goes through
``sentineld.contracts.recipe.train_step`` with the agent attached, a NaN planted in the batch of step 6, and
whatever the scenario adds between steps (validation, RNG draws). The replay must rebuild steps
S..5 with every loss bitwise equal (``reproduced``) and blame the data.
"""

from __future__ import annotations

import pytest
import torch

from sentineld.agent import attach
from sentineld.contracts.recipe import train_step
from sentineld.replay import replay_run

from .conftest import problems

COMMON = '''
import torch, torch.nn as nn, torch.nn.functional as F
from sentineld.contracts.recipe import Recipe

def batches(n=8, dtype=torch.float32, bad=6, shape=(8, 4)):
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        x = torch.randn(*shape, generator=g).to(dtype)
        y = torch.randint(0, 2, (shape[0],), generator=g)
        if i == bad:
            x.view(-1)[0] = float("nan")
        out.append((x, y))
    return out
'''

SCENARIOS = {
    # dropout + eval/no_grad validation (with its own RNG draws) between every step
    "dropout_validation": COMMON + '''
def make():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 2))
    return Recipe(model=m, optimizer=torch.optim.AdamW(m.parameters(), 1e-2),
                  loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))

def between(rec):
    rec.model.eval()
    with torch.no_grad():
        rec.model(torch.randn(5, 4))
    rec.model.train()
    with torch.no_grad():          # train-mode MC-dropout evaluation: consumes RNG, no grad
        rec.model(torch.randn(5, 4))
    torch.rand(3)
''',
    # bfloat16 parameters (the model is cast after construction), two param groups, tensor lr
    "bf16_groups_tensor_lr": COMMON + '''
def make():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2)).to(torch.bfloat16)
    opt = torch.optim.Adam([{"params": m[0].parameters(), "lr": torch.tensor(1e-2)},
                            {"params": m[2].parameters(), "lr": torch.tensor(1e-3)}])
    return Recipe(model=m, optimizer=opt, loss_fn=lambda m, b: F.cross_entropy(m(b[0].bfloat16()).float(), b[1]))

def between(rec):
    pass
''',
    # scheduler + clipping + gradient accumulation + frozen parameter
    "sched_clip_accum_frozen": COMMON + '''
def make():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    m[0].bias.requires_grad_(False)
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return Recipe(model=m, optimizer=opt, scheduler=sched, clip_grad_norm=0.5, accumulation_steps=2,
                  loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))

def between(rec):
    pass
''',
    # GradScaler on CPU with bfloat16 autocast, RMSprop
    "gradscaler_autocast": COMMON + '''
def make():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 2))
    return Recipe(model=m, optimizer=torch.optim.RMSprop(m.parameters(), 1e-2),
                  scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2),
                  autocast_dtype=torch.bfloat16,
                  loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))

def between(rec):
    pass
''',
    # channels_last conv net with channels_last inputs
    "channels_last_conv": COMMON + '''
def make():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    m = m.to(memory_format=torch.channels_last)
    return Recipe(model=m, optimizer=torch.optim.SGD(m.parameters(), 0.1),
                  loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))

def between(rec):
    pass
''',
}


def _train(mod, spec, runs, scenario):
    rec = mod.make()
    accum = rec.accumulation_steps
    shape = (3 * 8, 3, 6, 6) if scenario == "channels_last_conv" else (8, 4)
    data = mod.batches(n=8 * accum, shape=shape, bad=6 * accum)
    if scenario == "channels_last_conv":
        data = [(x.contiguous(memory_format=torch.channels_last), y) for x, y in data]
    w = attach(rec.model, rec.optimizer, run_id=scenario, runs_dir=runs, recipe=spec, metrics_port=0,
               snapshot_every=8, scheduler=rec.scheduler, scaler=rec.scaler, accumulation_steps=accum)
    with w:
        for i in range(8):
            batch = data[i * accum:(i + 1) * accum] if accum > 1 else data[i]
            loss = train_step(rec, batch)
            mod.between(rec)
            w.step(loss, batch)
    return w


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_unusual_run_replays_bitwise(project, scenario):
    p = project(SCENARIOS[scenario])
    w = _train(p.module, p.spec(), p.runs, scenario)
    assert not problems(w.run_dir), problems(w.run_dir)
    assert len(w.captures) == 1, w.captures
    report = replay_run(w.run_dir, trust=True)
    assert report.reproduced, (report.max_loss_deviation, report.evidence.get("rebuilt_losses"))
    assert report.steps_rebuilt == 6
    assert report.phase in ("data", "forward"), report.phase


NOISY_LOSS = COMMON + '''
def make():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    # input-noise augmentation drawn in loss_fn, before the model's forward
    return Recipe(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                  loss_fn=lambda m, b: F.cross_entropy(m(b[0] + 0.1 * torch.randn_like(b[0])), b[1]))
'''


@pytest.mark.xfail(strict=True, reason=(
    "known limitation: RNG states are recorded at the step's first training forward, so random "
    "draws a loss function makes before calling the model (and after other draws between steps) "
    "are not replayed bit for bit; the agent cannot see where a plain loop's step starts"))
def test_rng_drawn_in_loss_fn_before_the_forward_replays_bitwise(project):
    """A loop that calls ``train_step`` itself must replay bit for bit (README), also when its
    ``loss_fn`` draws random numbers before calling the model (noise augmentation, a mixup
    coefficient, random masking) and the loop uses the RNG between steps (random augmentation or
    a shuffling sampler in the main process).

    Today the RNG is recorded at the model's first forward only, so the draws made in ``loss_fn``
    before it come from a different state in the replay: rebuilt losses differ (reproduced False,
    deviation ~7e-3, exit 1).
    """
    p = project(NOISY_LOSS)
    rec = p.module.make()
    data = p.module.batches()
    w = attach(rec.model, rec.optimizer, run_id="noisy", runs_dir=p.runs, recipe=p.spec(),
               metrics_port=0, snapshot_every=8)
    with w:
        for i in range(8):
            loss = train_step(rec, data[i])
            torch.rand(3)  # e.g. the next batch's random crop, drawn in the main process
            w.step(loss, data[i])
    report = replay_run(w.run_dir, trust=True)
    assert report.reproduced, report.max_loss_deviation
