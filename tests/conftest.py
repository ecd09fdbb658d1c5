"""Shared fixtures: real servers on loopback (SMTP via aiosmtpd, an HTTP JSON sink) and a real
daemon process. Every server binds 127.0.0.1 on a free port and is stopped by its finalizer."""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
from email import message_from_bytes
from email.policy import default as default_policy
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _restore_import_path() -> Iterator[None]:
    """Give each test the import path it started with. A replay or a script load in the test
    process puts the run's folder on ``sys.path`` (right for the one-shot replay process); left
    there, a later in-process replay's import-path check would refuse a folder of another test."""
    saved = list(sys.path)
    import resource

    limit = resource.getrlimit(resource.RLIMIT_AS)
    yield
    sys.path[:] = saved
    # `sentineld replay` run in-process (click's CliRunner) puts the process under the replay's
    # address-space limit; children started later (Chromium reserves far more address space
    # than it uses) would die of it.
    resource.setrlimit(resource.RLIMIT_AS, limit)


def get_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(pred: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.05) -> Any:
    """Poll ``pred`` until it returns something truthy; fail the test with ``what`` on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(poll_s)
    pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}")


class SmtpInbox:
    """Messages received by a real aiosmtpd server: ``(arrival monotonic s, email.message)``."""

    def __init__(self) -> None:
        self.messages: list[tuple[float, Any]] = []
        self.lock = threading.Lock()

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        msg = message_from_bytes(envelope.content, policy=default_policy)
        with self.lock:
            self.messages.append((time.monotonic(), msg))
        return "250 OK"

    def bodies(self) -> list[str]:
        with self.lock:
            out = []
            for _, m in self.messages:
                part = m.get_body(preferencelist=("plain", "html"))
                out.append(f"{m['subject']}\n{part.get_content() if part else m.get_payload()}")
            return out


@pytest.fixture
def smtp_server() -> Iterator[tuple[int, SmtpInbox]]:
    """A real SMTP server (aiosmtpd) on 127.0.0.1; yields ``(port, inbox)``."""
    from aiosmtpd.controller import Controller

    inbox = SmtpInbox()
    port = get_free_port()
    # hostname must be 127.0.0.1: the default '::1' misses IPv4 clients (ecosystem-facts 4).
    ctl = Controller(inbox, hostname="127.0.0.1", port=port)
    ctl.start()
    try:
        yield port, inbox
    finally:
        ctl.stop()


class HttpSink:
    """JSON bodies POSTed to a real HTTP server on loopback: ``(arrival monotonic s, path, obj)``."""

    def __init__(self) -> None:
        self.posts: list[tuple[float, str, Any]] = []
        self.lock = threading.Lock()
        self.status = 200


@pytest.fixture
def http_sink() -> Iterator[tuple[int, HttpSink]]:
    """A real HTTP endpoint on 127.0.0.1 recording JSON POSTs; yields ``(port, sink)``."""
    sink = HttpSink()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            n = int(self.headers.get("Content-Length", 0))
            raw = self.rfile.read(n)
            try:
                obj = json.loads(raw)
            except ValueError:
                obj = raw.decode(errors="replace")
            with sink.lock:
                sink.posts.append((time.monotonic(), self.path, obj))
            self.send_response(sink.status)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    # polls for shutdown every 0.05 s, not serve_forever's 0.5 s: each teardown waited it out (issue 23)
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        yield int(server.server_address[1]), sink
    finally:
        server.shutdown()
        server.server_close()


class DaemonProc:
    """A real ``sentineld start --foreground`` process."""

    def __init__(self, runs_dir: Path, state_dir: Path, notify: list[str], extra: list[str]) -> None:
        self.runs_dir, self.state_dir, self.notify, self.extra = runs_dir, state_dir, notify, extra
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = state_dir.parent / f"{state_dir.name}.log"

    def start(self) -> "DaemonProc":
        args = [sys.executable, "-m", "sentineld", "start", "--foreground", "--runs-dir", str(self.runs_dir),
                "--state-dir", str(self.state_dir), "--metrics-port", "0", *self.extra]
        for u in self.notify:
            args += ["--notify", u]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(args, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, env=env)
        wait_until(lambda: (self.state_dir / "status.json").exists() or self.proc.poll() is not None,
                   30, "the daemon's status.json")
        if self.proc.poll() is not None:
            pytest.fail(f"daemon exited: {self.log.read_text()[-2000:]}")
        return self

    def status(self) -> dict[str, Any]:
        try:
            return json.loads((self.state_dir / "status.json").read_text())
        except (OSError, ValueError):
            return {}

    def notifications(self) -> list[dict[str, Any]]:
        try:
            lines = (self.state_dir / "notifications.jsonl").read_text().splitlines()
        except OSError:
            return []
        return [json.loads(x) for x in lines if x.strip()]

    def stop(self, sig: int = 15) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., DaemonProc]]:
    """Start real daemons on ``tmp_path/runs``; all are stopped at teardown."""
    started: list[DaemonProc] = []

    def make(notify: list[str] | None = None, extra: list[str] | None = None,
             runs_dir: Path | None = None, state_dir: Path | None = None) -> DaemonProc:
        d = DaemonProc(runs_dir or tmp_path / "runs", state_dir or tmp_path / "state", notify or [], extra or [])
        d.runs_dir.mkdir(exist_ok=True)
        started.append(d)
        return d.start()

    yield make
    for d in started:
        d.stop()


#: The files that take longest (``--durations=0`` summed per file at `make test`'s ``-n 2``,
#: 2026-12-02: 272 s for test_lightning.py down to 26 s, of 2055 s in all), collected first:
#: pytest-xdist's ``--dist loadfile`` hands files out in collection order as workers free up, so
#: the longest start at once and the run ends on short files (longest-first scheduling). In
#: xdist's default order the long end-to-end files came last and one worker ran alone for the
#: last ~5 minutes (23.5 min against 17.9). Only the order changes; other files follow these.
LONGEST_FIRST = (
    "tests/integrations/test_lightning.py",
    "tests/integrations/test_e2e_frameworks.py",
    "tests/adversarial/test_breaker_newsurfaces.py",
    "tests/deploy/test_oncall.py",
    "tests/regress/test_loss_fn_chain.py",
    "tests/regress/test_regress.py",
    "tests/integrations/test_transformers.py",
    "tests/e2e/test_fsdp_relaunch.py",
    "tests/e2e/test_ddp_replay.py",
    "tests/e2e/test_fsdp_mixed.py",
    "tests/contracts/test_import_rules.py",
    "tests/agent/test_first_steps.py",
    "tests/e2e/test_end_to_end.py",
    "tests/e2e/test_fsdp_replay.py",
    "tests/reliability/test_trust_runfiles.py",
    "tests/reliability/test_trust_users.py",
    "tests/reliability/test_load.py",
    "tests/reliability/test_daemon_faults.py",
    "tests/reliability/test_delivery.py",
    "tests/deploy/test_daemon_restart.py",
    "tests/e2e/test_ddp.py",
    "tests/regress/test_regress_trust.py",
    "tests/signatures/test_healthy_corpus.py",
    "tests/adversarial/test_hostile_captures.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Collect the files of :data:`LONGEST_FIRST` first, in its order (stable: the tests of a file
    keep their order, the other files theirs)."""
    root = Path(str(config.rootpath))
    rank = {root / name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.path)), len(rank)))
