"""Fixtures for the reliability tests: real daemons that can be SIGKILLed and restarted, an SMTP
server (aiosmtpd) whose behaviour can be changed mid-test (down, slow before or after taking a
message), an HTTP sink that records headers and can fail, and the crash-trial zygote."""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from email import message_from_bytes
from email.policy import default as default_policy
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from tests.conftest import REPO, get_free_port, wait_until

HERE = Path(__file__).resolve().parent


# ------------------------------------------------------------------ daemon
class Daemon:
    """A real ``sentineld start --foreground`` process that tests may SIGKILL and restart."""

    def __init__(self, runs_dir: Path, state_dir: Path, notify: list[str], extra: list[str],
                 config: dict[str, Any] | None, env: dict[str, str] | None = None) -> None:
        self.runs_dir, self.state_dir, self.notify, self.extra = runs_dir, state_dir, notify, extra
        self.log = state_dir.parent / f"{state_dir.name}.log"
        self.env = env or {}
        self.config_path: Path | None = None
        if config:
            self.config_path = state_dir.parent / f"{state_dir.name}.toml"
            self.config_path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in config.items()))
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, wait: bool = True) -> "Daemon":
        args = [sys.executable, "-m", "sentineld", "start", "--foreground", "--runs-dir", str(self.runs_dir),
                "--state-dir", str(self.state_dir), "--metrics-port", "0", *self.extra]
        if self.config_path:
            args += ["--config", str(self.config_path)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        if self.notify:
            env["SENTINELD_NOTIFY"] = " ".join(self.notify)  # not argv: URLs may hold secrets
        (self.state_dir / "status.json").unlink(missing_ok=True)
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        self.starts += 1
        if wait:
            wait_until(lambda: self.status().get("pid") == self.proc.pid or self.proc.poll() is not None,
                       60, "the daemon's status.json")
            if self.proc.poll() is not None:
                pytest.fail(f"daemon exited ({self.proc.returncode}): {self.log.read_text()[-3000:]}")
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

    def kill(self) -> None:
        """SIGKILL, as the OOM killer or a power cut of the process would."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=20)

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def rss_cpu(self) -> tuple[int, int, float]:
        """(VmRSS bytes, VmHWM bytes, CPU seconds used) of the daemon process."""
        assert self.proc is not None
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        kb = {line.split(":")[0]: int(line.split()[1]) for line in status.splitlines()
              if line.startswith(("VmRSS", "VmHWM"))}
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        return kb["VmRSS"] * 1024, kb["VmHWM"] * 1024, (int(fields[11]) + int(fields[12])) / ticks


@pytest.fixture
def make_daemon(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """``make_daemon(notify=[...], extra=[...], config={...}, name="state")`` -> started Daemon."""
    made: list[Daemon] = []

    def make(notify: list[str] | None = None, extra: list[str] | None = None,
             config: dict[str, Any] | None = None, name: str = "state", runs_dir: Path | None = None,
             start: bool = True, env: dict[str, str] | None = None) -> Daemon:
        d = Daemon(runs_dir or tmp_path / "runs", tmp_path / name, notify or [], extra or [], config, env)
        made.append(d)
        return d.start() if start else d

    yield make
    for d in made:
        d.stop()


# -------------------------------------------------------------------- SMTP
class Inbox:
    """A real SMTP server's handler whose behaviour tests change mid-test.

    Attributes:
        messages: ``(arrival monotonic s, email.message)`` of every message taken.
        rcpt_delay_s: seconds to stall at RCPT (before the message exists: a kill then loses
            nothing on the server side).
        after_data_delay_s: seconds to stall after the message was taken, before replying 250
            (the in-doubt window: the server has it, the client does not know yet).
        in_data: set while a message was taken and its 250 is being held back.
    """

    def __init__(self) -> None:
        self.messages: list[tuple[float, Any]] = []
        self.lock = threading.Lock()
        self.rcpt_delay_s = 0.0
        self.after_data_delay_s = 0.0
        self.in_rcpt = threading.Event()
        self.in_data = threading.Event()

    async def handle_RCPT(self, server: Any, session: Any, envelope: Any, address: str,
                          rcpt_options: Any) -> str:
        envelope.rcpt_tos.append(address)
        if self.rcpt_delay_s:
            self.in_rcpt.set()
            await asyncio.sleep(self.rcpt_delay_s)
        return "250 OK"

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        msg = message_from_bytes(envelope.content, policy=default_policy)
        with self.lock:
            self.messages.append((time.monotonic(), msg))
        if self.after_data_delay_s:
            self.in_data.set()
            await asyncio.sleep(self.after_data_delay_s)
        return "250 OK"

    def ids(self) -> list[str]:
        with self.lock:
            return [str(m["X-Sentineld-Id"]) for _, m in self.messages]

    def resends(self) -> list[str]:
        with self.lock:
            return [str(m["X-Sentineld-Id"]) for _, m in self.messages if m["X-Sentineld-Resend"]]

    def unmarked(self) -> list[str]:
        with self.lock:
            return [str(m["X-Sentineld-Id"]) for _, m in self.messages if not m["X-Sentineld-Resend"]]

    def bodies(self) -> list[str]:
        with self.lock:
            out = []
            for _, m in self.messages:
                part = m.get_body(preferencelist=("plain", "html"))
                out.append(f"{m['subject']}\n{part.get_content() if part else m.get_payload()}")
            return out


class Smtp:
    """aiosmtpd on a fixed loopback port that can be started, stopped and started again."""

    def __init__(self, port: int) -> None:
        self.port, self.inbox, self.ctl = port, Inbox(), None

    @property
    def url(self) -> str:
        return f"mailto://127.0.0.1:{self.port}?from=sentineld@localhost&to=oncall@localhost"

    def start(self) -> "Smtp":
        from aiosmtpd.controller import Controller

        # 127.0.0.1, not the default ::1 (ecosystem-facts 4); port=0 is broken (aiosmtpd#388).
        self.ctl = Controller(self.inbox, hostname="127.0.0.1", port=self.port)
        self.ctl.start()
        return self

    def stop(self) -> None:
        if self.ctl is not None:
            self.ctl.stop()
            self.ctl = None


@pytest.fixture
def smtp() -> Iterator[Smtp]:
    """A real SMTP server on 127.0.0.1 (not started: call ``.start()``)."""
    s = Smtp(get_free_port())
    yield s
    s.stop()


# -------------------------------------------------------------------- HTTP
class Sink:
    """POSTs to a real loopback HTTP server: ``(path, headers, json)``; ``status`` is what it answers."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, dict[str, str], Any]] = []
        self.lock = threading.Lock()
        self.status = 200
        self.port = 0

    @property
    def url(self) -> str:
        return f"json://127.0.0.1:{self.port}/hook"

    def ids(self, resends: bool | None = None) -> list[str]:
        """Ids of the POSTs answered 200 (only marked resends, only unmarked, or all)."""
        with self.lock:
            return [h.get("X-Sentineld-Id", "") for p, h, _ in self.posts if h.get("_status") == "200"
                    and (resends is None or bool(h.get("X-Sentineld-Resend")) == resends)]


@pytest.fixture
def sink() -> Iterator[Sink]:
    s = Sink()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            try:
                obj = json.loads(raw)
            except ValueError:
                obj = raw.decode(errors="replace")
            status = s.status
            with s.lock:
                s.posts.append((self.path, {**dict(self.headers), "_status": str(status)}, obj))
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    s.port = int(server.server_address[1])
    # polls for shutdown every 0.05 s, not serve_forever's 0.5 s: each teardown waited it out (issue 23)
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    yield s
    server.shutdown()
    server.server_close()


# ------------------------------------------------------------------ zygote
class Zygote:
    """The crash-trial zygote (``zygote.py``): forks real training processes on request."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(HERE / "zygote.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, cwd=REPO, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert json.loads(self.proc.stdout.readline()) == {"ready": True}

    def _ask(self, req: dict[str, Any]) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def train(self, **spec: Any) -> int:
        return int(self._ask({"op": "train", **spec})["pid"])

    def reap(self, pid: int) -> int:
        return int(self._ask({"op": "reap", "pid": pid})["status"])

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="session")
def zygote() -> Iterator[Zygote]:
    z = Zygote()
    yield z
    z.close()


def run_once(spec: dict[str, Any], timeout_s: float = 120) -> subprocess.Popen[bytes]:
    """Start one training process (plain interpreter) running ``zygote.py --once SPEC``."""
    return subprocess.Popen([sys.executable, str(HERE / "zygote.py"), "--once", json.dumps(spec)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
