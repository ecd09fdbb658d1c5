"""No one let in: run and state directories 0700 and files 0600, endpoints on loopback unless told
otherwise, and secrets in notification URLs nowhere the daemon writes or prints."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path

import torch

from sentineld.agent import attach
from sentineld.daemon.replay_runner import run_replay_subprocess
from sentineld.contracts.rundir import RunMeta
from tests.conftest import REPO, get_free_port, wait_until

from .checks import write_run
from .zygote import make_model

SECRETS = ["S3cr3tPassw0rd", "HookPassw0rd42", "T0kenInPath9876", "QueryT0ken5555", "AmPassw0rd77"]


def _listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state owned by ``pid``."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A = LISTEN
                addr, port = f[1].split(":")
                raw = bytes.fromhex(addr)
                if width == 8:
                    ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
                else:
                    ip = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
                out.append((ip, int(port, 16)))
    return out


def _modes(root: Path) -> list[str]:
    bad = []
    for p in [root, *root.rglob("*")]:
        try:
            mode = stat.S_IMODE(p.lstat().st_mode)
        except FileNotFoundError:
            continue  # a ring's temp file renamed by the writer while we list
        want = 0o700 if p.is_dir() else 0o600
        if mode != want:
            bad.append(f"{p.relative_to(root.parent)} {mode:o}")
    return bad


def test_files_private_endpoints_loopback(make_daemon, tmp_path):
    os.umask(0o022)  # the usual umask: privacy must not depend on the caller's
    runs = tmp_path / "home" / "state" / "runs"  # missing parents: created 0700 as well
    model, opt = make_model(16)
    watch = attach(model, opt, run_id="private", runs_dir=runs, metrics_port=-1, snapshot_every=5,
                   disk_ring=True, capture_on_sigterm=False)
    assert _listening(os.getpid()) and all(ip == "127.0.0.1" for ip, port in _listening(os.getpid())
                                          if port == watch.metrics_port)
    g = torch.Generator().manual_seed(0)
    for step in range(12):
        x, y = torch.randn(4, 64, generator=g), torch.randint(0, 10, (4,), generator=g)
        if step == 7:
            x[0, 0] = float("nan")
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        watch.step(torch.nn.functional.cross_entropy(model(x), y), batch=(x, y))
        if step == 10:
            ring_bad = _modes(next(watch.run_dir.glob("ring-*")))  # the on-disk ring, while it exists
    watch.close()
    assert ring_bad == [] and list(watch.run_dir.glob("capture-*.h5"))
    # Told otherwise: it binds where it is told.
    model2, opt2 = make_model(8)
    w2 = attach(model2, opt2, run_id="public", runs_dir=runs, metrics_port=-1, metrics_addr="0.0.0.0")
    assert ("0.0.0.0", w2.metrics_port) in _listening(os.getpid())
    w2.close()

    daemon = make_daemon(runs_dir=runs, extra=["--no-replay", "--metrics-port", "-1"])
    wait_until(lambda: daemon.status().get("runs_watched") == 2, 20, "the daemon to see both runs")
    wait_until(lambda: daemon.notifications(), 20, "the alert")
    port = daemon.status()["metrics_port"]
    assert port and _listening(daemon.proc.pid) == [("127.0.0.1", port)]  # its only listening socket
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "sentineld_daemon_runs_watched 2.0" in body
    daemon.stop()
    for root in (tmp_path / "home", daemon.state_dir):
        assert _modes(root) == [], _modes(root)


def test_secrets_in_urls_never_leave_the_config(sink, tmp_path):
    from aiosmtpd.controller import Controller

    class NoAuth:  # a mail server that offers no AUTH: apprise's login fails, delivery retries
        async def handle_DATA(self, server, session, envelope):
            return "250 OK"

    smtp_port = get_free_port()
    ctl = Controller(NoAuth(), hostname="127.0.0.1", port=smtp_port)
    ctl.start()
    runs, state = tmp_path / "runs", tmp_path / "state"
    urls = [f"mailto://sentineld:{SECRETS[0]}@127.0.0.1:{smtp_port}?from=sentineld@localhost&to=oncall@localhost",
            f"json://hookuser:{SECRETS[1]}@127.0.0.1:{sink.port}/hook/{SECRETS[2]}?token={SECRETS[3]}"]
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f"retry_initial_s = 0.3\nretry_max_s = 1.0\nmetrics_port = 0\n")
    cli = [sys.executable, "-m", "sentineld"]
    env = {**os.environ, "SENTINELD_CONFIG": str(cfg)}
    outputs = []
    try:
        start = subprocess.run([*cli, "start", "-v", "--runs-dir", str(runs), "--state-dir", str(state),
                                "--no-replay", "--alertmanager-url", f"http://am:{SECRETS[4]}@127.0.0.1:9/",
                                *[a for u in urls for a in ("--notify", u)]],
                               cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        outputs.append(start.stdout + start.stderr)
        assert start.returncode == 0, start.stderr
        pid = int((state / "daemon.pid").read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()  # readable by every user on the host
        write_run(runs, "leak", 30, {9})
        wait_until(lambda: sink.ids(), 30, "the webhook delivery")
        wait_until(lambda: json.loads((state / "status.json").read_text())["delivery_failures"] >= 2, 30,
                   "failed mail attempts (logged)")
        wait_until(lambda: "alertmanager forward failed" in (state / "daemon.log").read_text(), 30,
                   "a failed Alertmanager forward (logged)")
        for args in (["status"], ["status", "--json"], ["runs", "--runs-dir", str(runs)]):
            r = subprocess.run([*cli, *args, "--state-dir", str(state)] if args[0] == "status" else [*cli, *args],
                               cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
            outputs.append(r.stdout + r.stderr)
        status = json.loads(outputs[-2])["status"]
        assert status["notify"][0].startswith("mailto://sentineld:****@127.0.0.1") and len(status["notify"]) == 2
    finally:
        stop = subprocess.run([*cli, "stop", "--state-dir", str(state)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=60)
        outputs.append(stop.stdout + stop.stderr)
        ctl.stop()
    log = (state / "daemon.log").read_text()
    assert "delivery of" in log and "failed" in log and "alertmanager forward failed" in log  # it did log
    assert "****" in log
    leaks = []
    for p in [*runs.rglob("*"), *state.rglob("*")]:
        if p.is_file():
            data = p.read_bytes()
            leaks += [f"{p.name}: {s}" for s in SECRETS if s.encode() in data]
    for i, text in enumerate(outputs):
        leaks += [f"command output {i}: {s}" for s in SECRETS if s in text]
    leaks += [f"cmdline: {s}" for s in SECRETS if s.encode() in cmdline]
    assert leaks == [], leaks
    # The destination itself does get what it needs (basic auth), and the id.
    assert sink.posts[-1][1].get("Authorization", "").startswith("Basic ")


def test_replay_subprocess_does_not_inherit_notification_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv("SENTINELD_NOTIFY", f"json://u:{SECRETS[1]}@127.0.0.1:1/")
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nenv > {tmp_path / 'env.txt'}\necho '{{}}'\n")
    fake.chmod(0o700)
    meta = RunMeta(run_id="r", python=str(fake), cwd=str(tmp_path))
    out = run_replay_subprocess(meta, tmp_path, tmp_path / "c.h5", timeout_s=30, memory_bytes=1 << 30)
    env = (tmp_path / "env.txt").read_text()
    assert "SENTINELD_NOTIFY" not in env and SECRETS[1] not in env and "PYTHONUNBUFFERED=1" in env
    # Its `{}` is no verdict: d9bb298 delivered it as one ("every value finite").
    assert out.result == "failed" and out.report is None and "not a replay verdict" in out.reason
