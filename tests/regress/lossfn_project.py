"""A user's plain training loop attached the README's way (``loss_fn=lambda ...``, no recipe), as a
project in a temp dir, trained in a subprocess.

``train.py`` defines its model (``CountNet``, a constructor argument without default) and a custom
optimizer whose constructor takes a required argument (``StaticScaleAdam(params, lr, loss_scale)``)
in the script itself, trains under ``if __name__ == "__main__":`` and plants a forward overflow:
row 3 of step ``NAN_STEP``'s batch is 1e25, finite, and its square after ``fc1`` overflows float32
(``aten.mul`` in ``CountNet.forward``); ``FAULT=backward`` makes that row 0 instead, and the
model's row norm ``sqrt`` has an infinite derivative there; ``FAULT=fp16`` makes it 1e5, which
overflows float16 only (``AUTOCAST=float16``). ``NO_LOSS_FN=1`` attaches without loss_fn
(forward-only); ``OPT=adam`` uses torch's Adam. ``HOG=gil`` makes the loss_fn hold the GIL for seconds in
one C call (a regular expression with catastrophic backtracking); ``HOG=hang`` makes it sleep for
ever. Each step's wall time goes to ``steps.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["NAN_STEP", "BAD_ROW", "TRAIN", "write_project", "train", "fix_bug"]

NAN_STEP = 5
BAD_ROW = 3
BUGGY = "        h = h * h\n"
FIXED = "        h = h * torch.tanh(h)\n"

TRAIN = '''"""A plain loop, attached with loss_fn (README quickstart)."""
import contextlib
import json
import os
import re
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from sentineld.agent import attach


class CountNet(nn.Module):
    def __init__(self, width, norm=False):
        super().__init__()
        self.norm = norm
        self.scale = nn.Parameter(torch.ones(8))
        self.fc1 = nn.Linear(8, width)
        self.fc2 = nn.Linear(width, 3)

    def forward(self, x):
        if self.norm:  # a row of zeros: sqrt at 0, finite forward, infinite gradient
            z = x * self.scale
            x = z / (z.pow(2).sum(1, keepdim=True).sqrt() + 1)
        h = torch.relu(self.fc1(x))
''' + BUGGY + '''        return self.fc2(h)


class StaticScaleAdam(torch.optim.Adam):
    def __init__(self, params, lr, loss_scale):
        super().__init__(params, lr=lr)
        self.loss_scale = loss_scale


def hog():
    if os.environ.get("HOG") == "gil":  # one C call that never releases the GIL (~seconds)
        re.match(r"(a|aa)+$", "a" * int(os.environ.get("HOG_N", "34")) + "b")
    elif os.environ.get("HOG") == "hang":
        time.sleep(10_000)


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
    if step == NAN_STEP:
        fault = os.environ.get("FAULT")
        x[BAD_ROW] = 0.0 if fault == "backward" else 1e5 if fault == "fp16" else 1e25
    return x, y


if __name__ == "__main__":
    import sentineld.agent.localize_live as live
    live.CLOSE_WAIT_S = float(os.environ.get("CLOSE_WAIT_S", getattr(live, "CLOSE_WAIT_S", 30)))
    torch.manual_seed(0)
    model = CountNet(12, norm=os.environ.get("FAULT") == "backward")
    opt = (torch.optim.Adam(model.parameters(), lr=1e-2) if os.environ.get("OPT") == "adam"
           else StaticScaleAdam(model.parameters(), lr=1e-2, loss_scale=4.0))
    loss_fn = None if os.environ.get("NO_LOSS_FN") else (
        lambda model, batch: (hog(), F.cross_entropy(model(batch[0]), batch[1]))[1])
    watch = attach(model, opt, run_id=sys.argv[2], runs_dir=sys.argv[1], metrics_port=0, loss_fn=loss_fn)
    cast = os.environ.get("AUTOCAST")
    autocast = (torch.autocast("cpu", dtype=getattr(torch, cast)) if cast else contextlib.nullcontext())
    times = []
    steps = int(os.environ.get("STEPS", "8"))
    for step in range(steps):
        t0 = time.perf_counter()
        x, y = batch(step)
        opt.zero_grad()
        with autocast:
            loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        watch.step(loss, batch=(x, y))
        if step > NAN_STEP + 2:
            time.sleep(float(os.environ.get("STEP_SLEEP", "0")))
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    watch.close()
    json.dump({"steps": times, "close_s": time.perf_counter() - t0}, open("steps.json", "w"))
'''.replace("NAN_STEP", str(NAN_STEP)).replace("BAD_ROW", str(BAD_ROW))


def write_project(project: Path) -> Path:
    """``train.py`` in ``project`` (created, mode 0755; the file 0644)."""
    project.mkdir(parents=True, exist_ok=True)
    project.chmod(0o755)
    (project / "train.py").write_text(TRAIN)
    (project / "train.py").chmod(0o644)
    return project


def train(project: Path, runs: Path, run_id: str = "counts", timeout: float = 300, **env: str) -> dict:
    """Train in a subprocess (cwd = the project); the run dir and the step times."""
    r = subprocess.run([sys.executable, "train.py", str(runs), run_id], cwd=project, capture_output=True,
                       text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    assert r.returncode == 0, r.stdout + r.stderr
    return {"run_dir": runs / run_id, "log": r.stderr, **json.loads((project / "steps.json").read_text())}


def fix_bug(project: Path) -> None:
    """The fix a person would make (no square of an unbounded activation)."""
    path = project / "train.py"
    path.write_text(path.read_text().replace(BUGGY, FIXED))
