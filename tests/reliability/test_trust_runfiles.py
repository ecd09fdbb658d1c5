"""Issue 20 (items 1, 2, 5-10): nothing written through another user's link, no verdict from another
user's files, tried as a real second local user (``sntl_mallory``, as in test_trust_users.py).

Each test plants what the adversary planted on 49179bb and asserts the exact outcome: root's file
unchanged byte for byte, no file at her path, her verdict not delivered and counted, the run
still alerted. Needs root (to create the user and act as it); CI runs as root.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import pytest

from tests.conftest import REPO, wait_until
from tests.reliability.test_trust_users import as_mallory, mallory, shared  # noqa: F401 - fixtures

pytestmark = [pytest.mark.slow,  # real training subprocesses and daemons
              pytest.mark.skipif(os.geteuid() != 0 and not os.environ.get("CI"),
                                 reason="acting as another user needs root (CI runs as root)")]

PRECIOUS = b"root's own file: never to be overwritten\n"

TRAIN = textwrap.dedent('''
    import sys, torch
    import torch.nn.functional as F
    from sentineld.agent import attach
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = attach(model, opt, run_id=sys.argv[2], runs_dir=sys.argv[1], metrics_port=0,
                   snapshot_every=2, layer_every=0)
    g = torch.Generator().manual_seed(0)
    with watch:
        for step in range(8):
            x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
            if step == 5:
                x[2, 1] = float("nan")
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            watch.step(loss, (x, y))
''')


def _train(runs: Path, run_id: str) -> subprocess.CompletedProcess[str]:
    """Root trains a tiny run with a NaN batch at step 5 into ``runs`` (its agent's log returned)."""
    script = runs.parent / "train_tiny.py"
    script.write_text(TRAIN)
    return subprocess.run([sys.executable, str(script), str(runs), run_id], cwd=REPO, check=True,
                          timeout=120, capture_output=True, text=True)


@pytest.fixture(scope="module")
def template() -> Iterator[Path]:
    """One trained run (NaN at step 5, a nonfinite capture, its in-process verdict), trained once
    and copied by the tests that need a real run's files."""
    base = Path(tempfile.mkdtemp(prefix="sentineld-tmpl-", dir="/tmp"))
    base.chmod(0o755)
    (base / "runs").mkdir(mode=0o700)
    _train(base / "runs", "t")
    yield base / "runs" / "t"
    shutil.rmtree(base, ignore_errors=True)


def _precious(shared_dir: Path) -> Path:
    p = shared_dir / "precious"
    p.write_bytes(PRECIOUS)
    p.chmod(0o644)
    return p


def _shared_runs(shared_dir: Path) -> Path:
    runs = shared_dir / "runs"
    runs.mkdir()
    runs.chmod(0o1777)  # the shared runs dir the docs describe: anyone may add a run dir
    return runs


def _chown_tree(path: Path, who) -> None:  # noqa: ANN001
    for p in [path, *path.rglob("*")]:
        os.chown(p, who.pw_uid, who.pw_gid, follow_symlinks=False)


# ------------------------------------------------------------------ item 1: ring recovery
def _dead_ring(run_dir: Path, run_id: str) -> Path:
    """A real on-disk ring, as a SIGKILLed agent leaves it (lock free, files there)."""
    import torch

    from sentineld.agent.diskring import DiskRingWriter
    from sentineld.contracts.rng import capture_rng

    model = torch.nn.Linear(3, 2)
    snap = {"model": dict(model.state_dict()), "optimizer": {"state": {}, "param_groups": []},
            "scheduler": None, "scaler": None}
    ring = DiskRingWriter(run_dir, rank=0, window=8, run_id=run_id, torch_version=torch.__version__)
    ring.add_snapshot(SimpleNamespace(step=5, state=snap, wait=lambda: None))
    for n in (5, 6, 7):
        ring.add_step(SimpleNamespace(step=n, batch=(torch.randn(2, 3),), rng=capture_rng(),
                                      record={"kind": "step", "step": n, "loss": 0.5}))
    ring.flush()
    ring.close(remove=False)
    return ring.dir


@pytest.mark.parametrize("who", ["root daemon", "recover command"])
def test_ring_recovery_never_writes_through_her_temp_file_link(mallory, shared, who):  # noqa: F811
    """49179bb: her `capture-...-crash.h5.tmp` -> a root file was replaced with HDF5 by recovery."""
    runs = _shared_runs(shared)
    precious = _precious(shared)
    run_dir = runs / "hers"
    run_dir.mkdir(mode=0o700)
    ring = _dead_ring(run_dir, "hers")
    _chown_tree(run_dir, mallory)
    as_mallory(mallory, f"ln -s {precious} {run_dir}/capture-rank0-step000000007-crash.h5.tmp; "
                        f"chmod 666 {ring}/lock")
    if who == "root daemon":
        code = ("from pathlib import Path\nfrom sentineld.daemon.ring_recovery import recover_ring\n"
                f"print(recover_ring(Path({str(ring)!r})))")
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    else:
        out = subprocess.run([sys.executable, "-m", "sentineld", "recover", str(run_dir)], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert precious.read_bytes() == PRECIOUS, "recovery wrote through her link"
    assert os.path.islink(run_dir / "capture-rank0-step000000007-crash.h5.tmp")  # left as it was
    cap = run_dir / "capture-rank0-step000000007-crash.h5"
    assert stat.S_ISREG(os.lstat(cap).st_mode) and cap.read_bytes()[:8] == b"\x89HDF\r\n\x1a\n"
    assert not ring.exists()


def test_ring_recovery_leaves_a_ring_another_user_may_write_alone(mallory, shared):  # noqa: F811
    """A ring dir writable by others (or owned by someone but the run dir's owner) is not ours to read."""
    runs = _shared_runs(shared)
    run_dir = runs / "r"
    run_dir.mkdir(mode=0o700)
    ring = _dead_ring(run_dir, "r")
    ring.chmod(0o777)
    from sentineld.daemon.ring_recovery import recover_ring

    with pytest.raises(OSError, match="not an on-disk ring sentineld can trust"):
        recover_ring(ring)
    assert ring.is_dir()
    assert not list(run_dir.glob("capture-*"))


# ------------------------------------------------------------- item 9: FIFO in a ring dir
def test_a_fifo_meta_json_never_blocks_the_daemon(mallory, shared, make_daemon, tmp_path):  # noqa: F811
    """49179bb: a FIFO named meta.json in a dead ring blocked the main loop: no run was read again."""
    runs = _shared_runs(shared)
    ring = f"{runs}/hers/ring-rank0-4242"
    as_mallory(mallory, f"mkdir -m 700 {runs}/hers {ring}; touch {ring}/lock; mkfifo {ring}/meta.json; "
                        f"mkfifo {ring}/snap-000000005.ring")
    d = make_daemon(runs_dir=runs)
    _train(runs, "ours")  # our NaN run, trained while her ring sits there
    notes = wait_until(lambda: [n for n in d.notifications() if n.get("run") == "ours" and n["kind"] == "alert"],
                       60, "the alert of our run")
    assert notes[0]["signature"] == "nonfinite"
    t0 = time.monotonic()
    assert d.stop() == 0 and time.monotonic() - t0 < 15  # SIGTERM is heard, nothing hangs


# --------------------------------------------------------- item 2: the agent's run dir
def test_the_agent_never_follows_links_in_a_run_dir_she_created(mallory, shared, make_daemon, tmp_path):  # noqa: F811
    """49179bb: in her pre-created 0777 `runs/<id>`, root's agent overwrote root's file through
    `run.json.tmp`, wrote a file at her path through `stream-rank0.jsonl`, and got no alert."""
    runs = _shared_runs(shared)
    precious = _precious(shared)
    hers = shared / "her-path"
    as_mallory(mallory, f"mkdir -m 777 {runs}/exp1; ln -s {precious} {runs}/exp1/run.json.tmp; "
                        f"ln -s {precious} {runs}/exp1/run.json; ln -s {hers} {runs}/exp1/stream-rank0.jsonl")
    d = make_daemon(runs_dir=runs)
    out = _train(runs, "exp1")
    assert precious.read_bytes() == PRECIOUS
    assert not hers.exists() and not os.path.lexists(hers)
    ours = runs / "exp1.2"
    st = os.lstat(ours)
    assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o700
    assert json.loads((ours / "run.json").read_text())["run_id"] == "exp1.2"
    assert out.stderr.count("was not created by this user") == 1, out.stderr  # said once
    assert sorted(p.name for p in (runs / "exp1").iterdir()) == ["run.json", "run.json.tmp", "stream-rank0.jsonl"]
    notes = wait_until(lambda: [n for n in d.notifications() if n.get("run") == "exp1.2" and n["kind"] == "alert"],
                       60, "the alert of root's run")
    assert notes[0]["signature"] == "nonfinite"


def test_the_agent_refuses_a_runs_dir_others_may_write_without_the_sticky_bit(shared):  # noqa: F811
    runs = shared / "runs"
    runs.mkdir()
    runs.chmod(0o777)
    out = _train(runs, "r")
    assert "chmod +t" in out.stderr and "the agent is off" in out.stderr
    assert list(runs.iterdir()) == []


# ------------------------------------------------------------ item 5: forged verdicts
def _copy_run(src: Path, dst: Path, meta_update: dict) -> Path:  # noqa: ANN001
    dst.mkdir(mode=0o700)
    for f in src.iterdir():
        if f.is_file() and f.name != "run.json":
            shutil.copyfile(f, dst / f.name)
    meta = json.loads((src / "run.json").read_text())
    meta.update(meta_update)
    (dst / "run.json").write_text(json.dumps(meta))
    return dst


def _forged(run_id: str, capture: str) -> str:
    return json.dumps({"schema_version": 2, "run_id": run_id, "rank": 0, "step": 5, "requested_step": 5,
                       "phase": "forward", "module": "FORGED_BY_MALLORY", "where": "x", "reproduced": True,
                       "capture": capture, "cause": "FORGED", "fix": "run her script"})


@pytest.mark.parametrize("case", ["names_another_run", "next_to_our_capture"])
def test_forged_verdicts_are_not_delivered_and_are_counted(mallory, shared, template, make_daemon, tmp_path,  # noqa: F811
                                                           case):
    """49179bb: her verdict naming run exp1 went out as "replay of run exp1"; in her pre-created
    dir her verdict for the victim's own capture was sent before the victim's."""
    runs = _shared_runs(shared)
    cap = next(template.glob("capture-rank0-*-nonfinite.h5")).name
    run = _copy_run(template, runs / "r1", {"run_id": "r1", "recipe": None, "pid": 999999,
                                               "extra": {"localize": "thread"}})
    verdict = run / cap.replace(".h5", ".verdict.json")
    if case == "names_another_run":  # her run, her files, a verdict naming someone else's run
        _chown_tree(run, mallory)
        as_mallory(mallory, f"cat > {verdict} <<'EOF'\n{_forged('exp1', cap)}\nEOF")
    else:  # her dir, root's capture in it (as root's agent wrote it on 49179bb), her verdict
        os.chown(run, mallory.pw_uid, mallory.pw_gid)
        run.chmod(0o777)
        as_mallory(mallory, f"rm -f {verdict}; cat > {verdict} <<'EOF'\n{_forged('r1', cap)}\nEOF")
    d = make_daemon(runs_dir=runs)
    notes = wait_until(lambda: [n for n in d.notifications() if n["kind"] == "verdict"], 60, "the verdict note")
    time.sleep(1.0)
    notes = [n for n in d.notifications() if n["kind"] == "verdict"]
    assert len(notes) == 1 and notes[0]["signature"] == "replay_failed", notes
    assert "FORGED" not in json.dumps(d.notifications())  # her module, cause and fix: none went out
    assert all(n["run"] == "r1" and "replay of run exp1" not in n["title"] for n in d.notifications())
    assert "ignored" in notes[0]["body"]
    assert wait_until(lambda: d.status().get("verdicts_ignored"), 10, "the count") == 1
    assert [n for n in d.notifications() if n["kind"] == "alert" and n["run"] == "r1"]  # still alerted


# ------------------------------------------------------- item 7: bounded per run, fair
def _junk_run(who, runs: Path, n: int, pid: int) -> None:  # noqa: ANN001
    """Her run: ``n`` junk capture files that claim in-process localization (no verdict comes)."""
    meta = {"schema_version": 1, "run_id": "flood", "pid": pid, "host": os.uname().nodename,
            "extra": {"localize": "thread"}}
    as_mallory(who, f"mkdir -m 700 {runs}/flood && cd {runs}/flood && echo '{json.dumps(meta)}' > run.json && "
                        f"i=0; while [ $i -lt {n} ]; do : > capture-rank0-step$(printf %09d $i)-nonfinite.h5; "
                        "i=$((i+1)); done")


def _our_run_with_its_verdict(template: Path, runs: Path) -> None:
    cap = next(template.glob("capture-rank0-*-nonfinite.h5")).name
    ours = _copy_run(template, runs / "zz-ours", {"run_id": "zz-ours", "recipe": None, "pid": 999999,
                                                   "extra": {"localize": "thread"}})
    report = json.loads(_forged("zz-ours", cap))
    report.update(module="0", cause="ours", fix="")
    (ours / cap.replace(".h5", ".verdict.json")).write_text(json.dumps(report))


def test_a_flood_of_junk_captures_pages_replay_failed_once(mallory, shared, make_daemon, tmp_path):  # noqa: F811
    """49179bb: one run with 200 junk captures claiming in-process localization paged 200 times."""
    runs = _shared_runs(shared)
    _junk_run(mallory, runs, 200, pid=999999)  # its process is gone: each is "failed" at once
    d = make_daemon(runs_dir=runs)
    wait_until(lambda: len(list((tmp_path / "state" / "replays").glob("*.json"))) >= 200, 120, "all 200 handled")
    time.sleep(1.0)
    failed = [n for n in d.notifications() if n["kind"] == "verdict"]
    assert len(failed) == 1 and failed[0]["signature"] == "replay_failed" and failed[0]["run"] == "flood"


def test_a_flood_of_captures_delays_another_runs_verdict_by_at_most_one(mallory, shared, template,  # noqa: F811
                                                                         make_daemon, tmp_path):
    """49179bb: 3000 junk captures of one run delayed another run's verdict to 160 s."""
    runs = _shared_runs(shared)
    _our_run_with_its_verdict(template, runs)
    sleeper = subprocess.Popen(["sleep", "300"])  # her "live" process: each junk capture keeps waiting
    try:
        _junk_run(mallory, runs, 3000, pid=sleeper.pid)
        t0 = time.monotonic()
        d = make_daemon(runs_dir=runs)
        wait_until(lambda: [n for n in d.notifications() if n["kind"] == "verdict" and n["run"] == "zz-ours"],
                   60, "our run's verdict")
        took = time.monotonic() - t0
        assert took < 20, took
        assert not [n for n in d.notifications() if n["run"] == "flood" and n["kind"] == "verdict"]
    finally:
        sleeper.kill()
        sleeper.wait()


# ---------------------------------------------------------------- item 8: runs dir mode
def test_the_daemon_never_chmods_a_shared_runs_dir(shared, make_daemon, tmp_path):  # noqa: F811
    """49179bb: a root daemon on a shared 1777 runs dir made it 0700 for good."""
    runs = _shared_runs(shared)
    d = make_daemon(runs_dir=runs)
    assert stat.S_IMODE(os.stat(runs).st_mode) == 0o1777
    assert d.stop() == 0 and stat.S_IMODE(os.stat(runs).st_mode) == 0o1777


@pytest.mark.parametrize("setup", ["world_writable", "hers"])
def test_the_daemon_refuses_a_runs_dir_it_cannot_trust(mallory, shared, tmp_path, setup):  # noqa: F811
    runs = shared / "runs"
    runs.mkdir()
    runs.chmod(0o777)
    if setup == "hers":
        os.chown(runs, mallory.pw_uid, mallory.pw_gid)
        runs.chmod(0o1777)
    proc = subprocess.run([sys.executable, "-m", "sentineld", "start", "--foreground", "--runs-dir", str(runs),
                           "--state-dir", str(tmp_path / "state"), "--metrics-port", "0"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert ("chmod +t" if setup == "world_writable" else "owned by uid") in proc.stderr, proc.stderr
    assert stat.S_IMODE(os.stat(runs).st_mode) == (0o777 if setup == "world_writable" else 0o1777)


# ------------------------------------------------------------------ item 10: state files
@pytest.mark.parametrize("damage", ["deep", "fifo"])
def test_damaged_state_files_never_stop_the_daemon(make_daemon, template, tmp_path, damage):
    """49179bb: am_extras.json nested 200k deep stopped the daemon at start; as a FIFO it blocked
    the start and SIGTERM; an outbox record nested 100k deep stopped all delivery."""
    state = tmp_path / "state"
    (state / "outbox").mkdir(parents=True, mode=0o700)
    state.chmod(0o700)
    extras = state / "am_extras.json"
    if damage == "deep":
        extras.write_text("[" * 200_000 + "]" * 200_000)
        (state / "outbox" / "0000-deep.json").write_text("[" * 100_000 + "]" * 100_000)
    else:
        os.mkfifo(extras)
        os.mkfifo(state / "outbox" / "0000-fifo.json")
    d = make_daemon(runs_dir=tmp_path / "runs", start=False,
                    env={"SENTINELD_ALERTMANAGER_URL": "http://127.0.0.1:9"})
    (tmp_path / "runs").mkdir(mode=0o700)
    _copy_run(template, tmp_path / "runs" / "r", {"run_id": "r"})  # a real run's NaN stream
    d.start()
    wait_until(lambda: [n for n in d.notifications() if n["kind"] == "alert"], 60, "the alert")
    assert list(state.glob("am_extras.json.damaged-*"))
    assert not os.path.lexists(extras) or isinstance(json.loads(extras.read_text()), list)  # rewritten whole
    assert list((state / "outbox").glob("0000-*.json.damaged-*"))
    assert "damaged" in d.log.read_text()
    t0 = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(timeout=20) == 0 and time.monotonic() - t0 < 20


# -------------------------------------------------------------------- item 6: report.html
def test_report_never_writes_through_her_report_link(mallory, shared, template):  # noqa: F811
    """49179bb: `sentineld report` wrote through report.html.tmp when it was her symlink."""
    runs = _shared_runs(shared)
    precious = _precious(shared)
    run = _copy_run(template, runs / "hers", {"run_id": "hers"})
    _chown_tree(run, mallory)
    run.chmod(0o755)
    as_mallory(mallory, f"ln -s {precious} {run}/report.html.tmp")
    proc = subprocess.run([sys.executable, "-m", "sentineld", "report", str(run)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert precious.read_bytes() == PRECIOUS
    assert stat.S_ISREG(os.lstat(run / "report.html").st_mode) and b"<html" in (run / "report.html").read_bytes()
    # Her report.html itself as a link: refused by the same writer, never replaced or written through.
    from sentineld.contracts.safeio import write_atomic

    (run / "report.html").unlink()
    as_mallory(mallory, f"ln -s {precious} {run}/report.html")
    with pytest.raises(OSError, match="replaces only files it wrote"):
        write_atomic(run / "report.html", "<html>")
    assert precious.read_bytes() == PRECIOUS and os.path.islink(run / "report.html")
