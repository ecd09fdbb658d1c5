"""The training process's localization, run in a child process: ``python -m sentineld.replay.live_child``.

The agent (:mod:`sentineld.agent.localize_live`, mode ``process``) starts this with its own
interpreter and working directory after a capture was written, and writes what it prints as the
capture's verdict. A child rather than a thread of the training process: a ``loss_fn`` that holds
the GIL in one long call (a pure-C loop, a pathological regular expression) or hangs would stall
training for as long; here it stalls only the child, which the agent kills at its deadline.

Reads one JSON object on stdin: ``{"run_dir", "capture", "recipe_args"`` (the run's live recipe,
:mod:`replay.live_recipe`, with the ``autocast_dtype`` the training forward ran under)``,
"zero_grad", "modes", "num_threads"}``; prints the verdict JSON (``sentineld replay --json``'s
report) on stdout, or ``{"result": "failed", "reason": ...}``. The files it loads are the ones the
training process imported itself (same user, same folder), so the ownership checks are not
repeated (``trust``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _run(spec: dict[str, Any]) -> str:
    from sentineld.contracts.recipe import Recipe  # noqa: PLC0415
    from sentineld.contracts.rundir import read_run_meta  # noqa: PLC0415
    from sentineld.contracts.verdict import make_report  # noqa: PLC0415
    from sentineld.replay.engine import replay_capture  # noqa: PLC0415
    from sentineld.replay.live_recipe import recipe_from_run  # noqa: PLC0415
    from sentineld.replay.rebuild import torch_globals  # noqa: PLC0415
    from sentineld.replay.trust import _TRUST  # noqa: PLC0415

    _TRUST.set(True)
    meta = read_run_meta(spec["run_dir"])
    modes = spec.get("modes")

    def make() -> Recipe:
        rec = recipe_from_run(**spec["recipe_args"])
        rec.zero_grad = bool(spec.get("zero_grad", True))
        mods = list(rec.model.modules())
        if isinstance(modes, list) and len(modes) == len(mods):
            for m, flag in zip(mods, modes):
                m.training = bool(flag)
        return rec

    flags = meta.extra.get("torch_flags") if isinstance(meta.extra, dict) else None
    replayed = replay_capture(Path(spec["capture"]), lambda: make, None,
                              lambda: torch_globals(int(spec.get("num_threads") or meta.num_threads),
                                                    flags if isinstance(flags, dict) else None))
    return make_report(replayed, meta.run_id).to_json()


def main() -> int:
    """Entry point; exit 0 when a verdict (or a failure payload) was printed."""
    from sentineld.replay.main import stdout_to_stderr  # noqa: PLC0415

    spec = json.loads(sys.stdin.read())
    try:
        with stdout_to_stderr():  # the user's code may print: stdout carries only the verdict
            out = _run(spec)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - reported to the agent as the verdict
        out = json.dumps({"result": "failed", "reason": f"{type(exc).__name__}: {exc}"[:2000]})
    sys.stdout.write(out)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
