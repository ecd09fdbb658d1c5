"""``sentineld demo``: a real training run with a planted fault, watched end to end.

Trains :class:`sentineld.demo_model.DigitsNet` on scikit-learn's bundled digits (no download) in a
plain PyTorch loop with the agent attached (the README's two lines), uses the running daemon when
it watches the same runs dir or starts one for itself, and prints the alert as delivered and the
replay verdict, both read back from the daemon's notifications log.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sentineld.contracts.trust import module_command

__all__ = ["run_demo", "wait_for_notifications"]


def wait_for_notifications(log_path: Path, run_id: str, kinds: set[str], timeout_s: float,
                           poll_s: float = 0.2) -> dict[str, dict[str, Any]]:
    """Wait until the notifications log holds one notification of each kind for ``run_id``.

    Returns ``{kind: notification}`` for the kinds seen (possibly fewer after ``timeout_s``).
    """
    found: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not kinds <= set(found):
        try:
            lines = log_path.read_text().splitlines()
        except OSError:
            lines = []
        for line in lines:
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if obj.get("run") == run_id and obj.get("kind") in kinds and obj["kind"] not in found:
                found[obj["kind"]] = obj
        time.sleep(poll_s)
    return found


def _existing_daemon(runs_dir: Path) -> Path | None:
    """State dir of a running daemon that watches ``runs_dir``, if any."""
    from sentineld.daemon.daemon_config import ConfigError, load_config  # noqa: PLC0415
    from sentineld.daemon.statedir import daemon_pid, read_status  # noqa: PLC0415

    try:
        sd = load_config().state_dir
    except ConfigError:
        return None
    if not sd.exists() or daemon_pid(sd) is None:
        return None
    st = read_status(sd) or {}
    if Path(st.get("runs_dir", "")).resolve() == runs_dir.resolve():
        return sd
    return None


def _show(con: Any, title: str, body: str, style: str) -> None:
    """A notification as delivered: its title, then its body line for line (no panel: a panel
    wraps long lines and cuts a long title)."""
    from rich.text import Text  # noqa: PLC0415

    con.print(Text(f"== {title}", style=f"bold {style}"))
    con.print(Text(body.rstrip("\n")))


def _start_daemon(rd: Path, notify: tuple[str, ...], con: Any) -> tuple[Path, subprocess.Popen[bytes] | None]:
    """The state dir of the daemon watching ``rd``: a running one, or one started for the demo
    (then also its process, stopped by the caller)."""
    state_dir = _existing_daemon(rd)
    if state_dir is not None and not notify:
        con.print(f"[dim]using the running daemon (state {state_dir})[/dim]")
        return state_dir, None
    state_dir = Path(tempfile.mkdtemp(prefix="sentineld-demo-state-"))
    args = [*module_command("sentineld"), "start", "--foreground", "--runs-dir", str(rd),  # not -m (cwd)
            "--state-dir", str(state_dir), "--metrics-port", "0"]
    for u in notify:
        args += ["--notify", u]
    log = open(state_dir / "daemon.log", "ab")
    proc = subprocess.Popen(args, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    con.print(f"[dim]started a daemon for this demo (pid {proc.pid}), state {state_dir}[/dim]")
    return state_dir, proc


def _train(fault: str, run_id: str, rd: Path, epochs: int, con: Any) -> tuple[Any, float]:
    """Train the digits MLP with the agent attached; returns the closed watch and the test accuracy."""
    import torch  # noqa: PLC0415
    from rich.progress import Progress  # noqa: PLC0415

    from sentineld.agent import attach  # noqa: PLC0415
    from sentineld.demo_model import load_digits_tensors, loss_fn, make_recipe  # noqa: PLC0415

    xtr, ytr, xte, yte = load_digits_tensors()
    recipe = make_recipe(fault)
    model, optimizer = recipe.model, recipe.optimizer
    # The two added lines of the README quickstart: attach, then watch.step once per step.
    watch = attach(model, optimizer, run_id=run_id, runs_dir=rd, metrics_port=0, num_classes=10,
                   recipe="sentineld.demo_model:make_recipe", recipe_args={"fault": fault})
    g = torch.Generator().manual_seed(1)
    batch_size = 64
    steps_per_epoch = len(xtr) // batch_size
    nonfinite_steps = 0
    with Progress(console=con, transient=False) as progress:
        task = progress.add_task(f"training ({fault})", total=epochs * steps_per_epoch)
        for _epoch in range(epochs):
            perm = torch.randperm(len(xtr), generator=g)
            for i in range(steps_per_epoch):
                idx = perm[i * batch_size:(i + 1) * batch_size]
                x, y = xtr[idx], ytr[idx]
                optimizer.zero_grad()
                loss = loss_fn(model, (x, y))
                loss.backward()
                optimizer.step()
                watch.step(loss, batch=(x, y))
                value = loss.item()
                nonfinite_steps += value != value or abs(value) == float("inf")
                progress.update(task, advance=1, description=f"training ({fault}) loss={value:.4f}")
                if nonfinite_steps >= 5:
                    break  # the run is dead; a real job would be stopped by its owner now
            if nonfinite_steps >= 5:
                break
    watch.close()
    if nonfinite_steps:
        con.print(f"training stopped after {nonfinite_steps} non-finite steps (the run is dead; "
                  "its owner would stop it here too)")
    with torch.no_grad():
        acc = float((model(xte).argmax(1) == yte).float().mean())
    return watch, acc


def _outcome(con: Any, fault: str, run_id: str, rd: Path, state_dir: Path, watch: Any, acc: float,
             timeout_s: float) -> int:
    """Show what the daemon delivered for the run; the demo's exit code."""
    log_path = state_dir / "notifications.jsonl"
    if fault == "none":
        seen = wait_for_notifications(log_path, run_id, {"alert", "verdict"}, timeout_s=3.0)
        if seen or watch.captures:
            con.print(f"[red]unexpected alert or capture for a healthy run: {list(seen)}[/red]")
            return 1
        _show(con, "healthy run", f"no alert, no capture; test accuracy {acc:.3f}\n", "green")
        return 0 if acc > 0.9 else 1
    seen = wait_for_notifications(log_path, run_id, {"alert", "verdict"}, timeout_s=timeout_s)
    if "alert" in seen:
        a = seen["alert"]
        _show(con, a["title"], a["body"], "red")
    if "verdict" in seen:
        v = seen["verdict"]
        _show(con, v["title"], v["body"], "yellow")
        report = v.get("data") or {}
        con.print(f"verdict: phase={report.get('phase')} module={report.get('module')} "
                  f"op={report.get('op')} step={report.get('step')} reproduced={report.get('reproduced')}",
                  markup=False)
        con.print(f"replay it yourself: {Path(sys.executable).parent / 'sentineld'} replay "
                  f"{shlex.quote(str(rd / run_id))} --json", markup=False)
        return 0 if report.get("phase") not in (None, "none") else 1
    con.print(f"[red]no verdict within {timeout_s:g} s; see {state_dir / 'daemon.log'}[/red]")
    return 1


def run_demo(fault: str, runs_dir: str | None, notify: tuple[str, ...], epochs: int,
             timeout_s: float) -> int:
    """Run the demo; return the exit code (0 when the expected outcome was seen)."""
    from sentineld.console import console  # noqa: PLC0415

    con = console()
    rd = Path(runs_dir) if runs_dir else Path(tempfile.mkdtemp(prefix="sentineld-demo-runs-"))
    rd.mkdir(parents=True, exist_ok=True, mode=0o700)
    state_dir, proc = _start_daemon(rd, notify, con)
    try:
        run_id = f"demo-{fault}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        watch, acc = _train(fault, run_id, rd, epochs, con)
        con.print(f"run {run_id}: test accuracy {acc:.3f}, captures {[p.name for p in watch.captures]}",
                  markup=False)
        return _outcome(con, fault, run_id, rd, state_dir, watch, acc, timeout_s)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
