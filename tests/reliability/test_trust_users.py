"""Issue 15, item 1: no code from files another user can write, tried as another real user.

Each test creates a real Unix user (``sntl_mallory``), lets that user plant files the way the
adversary did (a ``click.py`` in a writable project folder, an interpreter named by their own
run's ``run.json`` in a shared runs dir, modules the recipe imports, a package shadowing the
user's module), and checks that nothing they wrote ran as us: each planted file would create a
marker file when executed, and no marker may exist afterwards. Needs root (to create the user and
to run as it); CI runs as root, so there these tests fail rather than skip.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Iterator

import pytest

from sentineld.daemon.replay_runner import run_replay_subprocess
from sentineld.contracts.rundir import read_run_meta
from tests.conftest import wait_until

MALLORY = "sntl_mallory"

if os.geteuid() != 0 and not os.environ.get("CI"):
    pytest.skip("creating another user needs root (CI runs as root and runs these)", allow_module_level=True)

RECIPE = textwrap.dedent('''
    import torch
    import torch.nn.functional as F
    from sentineld.recipe import Recipe, train_step
    import netdef                     # a second module of the project, imported by the recipe

    def make() -> Recipe:
        torch.manual_seed(0)
        model = netdef.Net()
        return Recipe(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                      loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))

    if __name__ == "__main__":
        import sys
        from sentineld.agent import attach
        rec = make()
        watch = attach(rec.model, rec.optimizer, run_id="victim", runs_dir=sys.argv[1],
                       recipe="trainmod:make", metrics_port=0, snapshot_every=2, layer_every=0)
        g = torch.Generator().manual_seed(0)
        with watch:
            for step in range(8):
                x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
                if step == 5:
                    x[2, 1] = float("nan")   # a planted data fault: the replay names data
                watch.step(train_step(rec, (x, y)), (x, y))
''')

NETDEF = textwrap.dedent('''
    import torch
    class Net(torch.nn.Sequential):
        def __init__(self):
            super().__init__(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
''')


@pytest.fixture(scope="module")
def mallory() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(MALLORY)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/bin/sh", MALLORY], check=True)
        return pwd.getpwnam(MALLORY)


def as_mallory(mallory: pwd.struct_passwd, script: str) -> None:
    """Run a shell script as the other user (their files are theirs: owner uid, their umask)."""
    subprocess.run(["/bin/sh", "-ec", f"umask 000; {script}"], check=True, user=mallory.pw_uid,
                   group=mallory.pw_gid, cwd="/", timeout=30)


def public_dir(shared: Path) -> Path:
    """``shared/pub``, a sticky world-writable folder (as /tmp is) for her to plant files in."""
    pub = shared / "pub"
    pub.mkdir()
    pub.chmod(0o1777)
    return pub


def precious_file(shared: Path, content: bytes) -> Path:
    """A file of ours (0644) she must never get written: ``shared/precious``."""
    precious = shared / "precious"
    precious.write_bytes(content)
    precious.chmod(0o644)
    return precious


def plant_package(mallory: pwd.struct_passwd, where: Path, marker: Path) -> None:
    """Her ``sentineld`` package in ``where``: importing it writes ``marker``."""
    as_mallory(mallory, f"mkdir {where}/sentineld && printf 'import pathlib\\npathlib.Path(\"{marker}\")"
                        f".write_text(\"ran\")\\n' > {where}/sentineld/__init__.py")


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder other users can reach (pytest's tmp dirs are 0700, so not under them)."""
    base = Path(tempfile.mkdtemp(prefix="sentineld-trust-", dir="/tmp"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _marker_script(marker: Path) -> str:
    return f"import pathlib; pathlib.Path({str(marker)!r}).write_text('ran')\n"


def train_victim(project: Path, runs: Path) -> Path:
    """Our own run: recipe and its module written by us, trained in a subprocess; its run dir."""
    (project / "trainmod.py").write_text(RECIPE)
    (project / "netdef.py").write_text(NETDEF)
    for f in ("trainmod.py", "netdef.py"):
        (project / f).chmod(0o644)
    subprocess.run([sys.executable, "trainmod.py", str(runs)], cwd=project, check=True, timeout=120,
                   capture_output=True)
    return runs / "victim"


def _replay_by_daemon(run_dir: Path) -> object:
    meta = read_run_meta(run_dir)
    cap = sorted(run_dir.glob("capture-*.h5"))[0]
    return run_replay_subprocess(meta, run_dir, cap, timeout_s=120, memory_bytes=0)


def test_planted_click_in_the_project_folder_never_runs(mallory, shared):
    """d9bb298: `python -m sentineld replay` with cwd = the project put a planted click.py first."""
    project = shared / "project"
    project.mkdir()
    project.chmod(0o1777)  # writable by everyone, sticky: others may add files, not replace ours
    runs = shared / "runs"
    runs.mkdir(mode=0o700)
    run_dir = train_victim(project, runs)
    marker = shared / "click-ran"
    as_mallory(mallory, f"cat > {project}/click.py <<'EOF'\n{_marker_script(marker)}EOF")
    out = _replay_by_daemon(run_dir)
    assert not marker.exists(), "a click.py another user planted ran as the daemon's user"
    assert out.result == "localized", out.reason  # and our own replay still gives its verdict
    assert out.report["phase"] == "data"


def test_interpreter_named_by_another_users_run_is_never_executed(mallory, shared, daemon_factory, tmp_path):
    """d9bb298: in a 1777 runs dir, mallory's run.json named her script as `python`; its `{}` was
    delivered as a verdict ("every value finite")."""
    runs = shared / "runs"
    runs.mkdir()
    runs.chmod(0o1777)
    project = shared / "project"
    project.mkdir(mode=0o755)
    ours = train_victim(project, shared / "ours")
    marker = shared / "evil-ran"
    home = shared / "mallory"  # a folder of hers
    home.mkdir(mode=0o755)
    os.chown(home, mallory.pw_uid, mallory.pw_gid)
    evil = home / "evil.sh"
    as_mallory(mallory, f"printf '#!/bin/sh\\ntouch {marker}\\necho {{}}\\n' > {evil}; chmod 755 {evil}; "
                        f"mkdir -m 755 {runs}/evil")
    # Her run: a copy of a real run (stream, capture) whose run.json names her interpreter.
    meta = json.loads((ours / "run.json").read_text())
    meta.update(run_id="evil", python=str(evil))
    for src in ours.iterdir():
        if src.is_file():
            data = json.dumps(meta) if src.name == "run.json" else None
            dst = runs / "evil" / src.name
            if data is None:
                shutil.copyfile(src, dst)
            else:
                dst.write_text(data)
            os.chown(dst, mallory.pw_uid, mallory.pw_gid)
    os.chown(runs / "evil", mallory.pw_uid, mallory.pw_gid)
    out = _replay_by_daemon(runs / "evil")
    assert not marker.exists() and out.result == "refused" and out.report is None
    assert "not trusted" in out.reason and "uid" in out.reason
    # Our run.json naming an interpreter she can replace (her folder) is refused too.
    as_mallory(mallory, f"mkdir -m 755 {home}/bin; cp {evil} {home}/bin/python3")
    edited = json.loads((ours / "run.json").read_text())
    edited["python"] = str(home / "bin" / "python3")
    (ours / "run.json").write_text(json.dumps(edited))
    out = _replay_by_daemon(ours)
    assert not marker.exists() and out.result == "refused" and "interpreter" in out.reason
    # Through the real daemon: her run's NaN is alerted, but no verdict is ever delivered for it.
    d = daemon_factory(runs_dir=runs, state_dir=tmp_path / "state")
    notes = wait_until(lambda: [n for n in d.notifications() if n.get("kind") == "verdict"], 90,
                       "the replay notification for the other user's run")
    assert not marker.exists()
    assert [n["signature"] for n in notes] == ["replay_failed"], notes
    assert "refused" in notes[0]["body"] and "every value" not in notes[0]["body"]


@pytest.mark.parametrize("attack", ["module_of_another_user", "world_writable_module", "shadowing_package"])
def test_modules_the_recipe_imports_are_checked(mallory, shared, attack):
    """d9bb298 checked only the recipe module: what it imported from the project ran unchecked."""
    project = shared / "project"
    project.mkdir()
    project.chmod(0o1777 if attack == "shadowing_package" else 0o755)
    runs = shared / "runs"
    runs.mkdir(mode=0o700)
    run_dir = train_victim(project, runs)
    marker = shared / "module-ran"
    payload = _marker_script(marker) + NETDEF
    if attack == "module_of_another_user":
        (project / "netdef.py").unlink()
        project.chmod(0o1777)
        as_mallory(mallory, f"cat > {project}/netdef.py <<'EOF'\n{payload}EOF")
        project.chmod(0o755)
    elif attack == "world_writable_module":
        (project / "netdef.py").chmod(0o666)
        as_mallory(mallory, f"cat > {project}/netdef.py <<'EOF'\n{payload}EOF")
    else:  # a package beats a module of the same name in the same folder
        as_mallory(mallory, f"mkdir {project}/netdef && cat > {project}/netdef/__init__.py <<'EOF'\n{payload}EOF")
    for pyc in project.glob("__pycache__/netdef*"):
        pyc.unlink()  # our own earlier compile would otherwise be used instead of the new source
    proc = subprocess.run([str(Path(sys.executable).parent / "sentineld"), "replay", str(run_dir), "--json"],
                          cwd=project, capture_output=True, text=True, timeout=120)
    assert not marker.exists(), f"{attack}: the planted module ran"
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "netdef" in proc.stderr and ("uid" in proc.stderr or "writable" in proc.stderr), proc.stderr
    assert proc.stdout == ""  # no verdict printed
