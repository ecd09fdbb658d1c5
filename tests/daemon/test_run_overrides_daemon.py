"""A run's own signature overrides (run.json ``extra.signatures``) that the daemon cannot take all
of, against a real daemon process: what parses is applied, what does not is named in the daemon's
log and in ``sentineld status`` (issue 21 follow-up).

On main at 3793601 one bad key dropped the WHOLE override, silently: the run that had switched
``nonfinite`` off for itself (and misspelled one other setting) was paged for its NaN, and
neither the log nor the status said why its override was ignored.
"""

from __future__ import annotations

import subprocess
import sys
import time

from tests.conftest import REPO, wait_until
from tests.reliability.checks import write_run

#: nonfinite off (valid), a misspelled key and an unknown signature (both invalid).
OVERRIDES = {"nonfinite": {"enabled": False}, "plateau": {"patiense": 3}, "nope\n": {}}


def test_the_valid_part_of_a_run_override_is_applied_and_the_bad_part_named(daemon_factory) -> None:
    daemon = daemon_factory(extra=["--no-replay"])
    write_run(daemon.runs_dir, "control", 40, {12})  # no override: its NaN is paged
    write_run(daemon.runs_dir, "tuned", 40, {12}, extra={"signatures": OVERRIDES})

    def entry(run: str) -> dict:
        return next((r for r in daemon.status().get("runs", []) if r["run_id"] == run), {})

    wait_until(lambda: any(n["run"] == "control" and n["kind"] == "alert" for n in daemon.notifications()),
               30, "the control run's NaN alert")
    tuned = wait_until(lambda: (e := entry("tuned")).get("signature_overrides_refused")
                       and e.get("last_step") == 39 and e, 30, "the tuned run's refused overrides in status")
    time.sleep(1.0)  # a few more daemon loops: an alert for it would have been enqueued with control's
    assert not [n for n in daemon.notifications() if n["run"] == "tuned"]  # nonfinite off was applied
    refused = tuned["signature_overrides_refused"]
    assert len(refused) == 2, refused
    assert "'plateau.patiense'" in refused[0] and "known: chunk, enabled" in refused[0]
    assert "unknown signature 'nope\\n'" in refused[1]  # shown as repr: no raw newline in a log line
    assert all("fix extra.signatures in the run's run.json" in p for p in refused)
    log = daemon.log.read_text()
    assert "run tuned: run.json signature override refused: unknown signature config key 'plateau.patiense'" in log
    assert log.count("'plateau.patiense'") == 1  # said once, not at every evaluation
    out = subprocess.run([sys.executable, "-m", "sentineld", "status", "--state-dir", str(daemon.state_dir)],
                         capture_output=True, text=True, timeout=60, cwd=REPO).stdout
    assert "run tuned: signature override refused: unknown signature config key 'plateau.patiense'" in out, out
