"""The import rules of docs/DESIGN.md, checked in fresh interpreters: a forbidden import fails here
instead of in someone's training job (apprise pulled into the training process) or in the replay
(the daemon's code, or the CLI, loaded to explain one step)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: The installed package's folders (pyproject.toml's package-dir): module prefix -> folder.
PACKAGE_DIRS = {"sentineld": REPO / "sentineld", "sentineld.agent": REPO / "agent",
                "sentineld.replay": REPO / "replay"}
#: Every contracts module, so that a new one is covered by the rules below without being listed.
CONTRACTS = sorted(p.stem for p in (REPO / "sentineld" / "contracts").glob("*.py") if p.stem != "__init__")

#: module imported -> prefixes of modules that must not be in sys.modules afterwards.
RULES = {
    # The agent lives in the training process: no daemon, CLI, replay, apprise or watchdog.
    "sentineld.agent": ["sentineld.daemon", "sentineld.cli", "sentineld.replay", "apprise", "watchdog"],
    # The framework callbacks run in the training process too (agent-side).
    **{f"sentineld.integrations.{m}": ["sentineld.daemon", "sentineld.cli", "sentineld.replay", "apprise",
                                       "watchdog"]
       for m in ("lightning", "transformers")},
    # Their built-in recipes run in the replay's process.
    **{f"sentineld.integrations.{m}_replay": ["sentineld.daemon", "sentineld.cli", "apprise", "watchdog"]
       for m in ("lightning", "transformers")},
    # The replay runs as its own process: no CLI or daemon code.
    "sentineld.replay.main": ["sentineld.daemon", "sentineld.cli", "apprise", "watchdog"],
    "sentineld.replay.engine": ["sentineld.daemon", "sentineld.cli", "sentineld.agent", "apprise",
                                "watchdog"],
    # The contracts import no side.
    **{f"sentineld.contracts.{m}": ["sentineld.daemon", "sentineld.cli", "sentineld.agent",
                                    "sentineld.replay", "sentineld.signatures", "apprise", "watchdog"]
       for m in CONTRACTS},
    # The signatures are pure: records in, verdicts out.
    "sentineld.signatures": ["sentineld.daemon", "sentineld.cli", "sentineld.agent", "sentineld.replay",
                             "torch", "apprise", "watchdog"],
    # Preflight runs in the user's shell on their recipe: no daemon, agent, apprise or watchdog
    # (the CLI imports it, not the other way round). replay.trust is what it imports the recipe with.
    **{m: ["sentineld.daemon", "sentineld.cli", "sentineld.agent", "apprise", "watchdog"]
       for m in ("sentineld.preflight", "sentineld.preflight.command", "sentineld.preflight.runner",
                 "sentineld.replay.trust")},
    # The daemon never imports the agent or the replay (it spawns the replay).
    "sentineld.daemon.service": ["sentineld.agent", "sentineld.replay", "sentineld.cli", "torch"],
    "sentineld.daemon.inprocess": ["sentineld.agent", "sentineld.replay", "sentineld.cli", "torch"],
}

#: Contracts that must stay torch-free (the daemon reads them without torch).
TORCH_FREE = ["sentineld.contracts.rundir", "sentineld.contracts.records", "sentineld.contracts.stream",
              "sentineld.contracts.capture", "sentineld.contracts.errors", "sentineld.contracts.nonfinite",
              "sentineld.contracts.metric_names", "sentineld.contracts.snapshot",
              "sentineld.contracts.triggers", "sentineld.contracts.ringformat", "sentineld.contracts.ringrecord",
              "sentineld.contracts.verdict",
              "sentineld.contracts.h5write", "sentineld.contracts.verdict_file"]


def _modules_after(module: str) -> list[str]:
    code = f"import importlib, json, sys; importlib.import_module({module!r}); print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _hits(mods: list[str], prefixes: list[str]) -> list[str]:
    return [m for m in mods if any(m == p or m.startswith(p + ".") for p in prefixes)]


@pytest.mark.parametrize("module", sorted(RULES))
def test_forbidden_imports(module):
    assert _hits(_modules_after(module), RULES[module]) == []


@pytest.mark.parametrize("module", TORCH_FREE)
def test_torch_free_contracts(module):
    assert _hits(_modules_after(module), ["torch"]) == []


def test_the_check_can_fail():
    # The cli imports the daemon's config: a rule "cli imports no daemon" would be violated.
    assert _hits(_modules_after("sentineld.cli"), ["sentineld.daemon"]) != []


def test_attach_with_loss_fn_loads_no_replay_code_before_an_incident(tmp_path):
    # The in-process localization imports the replay inside its thread, at the first incident:
    # a run that never has one never loads it.
    code = ("import json, sys, torch; from sentineld.agent import attach\n"
            "m = torch.nn.Linear(3, 1); opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
            f"w = attach(m, opt, runs_dir={str(tmp_path)!r}, metrics_port=0, disk_ring=False,\n"
            "           loss_fn=lambda model, b: model(b).sum())\n"
            "for _ in range(3):\n"
            "    x = torch.randn(2, 3); opt.zero_grad(); loss = m(x).sum(); loss.backward(); opt.step()\n"
            "    w.step(loss, x)\n"
            "w.close(); print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert _hits(json.loads(out.stdout.strip().splitlines()[-1]), ["sentineld.replay", "sentineld.daemon"]) == []


def _module_files() -> dict[str, Path]:
    """Every module of the installed package -> its file (``agent/watch.py`` is ``sentineld.agent.watch``)."""
    out: dict[str, Path] = {}
    for prefix, folder in PACKAGE_DIRS.items():
        for f in folder.rglob("*.py"):
            parts = list(f.relative_to(folder).with_suffix("").parts)
            if parts[0] in ("agent", "replay") and prefix == "sentineld":
                continue  # sentineld/ holds no agent/ or replay/ of its own; the mapping decides
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([prefix, *parts])] = f
    return out


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules ``module`` imports anywhere in its file (also inside functions and
    ``if TYPE_CHECKING:``): a cycle of lazy imports is still a cycle of the design."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        found |= {n for n in names if n in known and n != module}
    return found


def import_cycles() -> list[list[str]]:
    """Groups of the package's modules that import each other in a loop (Tarjan's strongly
    connected components of more than one module)."""
    files = _module_files()
    graph = {m: _imports(m, f, set(files)) for m, f in files.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles():
    assert import_cycles() == []


def test_the_cycle_check_sees_the_mapped_folders():
    files = _module_files()
    assert files["sentineld.agent.watch"] == REPO / "agent" / "watch.py"
    assert "sentineld.agent.exits" in _imports("sentineld.agent.watch", files["sentineld.agent.watch"], set(files))
    assert "sentineld.replay.errors" in _imports("sentineld.replay.ddp", files["sentineld.replay.ddp"], set(files))
    assert len(CONTRACTS) >= 20
