"""deploy/alertmanager: amtool accepts it, routes by severity, and a real Alertmanager running the
shipped routes, inhibition and templates delivers to Slack (an HTTP sink) and email (aiosmtpd).

Only the endpoints (Slack URL, SMTP host, secrets files) and the wait times are swapped for the
real-server test; routes, receivers, inhibit rules and templates are the shipped ones.
"""

from __future__ import annotations

import subprocess
import time
import urllib.parse
from email import message_from_bytes
from email.message import Message
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import yaml

from .helpers import DEPLOY, HttpSink, Server, free_port, http_json, require_binary, wait_for
from sentineld.daemon.alertmanager import post_alerts, to_am_alert

AM_DIR = DEPLOY / "alertmanager"
CONFIG = AM_DIR / "alertmanager.yml"


def amtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require_binary("amtool"), *args], cwd=AM_DIR, capture_output=True, text=True, timeout=60
    )


def test_amtool_check_config() -> None:
    result = amtool("check-config", "alertmanager.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 templates" in result.stdout  # the template file was found and parsed


@pytest.mark.parametrize(
    "labels, receiver",
    [
        (["severity=critical", "alertname=SentineldLossNonFinite", "run=r1"], "ml-oncall"),
        (["severity=warning", "alertname=SentineldDeadReLU", "run=r1"], "ml-team-slack"),
        (["severity=info", "alertname=Other"], "ml-team-email"),
    ],
)
def test_routes(labels: list[str], receiver: str) -> None:
    result = amtool("config", "routes", "test", "--config.file=alertmanager.yml", *labels)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [receiver]


def test_grouping_and_inhibition_settings() -> None:
    doc = yaml.safe_load(CONFIG.read_text())
    assert doc["route"]["group_by"] == ["run"]  # one group per run: incident, verdict, crash
    rule, fallback, replicas = doc["inhibit_rules"]
    # ... and its replica_divergence alert mutes the rule that reads it off the daemon's gauge.
    assert replicas["source_matchers"][0] == 'alertname="SentineldReplicaDivergence"'
    assert replicas["target_matchers"] == ['alertname="SentineldReplicasDiverged"'] and replicas["equal"] == ["run"]
    # The daemon's non-finite alert mutes the rules' fallback alerts of the same run.
    assert fallback["source_matchers"][0] == 'alertname="SentineldNonfinite"'
    assert fallback["equal"] == ["run"]
    assert 'severity="critical"' in rule["source_matchers"]
    assert rule["target_matchers"] == ['severity="warning"']
    assert rule["equal"] == ["run"]
    # Receivers that page also resolve; nobody is left guessing.
    for receiver in doc["receivers"]:
        for kind in ("slack_configs", "email_configs"):
            for c in receiver.get(kind, []):
                assert c["send_resolved"] is True, receiver["name"]


# --- the shipped configuration in a real Alertmanager -----------------------------------------


class Mailbox:
    """aiosmtpd on 127.0.0.1 that keeps every message (aiosmtpd's port=0 is broken: #388)."""

    def __init__(self) -> None:
        from aiosmtpd.controller import Controller

        self.messages: list[Message] = []
        mailbox = self

        class Handler:
            async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
                mailbox.messages.append(message_from_bytes(envelope.content))
                return "250 OK"

        self.port = free_port()
        self.controller = Controller(Handler(), hostname="127.0.0.1", port=self.port)
        self.controller.start()

    def close(self) -> None:
        self.controller.stop()


@pytest.fixture
def mailbox() -> Iterator[Mailbox]:
    pytest.importorskip("aiosmtpd")
    box = Mailbox()
    yield box
    box.close()


@pytest.fixture
def alertmanager(
    tmp_path: Path,
    http_sink: HttpSink,
    mailbox: Mailbox,
    start_alertmanager: Callable[[Path], Server],
) -> Iterator[Server]:
    doc = yaml.safe_load(CONFIG.read_text())
    g = doc["global"]
    del g["slack_api_url_file"], g["smtp_auth_username"], g["smtp_auth_password_file"]
    g["slack_api_url"] = http_sink.url + "/slack"
    g["smtp_smarthost"] = f"127.0.0.1:{mailbox.port}"
    g["smtp_require_tls"] = False
    doc["templates"] = [str(AM_DIR / t) for t in doc["templates"]]
    for route in [doc["route"], *doc["route"]["routes"]]:
        route["group_wait"] = "1s"
        route["group_interval"] = "1s"
        for child in route.get("routes", []):
            child["group_wait"] = "1s"
            child["group_interval"] = "1s"
    config = tmp_path / "alertmanager.yml"
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    server = start_alertmanager(config)
    yield server
    server.stop()


def slack_posts(sink: HttpSink) -> list[dict[str, Any]]:
    return [r["json"] for r in sink.received if r["path"] == "/slack"]


def test_shipped_routing_inhibition_and_templates(
    alertmanager: Server, http_sink: HttpSink, mailbox: Mailbox
) -> None:
    now = time.time()
    common = dict(description="d", step=48112, ranks=[0, 3], host="gpu-node-3", starts_at=now)
    alerts = [
        to_am_alert(signature="nonfinite_loss", run="r1", severity="critical",
                    summary="run r1: loss is nan at step 48112", **common),
        # Same run as the critical: inhibited.
        to_am_alert(signature="loss_diverging", run="r1", severity="warning",
                    summary="run r1: loss diverging", **common),
        # Other run: delivered.
        to_am_alert(signature="loss_diverging", run="r2", severity="warning",
                    summary="run r2: loss diverging", **common),
        # A daemon-level critical has no run label and must not mute other hosts' warnings.
        {"labels": {"alertname": "SentineldDaemonDown", "severity": "critical", "host": "h1"},
         "annotations": {"summary": "sentineld daemon on h1 down"}},
        {"labels": {"alertname": "SentineldReplayFailed", "severity": "warning", "host": "h2",
                    "result": "failed"},
         "annotations": {"summary": "sentineld replay failed on h2"}},
    ]
    post_alerts(alertmanager.url, alerts)

    def titles() -> dict[str, dict[str, Any]]:
        return {a["title"]: {"channel": p["channel"], **a}
                for p in slack_posts(http_sink) for a in p["attachments"]}

    expected = {
        "[FIRING:1] SentineldNonfiniteLoss run r1": "#ml-oncall",
        "[FIRING:1] SentineldLossDiverging run r2": "#ml-training",
        "[FIRING:1] SentineldDaemonDown": "#ml-oncall",
        "[FIRING:1] SentineldReplayFailed": "#ml-training",
    }
    got = wait_for(lambda: titles() if set(expected) <= set(titles()) else None, 20,
                   f"Slack posts {sorted(expected)}")
    assert {t: got[t]["channel"] for t in expected} == expected
    text = got["[FIRING:1] SentineldNonfiniteLoss run r1"]["text"]
    assert "*critical* run r1: loss is nan at step 48112" in text
    assert "gpu-node-3" not in text  # the description names host/ranks/step; not repeated

    # Critical alerts also go by email, with the same title as subject.
    mail = wait_for(lambda: [m for m in mailbox.messages
                             if m["Subject"] == "[FIRING:1] SentineldNonfiniteLoss run r1"], 20,
                    "the critical alert's email")[0]
    assert mail["To"] == "ml-oncall@example.org"

    # The r1 warning is suppressed by the r1 critical and never reached Slack.
    query = urllib.parse.urlencode([("filter", 'run="r1"'), ("filter", 'severity="warning"')])
    (warning,) = http_json(f"{alertmanager.url}/api/v2/alerts?{query}")
    assert warning["status"]["state"] == "suppressed"
    assert warning["status"]["inhibitedBy"]
    time.sleep(1.5)  # a group_interval more: still nothing for it
    assert not [t for t in titles() if "SentineldLossDiverging run r1" in t]


def test_readme_creates_the_secret_files_as_the_config_says(tmp_path: Path) -> None:
    """Run the README's secret-file commands (paths moved under tmp_path): 0640, root:prometheus,
    the exact secret, as alertmanager.yml's header says (issue 16: they were 0644)."""
    import grp
    import os
    import re
    import stat

    try:
        group = grp.getgrnam("prometheus")
    except KeyError:
        pytest.skip("no prometheus group (Debian's prometheus package creates it)")
    if os.geteuid() != 0:
        pytest.skip("install -o root needs root")
    readme = (DEPLOY / "README.md").read_text()
    section = readme[readme.index("### Alertmanager"):]
    block = re.search(r"```\n(.*?)```", section, re.S).group(1)
    cmds = [c for c in block.splitlines() if "secrets" in c]
    assert len(cmds) == 3, cmds
    script = "\n".join(cmds).replace("/etc/alertmanager", str(tmp_path))
    env = {**os.environ, "SLACK_WEBHOOK_URL": "https://hooks.example/T0/B0/x", "SMTP_PASSWORD": "p@ss"}
    subprocess.run(["bash", "-euc", script], check=True, env=env, timeout=30)
    header = CONFIG.read_text().split("global:")[0]
    assert "mode 0640, owner root, group prometheus" in header
    for name, value in (("slack_webhook_url", "https://hooks.example/T0/B0/x"), ("smtp_password", "p@ss")):
        st = (tmp_path / "secrets" / name).stat()
        assert stat.S_IMODE(st.st_mode) == 0o640 and st.st_uid == 0 and st.st_gid == group.gr_gid, name
        assert (tmp_path / "secrets" / name).read_text() == value  # no trailing newline
    d = (tmp_path / "secrets").stat()
    assert stat.S_IMODE(d.st_mode) == 0o750 and d.st_gid == group.gr_gid
