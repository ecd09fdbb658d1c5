"""A second local user (``sntl_mallory``, a real Unix account) against ``sentineld regress`` writing
into a folder she can write (a sticky ``/tmp``-like one: the command's default output is ``.``).

Before: root's ``sentineld regress RUN`` run in such a folder wrote the test's text and its JSON
sidecar through her ``test_sentineld_<run>_step<N>.py`` / ``.json`` links (the names are
predictable), over files of root's; and her ``conftest.py`` next to the test ran when root ran it.
Now the folder is refused (it must be as trusted as the code the test imports), and with
``--trust`` the writes still never go through her links.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from tests.regress import lossfn_project as lp
from tests.reliability.test_trust_users import as_mallory, mallory, shared  # noqa: F401 - fixtures

pytestmark = [pytest.mark.slow,  # a real training subprocess
              pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root (CI runs as root)")]

PRECIOUS = b"root's own file: never to be overwritten\n"


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sentineld", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def our_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Root's own loss_fn run (NaN at step 5), trained once."""
    root = tmp_path_factory.mktemp("hostile-regress")
    project = lp.write_project(root / "project")
    runs = root / "runs"
    runs.mkdir(mode=0o700)
    yield lp.train(project, runs, "exp1", CLOSE_WAIT_S="0")["run_dir"]


def _planted(mallory, shared: Path) -> tuple[Path, list[Path], Path]:  # noqa: F811, ANN001
    """A sticky world-writable folder (as /tmp) where she planted links to root's files under the
    names regress will write, and a conftest.py that leaves a marker when pytest imports it."""
    pub = shared / "pub"
    pub.mkdir()
    pub.chmod(0o1777)
    precious = [shared / "precious-test", shared / "precious-json"]
    for p in precious:
        p.write_bytes(PRECIOUS)
        p.chmod(0o644)
    marker = shared / "conftest-ran"
    as_mallory(mallory, f"cd {pub} && ln -s {precious[0]} test_sentineld_exp1_step5.py && "
                        f"ln -s {precious[1]} sentineld_exp1_step5.json && "
                        f"printf 'import pathlib\\npathlib.Path(\"{marker}\").write_text(\"ran\")\\n' > conftest.py")
    return pub, precious, marker


def test_regress_refuses_an_output_folder_others_may_write(mallory, shared, our_run):  # noqa: F811
    pub, precious, marker = _planted(mallory, shared)
    r = _cli("regress", str(our_run), cwd=pub)  # the default output folder: "."
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"{pub} is writable by group or others (mode 1777)" in r.stderr and "--trust" in r.stderr
    assert [p.read_bytes() for p in precious] == [PRECIOUS, PRECIOUS]
    assert sorted(p.name for p in pub.iterdir()) == ["conftest.py", "sentineld_exp1_step5.json",
                                                     "test_sentineld_exp1_step5.py"]  # nothing written
    assert not marker.exists()


def test_regress_with_trust_never_writes_through_her_links(mallory, shared, our_run):  # noqa: F811
    pub, precious, _marker = _planted(mallory, shared)
    r = _cli("regress", str(our_run), "--trust", cwd=pub)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "is a symbolic link owned by uid" in r.stderr and "replaces only files it wrote itself" in r.stderr
    assert [p.read_bytes() for p in precious] == [PRECIOUS, PRECIOUS]
    for name in ("sentineld_exp1_step5.json", "test_sentineld_exp1_step5.py"):
        assert (pub / name).is_symlink()  # hers, left as it was


def test_regress_into_a_folder_of_ours_still_works(our_run, tmp_path):
    out = tmp_path / "tests"
    r = _cli("regress", str(our_run), "-o", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["sentineld_exp1_step5.h5", "sentineld_exp1_step5.json",
                                                     "test_sentineld_exp1_step5.py"]
