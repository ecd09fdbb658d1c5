"""Helpers for adversarial tests: a recipe module in its own project folder, trained in-process
with the real agent attached, then replayed with the real replay (API or CLI subprocess)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any, Callable

import pytest

REPO = Path(__file__).resolve().parents[2]


class Project:
    """A folder holding one recipe module; ``module`` is it, imported."""

    def __init__(self, root: Path, source: str) -> None:
        self.root = root
        self.name = f"adv_{uuid.uuid4().hex[:10]}"
        self.file = root / f"{self.name}.py"
        self.file.write_text(textwrap.dedent(source))
        self.file.chmod(0o644)
        self.module = importlib.import_module(self.name)
        self.runs = root / "runs"

    def spec(self, fn: str = "make") -> str:
        return f"{self.name}:{fn}"


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], Project]:
    """``project(source)`` -> a :class:`Project`; cwd is the project folder while the test runs."""
    root = tmp_path / "proj"
    root.mkdir(mode=0o700)
    monkeypatch.chdir(root)
    monkeypatch.syspath_prepend(str(root))
    made: list[Project] = []

    def make(source: str) -> Project:
        p = Project(root, source)
        made.append(p)
        return p

    yield make
    for p in made:
        sys.modules.pop(p.name, None)


def stream(run_dir: Path) -> list[dict[str, Any]]:
    """Every object of every rank's stream of ``run_dir``."""
    out: list[dict[str, Any]] = []
    for p in sorted(Path(run_dir).glob("stream-rank*.jsonl")):
        out += [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return out


def problems(run_dir: Path) -> list[dict[str, Any]]:
    """``agent_error`` and ``agent_warning`` lines of the stream."""
    return [o for o in stream(run_dir) if o["kind"] in ("agent_error", "agent_warning")]


def cli_replay(run_dir: Path, *args: str, cwd: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python -m sentineld replay RUN_DIR --json --trust *args`` in a subprocess."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-W", "ignore", "-m", "sentineld", "replay", str(run_dir),
                           "--json", "--trust", *args],
                          cwd=cwd or run_dir, capture_output=True, text=True, timeout=timeout, env=env)
