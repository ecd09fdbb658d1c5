"""The ``sentineld`` command line (click).

Exit codes (documented in README; defined in sentineld.contracts.errors):
    0  success; for ``replay``, a verdict whose outcome is localized or not_localized (the step
       reproduced; a loss spike's cause named): ``contracts.verdict.verdict_exit_code``
    1  ``replay``: outcome not_reproduced; ``demo``: no verdict arrived in time
    2  bad input: unknown run, missing or corrupt capture, missing step, bad config, untrusted
       or unbuildable recipe
    3  ``status``/``stop``: no daemon is running
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click

from sentineld.cliargs import SentineldGroup, fail, run_dir_of, safe_state_dir
from sentineld.contracts.errors import EXIT_NOT_RUNNING, EXIT_OK, NoDaemon
from sentineld.contracts.trust import module_command
from sentineld.daemon.daemon_config import ConfigError, load_config
from sentineld.preflight.command import preflight
from sentineld.regress.command import regress
from sentineld.replay.main import replay_options, run_replay
from sentineld.report.command import report

__all__ = ["main", "cli"]

#: --runs-dir of the commands that take a run id (recover; replay has its own in replay/main.py).
RUNS_DIR_HELP = ("Parent of run directories, where a RUN id is looked up (default: "
                 "$SENTINELD_RUNS_DIR, the config's runs_dir, else ~/.local/state/sentineld/runs). "
                 "Not needed when RUN is a directory.")


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


@click.group(cls=SentineldGroup)
@click.version_option(package_name="sentineld")
def cli() -> None:
    """sentineld: a watchdog for PyTorch training runs."""


# --------------------------------------------------------------------- daemon
def _daemon_options(fn: Any) -> Any:
    opts = [
        click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
                     help="TOML config file (default $SENTINELD_CONFIG or ~/.config/sentineld/config.toml)."),
        click.option("--runs-dir", type=click.Path(file_okay=False), default=None,
                     help="Parent of run directories (default $SENTINELD_RUNS_DIR or the user state dir)."),
        click.option("--state-dir", type=click.Path(file_okay=False), default=None,
                     help="Outbox, replays, pidfile and log "
                          "(default $SENTINELD_STATE_DIR or ~/.local/state/sentineld)."),
        click.option("--notify", multiple=True, help="apprise URL to notify (repeatable)."),
        click.option("--alertmanager-url", default=None, help="Forward alerts to this Alertmanager (v2 API)."),
        click.option("--metrics-port", type=int, default=None, help="Daemon metrics port (9490; 0 = off)."),
        click.option("--no-replay", is_flag=True, help="Do not replay new captures."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def _load(config_path: str | None, runs_dir: str | None, state_dir: str | None, notify: tuple[str, ...],
          alertmanager_url: str | None, metrics_port: int | None, no_replay: bool) -> Any:
    return load_config(config_path, runs_dir=runs_dir, state_dir=state_dir,  # ConfigError: exit 2
                       notify=notify or None, alertmanager_url=alertmanager_url,
                       metrics_port=metrics_port, replay=False if no_replay else None)


@cli.command()
@_daemon_options
@click.option("--foreground", is_flag=True, help="Run in the foreground (for systemd and other service managers).")
@click.option("-v", "--verbose", is_flag=True)
def start(config_path: str | None, runs_dir: str | None, state_dir: str | None, notify: tuple[str, ...],
          alertmanager_url: str | None, metrics_port: int | None, no_replay: bool, foreground: bool,
          verbose: bool) -> None:
    """Start the daemon (in the background unless --foreground)."""
    cfg = _load(config_path, runs_dir, state_dir, notify, alertmanager_url, metrics_port, no_replay)
    from sentineld.daemon.delivery import valid_url  # noqa: PLC0415
    from sentineld.daemon.service import Daemon  # noqa: PLC0415
    from sentineld.daemon.statedir import AlreadyRunning, daemon_pid, private_state_dir  # noqa: PLC0415

    bad = [i for i, u in enumerate(cfg.notify) if not valid_url(u)]
    if bad:
        fail(f"--notify URL #{bad[0] + 1} is not a URL apprise understands (see apprise's URL list)")
    if foreground:
        _setup_logging(verbose)
        try:  # a runs dir that is a file, a state dir we cannot create: SentineldError, its exit code
            Daemon(cfg).run()
        except AlreadyRunning as exc:
            fail(str(exc), EXIT_OK)
        return
    # Checked before anything is opened in it (the lock, the log): in a state dir another user
    # owns or may write, her daemon.log link would take the daemon's output wherever it points.
    # Missing parents are made 0700 too (~/.local/state): nothing of ours world-readable.
    private_state_dir(cfg.state_dir)
    pid = daemon_pid(cfg.state_dir)
    if pid is not None:
        click.echo(f"sentineld daemon already running (pid {pid}), state dir {cfg.state_dir}")
        return
    args = [*module_command("sentineld"), "start", "--foreground",  # not -m: that imports from the cwd
            "--runs-dir", str(cfg.runs_dir), "--state-dir", str(cfg.state_dir)]
    if config_path:
        args += ["--config", config_path]
    # URLs go through the environment, not argv: /proc/<pid>/cmdline is readable by every user,
    # /proc/<pid>/environ only by the owner, and URLs may hold passwords and tokens.
    env = dict(os.environ)
    if notify:
        env["SENTINELD_NOTIFY"] = " ".join(notify)
    if alertmanager_url:
        env["SENTINELD_ALERTMANAGER_URL"] = alertmanager_url
    if metrics_port is not None:
        args += ["--metrics-port", str(metrics_port)]
    if no_replay:
        args.append("--no-replay")
    if verbose:
        args.append("-v")
    log_path = cfg.state_dir / "daemon.log"
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)  # never a link
    proc = subprocess.Popen(args, stdout=fd, stderr=fd, stdin=subprocess.DEVNULL, start_new_session=True,
                            env=env)
    os.close(fd)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            fail(f"daemon exited at start (code {proc.returncode}); see {log_path}")
        if daemon_pid(cfg.state_dir) == proc.pid and (cfg.state_dir / "status.json").exists():
            click.echo(f"sentineld daemon started (pid {proc.pid}) watching {cfg.runs_dir}; log {log_path}")
            return
        time.sleep(0.1)
    fail(f"daemon did not report ready in 15 s; see {log_path}")


@cli.command()
@click.option("--state-dir", type=click.Path(file_okay=False), default=None)
@click.option("--grace-period", type=float, default=10.0, show_default=True,
              help="Seconds to wait after SIGTERM before SIGKILL.")
def stop(state_dir: str | None, grace_period: float) -> None:
    """Stop the daemon (SIGTERM, then SIGKILL after the grace period)."""
    from sentineld.daemon.statedir import daemon_pid  # noqa: PLC0415

    sd = Path(state_dir) if state_dir else load_config().state_dir
    pid = daemon_pid(sd)
    if pid is None or pid <= 0:
        raise NoDaemon(f"no daemon running with state dir {sd}")
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_period
    while time.monotonic() < deadline:
        if daemon_pid(sd) is None:
            click.echo(f"sentineld daemon (pid {pid}) stopped")
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    click.echo(f"sentineld daemon (pid {pid}) did not stop in {grace_period:g} s; killed")


@cli.command()
@click.option("--state-dir", type=click.Path(file_okay=False), default=None)
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def status(state_dir: str | None, as_json: bool) -> None:
    """Show whether the daemon runs, what it watches, alerts sent and replays run."""
    from sentineld.daemon.statedir import daemon_pid, read_status  # noqa: PLC0415

    sd = Path(state_dir) if state_dir else safe_state_dir()
    pid = daemon_pid(sd) if sd.exists() else None
    st = read_status(sd) if sd.exists() else None
    if as_json:
        click.echo(json.dumps({"running": pid is not None, "pid": pid, "status": st}, indent=1))
    elif pid is None:
        click.echo(f"sentineld daemon: not running (state dir {sd})"
                   + ("; stale status from pid %s" % st.get("pid") if st else ""))
    else:
        from rich.table import Table  # noqa: PLC0415

        from sentineld.console import console  # noqa: PLC0415

        con = console()
        con.print(f"sentineld daemon: running (pid {pid}), runs dir {st.get('runs_dir') if st else '?'}",
                  markup=False)
        if st:
            # .get throughout: a status.json from another daemon version may lack a key.
            notify = ", ".join(map(str, st.get("notify") or [])) or "log only"
            con.print(f"runs watched: {st.get('runs_watched', '?')}  alerts sent: {st.get('alerts_sent', '?')}  "
                      f"pending: {st.get('alerts_pending', '?')}  replays run: {st.get('replays_run', '?')}  "
                      f"notify: {notify}", markup=False)
            t = Table("run", "ranks", "last step", "active signatures", "captures", "error")
            for r in st.get("runs") or []:
                r = r if isinstance(r, dict) else {}
                t.add_row(str(r.get("run_id", "?")), ",".join(map(str, r.get("ranks") or [])),
                          str(r.get("last_step")), ", ".join(map(str, r.get("active") or [])) or "-",
                          str(r.get("captures")), str(r.get("error") or "")[:60])
            con.print(t)
            for r in st.get("runs") or []:  # the run's own signature settings the daemon did not take
                r = r if isinstance(r, dict) else {}
                for p in (r.get("signature_overrides_refused") or [])[:10]:
                    con.print(f"run {str(r.get('run_id', '?'))[:80]}: signature override {str(p)[:400]}", markup=False)
    sys.exit(EXIT_OK if pid is not None else EXIT_NOT_RUNNING)


@cli.command()
@click.option("--runs-dir", type=click.Path(file_okay=False), default=None,
              help="Runs dir to list (default: the one the running daemon watches, else "
                   "$SENTINELD_RUNS_DIR, the config's runs_dir or ~/.local/state/sentineld/runs).")
@click.option("--state-dir", type=click.Path(file_okay=False), default=None,
              help="State dir of the daemon whose runs dir to list (as for status and stop).")
@click.option("--json", "as_json", is_flag=True)
def runs(runs_dir: str | None, state_dir: str | None, as_json: bool) -> None:
    """List run directories with their last step, captures and state (read from disk)."""
    if runs_dir is None:  # with a daemon running, list what it watches
        from sentineld.daemon.statedir import daemon_pid, read_status  # noqa: PLC0415

        sd = Path(state_dir) if state_dir else safe_state_dir()
        st = read_status(sd) if sd.is_dir() and daemon_pid(sd) is not None else None
        if st and isinstance(st.get("runs_dir"), str):
            runs_dir = st["runs_dir"]
    from sentineld.contracts.rundir import list_captures  # noqa: PLC0415
    from sentineld.daemon.runwatch import RunWatch  # noqa: PLC0415

    rd = Path(runs_dir) if runs_dir else load_config().runs_dir
    if runs_dir is not None and not rd.is_dir():  # an explicit folder that is not there: say so, exit 2
        fail(f"runs dir {rd} {'is not a directory' if rd.exists() else 'does not exist'}: pass the folder "
              "the agent writes to (attach(runs_dir=...) or $SENTINELD_RUNS_DIR)")
    rows: list[dict[str, Any]] = []
    for d in sorted(p for p in rd.iterdir() if p.is_dir() and not p.is_symlink()) if rd.is_dir() else []:
        try:  # one damaged run is shown with its error; it never hides the others
            rw = _tail_watch(RunWatch(d))
            rw.poll()
            while rw.behind:
                rw.poll()
            meta, err = rw.meta, rw.meta_error  # as the daemon reads it (a run.json naming another run is none)
            nonfinite = sum(1 for rk in rw.ranks.values() for r in rk.records if r.nonfinite)
            rows.append({"run_id": meta.run_id if meta else d.name, "dir": str(d), "ranks": sorted(rw.ranks),
                         "last_step": rw.last_step,
                         "state": ",".join(sorted(set(rw.ended.values()))) or ("running" if rw.ranks else "-"),
                         "nonfinite_steps_in_window": nonfinite,
                         "captures": [p.name for *_x, p in list_captures(d)], "error": err or rw.error,
                         "metrics_port": (meta.extra.get("metrics_port") if meta and isinstance(meta.extra, dict)
                                          else None)})
        except Exception as exc:  # noqa: BLE001 - whatever another process left there
            rows.append({"run_id": d.name, "dir": str(d), "ranks": [], "last_step": None, "state": "-",
                         "nonfinite_steps_in_window": 0, "captures": [],
                         "error": f"cannot read: {type(exc).__name__}: {str(exc)[:200]}"})
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    from rich.table import Table  # noqa: PLC0415

    from sentineld.console import console  # noqa: PLC0415

    con = console()
    con.print(f"runs in {rd}", markup=False)  # a line of its own: a table title is cut to the table's width
    t = Table("run", "ranks", "last step", "state", "captures", "metrics port", "error")
    for r in rows:
        t.add_row(r["run_id"], ",".join(map(str, r["ranks"])), str(r["last_step"]), r["state"],
                  str(len(r["captures"])), str(r.get("metrics_port") or "-"), (r["error"] or "")[:60])
    con.print(t)


#: How much of each stream's end ``sentineld runs`` reads: its last step, end and window are
#: there (a step record is a few hundred bytes). Reading whole streams made a listing of a shared
#: runs dir take as long as another user's sparse multi-GiB stream took to read.
RUNS_TAIL_BYTES = 8 << 20


def _tail_watch(rw: Any) -> Any:
    """``rw`` (a fresh RunWatch) set to read only the last :data:`RUNS_TAIL_BYTES` of each stream."""
    from sentineld.contracts.rundir import RunDir  # noqa: PLC0415
    from sentineld.daemon.rankwatch import RankWatch  # noqa: PLC0415

    for name in os.listdir(rw.run_dir):
        rank = RunDir.stream_rank(name)
        if rank is None:
            continue
        path = rw.run_dir / name
        try:
            size = os.lstat(path).st_size
        except OSError:
            continue
        if size > RUNS_TAIL_BYTES:  # starts inside a line: that one is skipped as damaged
            rw.ranks[rank] = RankWatch.at(path, rw.window, size - RUNS_TAIL_BYTES)
    return rw


@cli.command()
@click.argument("run")
@click.option("--runs-dir", type=click.Path(file_okay=False), default=None,
              help=RUNS_DIR_HELP)
def recover(run: str, runs_dir: str | None) -> None:
    """Turn the on-disk rings of RUN's dead training processes into crash captures.

    A run with ``disk_ring=True`` that was killed without warning (SIGKILL, the OOM killer)
    leaves ``ring-rank<R>-<pid>/`` behind; the daemon recovers it on its own, this does it
    without a daemon. Rings of live processes are left alone.
    """
    from sentineld.daemon.ring_recovery import recover_run  # noqa: PLC0415

    run_dir = run_dir_of(run, runs_dir)  # RunDirError: exit 2
    try:
        caps = recover_run(run_dir, who="sentineld recover")
    except OSError as exc:
        fail(f"cannot write the crash capture: {exc}")
    for c in caps:
        click.echo(str(c))
    if not caps:
        click.echo(f"no on-disk ring of a dead process in {run_dir}")


# --------------------------------------------------------------------- replay
@cli.command()
@replay_options
def replay(run: str, step: int | None, as_json: bool, recipe: str | None, capture: str | None,
           trust: bool, rank: int | None, runs_dir: str | None, what_if: bool = False, repeats: int = 3,
           world_size: int | None = None) -> None:
    """Rebuild RUN (an id or a directory) before the offending step and name where it broke.

    Exit codes, from the verdict's outcome: 0 localized or not_localized (the step reproduced; a
    loss spike's cause named), 1 not_reproduced, 2 bad input (unknown run, damaged capture, missing
    step, untrusted or unbuildable recipe)."""
    try:
        cfg = load_config()
    except ConfigError:
        cfg = None
    if runs_dir is None and cfg is not None:  # a run id is looked up where the daemon's config puts runs
        runs_dir = str(cfg.runs_dir)
    _limit_memory(cfg.replay_memory_bytes if cfg is not None else 16 << 30)
    sys.exit(run_replay(run, step, as_json, recipe, capture, trust, runs_dir, rank, what_if, repeats, world_size))


def _limit_memory(limit_bytes: int) -> None:
    """Run this replay under the address-space limit the daemon's replays get
    (``replay_memory_bytes``): a crafted capture or a runaway model fails with a message instead
    of taking the machine's memory."""
    import resource  # noqa: PLC0415

    if limit_bytes <= 0:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft > limit_bytes:
        new = limit_bytes if hard == resource.RLIM_INFINITY else min(limit_bytes, hard)
        resource.setrlimit(resource.RLIMIT_AS, (new, hard))


# ----------------------------------------------------------------------- demo
@cli.command()
@click.option("--fault", type=click.Choice(["zero-std", "lr", "none"]), default="zero-std",
              show_default=True, help="The planted fault.")
@click.option("--runs-dir", type=click.Path(file_okay=False), default=None,
              help="Where the demo run goes (default: a new temp dir).")
@click.option("--notify", multiple=True, help="Also send the alerts to this apprise URL (repeatable).")
@click.option("--epochs", type=int, default=3, show_default=True)
@click.option("--timeout", "timeout_s", type=float, default=180.0, show_default=True,
              help="Seconds to wait for the alert and the replay verdict.")
def demo(fault: str, runs_dir: str | None, notify: tuple[str, ...], epochs: int, timeout_s: float) -> None:
    """Train on scikit-learn's handwritten digits with a planted fault, watched by the daemon."""
    try:  # the data set comes with scikit-learn, an optional dependency (the `demo` extra)
        import sklearn  # noqa: F401, PLC0415
    except ImportError as exc:
        fail(f"the demo needs scikit-learn (its handwritten digits data set), which is not importable "
              f"({exc}); install it with: pip install 'sentineld[demo]'  (or: pip install scikit-learn)")
    from sentineld.demo import run_demo  # noqa: PLC0415

    sys.exit(run_demo(fault, runs_dir, notify, epochs, timeout_s))


# ------------------------------------------ preflight, report, regress (issue 12)
cli.add_command(preflight)  # defined in sentineld/preflight/command.py (imports torch only when run)
cli.add_command(report)  # sentineld/report/command.py (matplotlib and torch only when run)
cli.add_command(regress)  # sentineld/regress/command.py (torch only when run)


def main() -> None:
    """Console-script entry point."""
    cli()


if __name__ == "__main__":
    main()
