"""A planted-bug run trained once per module (real agent, real training, real capture)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.report import planted


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``{"project": Path, "run_dir": Path, "captures": [...]}`` of the stuck-sensor run."""
    root = tmp_path_factory.mktemp("planted")
    project = planted.write_project(root / "project")
    run = planted.train(project, root / "runs")
    return {"project": project, **run}
