"""The daemon forwards its alerts to a real Alertmanager (v2 API), which routes them to a webhook."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from tests.conftest import REPO

from .helpers import HttpSink, Server, wait_for
from .test_alertmanager_client import WEBHOOK_CONFIG, am_alerts

TRAIN = REPO / "tests" / "e2e" / "train_digits.py"


@pytest.mark.slow
def test_daemon_alert_reaches_alertmanager_and_its_webhook(
    tmp_path: Path, http_sink: HttpSink, start_alertmanager: Callable[[Path], Server], daemon_factory
) -> None:
    config = tmp_path / "alertmanager.yml"
    config.write_text(WEBHOOK_CONFIG.format(url=http_sink.url))
    am = start_alertmanager(config)
    daemon = daemon_factory(extra=["--alertmanager-url", am.url, "--no-replay"])
    subprocess.run([sys.executable, str(TRAIN), str(daemon.runs_dir), "am-run", "zero-std", "20"],
                   cwd=REPO, check=True, timeout=120)
    alerts = wait_for(lambda: am_alerts(am, run="am-run"), 30, "the alert in Alertmanager")
    labels = alerts[0]["labels"]
    assert labels["run"] == "am-run" and labels["severity"] == "critical"
    assert labels["host"] == socket.gethostname()  # one alert per host of a multi-node run
    assert alerts[0]["annotations"]["step"] == "0"
    hook = http_sink.wait(lambda item: any(a["labels"].get("run") == "am-run"
                                           for a in item["json"].get("alerts", [])), 30)
    assert hook["json"]["status"] == "firing"
