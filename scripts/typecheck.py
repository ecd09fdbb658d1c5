#!/usr/bin/env python3
"""Type-check sentineld as it is installed: ``agent/`` as ``sentineld.agent``, ``replay/`` as
``sentineld.replay`` (pyproject's package-dir mapping, which mypy cannot follow by itself).

mypy run over the three folders as separate packages sees every import across them as ``Any``:
a call from the agent into the replay with the wrong arguments passes. This script lays out the
installed package as a tree of symbolic links (``build/typecheck/sentineld``: each entry of
``sentineld/``, plus ``agent`` and ``replay``), runs ``mypy -p sentineld`` on it with the
project's configuration, and prints mypy's report with the paths of the source tree.

Usage: ``python scripts/typecheck.py [extra mypy arguments]`` (``make lint`` runs it); exit
status is mypy's. ``--shadow-file SOURCE SHADOW`` takes SOURCE as a path of the source tree.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Folders installed under another name (pyproject.toml ``[tool.setuptools.package-dir]``).
MAPPED = {"agent": "agent", "replay": "replay"}


def layout(root: Path, tree: Path) -> Path:
    """(Re)build the link tree of the installed ``sentineld`` under ``tree``; returns its parent
    directory (the one to type-check from)."""
    pkg = tree / "sentineld"
    pkg.mkdir(parents=True, exist_ok=True)
    want = {p.name: p for p in (root / "sentineld").iterdir() if p.name != "__pycache__"}
    want |= {name: root / folder for name, folder in MAPPED.items()}
    for entry in pkg.iterdir():
        if entry.name not in want or not entry.is_symlink() or Path(os.readlink(entry)) != want[entry.name]:
            entry.unlink()
    for name, target in want.items():
        if not (pkg / name).is_symlink():
            (pkg / name).symlink_to(target)
    return tree


def source_path(path: str) -> str:
    """A path in the link tree -> the same file in the source tree (``sentineld/agent/x.py`` ->
    ``agent/x.py``)."""
    for name, folder in MAPPED.items():
        if path.startswith(f"sentineld/{name}/"):
            return folder + path[len(f"sentineld/{name}"):]
    return path


def tree_path(root: Path, path: str) -> str:
    """A path of the source tree (absolute or from ``root``) -> the same file in the link tree."""
    rel = os.path.relpath(Path(path).resolve(), root)
    for name, folder in MAPPED.items():
        if rel.startswith(folder + os.sep):
            return f"sentineld/{name}" + rel[len(folder):]
    return rel


def main(argv: list[str], root: Path = ROOT) -> int:
    tree = layout(root, root / "build" / "typecheck")
    args = list(argv)
    for i, a in enumerate(args):
        if a == "--shadow-file" and i + 1 < len(args):
            args[i + 1] = tree_path(root, args[i + 1])
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(root / "pyproject.toml"),
           "--cache-dir", str(root / ".mypy_cache" / "installed"), "-p", "sentineld", *args]
    proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
    line_path = re.compile(r"^(sentineld/[^:]+)(:.*)$")
    for line in (proc.stdout + proc.stderr).splitlines():
        m = line_path.match(line)
        print(source_path(m.group(1)) + m.group(2) if m else line)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
