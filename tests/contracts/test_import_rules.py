"""The import rules of docs/DESIGN.md, checked in fresh interpreters: a forbidden import fails here
instead of in someone's training job (apprise pulled into the training process) or in the replay
(the daemon's code, or the CLI, loaded to explain one step)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

#: module imported -> prefixes of modules that must not be in sys.modules afterwards.
RULES = {
    # The agent lives in the training process: no daemon, CLI, replay, apprise or watchdog.
    "sentineld.agent": ["sentineld.daemon", "sentineld.cli", "sentineld.replay", "apprise", "watchdog"],
    # The replay runs as its own process: no CLI or daemon code.
    "sentineld.replay.main": ["sentineld.daemon", "sentineld.cli", "apprise", "watchdog"],
    "sentineld.replay.engine": ["sentineld.daemon", "sentineld.cli", "sentineld.agent", "apprise",
                                "watchdog"],
    # The contracts import no side.
    **{f"sentineld.contracts.{m}": ["sentineld.daemon", "sentineld.cli", "sentineld.agent",
                                    "sentineld.replay", "sentineld.signatures", "apprise", "watchdog"]
       for m in ("rundir", "records", "stream", "capture", "treecodec", "rng", "recipe", "metric_names",
                 "nonfinite", "errors", "snapshot", "triggers", "ringformat", "verdict", "h5write")},
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
}

#: Contracts that must stay torch-free (the daemon reads them without torch).
TORCH_FREE = ["sentineld.contracts.rundir", "sentineld.contracts.records", "sentineld.contracts.stream",
              "sentineld.contracts.capture", "sentineld.contracts.errors", "sentineld.contracts.nonfinite",
              "sentineld.contracts.metric_names", "sentineld.contracts.snapshot",
              "sentineld.contracts.triggers", "sentineld.contracts.ringformat", "sentineld.contracts.verdict",
              "sentineld.contracts.h5write"]


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
