"""Forward daemon alerts to Prometheus Alertmanager's v2 API.

Alertmanager identifies an alert by its label set and keeps the last annotations it received
(prometheus.io/docs/alerting/latest/clients). The labels here are ``alertname``, ``run``,
``severity``, ``signature`` and the daemon's ``host``; when and which ranks (``step``, ``rank``)
go into annotations. Each host's daemon sees only its own ranks, so the daemons of a multi-node
job post one alert per host (with host-free labels the last poster's ranks replaced the
others', issue 16); ``group_by: [run]`` (deploy/alertmanager) makes them one notification that
names every host and rank (deploy/alertmanager/templates).

An alert without ``endsAt`` resolves itself ``resolve_timeout`` (default 5 min) after it was last
received, and the client docs ask for re-sends every 30 s to 3 min. :class:`ActiveAlerts` does what
Prometheus's own rule manager does (:mod:`sentineld.daemon.am_active`): re-send every ``resend_s`` (60 s) with
``endsAt = now + 4 * resend_s``, so an alert whose daemon died resolves by itself within minutes,
and resolve by sending ``endsAt = now``.

Example::

    active = ActiveAlerts(resend_s=60.0)
    active.fire(to_am_alert(signature="nonfinite_loss", run="r7", severity="critical",
                            summary="loss is nan at step 48112", description="...",
                            step=48112, ranks=[0, 3], host="gpu-node-3",
                            starts_at=time.time()))
    flush(active, "http://127.0.0.1:9093")        # call again every few seconds
    active.resolve(alert_labels("nonfinite_loss", "r7", "critical", host="gpu-node-3"))
    flush(active, "http://127.0.0.1:9093")

Transport is :func:`post_alerts` (stdlib ``urllib``, no extra dependency); the rest is pure.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime, timezone
from typing import Any, Iterable, Mapping, Sequence

__all__ = [
    "AlertmanagerError",
    "alertname_for",
    "alert_labels",
    "to_am_alert",
    "post_alerts",
    "rfc3339",
    "SEVERITIES",
    "MAX_RESEND_S",
    "DAEMON_HOLD_S",
]

#: Severity label values; deploy/alertmanager routes "critical" and "warning".
SEVERITIES = ("critical", "warning", "info")

#: Longest allowed re-send period in seconds: Alertmanager's client docs ask for re-sends every
#: 30 s to 3 min (prometheus.io/docs/alerting/latest/clients).
MAX_RESEND_S = 180.0

#: How long Alertmanager keeps a daemon alert after the daemon's last re-send (seconds). The
#: daemon owns the lifetime of its alerts: they resolve when the run recovers, not when the daemon
#: stops (a restart restores and re-sends them); a daemon that stays down is paged as
#: SentineldDaemonDown long before this runs out.
DAEMON_HOLD_S = 24 * 3600.0

Alert = dict[str, Any]
Labels = Mapping[str, str]


class AlertmanagerError(Exception):
    """Alertmanager could not be reached or rejected the alerts.

    Attributes:
        status: HTTP status code, or None when no response came back (connection refused,
            timeout, DNS).
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def alertname_for(signature: str) -> str:
    """Alert name for a signature: ``"nonfinite_loss"`` -> ``"SentineldNonfiniteLoss"``.

    Args:
        signature: signature name (snake_case, as the signatures module names them).

    Returns:
        CamelCase name with the ``Sentineld`` prefix, like the Prometheus rules' names.
    """
    parts = [p for p in signature.replace("-", "_").split("_") if p]
    return "Sentineld" + "".join(p[:1].upper() + p[1:] for p in parts)


def alert_labels(signature: str, run: str, severity: str, module: str | None = None,
                 host: str | None = None) -> dict[str, str]:
    """The identity of a daemon alert in Alertmanager.

    Args:
        signature: signature id (``sentineld.signatures.SIGNATURES``).
        run: run id.
        severity: one of :data:`SEVERITIES`.
        module: qualified module name for per-layer signatures (bounded: one per module), or None.
        host: the posting daemon's host (one alert per host of a multi-node run), or None.

    Returns:
        ``{"alertname", "run", "severity", "signature"[, "module"][, "host"]}``; pass it to
        :meth:`ActiveAlerts.resolve`.

    Raises:
        ValueError: an empty field or an unknown severity (the message names it).
    """
    _nonempty(signature, "signature")
    _nonempty(run, "run")
    if severity not in SEVERITIES:
        raise ValueError(f"severity must be one of {SEVERITIES}, got {severity!r}")
    labels = {
        "alertname": alertname_for(signature),
        "run": run,
        "severity": severity,
        "signature": signature,
    }
    if module is not None:
        labels["module"] = _nonempty(module, "module")
    if host is not None:
        labels["host"] = _nonempty(host, "host")
    return labels


def rfc3339(t: float | datetime, name: str) -> str:
    """Format Unix seconds or an aware datetime as RFC 3339 UTC (``2026-11-30T15:12:00.123Z``)."""
    if isinstance(t, datetime):
        if t.tzinfo is None:
            raise ValueError(f"{name} must be timezone-aware, got naive datetime {t!r}")
        dt = t.astimezone(timezone.utc)
    elif isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t):
        dt = datetime.fromtimestamp(float(t), tz=timezone.utc)
    else:
        raise ValueError(f"{name} must be Unix seconds or an aware datetime, got {t!r}")
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond // 1000:03d}Z"


def _nonempty(value: str, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    return value


def to_am_alert(
    *,
    signature: str,
    run: str,
    severity: str,
    summary: str,
    description: str,
    step: int | None,
    ranks: Iterable[int],
    host: str,
    starts_at: float | datetime,
    ends_at: float | datetime | None = None,
    module: str | None = None,
    generator_url: str | None = None,
    extra_annotations: Mapping[str, str] | None = None,
) -> Alert:
    """Build one Alertmanager v2 alert (a JSON-ready dict) from a daemon alert's fields.

    Args:
        signature: signature that fired, e.g. ``"nonfinite_loss"``; also gives ``alertname``
            (see :func:`alertname_for`).
        run: run id.
        severity: one of :data:`SEVERITIES`.
        summary: one line for the notification title.
        description: the longer text.
        step: optimizer step the signature fired at, or None (annotation omitted).
        ranks: ranks that saw it (the ``rank`` annotation, ``"0,3"``; omitted when empty).
        host: host name of the daemon that saw it: label and annotation (see the module doc);
            omitted when empty.
        starts_at: when it started, Unix seconds or an aware datetime.
        ends_at: when it ends, same types; None leaves it to Alertmanager (receipt +
            ``resolve_timeout``). Set it to now to resolve.
        module: qualified module name for per-layer signatures; becomes a label, so two
            modules firing the same signature are two alerts.
        generator_url: link back to the source (e.g. the daemon's status page); omitted if None.
        extra_annotations: more annotations (e.g. ``replay``: what the replay found or why it
            did not run); empty values are left out.

    Returns:
        ``{"labels": {alertname, run, severity, signature, [module], [host]}, "annotations": {summary,
        description, [host], [step], [rank]}, "startsAt": ..., ["endsAt": ...],
        ["generatorURL": ...]}`` with RFC 3339 UTC times (millisecond precision).

    Raises:
        ValueError: an empty string field, an unknown severity, a naive datetime or a
            non-finite time; the message names the argument.
    """
    if not isinstance(host, str):
        raise ValueError(f"host must be a string, got {host!r}")
    labels = alert_labels(signature, run, severity, module, host or None)
    _nonempty(summary, "summary")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"step must be a non-negative int or None, got {step!r}")
    rank_list = sorted({int(r) for r in ranks})
    alert: Alert = {
        "labels": labels,
        "annotations": {"summary": summary, "description": description},
        "startsAt": rfc3339(starts_at, "starts_at"),
    }
    if host:
        alert["annotations"]["host"] = host
    if step is not None:
        alert["annotations"]["step"] = str(step)
    if rank_list:
        alert["annotations"]["rank"] = ",".join(str(r) for r in rank_list)
    for k, v in (extra_annotations or {}).items():
        if v:
            alert["annotations"][_nonempty(k, "annotation name")] = str(v)
    if ends_at is not None:
        alert["endsAt"] = rfc3339(ends_at, "ends_at")
    if generator_url is not None:
        alert["generatorURL"] = _nonempty(generator_url, "generator_url")
    return alert


def post_alerts(base_url: str, alerts: Sequence[Alert], timeout_s: float = 5.0) -> None:
    """POST alerts to ``<base_url>/api/v2/alerts``.

    Args:
        base_url: Alertmanager's URL, e.g. ``"http://127.0.0.1:9093"`` (a path prefix such as
            ``/alertmanager`` is kept).
        alerts: alerts as built by :func:`to_am_alert`; an empty sequence sends nothing.
        timeout_s: connect and read timeout in seconds.

    Raises:
        ValueError: ``base_url`` is not http(s) or ``timeout_s`` is not positive.
        AlertmanagerError: no connection, a timeout, or a non-2xx answer (status and the start
            of the body in the message; 400/422 mean a malformed alert, which a retry will not
            fix).
    """
    parts = urllib.parse.urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
    if not alerts:
        return
    url = base_url.rstrip("/") + "/api/v2/alerts"
    body = json.dumps(list(alerts)).encode("utf-8")
    request = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            response.read()
    except urllib.error.HTTPError as e:
        detail = e.read(500).decode("utf-8", "replace").strip()
        raise AlertmanagerError(
            f"Alertmanager at {url} answered {e.code} {e.reason}: {detail}", status=e.code
        ) from e
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise AlertmanagerError(f"cannot reach Alertmanager at {url}: {reason}") from e
