"""What a replay imports (issue 23: a replay's time is mostly interpreter start and imports, so a
plain run's replay loads no framework it did not use). Checked after a real replay of a real run, in
the two processes a user and the daemon start: ``sentineld replay`` and the daemon's
``python -I -m sentineld.replay``.

torch._dynamo is allowed: torch itself imports it on the first ``torch.optim`` call
(``Optimizer.add_param_group`` is ``@torch._disable_dynamo``; ``Optimizer.step`` runs
``torch._dynamo.graph_break()``), so every replay of a torch optimizer pays it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

#: Prefixes a plain (no Lightning, no transformers, no notifier) run's replay must not load.
UNUSED = ["lightning", "pytorch_lightning", "transformers", "matplotlib", "rich", "apprise", "scipy",
          "sklearn", "pandas", "tensorboard", "wandb", "watchdog", "sentineld.integrations",
          "sentineld.agent", "sentineld.daemon.service", "sentineld.daemon.replay_runner"]

#: Runs ``module`` as ``__main__`` with ``argv``; at exit prints its sys.modules to stderr's last line.
_WRAP = ("import atexit, json, runpy, sys\n"
         "atexit.register(lambda: print('\\n' + json.dumps(sorted(sys.modules)), file=sys.stderr, flush=True))\n"
         "sys.argv = {argv!r}\n"
         "runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n")


def _replay_modules(run: Path, module: str, *flags: str) -> list[str]:
    argv = [module, *([] if module == "sentineld.replay" else ["replay"]), str(run), "--step", "5", "--json"]
    code = _WRAP.format(argv=argv, module=module)
    proc = subprocess.run([sys.executable, *flags, "-W", "ignore", "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=run.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["reproduced"] is True
    return json.loads(proc.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize(("module", "flags"), [("sentineld", ()), ("sentineld.replay", ("-I",))],
                         ids=["sentineld-replay", "daemon-child"])
def test_a_plain_runs_replay_loads_no_framework(mini_run: tuple[Path, Path], module: str,
                                                flags: tuple[str, ...]) -> None:
    run, _ = mini_run
    mods = _replay_modules(run, module, *flags)
    assert "torch" in mods and "h5py" in mods  # the check saw the replay's own imports
    assert [m for m in mods if any(m == p or m.startswith(p + ".") for p in UNUSED)] == []
