"""Notifications go out in each destination's own format (issue 10, Messages).

On d9bb298 apprise got our plain text with no declared format; its email plugin (HTML by
default) took it for HTML: the text/plain part arrived as one line with ``<run>`` dropped, and
the HTML part had raw newlines and an unescaped ``<run>``. Here a real apprise sends to a real
SMTP server (aiosmtpd on loopback); the raw MIME it received is parsed with the email package.
"""

from __future__ import annotations

import html
import re
import threading
from email import message_from_bytes
from email.policy import default as default_policy
from pathlib import Path
from typing import Any, Iterator

import pytest

from sentineld.contracts.render import format_body, render_verdict
from sentineld.daemon.delivery import _apprise_send, destination_format
from sentineld.daemon.messages import alert_text
from sentineld.daemon.outbox import Notification
from sentineld.signatures.numerics import NONFINITE_FIX
from tests.conftest import get_free_port, wait_until

#: A verdict as the replay subprocess prints it, with what broke the email: ``<`` and ``&`` in
#: the text (a lambda loss function's module type, a ``<run>`` placeholder), an -inf input.
VERDICT: dict[str, Any] = {
    "run_id": "exp1", "rank": 0, "step": 7, "requested_step": 7, "phase": "forward",
    "module": "norm", "module_type": "<lambda>", "op": "aten.div", "parameters": [],
    "reproduced": True, "max_loss_deviation": 0.0, "steps_rebuilt": 2,
    "cause": "division by zero in forward (x / std & std == 0)", "fix": "add eps: sentineld replay <run>",
    "capture": "/runs/exp1/capture-rank0-step00000007-nonfinite.h5",
    "evidence": {"snapshot_step": 5, "op_inputs": [
        {"dtype": "float32", "shape": [4], "numel": 4, "nan": 0, "posinf": 0, "neginf": 1, "nonfinite": 1,
         "zeros": 0, "min": 2.343, "max": 2.916, "finite_max_abs": 2.916}],
        "op_output": {"dtype": "float32", "shape": [4], "numel": 4, "nan": 4, "posinf": 0, "neginf": 0,
                      "nonfinite": 4, "zeros": 0, "min": None, "max": None, "finite_max_abs": None}},
}


class RawInbox:
    """What a real aiosmtpd server received: the raw bytes of each message."""

    def __init__(self) -> None:
        self.raw: list[bytes] = []
        self.lock = threading.Lock()

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
        with self.lock:
            self.raw.append(bytes(envelope.original_content or envelope.content))
        return "250 OK"


@pytest.fixture
def raw_smtp() -> Iterator[tuple[int, RawInbox]]:
    from aiosmtpd.controller import Controller

    inbox, port = RawInbox(), get_free_port()
    ctl = Controller(inbox, hostname="127.0.0.1", port=port)
    ctl.start()
    try:
        yield port, inbox
    finally:
        ctl.stop()


def send_email(port: int, inbox: RawInbox, title: str, body: str) -> bytes:
    """Send ``title``/``body`` through the daemon's real delivery to the loopback SMTP server."""
    note = Notification(id="n-test-1", kind="verdict", title=title, body=body, severity="critical", run="exp1")
    ok, err = _apprise_send(f"mailto://127.0.0.1:{port}?from=sentineld@localhost&to=oncall@localhost",
                            note, timeout_s=10.0)
    assert ok, err
    wait_until(lambda: inbox.raw, 10, "the email")
    return inbox.raw[0]


def parts_of(raw: bytes) -> tuple[Any, str, str]:
    msg = message_from_bytes(raw, policy=default_policy)
    plain = msg.get_body(preferencelist=("plain",))
    htm = msg.get_body(preferencelist=("html",))
    assert plain is not None and htm is not None, msg.get_content_type()
    return msg, plain.get_content(), htm.get_content()


def _lines(text: str) -> list[str]:
    return [ln.rstrip() for ln in text.replace("\r\n", "\n").split("\n") if ln.strip()]


@pytest.mark.parametrize("which", ["verdict", "alert"])
def test_email_is_multipart_with_line_breaks_and_escaped_html(raw_smtp: tuple[int, RawInbox], which: str) -> None:
    port, inbox = raw_smtp
    if which == "verdict":
        title, body = render_verdict(VERDICT)
    else:
        title, body = alert_text("exp1", [0], "nonfinite", "critical", 7, "non-finite loss=nan at step 7",
                                 {"loss": float("nan"), "grad_norm": float("nan")}, NONFINITE_FIX,
                                 run_dir="/runs/exp1 <copy>")
    msg, plain, htm = parts_of(send_email(port, inbox, title, body))
    assert msg.get_content_type() == "multipart/alternative"
    assert msg["subject"] == title
    # text/plain: every line of the body on a line of its own, '<...>' kept
    want = _lines(body)
    assert _lines(plain)[:len(want)] == want
    assert "<" in body and all(ln in plain.splitlines() for ln in want)
    # text/html: one pre-formatted block, escaped; unescaped it is the body, line for line
    pre = re.search(r"<pre[^>]*>(.*?)</pre>", htm, re.S)
    assert pre is not None, htm
    assert "<lambda>" not in htm and "<copy>" not in htm and "<run>" not in htm
    assert _lines(html.unescape(pre.group(1)))[:len(want)] == want
    assert "sentineld notification id: n-test-1" in plain


def test_verdict_body_keeps_commands_whole_and_names_the_nonfinite_kinds() -> None:
    title, body = render_verdict(VERDICT)
    assert title == "[sentineld] replay of run exp1: step 7 went non-finite in forward, module norm"
    lines = body.splitlines()
    assert "op inputs: float32[4] finite range [2.343, 2.916], NaN 0, +Inf 0, -Inf 1" in lines
    assert "op output: float32[4] no finite value, NaN 4, +Inf 0, -Inf 0" in lines
    assert "replay it: sentineld replay /runs/exp1 --step 7" in lines


def test_slack_gets_markdown_that_apprise_turns_into_a_mrkdwn_code_block() -> None:
    import apprise
    from apprise.plugins.slack import NotifySlack

    a = apprise.Apprise()
    assert a.add("slack://T1JJ3T3L2/A1BRTD4JD/TIiajkdnlazkcOXrIdevi7FQ/#oncall")
    fmt = destination_format(a)
    assert fmt == apprise.NotifyFormat.MARKDOWN
    _title, body = render_verdict(VERDICT)
    # apprise's own CommonMark -> Slack mrkdwn translation (no Slack to post to from here)
    mrkdwn = NotifySlack._commonmark_to_slack(format_body(body, fmt.value))
    assert mrkdwn.startswith("```\n") and mrkdwn.rstrip().endswith("```")
    inner = html.unescape(mrkdwn.strip().strip("`").strip("\n"))
    assert inner.splitlines() == body.rstrip("\n").splitlines()
    assert "&lt;lambda&gt;" in mrkdwn


def test_email_with_format_text_gets_plain_text_only(raw_smtp: tuple[int, RawInbox]) -> None:
    import apprise

    port, inbox = raw_smtp
    a = apprise.Apprise()
    assert a.add(f"mailto://127.0.0.1:{port}?from=s@localhost&to=o@localhost&format=text")
    assert destination_format(a) == apprise.NotifyFormat.TEXT
    note = Notification(id="n-text", kind="alert", title="t", body="a <b>\n  c\n", run="exp1")
    ok, err = _apprise_send(f"mailto://127.0.0.1:{port}?from=s@localhost&to=o@localhost&format=text", note, 10.0)
    assert ok, err
    wait_until(lambda: inbox.raw, 10, "the email")
    msg = message_from_bytes(inbox.raw[0], policy=default_policy)
    assert msg.get_content_type() == "text/plain"
    assert msg.get_content().splitlines()[:2] == ["a <b>", "  c"]
    assert format_body("a <b>\n", "text") == "a <b>\n"
    with pytest.raises(ValueError, match="unknown output format"):
        format_body("x", "rtf")


def save_artifacts(raw: bytes, out: Path) -> Path:
    """Keep one received email (raw MIME and its HTML part) for a person to look at."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "verdict-email.eml").write_bytes(raw)
    _msg, _plain, htm = parts_of(raw)
    page = out / "verdict-email.html"
    page.write_text(htm)
    return page
