"""A planted-bug run written outside the repository, for the report and regress tests.

The zoo's ``zero_std`` fault as a user's own project: ``stuck_sensor.py`` (a recipe module: a
per-sample standardization without eps, 0/0 on the constant row of step 7's batch) and
``train.py`` (a training loop with the real agent attached), both written to a temp dir that is
the run's working directory, trained in a subprocess. ``fix_bug`` edits the module file the way a
person would (adds the eps).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

__all__ = ["BUGGY_LINE", "FIXED_LINE", "NAN_STEP", "write_project", "train", "fix_bug"]

#: The planted bug and its fix (one line of the module).
BUGGY_LINE = "        return (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True)\n"
FIXED_LINE = "        return (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + 1e-5)\n"
#: The step whose batch holds the constant row.
NAN_STEP = 7

MODULE = '''"""A user's model: per-sample standardization, an MLP with ReLU and Tanh units."""
import torch
import torch.nn.functional as F
from torch import nn

from sentineld.recipe import Recipe


class SampleNorm(nn.Module):
    def forward(self, x):
''' + BUGGY_LINE + '''

class NormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = SampleNorm()
        self.fc = nn.Linear(16, 32)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(32, 16)
        self.squash = nn.Tanh()
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.squash(self.fc2(self.act(self.fc(self.norm(x))))))


def _ce(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def make_recipe(seed=0):
    torch.manual_seed(seed)
    model = NormNet()
    return Recipe(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), loss_fn=_ce,
                  num_classes=4)


def batch(step):
    g = torch.Generator().manual_seed(4000 + step)
    x, y = torch.randn(16, 16, generator=g), torch.randint(0, 4, (16,), generator=g)
    if step == NAN_STEP:
        x[5] = 0.25  # a stuck sensor: every feature of sample 5 reads the same value
    return x, y
'''.replace("NAN_STEP", str(NAN_STEP))

TRAIN = '''import json, sys
import torch
from sentineld.agent import attach
from sentineld.recipe import train_step
import MODNAME as project

torch.set_num_threads(1)
runs_dir, run_id, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
rec = project.make_recipe()
watch = attach(rec.model, rec.optimizer, run_id=run_id, runs_dir=runs_dir,
               recipe="MODNAME:make_recipe", metrics_port=0, snapshot_every=5, window=64,
               layer_every=1)
with watch:
    for step in range(steps):
        b = project.batch(step)
        loss = train_step(rec, b)
        watch.step(loss, b)
print(json.dumps({"captures": [str(p) for p in watch.captures]}))
'''


def write_project(root: Path, module: str = MODULE, name: str = "stuck_sensor") -> Path:
    """Write the recipe module ``<name>.py`` (defining ``make_recipe`` and ``batch(step)``) and
    ``train.py`` into ``root`` (created 0700); return ``root``."""
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    (root / f"{name}.py").write_text(module)
    (root / "train.py").write_text(TRAIN.replace("MODNAME", name))
    return root


def train(root: Path, runs_dir: Path, run_id: str = "stuck-sensor", steps: int = 12) -> dict:
    """Train the project in a subprocess from ``root`` (the run's working directory).

    Returns:
        ``{"run_dir": Path, "captures": [paths]}``.
    """
    out = subprocess.run([sys.executable, "train.py", str(runs_dir), run_id, str(steps)], cwd=root,
                         capture_output=True, text=True, timeout=120, check=True)
    caps = json.loads(out.stdout.strip().splitlines()[-1])["captures"]
    return {"run_dir": runs_dir / run_id, "captures": caps}


def fix_bug(root: Path) -> None:
    """Add the eps to the module file, as a person fixing the bug would."""
    path = root / "stuck_sensor.py"
    text = path.read_text()
    assert BUGGY_LINE in text
    path.write_text(text.replace(BUGGY_LINE, FIXED_LINE))
