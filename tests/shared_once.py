"""Expensive session fixtures built once per test run, also under pytest-xdist (``make test`` runs
``-n 2``): each xdist worker is its own process with its own session, so a session fixture used by
files that landed on two workers was built twice (the healthy corpus: ~40 s of real training on
the 2-core machine). The first worker to ask builds it under a file lock in the
run's shared temp root and writes its JSON result; the others wait on the lock and read it. The
pattern is pytest-xdist's documented one ("Making session-scoped fixtures execute only once")."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import pytest
from filelock import FileLock


def shared_once(tmp_path_factory: pytest.TempPathFactory, name: str,
                build: Callable[[Path], Any]) -> Any:
    """``build(folder)`` run once for the whole test run; returns its (JSON-serialisable) result.

    Args:
        name: the fixture's key, unique in the run (a folder name).
        build: makes what it builds under ``folder`` and returns a JSON value describing it
            (paths as strings); a failure is raised to every worker that asks (each rebuilds).
    """
    if os.environ.get("PYTEST_XDIST_WORKER") is None:  # one process: an ordinary session fixture
        return build(tmp_path_factory.mktemp(name))
    # getbasetemp() is the worker's own folder; its parent is shared by every worker of this run
    root = tmp_path_factory.getbasetemp().parent
    done = root / f"{name}.json"
    with FileLock(str(root / f"{name}.lock")):
        if done.is_file():
            return json.loads(done.read_text())
        # a fresh folder per attempt: a worker whose build failed halfway leaves its runs behind,
        # and the next worker must not append to them
        folder = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))
        value = build(folder)
        tmp = done.with_suffix(".tmp")
        tmp.write_text(json.dumps(value))
        tmp.replace(done)
        return value
