"""A second local user (``sntl_mallory``, a real Unix account) against a root daemon watching a
shared 1777 runs dir, through the capture files of her run dir.

Before: the daemon listed captures with ``lstat`` (a FIFO named like a capture is none) and then
let HDF5 open the capture *by name* to read a crash capture's message. She owns her run dir, so
she swaps names between the two: a loop renaming a regular file and a FIFO over
``capture-rank0-step<N>-crash.h5`` in turn. Within seconds HDF5 opened the FIFO and blocked for
good on the daemon's main loop: no run was read again, SIGTERM was not heard. Now a capture is
opened once with ``O_NOFOLLOW | O_NONBLOCK``, checked to be a regular file, and HDF5 opens that
very descriptor (``/proc/self/fd/N``, :func:`sentineld.contracts.safeio.open_pinned`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import wait_until
from tests.reliability.conftest import make_daemon  # noqa: F401 - fixture
from tests.reliability.test_trust_runfiles import _copy_run, _shared_runs, template  # noqa: F401 - fixture
from tests.reliability.test_trust_users import mallory, shared  # noqa: F401 - fixtures

pytestmark = [pytest.mark.slow,  # a real training subprocess and daemon
              pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root (CI runs as root)")]

FLIP = textwrap.dedent('''
    import os, sys, time
    os.chdir(sys.argv[1])
    open("R", "wb").write(b"\\x89HDF\\r\\n\\x1a\\n" + bytes(4096))
    os.mkfifo("F")
    end, i = time.time() + float(sys.argv[2]), 0
    while time.time() < end:
        name, until = f"capture-rank0-step{i:09d}-crash.h5", time.time() + 0.1
        while time.time() < until:
            os.link("R", "r.tmp"); os.rename("r.tmp", name)
            os.link("F", "f.tmp"); os.rename("f.tmp", name)
        i += 1
''')


def test_swapping_a_fifo_under_a_capture_name_never_blocks_the_daemon(mallory, shared, template,  # noqa: F811
                                                                      make_daemon):
    runs = _shared_runs(shared)
    hers = runs / "hers"
    hers.mkdir()
    os.chown(hers, mallory.pw_uid, mallory.pw_gid)
    d = make_daemon(runs_dir=runs)
    # Her own interpreter (stdlib only): ours may lie under a folder she cannot enter (/root).
    python = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
    subprocess.run([python, "-c", FLIP, str(hers), "20"], check=True, timeout=60,
                   user=mallory.pw_uid, group=mallory.pw_gid, cwd="/")
    # The daemon still reads runs: ours, added now, is alerted.
    _copy_run(template, runs / "ours", {"run_id": "ours", "recipe": None, "pid": 999999})
    notes = wait_until(lambda: [n for n in d.notifications() if n["run"] == "ours" and n["kind"] == "alert"],
                       30, "our run's alert after her swaps")
    assert notes[0]["signature"] == "nonfinite"
    # It read her crash captures as what they were when opened: junk, said so; never blocked.
    # One page for all her crash captures (a process dies once; before, one page per file).
    crashed = [n for n in d.notifications() if n["run"] == "hers" and n["signature"] == "crashed"]
    assert len(crashed) == 1 and "capture unreadable" in crashed[0]["body"], crashed
    assert d.log.read_text().count("another crash capture") >= 10
    t0 = time.monotonic()
    assert d.stop() == 0 and time.monotonic() - t0 < 15


def _her_crafted_run(mallory, runs, template, edit) -> None:  # noqa: F811, ANN001
    import shutil

    import h5py

    run = _copy_run(template, runs / "hers", {"run_id": "hers", "recipe": None})
    cap = next(run.glob("capture-*.h5"))
    with h5py.File(cap, "a") as f:
        edit(f)
    (run / cap.name.replace(".h5", ".verdict.json")).unlink(missing_ok=True)
    shutil.chown(run, mallory.pw_uid, mallory.pw_gid)
    for p in run.iterdir():
        os.chown(p, mallory.pw_uid, mallory.pw_gid)


def test_an_external_link_to_a_fifo_in_her_capture_never_blocks_report(mallory, shared, template):  # noqa: F811
    """Before: root's ``sentineld report`` of her run blocked for good: her capture's ``snapshot``
    was an HDF5 external link to a FIFO, which HDF5 opened when the report read the snapshot."""
    import h5py

    runs = _shared_runs(shared)
    fifo = shared / "fifo.h5"
    os.mkfifo(fifo)

    def edit(f):  # noqa: ANN001, ANN202
        del f["snapshot"]
        f["snapshot"] = h5py.ExternalLink(str(fifo), "/snapshot")

    _her_crafted_run(mallory, runs, template, edit)
    out = shared / "report.html"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "sentineld", "report", str(runs / "hers"), "-o", str(out),
                        "--no-activations"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - t0 < 60
    assert f"/snapshot is an external link to {fifo}" in out.read_text()


def test_a_dataset_stored_in_another_file_is_not_read(shared, template):  # noqa: F811
    """HDF5 external storage would read a dataset's bytes from any file (a root-only one)."""
    import h5py
    import numpy as np

    from sentineld.contracts.capture import CaptureError
    from sentineld.contracts.capture_data import read_dataset

    secret = shared / "secret"
    secret.write_bytes(b"root's secret bytes!" * 4)
    secret.chmod(0o600)
    path = shared / "crafted.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", shape=(80,), dtype=np.uint8, external=[(str(secret), 0, 80)])
    with h5py.File(path, "r") as f, pytest.raises(CaptureError, match="keeps its data in another file"):
        read_dataset(f["x"])
