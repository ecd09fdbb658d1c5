"""Bad inputs and misbehaving replays: the daemon reports each clearly and keeps watching the
other runs; a replay that hangs or eats memory is cut off and reported; a daemon SIGKILLed during
a replay finishes it after a restart, with one verdict and no repeated alert."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from sentineld.contracts.capture import CaptureStep, write_capture
from sentineld.contracts.rundir import RunMeta, make_private_dir, write_run_meta
from tests.conftest import REPO, wait_until

from .checks import write_run
from .conftest import Daemon

def _tiny_capture(path: Path, schema_version: int | None = None) -> Path:
    """A small, valid capture (optionally stamped with another schema version)."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    write_capture(path, run_id=path.parent.name, rank=0, trigger="nonfinite", first_step=1, snapshot_step=0,
                  snapshot={"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": None,
                            "scaler": None},
                  steps=[CaptureStep(0, torch.ones(2, 3), None), CaptureStep(1, torch.ones(2, 3), None)],
                  records=[{"step": 0, "loss": 1.0}, {"step": 1, "loss": float("nan")}])
    if schema_version is not None:
        import h5py

        with h5py.File(path, "r+") as f:
            f.attrs["schema_version"] = schema_version
    return path


def _replay_failures(daemon) -> dict[str, str]:
    return {n["body"].split(" gave no verdict")[0].split()[-1]: n["data"]["reason"]
            for n in daemon.notifications() if n["signature"] == "replay_failed"}


@pytest.mark.slow
def test_bad_inputs_are_reported_and_every_other_run_still_watched(tmp_path):
    runs, state = tmp_path / "runs", tmp_path / "state"
    # A run whose capture files are damaged three ways (the run itself is fine).
    damaged = make_private_dir(runs / "damaged")
    write_run_meta(damaged, RunMeta(run_id="damaged", cwd=str(damaged)))
    good = _tiny_capture(damaged / "capture-rank0-step000000001-nonfinite.h5")
    raw = good.read_bytes()
    (damaged / "capture-rank0-step000000002-nonfinite.h5").write_bytes(raw[: len(raw) // 3])
    (damaged / "capture-rank0-step000000003-nonfinite.h5").write_bytes(os.urandom(4096))
    good.unlink()
    _tiny_capture(damaged / "capture-rank0-step000000004-nonfinite.h5", schema_version=99)
    # Malformed run.json, a run.json from the future, a stream with garbage lines, no access.
    for name, text in (("bad-json", "{not json"), ("bad-version", json.dumps({"run_id": "x", "schema_version": 99}))):
        (write_run(runs, name, 20, {3}) / "run.json").write_text(text)
    noisy = write_run(runs, "noisy", 30, {20})
    lines = (noisy / "stream-rank0.jsonl").read_bytes().split(b"\n")
    lines[5:5] = [b"\x00\xff garbage", b"[[[[[[[[" * 10000, b'{"kind":"step","step":"x"}',
                  b'{"kind":"start","pid":"not a pid"}', b'{"kind":"step","step":1e999,"loss":1}']
    (noisy / "stream-rank0.jsonl").write_bytes(b"\n".join(lines))
    os.chmod(write_run(runs, "unreadable", 20, {3}), 0)
    old = time.time() - 60  # directories that have been there a while: reported at once
    for d in runs.iterdir():
        os.utime(d, (old, old))

    daemon = Daemon(runs, state, [], [], None)
    _start_without_dac_override(daemon)
    try:
        write_run(runs, "good-after", 30, {11})  # a new run while the others are broken
        alerts = lambda: {n["run"] for n in daemon.notifications() if n["kind"] == "alert"}  # noqa: E731
        # A damaged run.json does not silence the run's stream (d9bb298 never read it): bad-json
        # and bad-version are alerted on their NaN too.
        wait_until(lambda: {"noisy", "good-after", "bad-json", "bad-version"} <= alerts(), 60,
                   "alerts for every run whose stream can be read")
        # One "replay failed" page for the run (issue 20 item 7: per incident and run, not per
        # capture); the daemon's log says why each of the three captures failed.
        reasons = {"capture-rank0-step000000002-nonfinite.h5": "truncated",
                   "capture-rank0-step000000003-nonfinite.h5": "cannot open as HDF5",
                   "capture-rank0-step000000004-nonfinite.h5": "schema version 99 is not supported"}

        def failed_lines() -> dict[str, str]:
            return {name: line for line in daemon.log.read_text().splitlines() for name in reasons
                    if f"run damaged: replay {name} -> failed" in line}
        wait_until(lambda: len(failed_lines()) == 3, 120, "three replay failures logged")
        for name, why in reasons.items():
            assert why in failed_lines()[name], failed_lines()[name]
        fails = _replay_failures(daemon)
        assert len(fails) == 1, fails
        ((paged, reason),) = fails.items()
        assert reasons[paged] in reason
        wait_until(lambda: len(daemon.status().get("runs", [])) == 6, 10, "every run in the status")
        st = {r["run_dir"].rsplit("/", 1)[1]: r for r in daemon.status()["runs"]}
        assert "unreadable run metadata" in st["bad-json"]["error"]
        assert "run schema version 99 is not supported" in st["bad-version"]["error"]
        assert "Permission denied" in st["unreadable"]["error"]
        assert st["noisy"]["bad_lines"] == 4 and st["noisy"]["last_step"] == 29  # the odd start line is kept
        log = daemon.log.read_text()
        for name in ("bad-json", "bad-version", "unreadable"):
            assert f"run {name}: " in log
        assert "still watching the other runs" in log and "Traceback" not in log
        assert alerts() == {"noisy", "good-after", "bad-json", "bad-version"}
        assert daemon.proc.poll() is None
    finally:
        daemon.stop()


def _start_without_dac_override(daemon: Daemon) -> None:
    """Start the daemon unable to read what its file modes deny (root reads mode 000 otherwise)."""
    args = [sys.executable, "-m", "sentineld", "start", "--foreground", "--runs-dir", str(daemon.runs_dir),
            "--state-dir", str(daemon.state_dir), "--metrics-port", "0", "--config", os.devnull]
    if os.geteuid() == 0:
        drop = "-dac_override,-dac_read_search"
        args = ["setpriv", f"--inh-caps={drop}", f"--bounding-set={drop}", *args]
    with open(daemon.log, "ab") as logf:
        daemon.proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, cwd=REPO,
                                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wait_until(lambda: daemon.status().get("pid") in (daemon.proc.pid, *_children(daemon.proc.pid))
               or daemon.proc.poll() is not None, 60, "the daemon to start")
    assert daemon.proc.poll() is None, daemon.log.read_text()[-3000:]


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def test_bad_config_files_are_reported_with_file_and_key(tmp_path):
    cases = {
        "not TOML": ("runs_dir = [unclosed", "is not valid TOML"),
        "unknown key": ("runs_dirr = '/tmp'\n", "unknown key(s) ['runs_dirr']"),
        "wrong type": ("poll_s = 'fast'\n", "poll_s must be a number, got 'fast'"),
        "bad value": ("retry_initial_s = -1\n", "retry_initial_s must be > 0 seconds"),
        "bad signature": ("[signatures]\nnot_a_signature = {}\n", "[signatures]"),
    }
    procs = {}
    for name, (text, _) in cases.items():
        cfg = tmp_path / f"{name.replace(' ', '-')}.toml"
        cfg.write_text(text)
        procs[name] = (cfg, subprocess.Popen(
            [sys.executable, "-m", "sentineld", "start", "--foreground", "--config", str(cfg),
             "--state-dir", str(tmp_path / "state"), "--runs-dir", str(tmp_path / "runs")],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for name, (cfg, p) in procs.items():
        _, err = p.communicate(timeout=60)
        assert p.returncode == 2, (name, err)
        assert str(cfg) in err and cases[name][1] in err, (name, err)
        assert "Traceback" not in err


RECIPES = {
    "hang_recipe.py": """
        import time

        def make_recipe():
            time.sleep(600)  # a recipe that never returns
        """,
    "hog_recipe.py": """
        def make_recipe():
            hog = bytearray(8 << 30)  # 8 GiB, over the replay's memory limit
            return hog
        """,
}


def _run_with_recipe(runs: Path, run_id: str, recipe: str, cwd: Path) -> Path:
    d = make_private_dir(runs / run_id)
    write_run_meta(d, RunMeta(run_id=run_id, recipe=recipe, cwd=str(cwd)))
    return _tiny_capture(d / "capture-rank0-step000000001-nonfinite.h5")


@pytest.mark.slow
def test_replay_that_hangs_or_blows_up_is_cut_off_reported_and_the_daemon_goes_on(make_daemon, tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    for name, text in RECIPES.items():
        (code / name).write_text(textwrap.dedent(text))
    daemon = make_daemon(config={"replay_timeout_s": 15.0, "replay_memory_bytes": 3 << 30})
    _run_with_recipe(daemon.runs_dir, "hangs", "hang_recipe:make_recipe", code)
    wait_until(lambda: _replay_children(daemon), 30, "the hanging replay to start")
    t0 = time.monotonic()
    _run_with_recipe(daemon.runs_dir, "hogs", "hog_recipe:make_recipe", code)
    write_run(daemon.runs_dir, "alive", 20, {4})  # alerts still flow while a replay hangs
    wait_until(lambda: any(n["run"] == "alive" for n in daemon.notifications()), 10, "the alert meanwhile")
    assert time.monotonic() - t0 < 10 and _replay_children(daemon)  # while the replay still hangs
    wait_until(lambda: len([n for n in daemon.notifications() if n["signature"] == "replay_failed"]) == 2,
               120, "both replays reported")
    fails = {n["run"]: n["data"] for n in daemon.notifications() if n["signature"] == "replay_failed"}
    assert fails["hangs"]["result"] == "timeout" and "no verdict within 15 s (killed)" in fails["hangs"]["reason"]
    assert fails["hogs"]["result"] == "failed"
    assert "exceeded the replay memory limit (3 GiB" in fails["hogs"]["reason"]
    assert "MemoryError" in fails["hogs"]["reason"]
    assert not _replay_children(daemon)  # the killed replay left no process behind
    wait_until(lambda: daemon.status().get("replays_run") == 2, 5, "the status to count both")
    assert daemon.proc.poll() is None


def _replay_children(daemon) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().split(b"\0")
            if b"sentineld.replay" in cmd and b"--capture" in cmd and str(daemon.runs_dir).encode() in b" ".join(cmd):
                out.append(int(p.name))
        except OSError:
            continue
    return out


@pytest.mark.slow
def test_daemon_sigkilled_during_a_replay_finishes_it_after_restart(make_daemon, tmp_path):
    from sentineld.agent import attach

    from .zygote import make_model

    code = tmp_path / "code"
    code.mkdir()
    (code / "slow_recipe.py").write_text(textwrap.dedent("""
        import time
        from tests.reliability.zygote import make_recipe as _make

        def make_recipe(hidden):
            time.sleep(4)  # long enough to be killed in the middle
            return _make(hidden)
        """))
    daemon = make_daemon(env={"PYTHONPATH": str(REPO)})
    model, opt = make_model(32)
    watch = attach(model, opt, run_id="replayed", runs_dir=daemon.runs_dir, metrics_port=0,
                   recipe="slow_recipe:make_recipe", recipe_args={"hidden": 32}, snapshot_every=5,
                   capture_on_sigterm=False)
    watch.run_dir  # the run's cwd must be where the recipe lives
    meta = json.loads((watch.run_dir / "run.json").read_text())
    meta["cwd"] = str(code)
    (watch.run_dir / "run.json").write_text(json.dumps(meta))
    g = torch.Generator().manual_seed(0)
    for step in range(14):
        x, y = torch.randn(8, 64, generator=g), torch.randint(0, 10, (8,), generator=g)
        if step == 9:
            x[0, 0] = float("nan")
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        watch.step(loss, batch=(x, y))
    watch.close()
    kids = wait_until(lambda: _replay_children(daemon), 60, "the replay subprocess")
    time.sleep(0.5)
    daemon.kill()
    wait_until(lambda: not any(Path(f"/proc/{k}").exists() and
                               "Z" not in Path(f"/proc/{k}/stat").read_text().rsplit(")", 1)[1][:3]
                               for k in kids), 10, "the orphaned replay to die with the daemon")
    assert not any(n["kind"] == "verdict" for n in daemon.notifications())
    daemon.start()
    wait_until(lambda: any(n["kind"] == "verdict" for n in daemon.notifications()), 120, "the verdict")
    time.sleep(0.8)
    notes = daemon.notifications()
    verdicts = [n for n in notes if n["kind"] == "verdict"]
    alerts = [n for n in notes if n["kind"] == "alert"]
    assert len(verdicts) == 1 and verdicts[0]["data"].get("step") == 9, verdicts
    assert verdicts[0]["data"]["reproduced"] is True
    assert len(alerts) == 1 and alerts[0]["step"] == 9
