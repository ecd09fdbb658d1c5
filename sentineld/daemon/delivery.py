"""Delivering outbox notifications: the notifications log, apprise URLs, with retry and backoff.

apprise 2.x reports a failed delivery by its return value (``bool(result)`` is False), not by
raising (ecosystem-facts section 4), so every destination's result is checked and kept per
destination. A fresh ``Apprise`` object per send: the email plugin throttles sends from one object.

What a crash can do, and what we do about it. Before each send the destination's state becomes
``sending`` in the outbox (fsynced); after it, ``delivered`` or ``pending``. A daemon
that finds ``sending`` after a restart died during that very send and decides per destination:

- the notifications log: it looks for the id in the log and appends only if it is absent, so this
  destination gets every notification exactly once;
- an apprise URL: nothing can ask a mail server or a webhook whether it took a message, so it
  sends again (a lost alert is worse than a repeated one). That copy says so in its body and
  carries the same notification id as the first one: in the body footer, and as the
  ``X-Sentineld-Id`` header (mail header for ``mailto``, HTTP header for ``json``/``form``/``xml``),
  with ``X-Sentineld-Resend: 1``; a receiver can drop the repeat by id. Alertmanager dedups by
  labels on its own.

So the guarantee is: every notification reaches every destination at least once, and exactly once
unless the daemon dies inside the send itself (between the destination accepting the message and
the write of ``delivered``: apprise's own wind-down, e.g. the SMTP QUIT, measured 1-80 ms on a
loaded 2-core machine), in which case that destination gets one marked repeat with the same id.
The ``sending`` mark is fsynced; the ``delivered`` mark is not (it is the end of the window, and a
page-cache write survives a SIGKILL), so after a power loss a delivered message may also come
back as a marked repeat.

Secrets: URLs are shown only as ``scheme://host/…`` with apprise's masking of the netloc
(:func:`redact_url`); :class:`SecretFilter` masks every secret-looking part of the configured URLs
(password, tokens in the path or query) in every log record, including apprise's own, and errors
stored in the outbox are scrubbed the same way.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from sentineld.contracts.render import FORMATS, format_body
from sentineld.contracts.safeio import open_regular
from sentineld.daemon.outbox import DELIVERED, DROPPED, PENDING, SENDING, Notification, Outbox

__all__ = ["redact_url", "valid_url", "deliver_due", "LOG_TARGET", "append_log", "Destination",
           "destinations", "url_secrets", "SecretFilter", "DeliveryResult", "log_has", "destination_format"]

log = logging.getLogger("sentineld.daemon")

#: Target key of the state dir's notifications log (always present).
LOG_TARGET = "log"

#: Schemes whose apprise plugin turns ``+Name=value`` URL arguments into mail or HTTP headers.
_HEADER_SCHEMES = {"mailto", "mailtos", "json", "jsons", "form", "forms", "xml", "xmls"}


@functools.lru_cache(maxsize=128)
def redact_url(url: str) -> str:
    """``url`` reduced to what identifies it without secrets: ``scheme://netloc/…``.

    The netloc is apprise's privacy form (password masked, tokens shortened); the path and query
    are dropped entirely, because plugins such as ``json://`` do not know a token in the path is
    secret. ``<invalid url>`` when apprise rejects it.
    """
    import apprise  # noqa: PLC0415

    a = apprise.Apprise()
    if not a.add(url):
        return "<invalid url>"
    urls = a.urls(privacy=True)
    if not urls:
        return "<invalid url>"
    p = urlsplit(urls[0])
    tail = "/…" if (p.path.strip("/") or p.query) else ""
    return f"{p.scheme}://{p.netloc}{tail}"


def valid_url(url: str) -> bool:
    """True when apprise accepts ``url``."""
    import apprise  # noqa: PLC0415

    return bool(apprise.Apprise().add(url))


_PLAIN_VALUES = {"yes", "no", "true", "false", "on", "off", "insecure", "starttls", "ssl", "post",
                 "get", "put", "upstream", "truncate", "split", "html", "text", "markdown", "localhost"}


def url_secrets(url: str) -> set[str]:
    """Parts of ``url`` that may be secret: password, a user name of 16+ characters (a key in
    some plugins), a token-like host, every path segment and query value of 6+ characters
    (over-masking an e-mail address in a log line is harmless; leaking a webhook token is not).
    Both raw and percent-decoded forms."""
    out: set[str] = set()
    try:
        p = urlsplit(url)
        # A user name is shown (it tells destinations apart) unless it is long enough to be a key.
        cands = [p.password or "", p.username or "" if len(p.username or "") >= 16 else ""]
        host = p.hostname or ""
        if "." not in host and host != "localhost":
            cands.append(host)  # slack://TOKEN_A/..., pover://user@TOKEN: the host is a key
        cands += p.path.split("/")
        cands += [v for _k, v in parse_qsl(p.query, keep_blank_values=True)]
        cands += [k for k, _v in parse_qsl(p.query, keep_blank_values=True) if len(k) >= 16]
    except ValueError:
        cands = [url]
    for c in cands:
        for form in {c, unquote(c)}:
            if len(form) >= 6 and form.lower() not in _PLAIN_VALUES and not (form.isdigit() and len(form) < 8):
                out.add(form)
                out.add(quote(form, safe=""))
    return out


class SecretFilter(logging.Filter):
    """Masks given secrets in every record passing a handler (message, args and traceback).

    Install it on handlers, not loggers: a logger's filters do not see records propagated from
    child loggers such as ``apprise``.
    """

    def __init__(self, secrets: Iterable[str]) -> None:
        super().__init__()
        self.secrets = sorted({s for s in secrets if s}, key=len, reverse=True)

    def scrub(self, text: str) -> str:
        """``text`` with every secret replaced by ``****``."""
        for s in self.secrets:
            if s in text:
                text = text.replace(s, "****")
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.secrets:
            return True
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string: keep the raw message
            msg = str(record.msg)
        record.msg, record.args = self.scrub(msg), ()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self.scrub(record.exc_text)
        if record.stack_info:
            record.stack_info = self.scrub(record.stack_info)
        return True


@dataclass(frozen=True)
class Destination:
    """A configured apprise URL.

    Attributes:
        key: stable id of the URL in outbox records (an HMAC with the state dir's key, so the
            outbox holds no secret and reordering the URL list changes nothing).
        url: the URL itself (kept in memory only).
        shown: :func:`redact_url` form, for logs and status.
    """

    key: str
    url: str
    shown: str


def destinations(urls: Sequence[str], secret: bytes) -> list[Destination]:
    """One :class:`Destination` per URL, keyed with ``secret`` (see :meth:`Daemon` state dir)."""
    return [Destination("u-" + hmac.new(secret, u.encode(), hashlib.sha256).hexdigest()[:16], u,
                        redact_url(u)) for u in urls]


def _with_id(url: str, nid: str, resend: bool) -> str:
    scheme = url.split("://", 1)[0].lower()
    if scheme not in _HEADER_SCHEMES:
        return url
    extra = f"+X-Sentineld-Id={nid}" + ("&+X-Sentineld-Resend=1" if resend else "")
    return url + ("&" if "?" in url else "?") + extra


def _with_timeouts(url: str, timeout_s: float) -> str:
    """``url`` with apprise's socket timeouts (``rto`` read, ``cto`` connect) set to ``timeout_s``
    unless the URL sets them: apprise's own 4 s read timeout otherwise fails a slow receiver that
    then gets the same message again and again."""
    args = {k for k, _v in parse_qsl(urlsplit(url).query, keep_blank_values=True)}
    extra = [f"{k}={timeout_s:g}" for k in ("rto", "cto") if k not in args]
    if not extra or timeout_s <= 0:
        return url
    return url + ("&" if "?" in url else "?") + "&".join(extra)


def _footer(note: Notification, resend: bool) -> str:
    text = f"\n\nsentineld notification id: {note.id}\n"
    if resend:
        text += ("(sent again: an earlier send of this notification was cut short (the daemon "
                 "stopped, or the receiver did not answer in time) and may have arrived; drop it "
                 "if you already have this id)\n")
    return text


def destination_format(a: Any) -> Any:
    """The ``apprise.NotifyFormat`` the (single) destination in ``a`` renders natively: ``html``
    for email (apprise then sends multipart/alternative, its text/plain part derived from our
    HTML), ``markdown`` for Slack and the like, ``text`` otherwise or when the URL says
    ``?format=text``. The body is rendered in that format (:func:`format_body`) and declared as
    such, so apprise converts nothing: without a declared format it took our plain text as HTML
    (the text/plain part lost its line breaks and ``<run>``; the HTML part was unescaped).
    """
    import apprise  # noqa: PLC0415

    plugins = list(a)
    if not plugins:
        return apprise.NotifyFormat.TEXT
    fmt = plugins[0].resolve_format(None)
    return fmt if fmt.value in FORMATS else apprise.NotifyFormat.TEXT


def _apprise_send(url: str, note: Notification, timeout_s: float, resend: bool = False) -> tuple[bool, str]:
    import apprise  # noqa: PLC0415

    a = apprise.Apprise()
    if not a.add(_with_timeouts(_with_id(url, note.id, resend), timeout_s)) and not a.add(url):
        return False, "apprise rejected the URL"
    ntype = {"critical": apprise.NotifyType.FAILURE, "warning": apprise.NotifyType.WARNING}.get(
        note.severity, apprise.NotifyType.INFO)
    fmt = destination_format(a)
    result = a.notify(body=format_body(note.body + _footer(note, resend), fmt.value), title=note.title,
                      notify_type=ntype, body_format=fmt)
    status = getattr(result, "status", "FAILURE")
    return bool(result), "" if result else f"delivery failed ({getattr(status, 'name', status)})"


def append_log(path: Path, note: Notification, now_s: float, resend: bool = False) -> None:
    """Append ``note`` to the notifications log (JSON lines, 0600, fsynced)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)  # never a link
    line = json.dumps({"id": note.id, "time_s": now_s, "kind": note.kind, "severity": note.severity,
                       "run": note.run, "signature": note.signature, "step": note.step,
                       "title": note.title, "body": note.body, "data": note.data}) + "\n"
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def log_has(path: Path, nid: str) -> bool:
    """True when the notifications log holds a complete line for notification ``nid``."""
    needle = json.dumps(nid)
    try:
        with open_regular(path) as f:  # a regular file only: a FIFO there would block delivery
            for raw in f:
                if needle.encode() in raw and raw.endswith(b"\n"):
                    try:
                        if json.loads(raw).get("id") == nid:
                            return True
                    except (ValueError, RecursionError):
                        continue
    except OSError:
        return False
    return False


@dataclass
class DeliveryResult:
    """What one :func:`deliver_due` pass did: notifications completed, failed attempts, and
    in-doubt sends repeated after a crash or a timed-out send."""

    delivered: int = 0
    failed: int = 0
    resent: int = 0
    #: notifications completed per signature (``replay``/``replay_failed`` for verdicts)
    by_signature: dict[str, int] = field(default_factory=dict)


def _send_one(note: Notification, key: str, dest: Destination | None, log_path: Path, *,
              lock: threading.Lock, outbox: Outbox, res: DeliveryResult, clock: Callable[[], float],
              send: Callable[..., tuple[bool, str]], timeout_s: float, scrub: Callable[[str], str]) -> None:
    """One notification to one destination, with the ``sending`` protocol of the module docstring."""
    with lock:
        state = note.targets[key]
        in_doubt = state == SENDING
        if in_doubt and key == LOG_TARGET and log_has(log_path, note.id):
            note.targets[key] = DELIVERED
            outbox.save(note)
            return
        note.targets[key] = SENDING
        if in_doubt and key != LOG_TARGET:
            note.resent[key] = note.resent.get(key, 0) + 1
            res.resent += 1
            log.warning("resending %s to %s: an earlier send may have arrived (the daemon stopped "
                        "during it, or it timed out); the copy is marked as a possible repeat",
                        note.id, dest.shown if dest else key)
        outbox.save(note)  # fsynced before the send starts
    doubt_after = False
    if key == LOG_TARGET:
        try:
            append_log(log_path, note, clock())
            ok, err = True, ""
        except OSError as exc:
            ok, err = False, f"notifications log: {exc}"
    else:
        assert dest is not None
        t0 = time.monotonic()
        try:
            ok, err = send(dest.url, note, timeout_s, in_doubt)
        except Exception as exc:  # noqa: BLE001 - a plugin bug must not kill the daemon
            ok, err = False, f"{type(exc).__name__}: {exc}"
        # A send that failed only after waiting out the read timeout reached the receiver, which
        # may have taken it: the retry is a possible repeat and is marked as one.
        doubt_after = not ok and time.monotonic() - t0 >= 0.9 * timeout_s
        err = scrub(err)
        if not ok:
            log.warning("delivery of %s to %s failed (will retry): %s", note.id, dest.shown, err)
    with lock:
        # An in-doubt failure stays ``sending``: the next attempt is then marked as a repeat.
        note.targets[key] = DELIVERED if ok else (SENDING if doubt_after else PENDING)
        if not ok:
            note.last_error = err
            res.failed += 1
        # Not fsynced: this write ends the in-doubt window, so it must be quick; it survives
        # a SIGKILL as is, and after a power loss the fsynced ``sending`` mark is what is
        # found, which gives a marked repeat, never a loss.
        outbox.save(note, durable=False)


def deliver_due(outbox: Outbox, dests: Sequence[Destination], log_path: Path, *, initial_s: float,
                max_s: float, clock: Callable[[], float] = time.time,
                send: Callable[..., tuple[bool, str]] = _apprise_send,
                timeout_s: float = 30.0, scrub: Callable[[str], str] = lambda s: s,
                stop: Callable[[], bool] = lambda: False) -> DeliveryResult:
    """Try every due notification once (see the module docstring for the crash protocol).

    Each destination is served by its own thread, in notification order: a slow or hanging
    destination (bounded by ``timeout_s`` per send) delays no other. A failing destination gets
    ``next_attempt_s`` = now + backoff (``initial_s`` doubling per attempt up to ``max_s``); the
    others are not sent again.
    """
    res = DeliveryResult()
    by_key = {d.key: d for d in dests}
    lock = threading.Lock()
    notes = outbox.due(clock())
    queues: dict[str, list[Notification]] = {}
    for note in notes:
        for key, state in sorted(note.targets.items()):
            if state in (DELIVERED, DROPPED):
                continue
            if key != LOG_TARGET and key not in by_key:
                note.targets[key] = DROPPED  # destination removed from the config since
                outbox.save(note)
                continue
            queues.setdefault(key, []).append(note)

    def serve(key: str) -> None:
        for note in queues[key]:
            if stop():
                return
            _send_one(note, key, by_key.get(key), log_path, lock=lock, outbox=outbox, res=res, clock=clock,
                      send=send, timeout_s=timeout_s, scrub=scrub)

    threads = [threading.Thread(target=serve, args=(k,), name=f"sentineld-send-{k}", daemon=True) for k in queues]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for note in notes:
        if note.pending:
            note.attempts += 1
            note.next_attempt_s = clock() + min(max_s, initial_s * 2 ** (note.attempts - 1))
            outbox.save(note)
        else:
            note.delivered_s = clock()
            outbox.finish(note)
            res.delivered += 1
            sig = note.signature or note.kind
            res.by_signature[sig] = res.by_signature.get(sig, 0) + 1
    return res
