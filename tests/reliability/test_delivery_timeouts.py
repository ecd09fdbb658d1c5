"""Issue 15, item 4: slow receivers, in-doubt resends, independent destinations, bounded size.

Real apprise sending to real HTTP servers on loopback that answer slowly; deliver_due is driven
the way the daemon's delivery loop drives it (a pass, then the next when the backoff is due).
"""

from __future__ import annotations

import http.server
import json
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from sentineld.daemon.delivery import LOG_TARGET, deliver_due, destinations
from sentineld.daemon.outbox import MAX_BODY_CHARS, MAX_DATA_BYTES, Notification, Outbox


class SlowSink:
    """An HTTP endpoint whose n-th POST waits ``delays[n]`` seconds (last value repeats) before 200."""

    def __init__(self, delays: list[float]) -> None:
        self.delays = delays
        self.posts: list[tuple[float, dict[str, str], Any]] = []
        self.lock = threading.Lock()
        handler = self._handler()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        # shutdown is seen within 0.05 s, not serve_forever's 0.5 s poll (issue 23)
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"json://127.0.0.1:{self.server.server_address[1]}/hook"

    def _handler(self) -> type:
        sink = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with sink.lock:
                    n = len(sink.posts)
                    sink.posts.append((time.monotonic(), dict(self.headers), json.loads(raw)))
                time.sleep(sink.delays[min(n, len(sink.delays) - 1)])
                try:
                    self.send_response(200)
                    self.end_headers()
                except OSError:
                    pass  # the client gave up waiting

            def log_message(self, *args: Any) -> None:
                pass

        return Handler


@pytest.fixture
def sinks() -> Iterator[list[SlowSink]]:
    made: list[SlowSink] = []
    yield made
    for s in made:
        s.server.shutdown()
        s.server.server_close()


def _drive(outbox: Outbox, dests: list, log_path: Path, seconds: float, timeout_s: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        deliver_due(outbox, dests, log_path, initial_s=0.2, max_s=0.5, timeout_s=timeout_s)
        if not list(outbox):
            return
        time.sleep(0.1)


def _note(dests: list, nid: str = "n1", body: str = "loss=nan at step 7",
          data: dict | None = None) -> Notification:
    return Notification(id=nid, kind="alert", title="[sentineld] nonfinite", body=body, data=data or {},
                        targets={LOG_TARGET: "pending", **{d.key: "pending" for d in dests}})


def test_a_receiver_slower_than_apprises_default_gets_the_alert_once(tmp_path, sinks):
    """d9bb298: a webhook answering in 6 s got the same alert 9 times in 55 s, none marked."""
    sinks.append(SlowSink([6.0]))
    dests = destinations([sinks[0].url], b"k")
    outbox = Outbox(tmp_path / "outbox")
    outbox.add(_note(dests))
    _drive(outbox, dests, tmp_path / "log.jsonl", 20, timeout_s=10)
    assert len(sinks[0].posts) == 1 and list(outbox) == []


def test_a_send_that_timed_out_is_resent_marked_as_a_possible_repeat(tmp_path, sinks):
    sinks.append(SlowSink([3.0, 0.0]))  # first answer comes after our 1 s timeout, then at once
    dests = destinations([sinks[0].url], b"k")
    outbox = Outbox(tmp_path / "outbox")
    outbox.add(_note(dests))
    _drive(outbox, dests, tmp_path / "log.jsonl", 15, timeout_s=1)
    posts = sinks[0].posts
    assert len(posts) == 2 and list(outbox) == []
    assert posts[0][1].get("X-Sentineld-Resend") is None
    assert posts[1][1].get("X-Sentineld-Resend") == "1"  # the receiver may hold the first copy
    assert posts[0][1]["X-Sentineld-Id"] == posts[1][1]["X-Sentineld-Id"] == "n1"
    assert "sent again" in posts[1][2]["message"]


def test_one_slow_destination_does_not_delay_the_others(tmp_path, sinks):
    sinks += [SlowSink([4.0]), SlowSink([0.0])]
    dests = destinations([s.url for s in sinks], b"k")
    outbox = Outbox(tmp_path / "outbox")
    outbox.add(_note(dests, "a"))
    outbox.add(_note(dests, "b"))
    t0 = time.monotonic()
    deliver_due(outbox, dests, tmp_path / "log.jsonl", initial_s=0.2, max_s=0.5, timeout_s=10)
    fast = [p[0] - t0 for p in sinks[1].posts]
    assert len(fast) == 2 and max(fast) < 2.0, fast  # both, while the slow one still waits
    assert len(sinks[0].posts) == 2


def test_a_huge_message_is_cut_and_says_so(tmp_path, sinks):
    """d9bb298: a 20 MB exception message made a 20 MB post and a 40 MB outbox record."""
    sinks.append(SlowSink([0.0]))
    dests = destinations([sinks[0].url], b"k")
    outbox = Outbox(tmp_path / "outbox")
    huge = "RuntimeError: " + "x" * (20 << 20)
    outbox.add(_note(dests, body=f"the run crashed: {huge}", data={"exception": huge, "step": 7}))
    _drive(outbox, dests, tmp_path / "log.jsonl", 10, timeout_s=5)
    [(_, _, post)] = sinks[0].posts
    assert len(post["message"]) < MAX_BODY_CHARS + 500 and "[cut:" in post["message"]
    assert post["message"].startswith("the run crashed: RuntimeError: xxx")
    record = next((tmp_path / "outbox" / "delivered").glob("*.json"))
    assert record.stat().st_size < MAX_BODY_CHARS * 2 + MAX_DATA_BYTES + 4096
    kept = json.loads(record.read_text())["data"]
    assert kept["step"] == 7 and "[cut:" in kept["exception"]
