"""Daemon settings: defaults < config file (TOML) < environment < command-line flags.

Config file: ``--config FILE``, else ``$SENTINELD_CONFIG``, else ``<user config dir>/sentineld/
config.toml`` when it exists (platformdirs: ``~/.config/sentineld/config.toml`` on Linux). Keys are
the field names of :class:`DaemonConfig`; an unknown key is an error. Example::

    runs_dir = "/data/runs"
    notify = ["mailto://127.0.0.1:2525?from=sentineld@host&to=oncall@example.com"]
    replay_timeout_s = 300
    [signatures]
    divergence_spike = { ratio = 4.0 }

Environment: ``SENTINELD_RUNS_DIR``, ``SENTINELD_STATE_DIR``, ``SENTINELD_NOTIFY`` (URLs separated
by whitespace or commas), ``SENTINELD_ALERTMANAGER_URL``.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from sentineld.contracts.errors import BadInput
from sentineld.contracts.rundir import default_runs_dir
from sentineld.contracts.safeio import read_regular
from sentineld.contracts.trust import untrusted_reason

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = ["ConfigError", "DaemonConfig", "load_config", "default_state_dir"]


class ConfigError(BadInput):
    """The config file or a setting is invalid (the message names the file and key)."""


def default_state_dir() -> Path:
    """``$SENTINELD_STATE_DIR``, else the user state dir (``~/.local/state/sentineld``)."""
    env = os.environ.get("SENTINELD_STATE_DIR")
    if env:
        return Path(env)
    import platformdirs  # noqa: PLC0415

    return Path(platformdirs.user_state_dir("sentineld"))


#: Largest config file read (a config is a few hundred bytes; a [signatures] table a few KiB).
MAX_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True)
class DaemonConfig:
    """What the daemon watches, where it keeps state, and how it alerts.

    Attributes:
        runs_dir: parent of run directories (the agent's ``runs_dir``).
        state_dir: outbox, replay results, pidfile, lock, log (created 0700).
        notify: apprise URLs every notification goes to (besides the state dir's
            ``notifications.jsonl`` log, which always receives them).
        alertmanager_url: base URL of an Alertmanager to forward alerts to (v2 API), or None.
        replay: run a replay for each new capture.
        replay_timeout_s: seconds before a replay subprocess is killed (reported as timeout).
        replay_memory_bytes: address-space limit of the replay subprocess (RLIMIT_AS); 0 = none.
        what_if: the replay also re-runs the step under candidate fixes and classifies the
            fault (``--what-if``: the verdict's ``what_if`` and ``reproducibility``). Off by
            default: it costs a few more re-executions of the captured steps than the replay
            itself (per candidate about one replay of the steps after the fault; figures in
            docs/whatif.md).
        metrics_port: the daemon's own Prometheus port (9490); 0 = off; -1 = any free port.
        metrics_addr: bind address of that port.
        poll_s: seconds between rescans of the runs dir (file events wake it sooner).
        polling_observer: use stat polling instead of inotify (NFS, CIFS).
        retry_initial_s / retry_max_s: delivery backoff, doubling from initial to max.
        alert_interval_s: a signature that fires again in the same run within this many seconds
            of its last alert is tracked but not notified, nor is its recovery (rate limit per
            run and signature; 600 = one alert per flapping signature per 10 minutes).
        window: per-rank records kept for signatures.
        signatures: overrides for :class:`sentineld.signatures.SignatureConfig`.
        host: this host's name in alerts (Alertmanager label ``host``: one alert per host of a
            multi-node run); default the system's host name, as the agent's metrics use it.
    """

    runs_dir: Path = field(default_factory=default_runs_dir)
    state_dir: Path = field(default_factory=default_state_dir)
    notify: tuple[str, ...] = ()
    alertmanager_url: str | None = None
    replay: bool = True
    replay_timeout_s: float = 600.0
    replay_memory_bytes: int = 16 << 30
    what_if: bool = False
    metrics_port: int = 9490
    metrics_addr: str = "127.0.0.1"
    poll_s: float = 1.0
    polling_observer: bool = False
    retry_initial_s: float = 2.0
    retry_max_s: float = 300.0
    alert_interval_s: float = 600.0
    window: int = 200
    signatures: Mapping[str, Any] = field(default_factory=dict)
    host: str = field(default_factory=socket.gethostname)

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name), f.type)
        object.__setattr__(self, "runs_dir", Path(self.runs_dir).expanduser())
        object.__setattr__(self, "state_dir", Path(self.state_dir).expanduser())
        object.__setattr__(self, "notify", tuple(self.notify))
        for name in ("replay_timeout_s", "poll_s", "retry_initial_s", "retry_max_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        if self.metrics_port < -1 or self.metrics_port > 65535:
            raise ConfigError(f"metrics_port must be -1, 0 or a TCP port, got {self.metrics_port}")
        if self.window < 10:
            raise ConfigError(f"window must be >= 10 records, got {self.window}")
        if self.alert_interval_s < 0:
            raise ConfigError(f"alert_interval_s must be >= 0 seconds, got {self.alert_interval_s!r}")
        if not self.host.strip() or len(self.host) > 255:
            raise ConfigError(f"host must be a host name (1 to 255 characters), got {self.host!r}")
        if self.replay_memory_bytes < 0:
            raise ConfigError(f"replay_memory_bytes must be >= 0 (0 = no limit), got {self.replay_memory_bytes}")


_TYPES: dict[str, tuple[type, ...]] = {
    "Path": (str, os.PathLike), "tuple[str, ...]": (list, tuple), "str | None": (str, type(None)),
    "bool": (bool,), "float": (int, float), "int": (int,), "str": (str,),
    "Mapping[str, Any]": (dict, Mapping),
}


def _check_type(name: str, value: Any, annotation: Any) -> None:
    """Raise ConfigError naming ``name`` when ``value`` is not of the field's type."""
    want = _TYPES.get(str(annotation))
    if want is None:
        return
    ok = isinstance(value, want) and (not isinstance(value, bool) or bool in want)
    if ok and str(annotation) == "tuple[str, ...]":
        ok = all(isinstance(u, str) for u in value)
    if not ok:
        kind = {"Path": "a path (string)", "tuple[str, ...]": "a list of URL strings",
                "str | None": "a string", "bool": "true or false", "float": "a number",
                "int": "an integer", "str": "a string", "Mapping[str, Any]": "a table"}[str(annotation)]
        raise ConfigError(f"{name} must be {kind}, got {value!r} ({type(value).__name__})")


def _split_urls(text: str) -> tuple[str, ...]:
    return tuple(u for u in re.split(r"[\s,]+", text.strip()) if u)


def load_config(path: str | os.PathLike[str] | None = None, **overrides: Any) -> DaemonConfig:
    """Build the daemon config from file, environment and ``overrides`` (None values ignored).

    Raises:
        ConfigError: unreadable or invalid TOML, an unknown key, or a bad value.
    """
    values: dict[str, Any] = {}
    cfg_path = path or os.environ.get("SENTINELD_CONFIG")
    if cfg_path is None:
        import platformdirs  # noqa: PLC0415

        candidate = Path(platformdirs.user_config_dir("sentineld")) / "config.toml"
        cfg_path = candidate if candidate.exists() else None
    if cfg_path is not None and os.path.realpath(cfg_path) == os.devnull:
        cfg_path = None  # `--config /dev/null`: no config file (a device, read as empty)
    if cfg_path is not None:
        # The config names where alerts go (notify URLs: a webhook of hers would get every alert)
        # and the dirs the daemon trusts: one another user could write is refused, as the code
        # a run names is (contracts/trust.py). Read as a run file is: a regular file, bounded
        # (a FIFO would block the start, /dev/zero never end).
        why = untrusted_reason([Path(cfg_path)])
        if why:
            raise ConfigError(f"config file {cfg_path} could have been written by another user ({why.split(';')[0]}); "
                              "keep it in a folder of yours, writable by you only (`chmod go-w`)")
        try:
            values.update(tomllib.loads(read_regular(cfg_path, MAX_CONFIG_BYTES).decode()))
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read config file {cfg_path}: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {cfg_path} is not valid TOML: {exc}") from None
    known = {f.name for f in fields(DaemonConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"config file {cfg_path}: unknown key(s) {unknown}; known: {sorted(known)}")
    env = os.environ
    if env.get("SENTINELD_NOTIFY"):
        values["notify"] = _split_urls(env["SENTINELD_NOTIFY"])
    if env.get("SENTINELD_ALERTMANAGER_URL"):
        values["alertmanager_url"] = env["SENTINELD_ALERTMANAGER_URL"]
    if env.get("SENTINELD_RUNS_DIR"):
        values["runs_dir"] = env["SENTINELD_RUNS_DIR"]
    if env.get("SENTINELD_STATE_DIR"):
        values["state_dir"] = env["SENTINELD_STATE_DIR"]
    values.update({k: v for k, v in overrides.items() if v is not None})
    if isinstance(values.get("notify"), str):
        values["notify"] = _split_urls(values["notify"])
    try:
        cfg = DaemonConfig(**values)
    except TypeError as exc:
        raise ConfigError(f"bad setting: {exc}") from None
    except ConfigError as exc:
        where = f"config file {cfg_path}: " if cfg_path is not None else ""
        raise ConfigError(f"{where}{exc}") from None
    if cfg.signatures:
        try:
            from sentineld.signatures import SignatureConfig  # noqa: PLC0415

            SignatureConfig.from_mapping(dict(cfg.signatures))
        except ValueError as exc:
            where = f"config file {cfg_path}: " if cfg_path is not None else ""
            raise ConfigError(f"{where}[signatures]: {exc}") from None
    return cfg
