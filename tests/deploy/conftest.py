"""Fixtures that start the real Prometheus, Alertmanager and small HTTP sinks on loopback
(helpers in helpers.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import pytest

from .helpers import HttpSink, Server, require_binary, start_server


@pytest.fixture(scope="module")
def start_prometheus(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[Path], Server]:
    """Start ``prometheus`` with a config file; returns the running :class:`Server`.

    Module-scoped so module-scoped fixtures can use it; every server is stopped at the end of
    the module at the latest (fixtures that want it sooner call ``Server.stop``).
    """
    binary = require_binary("prometheus")

    def start(config: Path) -> Server:
        tmp = tmp_path_factory.mktemp("prometheus")

        def cmd(port: int) -> list[str]:
            return [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                f"--web.external-url=http://127.0.0.1:{port}/",
                "--web.enable-lifecycle",
                "--log.level=warn",
            ]

        return start_server(request, cmd, "/-/ready", tmp / "prometheus.log")

    return start


@pytest.fixture(scope="module")
def start_alertmanager(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[Path], Server]:
    """Start ``prometheus-alertmanager`` (no cluster gossip) with a config file (see above)."""
    binary = require_binary("prometheus-alertmanager")

    def start(config: Path) -> Server:
        tmp = tmp_path_factory.mktemp("alertmanager")

        def cmd(port: int) -> list[str]:
            return [
                binary,
                f"--config.file={config}",
                f"--storage.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--cluster.listen-address=",
                "--log.level=warn",
            ]

        return start_server(request, cmd, "/-/ready", tmp / "alertmanager.log")

    return start


@pytest.fixture
def http_sink() -> Iterator[HttpSink]:
    sink = HttpSink()
    yield sink
    sink.close()


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """urllib honours *_proxy variables; loopback requests must not go through a proxy."""
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
