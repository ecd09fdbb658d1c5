"""Fixtures for replay tests: the fault zoo trained once per session with the real agent attached.

The zoo runs in one subprocess from the repository root, so every run.json records the root as its
working directory and the replay imports ``tests.zoo.cases:make_<case>`` from there.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from sentineld.agent import attach
from sentineld.contracts.recipe import train_step

REPO = Path(__file__).resolve().parents[2]


def train_zoo(runs_dir: Path, names: list[str] | None = None, timeout_s: float = 300) -> dict[str, Any]:
    """Train zoo cases into ``runs_dir`` in a subprocess; return their summaries by name."""
    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "tests.zoo.run", str(runs_dir), *(names or [])],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        pytest.fail(f"zoo training failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return {s["case"]: s for s in map(json.loads, proc.stdout.splitlines())}


@pytest.fixture(scope="session")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """``(runs_dir, summaries)`` of the whole zoo (about 20 s on two cores)."""
    runs = tmp_path_factory.mktemp("zoo")
    return runs, train_zoo(runs)


MINI = textwrap.dedent('''
    import torch
    import torch.nn.functional as F
    from sentineld.contracts.recipe import Recipe

    def make(hidden: int = 8) -> Recipe:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))
        return Recipe(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                      loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
''')


@pytest.fixture
def mini_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A tiny run of a recipe module in its own project folder: ``(run_dir, recipe file)``."""
    proj = tmp_path / "proj"
    proj.mkdir(mode=0o700)
    mod = f"mini_{uuid.uuid4().hex[:8]}"
    src = proj / f"{mod}.py"
    src.write_text(MINI)
    src.chmod(0o644)
    monkeypatch.chdir(proj)
    monkeypatch.syspath_prepend(str(proj))
    module = __import__(mod)
    rec = module.make()
    watch = attach(rec.model, rec.optimizer, run_id="mini", runs_dir=tmp_path / "runs", recipe=f"{mod}:make",
                   recipe_args={"hidden": 8}, metrics_port=0, snapshot_every=2, layer_every=0)
    g = torch.Generator().manual_seed(0)
    with watch:
        for _ in range(6):
            batch = (torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g))
            watch.step(train_step(rec, batch), batch)
        watch.capture_now("manual")
    monkeypatch.chdir(tmp_path)
    return tmp_path / "runs" / "mini", src


def edit_run_json(run: Path, **changes: Any) -> None:
    """Change fields of a run's run.json (keeps its mode)."""
    p = run / "run.json"
    meta = json.loads(p.read_text())
    meta.update(changes)
    p.write_text(json.dumps(meta))
