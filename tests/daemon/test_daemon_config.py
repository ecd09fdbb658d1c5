"""The daemon's ``host`` setting (its name in Alertmanager alerts, issue 16: one alert per host)."""

from __future__ import annotations

import socket

import pytest

from sentineld.daemon.daemon_config import ConfigError, load_config


def test_host_defaults_to_the_host_name_and_comes_from_the_config_file(tmp_path, monkeypatch):
    monkeypatch.delenv("SENTINELD_CONFIG", raising=False)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'runs_dir = "{tmp_path}"\n')
    assert load_config(cfg).host == socket.gethostname()
    cfg.write_text('host = "node-b"\n')
    assert load_config(cfg).host == "node-b"


@pytest.mark.parametrize("text, why", [('host = ""', "host must be a host name"),
                                       ('host = "   "', "host must be a host name"),
                                       ("host = 3", "host must be a string")])
def test_a_bad_host_is_a_config_error_naming_it(tmp_path, text, why):
    cfg = tmp_path / "c.toml"
    cfg.write_text(text + "\n")
    with pytest.raises(ConfigError, match=why) as e:
        load_config(cfg)
    assert str(cfg) in str(e.value)
