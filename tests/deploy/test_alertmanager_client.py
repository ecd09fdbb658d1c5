"""sentineld/daemon/alertmanager.py: pure parts as truth tables, transport against a real Alertmanager
whose webhook receiver points at an HTTP server in the test."""

from __future__ import annotations

import json
import time
import urllib.parse
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from sentineld.daemon.alertmanager import (
    AlertmanagerError,
    alert_labels,
    alertname_for,
    post_alerts,
    to_am_alert,
)
from sentineld.daemon.am_active import ActiveAlerts, flush

from .helpers import HttpSink, Server, free_port, http_json, wait_for

T0 = 1_790_000_000.0  # 2026-09-21T...Z, a fixed Unix time for the pure tests


def alert(run: str = "r7", host: str = "gpu-node-3", **kw: Any) -> dict[str, Any]:
    fields: dict[str, Any] = dict(
        signature="nonfinite_loss",
        run=run,
        severity="critical",
        summary=f"run {run}: loss is nan at step 48112",
        description="first non-finite loss; capture written",
        step=48112,
        ranks=[3, 0, 3],
        host=host,
        starts_at=T0,
    )
    fields.update(kw)
    return to_am_alert(**fields)


# --- pure ---------------------------------------------------------------------------------------


def test_to_am_alert_shape() -> None:
    a = alert()
    assert a["labels"] == {
        "alertname": "SentineldNonfiniteLoss",
        "run": "r7",
        "severity": "critical",
        "signature": "nonfinite_loss",
        "host": "gpu-node-3",
    }
    assert a["annotations"] == {
        "summary": "run r7: loss is nan at step 48112",
        "description": "first non-finite loss; capture written",
        "host": "gpu-node-3",
        "step": "48112",
        "rank": "0,3",
    }
    assert a["startsAt"] == "2026-09-21T14:13:20.000Z"
    assert "endsAt" not in a and "generatorURL" not in a
    json.dumps(a)  # JSON-ready


def test_each_host_is_its_own_alert() -> None:
    """Two hosts' daemons of one run post two alerts (each names its own ranks; with one
    identity Alertmanager kept the last poster's ranks only, issue 16); one host's later
    steps update its own alert."""
    assert alert(host="a", step=10)["labels"] != alert(host="b", step=10)["labels"]
    assert alert(host="a", step=10)["labels"] == alert(host="a", step=11, ranks=[1])["labels"]
    assert alert()["labels"] == alert_labels("nonfinite_loss", "r7", "critical", host="gpu-node-3")
    assert "host" not in alert(host="")["labels"]
    with pytest.raises(ValueError, match="host"):
        alert_labels("nonfinite_loss", "r7", "critical", host="")


def test_module_is_part_of_the_identity() -> None:
    a = alert(signature="dead_relu", severity="warning", module="net.0")
    assert a["labels"]["module"] == "net.0"
    assert a["labels"] != alert(signature="dead_relu", severity="warning", module="net.2")["labels"]


def test_to_am_alert_times_and_optionals() -> None:
    starts = datetime(2026, 11, 30, 15, 12, 0, 123456, tzinfo=timezone(timedelta(hours=1)))
    a = alert(starts_at=starts, ends_at=T0 + 0.5, step=None, ranks=[], host="",
              generator_url="http://h:9490/")
    assert a["startsAt"] == "2026-11-30T14:12:00.123Z"
    assert a["endsAt"] == "2026-09-21T14:13:20.500Z"
    assert set(a["annotations"]) == {"summary", "description"}
    assert a["generatorURL"] == "http://h:9490/"


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"run": ""}, "run"),
        ({"signature": ""}, "signature"),
        ({"severity": "page"}, "severity"),
        ({"host": None}, "host"),
        ({"module": ""}, "module"),
        ({"step": -1}, "step"),
        ({"starts_at": datetime(2026, 1, 1)}, "starts_at"),
        ({"starts_at": float("nan")}, "starts_at"),
        ({"ends_at": "soon"}, "ends_at"),
    ],
)
def test_to_am_alert_rejects(bad: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        alert(**bad)


@pytest.mark.parametrize(
    "signature, name",
    [("nonfinite_loss", "SentineldNonfiniteLoss"), ("dead-relu", "SentineldDeadRelu"), ("x", "SentineldX")],
)
def test_alertname_for(signature: str, name: str) -> None:
    assert alertname_for(signature) == name


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def test_active_alerts_resend_and_resolve() -> None:
    clock = Clock()
    active = ActiveAlerts(resend_s=60.0, clock=clock)
    a = alert()
    active.fire(a)
    due = active.due()
    assert [d["labels"] for d in due] == [a["labels"]]
    assert due[0]["endsAt"] == "2026-09-21T14:17:20.000Z"  # now + 4 * 60 s
    active.mark_sent(due)
    assert active.due() == []

    clock.now += 59.0
    active.fire(a)  # same alert again: nothing new
    assert active.due() == []
    clock.now += 1.0
    assert len(active.due()) == 1  # re-send after resend_s
    active.mark_sent(active.due())

    clock.now += 5.0
    changed = alert(summary="run r7: loss is inf at step 48113")
    active.fire(changed)  # annotations changed: due at once, startsAt kept
    (d,) = active.due()
    assert d["annotations"]["summary"].endswith("48113") and d["startsAt"] == a["startsAt"]
    active.mark_sent([d])

    clock.now += 1.0
    assert active.resolve(a["labels"]) is True
    assert len(active) == 0
    (r,) = active.due()
    assert r["endsAt"] == "2026-09-21T14:14:26.000Z"  # now
    assert active.due() == [r]  # kept until a post succeeded
    active.mark_sent([r])
    assert active.due() == []
    assert active.resolve(a["labels"]) is False


def test_active_alerts_failed_post_is_retried() -> None:
    active = ActiveAlerts(clock=Clock())
    active.fire(alert())

    def refuse(url: str, alerts: Any, timeout_s: float) -> None:
        raise AlertmanagerError("down")

    with pytest.raises(AlertmanagerError):
        flush(active, "http://127.0.0.1:9", post=refuse)
    assert len(active.due()) == 1


def test_active_alerts_refire_before_resolution_was_sent() -> None:
    active = ActiveAlerts(clock=Clock())
    a = alert()
    active.fire(a)
    active.mark_sent(active.due())
    active.resolve(a["labels"])
    active.fire(a)  # back before the resolution went out: stays one firing alert
    (d,) = active.due()
    assert d["endsAt"] > d["startsAt"] and len(active) == 1


@pytest.mark.parametrize("resend_s", [0, -1.0, 180.5])
def test_active_alerts_validates(resend_s: float) -> None:
    with pytest.raises(ValueError, match="resend_s"):
        ActiveAlerts(resend_s)


def test_post_alerts_validates_arguments() -> None:
    with pytest.raises(ValueError, match="base_url"):
        post_alerts("127.0.0.1:9093", [alert()])
    with pytest.raises(ValueError, match="timeout_s"):
        post_alerts("http://127.0.0.1:9093", [alert()], timeout_s=0)


def test_post_alerts_connection_refused() -> None:
    port = free_port()  # nothing listens there
    with pytest.raises(AlertmanagerError, match=f"cannot reach Alertmanager at http://127.0.0.1:{port}") as e:
        post_alerts(f"http://127.0.0.1:{port}", [alert()], timeout_s=2.0)
    assert e.value.status is None


# --- against a real Alertmanager ------------------------------------------------------------------


WEBHOOK_CONFIG = """\
route:
  receiver: sink
  group_by: [alertname, run]
  group_wait: 1s
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: sink
    webhook_configs:
      - url: "{url}/hook"
        send_resolved: true
"""


@pytest.fixture
def alertmanager(
    tmp_path: Path, http_sink: HttpSink, start_alertmanager: Callable[[Path], Server]
) -> Iterator[Server]:
    config = tmp_path / "alertmanager.yml"
    config.write_text(WEBHOOK_CONFIG.format(url=http_sink.url))
    server = start_alertmanager(config)
    yield server
    server.stop()


def am_alerts(am: Server, **filters: str) -> list[dict[str, Any]]:
    query = urllib.parse.urlencode([("filter", f'{k}="{v}"') for k, v in filters.items()])
    return http_json(f"{am.url}/api/v2/alerts?{query}")


def test_post_fire_and_resolve_through_real_alertmanager(alertmanager: Server, http_sink: HttpSink) -> None:
    active = ActiveAlerts(resend_s=60.0)
    a = alert(run="r7", starts_at=time.time())
    active.fire(a)
    # The daemon of a second host of the same job saw it on its own ranks: its own alert.
    b = alert(run="r7", host="gpu-node-4", ranks=[5], starts_at=time.time())
    active.fire(b)
    assert flush(active, alertmanager.url) == 2
    active.fire(alert(run="r8", starts_at=time.time(), severity="warning"))
    assert flush(active, alertmanager.url) == 1  # only the new one is due

    got = wait_for(lambda: len(am_alerts(alertmanager, run="r7")) == 2 and am_alerts(alertmanager, run="r7"),
                   10, "r7's two alerts in /api/v2/alerts")
    assert {(x["labels"]["host"], x["annotations"]["rank"]) for x in got} == {("gpu-node-3", "0,3"),
                                                                              ("gpu-node-4", "5")}
    assert all(x["status"]["state"] == "active" for x in got)

    hook = http_sink.wait(
        lambda b: b["json"]["status"] == "firing" and b["json"]["groupLabels"].get("run") == "r7", 15
    )
    assert hook["path"] == "/hook"
    assert sorted(f["annotations"]["rank"] for f in hook["json"]["alerts"]) == ["0,3", "5"]

    assert active.resolve(a["labels"]) and active.resolve(b["labels"])
    assert flush(active, alertmanager.url) == 2
    resolved = http_sink.wait(
        lambda b: b["json"]["status"] == "resolved" and b["json"]["groupLabels"].get("run") == "r7", 15
    )
    gone = resolved["json"]["alerts"]
    assert len(gone) == 2 and all(g["status"] == "resolved" and g["endsAt"] != "0001-01-01T00:00:00Z" for g in gone)
    # Resolved alerts leave the active list; r8 is still there.
    wait_for(lambda: am_alerts(alertmanager, run="r7") == [], 10, "r7 to leave /api/v2/alerts")
    assert [x["labels"]["run"] for x in am_alerts(alertmanager, alertname="SentineldNonfiniteLoss")] == ["r8"]


def test_post_alerts_rejected_by_real_alertmanager(alertmanager: Server) -> None:
    with pytest.raises(AlertmanagerError) as e:
        post_alerts(alertmanager.url, [{"labels": {}, "annotations": {}}])
    assert e.value.status in (400, 422)
    assert str(e.value.status) in str(e.value)


def test_hold_s_sets_ends_at_and_is_checked() -> None:
    """The daemon holds its alerts for DAEMON_HOLD_S: a stopped daemon resolves nothing for hours
    (issue 16: they resolved 4 minutes after it stopped)."""
    from sentineld.daemon.alertmanager import DAEMON_HOLD_S

    now = [T0]
    active = ActiveAlerts(resend_s=60.0, clock=lambda: now[0], hold_s=DAEMON_HOLD_S)
    active.fire(alert())
    (due,) = active.due()
    ends = datetime.fromisoformat(due["endsAt"].replace("Z", "+00:00")).timestamp()
    assert ends - T0 == pytest.approx(DAEMON_HOLD_S) and DAEMON_HOLD_S >= 12 * 3600
    assert ActiveAlerts(resend_s=60.0).hold_s == 240.0  # default: Prometheus's 4 x resend
    with pytest.raises(ValueError, match="hold_s"):
        ActiveAlerts(resend_s=60.0, hold_s=90.0)
