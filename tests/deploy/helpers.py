"""Helpers for tests/deploy: start real servers on loopback, poll them, parse PromQL names.

Every server binds 127.0.0.1 on a free port and is stopped by a finalizer, also when the test
fails. A server that does not become ready fails the test with the tail of its log.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


#: Series names deploy/ may use besides sentineld's own (sentineld/contracts/metric_names.py).
PROMETHEUS_BUILTINS = {"up", "ALERTS", "ALERTS_FOR_STATE"}

_PROMQL_WORDS = {"and", "or", "unless", "bool", "offset", "Inf", "NaN", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """Series names in a PromQL expression: identifiers that select series, not functions,
    keywords, durations or label names."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", "{}", expr)  # label matchers
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range and subquery durations
    expr = re.sub(r"\boffset\s+\S+", "", expr)  # offset durations (also $__interval)
    names = set()
    for m in re.finditer(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\b(\s*\()?", expr):
        if not m.group(2) and m.group(1) not in _PROMQL_WORDS:
            names.add(m.group(1))
    return names


def require_binary(name: str) -> str:
    """Absolute path of a binary, or skip the test (Debian packages, see .ci/run)."""
    path = shutil.which(name)
    if path is None and os.environ.get("CI"):
        pytest.fail(f"{name} not installed: .ci/run must install it (scripts/system-deps.sh)")
    if path is None:
        pytest.skip(f"{name} not installed (apt-get install prometheus prometheus-alertmanager)")
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, bytes]:
    """GET a loopback URL; returns (status, body) for 2xx and 4xx/5xx alike."""
    assert urllib.parse.urlsplit(url).hostname == "127.0.0.1", url
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def http_json(url: str, timeout_s: float = 5.0) -> Any:
    status, body = http_get(url, timeout_s)
    assert status == 200, (url, status, body[:500])
    return json.loads(body)


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, step_s: float = 0.1) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail with ``what`` after timeout."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(step_s)
    pytest.fail(f"timed out after {timeout_s} s waiting for {what}; last value: {last!r}")


class Server:
    """A started binary: ``url`` (http://127.0.0.1:PORT), ``proc``, ``log`` path."""

    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def start_server(
    request: pytest.FixtureRequest,
    make_cmd: Callable[[int], list[str]],
    ready_path: str,
    log: Path,
    timeout_s: float = 30.0,
) -> Server:
    """Start ``make_cmd(port)`` until it is ready; retries with a new port if the port was taken."""
    for _attempt in range(3):
        port = free_port()
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                make_cmd(port), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        server = Server(proc, f"http://127.0.0.1:{port}", log)
        request.addfinalizer(server.stop)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if http_get(server.url + ready_path, timeout_s=1.0)[0] == 200:
                    return server
            except OSError:
                pass
            time.sleep(0.1)
        server.stop()
        if "address already in use" not in server.log_tail().lower():
            break
    pytest.fail(f"{make_cmd(0)[0]} did not become ready:\n{server.log_tail()}")


class HttpSink:
    """A loopback HTTP server that records every POSTed JSON body (``received``) and says 200."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        sink = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with sink._cond:
                    sink.received.append({"path": self.path, "json": json.loads(body or b"null")})
                    sink._cond.notify_all()
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        # shutdown is seen within 0.05 s, not serve_forever's 0.5 s poll (issue 23)
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()

    def wait(self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float) -> dict[str, Any]:
        """First received body (``{"path", "json"}``) matching ``predicate``; fails on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for item in self.received:
                    if predicate(item):
                        return item
                left = deadline - time.monotonic()
                if left <= 0:
                    pytest.fail(f"no matching POST within {timeout_s} s; got {self.received!r}")
                self._cond.wait(left)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)


# --- the Grafana dashboard ---------------------------------------------------------------------

DASHBOARD = DEPLOY / "grafana" / "dashboards" / "sentineld.json"

#: Grafana's built-in variables, replaced by typical values before Prometheus sees a query.
BUILTIN_VARIABLES = {"__rate_interval": "1m", "__interval": "15s", "__range": "1h"}


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def template_variables() -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard()["templating"]["list"]}


def substitute(expr: str) -> str:
    """Replace Grafana variables the way the dashboard's "All" selection does (``.*``)."""
    names = set(template_variables())

    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name in BUILTIN_VARIABLES:
            return BUILTIN_VARIABLES[name]
        assert name in names, f"unknown variable ${name} in {expr!r}"
        return ".*"

    out = re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]", repl, expr)
    assert "$" not in out, out
    return out
