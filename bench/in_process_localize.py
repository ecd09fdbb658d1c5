"""What the in-process localization (``attach(..., loss_fn=)``) costs a run that goes on.

Trains the planted-forward-fault loop of ``tests/replay/livecases.py`` (each step padded to about
``--step-ms`` with a sleep, as a stand-in for a real step's device time) until the training
process has written its verdict, then prints: seconds from the NaN step to the verdict file, the
memory of the second copy, the step times before the incident and while the localization ran,
and how much longer the same steps took than with ``localize="off"``.

    .venv/bin/python bench/in_process_localize.py [--step-ms 10] [--fault forward] [--hidden 1024]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sentineld.contracts.verdict_file import verdict_path  # noqa: E402
from tests.replay.livecases import FAULT_STEP, train  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--fault", default="forward")
    ap.add_argument("--hidden", type=int, default=16, help="width of the model (1024: ~1.1 M parameters)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: stable on a shared machine)")
    a = ap.parse_args()
    import torch  # noqa: PLC0415

    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        out = train(Path(tmp), "bench", a.fault, steps=FAULT_STEP + 4, step_sleep_s=a.step_ms / 1000,
                    until_verdict=True, hidden=a.hidden)
        off = train(Path(tmp) / "off", "bench-off", a.fault, steps=out["steps_run"],
                    step_sleep_s=a.step_ms / 1000, localize="off", hidden=a.hidden)
        w = out["watch"]
        vfile = verdict_path(w.captures[0])
        v = json.loads(vfile.read_text())
        during = out["step_s"][FAULT_STEP + 3:out["verdict_seen_at"]]
        before = out["step_s"][2:FAULT_STEP]
        print(json.dumps({
            "fault": a.fault, "phase": v["phase"], "module": v["module"], "op": v["op"], "step": v["step"],
            "reproduced": v["reproduced"],
            "nan_step_to_verdict_file_s": round(vfile.stat().st_mtime - out["nan_time_s"], 3),
            "localization_wall_s": v["evidence"]["in_process"]["wall_s"],
            "second_copy_bytes": v["evidence"]["in_process"]["memory_bytes"],
            "step_ms_median_before": round(1000 * statistics.median(before), 2),
            "step_ms_median_during": round(1000 * statistics.median(during), 2) if during else None,
            "step_ms_max_during": round(1000 * max(during), 2) if during else None,
            "steps_during_localization": len(during),
            # the same steps with localize="off": what the localization added to training's time
            "added_training_s": round(sum(out["step_s"]) - sum(off["step_s"]), 3)}, indent=1))


if __name__ == "__main__":
    main()
