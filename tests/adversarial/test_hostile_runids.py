"""A second local user (``sntl_mallory``, a real Unix account) against a root daemon watching a
shared 1777 runs dir, through the names of run dirs.

Before:
- her run dir ``hers`` whose ``run.json`` says ``run_id: exp1`` (a victim's run id: ids are
  predictable), with her own verdict naming ``exp1``, got her verdict delivered as "replay of run
  exp1": the verdict check compared the verdict's run id with the one in *her* run.json, so owning
  the dir, the capture and the verdict passed it; her NaN stream was alerted as "run exp1" too.
- her symlink ``runs/peek -> <a private run dir of root's>`` made the daemon watch (and alert,
  replay, recover rings in) a directory it was never pointed at, under a name she chose.
Now a run is named by its directory (the agent always writes ``run_id`` = its dir name): a
run.json naming another run is an error of that run (its stream is still alerted, under the
dir's name), and a symlink in the runs dir is not a run dir.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from tests.conftest import wait_until
from tests.reliability.conftest import make_daemon  # noqa: F401 - fixture
from tests.reliability.test_trust_runfiles import _chown_tree, _copy_run, _shared_runs, template  # noqa: F401
from tests.reliability.test_trust_users import as_mallory, mallory, shared  # noqa: F401 - fixtures

pytestmark = [pytest.mark.slow,  # real training subprocess and daemon
              pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root (CI runs as root)")]


def _forged(template: Path, cap: str, run_id: str) -> str:
    """A verdict that passes the verdict schema: the agent's own, with her run id and words."""
    v = json.loads((template / cap.replace(".h5", ".verdict.json")).read_text())
    v.update(run_id=run_id, cause="FORGED by mallory", fix="FORGED: run her script")
    return json.dumps(v)


def test_her_run_dir_cannot_speak_for_another_run_id(mallory, shared, template, make_daemon):  # noqa: F811
    runs = _shared_runs(shared)
    cap = next(template.glob("capture-rank0-*-nonfinite.h5")).name
    run = _copy_run(template, runs / "hers", {"run_id": "exp1", "recipe": None, "pid": 999999,
                                                 "extra": {"localize": "thread"}})
    verdict = run / cap.replace(".h5", ".verdict.json")
    verdict.unlink(missing_ok=True)
    _chown_tree(run, mallory)  # her dir, her capture, her stream: all hers, as if she had trained it
    as_mallory(mallory, f"cat > {verdict} <<'EOF'\n{_forged(template, cap, 'exp1')}\nEOF")
    d = make_daemon(runs_dir=runs)
    alerts = wait_until(lambda: [n for n in d.notifications() if n["kind"] == "alert"], 60, "her run's alert")
    time.sleep(2.0)  # what else would go out does so by now (a verdict is waited for about a second)
    notes = d.notifications()
    assert "FORGED" not in json.dumps(notes), notes  # her module, cause and fix: none went out
    assert all(n["run"] == "hers" and "exp1" not in n["title"] for n in notes), notes
    assert alerts[0]["signature"] == "nonfinite"  # her NaN is still alerted, as her dir's
    entry = next(r for r in d.status()["runs"] if r["run_dir"] == str(run))
    assert entry["run_id"] == "hers"
    assert "names run 'exp1'" in (entry["error"] or ""), entry


def test_a_symlink_in_the_runs_dir_is_not_a_run(mallory, shared, template, make_daemon):  # noqa: F811
    runs = _shared_runs(shared)
    private = shared / "root-private"
    private.mkdir(mode=0o700)
    shutil.copytree(template, private / "t")  # root's run, in a folder the daemon is not pointed at
    as_mallory(mallory, f"ln -s {private / 't'} {runs}/peek")
    ours = _copy_run(template, runs / "ours", {"run_id": "ours", "recipe": None, "pid": 999999})
    d = make_daemon(runs_dir=runs)
    wait_until(lambda: [n for n in d.notifications() if n["run"] == "ours" and n["kind"] == "alert"], 60,
               "our run's alert")
    time.sleep(2.0)
    assert {n["run"] for n in d.notifications()} == {"ours"}, d.notifications()
    assert [r["run_dir"] for r in d.status()["runs"]] == [str(ours)]


def test_her_run_dir_swapped_for_a_link_never_deletes_our_files(mallory, shared, make_daemon):  # noqa: F811
    """Before: the daemon removes a dead process's stale ``capture-rank<R>-*.h5.tmp`` by path; she
    swapped her watched run dir for a link to a private folder of ours, and ours went."""
    import socket

    runs = _shared_runs(shared)
    private = shared / "root-private"
    private.mkdir(mode=0o700)
    ours = private / "capture-rank0-step000000009-nonfinite.h5.tmp"  # e.g. a capture still being written
    ours.write_bytes(b"ours")
    os.utime(ours, (time.time() - 600, time.time() - 600))
    start = json.dumps({"kind": "start", "run_id": "hers", "rank": 0, "pid": 999999,
                        "host": socket.gethostname(), "time_s": time.time()})
    as_mallory(mallory, f"mkdir -m 755 {runs}/hers && echo '{start}' > {runs}/hers/stream-rank0.jsonl")
    d = make_daemon(runs_dir=runs)
    wait_until(lambda: [r for r in d.status().get("runs", []) if r["run_id"] == "hers" and r["ranks"] == [0]],
               30, "her run watched")
    as_mallory(mallory, f"mv {runs}/hers {runs}/hers.old && ln -s {private} {runs}/hers")
    time.sleep(4.0)  # several scans, each of which removes stale temp files
    assert ours.read_bytes() == b"ours"
    assert d.status()["stale_temps_removed"] == 0
