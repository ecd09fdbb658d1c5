"""The replay's promise: clear errors (exit 2) for bad input, never a traceback; ``--json`` stdout
is the verdict and nothing else; code is imported only from files nobody else can write."""

from __future__ import annotations

import importlib.util
import json
import os
import py_compile
import shutil
import sys
import textwrap
import uuid
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from sentineld.agent import attach
from sentineld.contracts.capture import CaptureError
from sentineld.contracts.recipe import train_step
from sentineld.replay import replay_run
from sentineld.replay.engine import ReplayError
from sentineld.replay.trust import RecipeError, UntrustedError
from sentineld.contracts.rundir import RunDirError

from .conftest import cli_replay

DOCUMENTED = (ReplayError, CaptureError, RunDirError, RecipeError, UntrustedError)

SRC = textwrap.dedent('''
    import sys
    import torch, torch.nn as nn, torch.nn.functional as F
    from sentineld.contracts.recipe import Recipe

    def make():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        return Recipe(model=m, optimizer=torch.optim.Adam(m.parameters(), lr=0.1),
                      loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))

    def make_chatty():
        print("building the model")             # the kind of print every training script has
        rec = make()
        print(rec.model)
        loss_fn = rec.loss_fn
        def noisy(m, b):
            print("loss step")
            return loss_fn(m, b)
        rec.loss_fn = noisy
        return rec

    def make_exits():
        sys.exit("no GPU found, giving up")

    def make_wrong_type():
        return make().model

    def make_other_model():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
        return Recipe(model=m, optimizer=torch.optim.Adam(m.parameters(), lr=0.1),
                      loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
''')


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """A run of ``<mod>:make`` (module written, never imported here) with a NaN batch at step 5."""
    root = tmp_path_factory.mktemp("replay_input")
    os.chmod(root, 0o700)
    proj = root / "proj"
    proj.mkdir(mode=0o700)
    mod = f"advrec_{uuid.uuid4().hex[:10]}"
    (proj / f"{mod}.py").write_text(SRC)
    (proj / f"{mod}.py").chmod(0o644)
    ns: dict = {}
    exec(SRC, ns)  # same code as the module, without importing it (the trust test needs that)
    rec = ns["make"]()
    old = os.getcwd()
    os.chdir(proj)
    try:
        w = attach(rec.model, rec.optimizer, run_id="base", runs_dir=root / "runs", recipe=f"{mod}:make",
                   metrics_port=0, snapshot_every=4)
        g = torch.Generator().manual_seed(0)
        with w:
            for i in range(6):
                x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
                if i == 5:
                    x[0, 0] = float("nan")
                w.step(train_step(rec, (x, y)), (x, y))
    finally:
        os.chdir(old)
    assert len(w.captures) == 1
    return w.run_dir, proj, mod


@pytest.fixture
def run(base_run, tmp_path):
    """A private copy of the base run: ``(run_dir, capture, project dir, module name)``."""
    src, proj, mod = base_run
    dst = tmp_path / "runs" / "base"
    shutil.copytree(src, dst)
    os.chmod(tmp_path / "runs", 0o700)
    yield dst, next(dst.glob("capture-*.h5")), proj, mod
    sys.modules.pop(mod, None)


# ------------------------------------------------------------------ guards (pass today)
def _set(f, name, value):
    del f[name]
    f[name] = value


EDITS = {
    "snapshot_tree_not_json": lambda f: _set(f, "snapshot/tree", "{oops"),
    "snapshot_tensor_index_out_of_range": lambda f: _set(
        f, "snapshot/tree", f["snapshot/tree"][()].decode().replace('{"t": 0}', '{"t": 999}')),
    "snapshot_tree_too_deep": lambda f: _set(f, "snapshot/tree", '{"l":' * 50000 + "null" + "}" * 50000),
    "snapshot_tensor_is_a_string": lambda f: _set(f, "snapshot/0", "hello"),
    "tensor_dtype_reinterpreted": lambda f: f["snapshot/0"].attrs.__setitem__("torch_dtype", "bfloat16"),
    "records_not_a_list": lambda f: _set(f, "records", "5"),
    "records_of_ints": lambda f: _set(f, "records", "[1, 2, 3]"),
    "record_step_not_a_number": lambda f: _set(f, "records", '[{"step": "abc", "loss": 1.0}]'),
    "record_step_overflows": lambda f: _set(f, "records", '[{"step": 1e400, "loss": 1.0}]'),
    "first_step_elsewhere": lambda f: f.attrs.__setitem__("first_step", 99),
    "first_step_not_int": lambda f: f.attrs.__setitem__("first_step", "x"),
    "snapshot_after_first_step": lambda f: f.attrs.__setitem__("snapshot_step", 7),
    "snapshot_before_steps": lambda f: f.attrs.__setitem__("snapshot_step", -3),
    "rng_group_removed": lambda f: [f["steps"][k].__delitem__("rng") for k in f["steps"]],
    "rng_state_truncated": lambda f: [_set(f, f"steps/{k}/rng/torch", np.zeros(3, np.uint8)) for k in f["steps"]],
    "rng_meta_wrong_shape": lambda f: [_set(f, f"steps/{k}/rng_meta", '{"numpy": 3}') for k in f["steps"]],
    "junk_step_key": lambda f: f["steps"].create_group("abc"),
    "batch_tree_malformed": lambda f: [_set(f, f"steps/{k}/batch/tree", "[1, 2]") for k in f["steps"]],
    "all_steps_removed": lambda f: [f["steps"].__delitem__(k) for k in list(f["steps"])],
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_hand_edited_capture_is_a_documented_error(run, edit):
    run_dir, cap, _proj, _mod = run
    with h5py.File(cap, "r+") as f:
        EDITS[edit](f)
    with pytest.raises(DOCUMENTED):
        replay_run(run_dir, trust=True)


@pytest.mark.parametrize("field,value", [("num_threads", "four"), ("recipe_args", [1, 2]),
                                         ("recipe", "no_colon"), ("schema_version", 2),
                                         ("run_id", "../../etc"), ("unknown_field", 1)])
def test_hand_edited_run_json_is_a_documented_error(run, field, value):
    run_dir = run[0]
    meta = json.loads((run_dir / "run.json").read_text())
    meta[field] = value
    (run_dir / "run.json").write_text(json.dumps(meta))
    with pytest.raises(DOCUMENTED):
        replay_run(run_dir, trust=True)


@pytest.mark.parametrize("fn", ["make_wrong_type", "make_other_model"])
def test_recipe_that_does_not_fit_is_a_replay_error(run, fn):
    run_dir, _cap, _proj, mod = run
    with pytest.raises(ReplayError):
        replay_run(run_dir, recipe=f"{mod}:{fn}", trust=True)


def test_cli_hand_edited_capture_exits_2_without_traceback(run):
    run_dir, cap, _proj, _mod = run
    with h5py.File(cap, "r+") as f:
        _set(f, "records", "5")
    p = cli_replay(run_dir)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""


# ------------------------------------------------------------------ breaks (fail today)
def test_json_stdout_stays_valid_when_the_recipe_prints(run):
    """``sentineld replay --json`` promises the verdict as JSON on stdout (the daemon parses it).
    A recipe that prints (``print(model)``, progress lines in the loss) must not corrupt it: user
    output belongs on stderr.

    Today the recipe's prints land on stdout before the JSON: json.loads fails, and the daemon's
    run_replay_subprocess() reports the replay as "failed" instead of sending its verdict.
    """
    run_dir, _cap, _proj, mod = run
    p = cli_replay(run_dir, "--recipe", f"{mod}:make_chatty")
    assert p.returncode == 0, p.stderr[-2000:]
    report = json.loads(p.stdout)
    assert report["reproduced"] is True


def test_recipe_calling_sys_exit_is_a_replay_error(run):
    """A recipe that calls ``sys.exit("...")`` (e.g. "no GPU found") is bad input: replay_run must
    raise ReplayError ("never another exception type") and the CLI exit 2 with the message.

    Today SystemExit escapes replay_run (only ``Exception`` is caught), so ``sentineld replay``
    exits 1, the code for "not reproduced", without saying why.
    """
    run_dir, _cap, _proj, mod = run
    with pytest.raises(ReplayError, match="no GPU found"):
        replay_run(run_dir, recipe=f"{mod}:make_exits", trust=True)


def test_bytecode_planted_in_a_world_writable_pycache_is_not_executed(run):
    """Without --trust the replay imports the recipe only if every file it would execute, and the
    folders holding them, are writable by no one else. The module's ``__pycache__`` is such a
    folder: Python executes a planted ``.pyc`` from it (an unchecked-hash pyc is never compared
    with the source), so a world-writable ``__pycache__`` must refuse the import (UntrustedError).

    Today only ``<mod>.py`` and its folder are checked: the planted bytecode runs.
    """
    run_dir, _cap, proj, mod = run
    marker = run_dir.parent / "PLANTED_CODE_RAN"
    pycache = proj / "__pycache__"
    pycache.mkdir(exist_ok=True)
    os.chmod(pycache, 0o777)
    evil = run_dir.parent / "evil.py"
    evil.write_text(f"open({str(marker)!r}, 'w').write('x')\n" + SRC)
    py_compile.compile(str(evil), cfile=importlib.util.cache_from_source(str(proj / f"{mod}.py")),
                       invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    try:
        with pytest.raises(UntrustedError):
            replay_run(run_dir, trust=False)
    finally:
        shutil.rmtree(pycache, ignore_errors=True)
    assert not marker.exists(), "code from the planted .pyc was executed"
