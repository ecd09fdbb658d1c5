"""Fuzz the readers of files other processes write: a capture (HDF5) and a metrics stream (JSON
lines). Whatever the bytes, reading gives data or a clear error (CaptureError / ValueError), never
another exception (and never a crash of the reader). Fixed budget, derandomized for CI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sentineld.contracts.capture import CaptureError, CaptureStep, open_capture, write_capture
from sentineld.contracts.rundir import RunMeta, make_private_dir, write_run_meta
from sentineld.daemon.runwatch import RunWatch
from sentineld.signatures import evaluate
from sentineld.contracts.stream import read_stream

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
COUNT = {"capture": 0, "structured": 0, "stream": 0}


@pytest.fixture(scope="module")
def capture_bytes(tmp_path_factory) -> bytes:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    path = tmp_path_factory.mktemp("fuzz") / "capture-rank0-step000000002-nonfinite.h5"
    write_capture(path, run_id="f", rank=0, trigger="nonfinite", first_step=2, snapshot_step=1,
                  snapshot={"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": None,
                            "scaler": None},
                  steps=[CaptureStep(s, (torch.randn(2, 4), torch.tensor([0, 1])), None) for s in (1, 2)],
                  records=[{"step": 1, "loss": 1.0}, {"step": 2, "loss": float("nan")}])
    return path.read_bytes()


def _read_everything(path: Path) -> None:
    try:
        with open_capture(path) as cap:
            cap.snapshot()
            for s in cap.steps:
                cap.step(s)
            cap.records()
            cap.step(10**6)
    except (CaptureError, ValueError):
        pass


mutation = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0, 1)),
    st.tuples(st.just("flip"), st.lists(st.tuples(st.floats(0, 1), st.integers(1, 255)), min_size=1, max_size=40)),
    st.tuples(st.just("overwrite"), st.floats(0, 1), st.binary(min_size=1, max_size=512)),
    st.tuples(st.just("random"), st.binary(max_size=4096)),
)


@FUZZ
@given(m=mutation)
# Regression (CI-sized run, 3569d09): one flipped bit in the link table made h5py's link walk
# (the external-link check) raise RuntimeError "Link visitation failed", not a CaptureError.
@example(m=("flip", [(0.396484375, 1)]))
def test_capture_reader_gives_only_clear_errors(m, capture_bytes, tmp_path):
    data = bytearray(capture_bytes)
    if m[0] == "truncate":
        data = data[: int(m[1] * len(data))]
    elif m[0] == "flip":
        for where, bits in m[1]:
            i = min(int(where * len(data)), len(data) - 1)
            data[i] ^= bits
    elif m[0] == "overwrite":
        i = int(m[1] * len(data))
        data[i:i + len(m[2])] = m[2]
    else:
        data = bytearray(m[1])
    path = tmp_path / "capture-rank0-step000000002-nonfinite.h5"
    path.write_bytes(bytes(data))
    _read_everything(path)
    COUNT["capture"] += 1


def _objects(f) -> list[str]:
    names: list[str] = []
    f.visit(names.append)
    return sorted(names)


# Strings h5py can store: a NUL in a variable-length string is refused by h5py itself while the
# test edits the file (the edit, not the reader under test, would raise).
_h5_text = st.characters(blacklist_characters="\x00")

edit = st.one_of(
    st.tuples(st.just("delete"), st.floats(0, 1)),
    st.tuples(st.just("json"), st.floats(0, 1), st.text(_h5_text, max_size=60)),
    st.tuples(st.just("attr"), st.sampled_from(["schema_version", "first_step", "snapshot_step", "rank", "run_id",
                                                 "trigger", "torch_dtype"]),
              st.one_of(st.integers(-3, 10**12), st.text(_h5_text, max_size=10), st.floats(allow_nan=True))),
    st.tuples(st.just("dtype"), st.floats(0, 1), st.sampled_from(["float32", "bfloat16", "complex64", "bogus", ""])),
)


@FUZZ
@given(edits=st.lists(edit, min_size=1, max_size=4))
def test_capture_reader_on_structurally_damaged_files(edits, capture_bytes, tmp_path):
    """Valid HDF5 with parts removed or replaced: wrong JSON trees, attributes of the wrong type,
    unknown tensor dtypes, missing groups."""
    import h5py

    path = tmp_path / "capture-rank0-step000000002-nonfinite.h5"
    path.write_bytes(capture_bytes)
    with h5py.File(path, "r+") as f:
        for e in edits:
            names = _objects(f)
            if e[0] == "delete" and names:
                name = names[min(int(e[1] * len(names)), len(names) - 1)]
                if name in f:
                    del f[name]
            elif e[0] == "json":
                trees = [n for n in names if n.endswith(("tree", "records", "rng_meta"))]
                if trees:
                    name = trees[min(int(e[1] * len(trees)), len(trees) - 1)]
                    del f[name]
                    f.create_dataset(name, data=e[2])
            elif e[0] == "attr":
                f.attrs[e[1]] = e[2]
            else:
                dsets = [n for n in names if isinstance(f[n], h5py.Dataset) and "torch_dtype" in f[n].attrs]
                if dsets:
                    f[dsets[min(int(e[1] * len(dsets)), len(dsets) - 1)]].attrs["torch_dtype"] = e[2]
    _read_everything(path)
    COUNT["structured"] += 1


json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
record_fields = ["step", "loss", "grad_norm", "lr", "step_s", "time_s", "optimizer_skipped", "loss_scale",
                 "rank", "grads_carried", "param_nonfinite", "input_nonfinite", "layers", "pid",
                 "reason", "message", "host"]
stream_obj = st.fixed_dictionaries({"kind": st.sampled_from(["step", "start", "end", "agent_error", "capture", "x"])},
                                   optional={k: json_value for k in record_fields})
stream_line = st.one_of(
    stream_obj.map(lambda o: json.dumps(o).encode()),
    st.binary(max_size=200),
    st.just(b"[" * 100_000),  # json recursion: RecursionError before the fix
    st.builds(lambda s: json.dumps({"kind": "step", "step": s, "loss": float("nan")}).encode(),
              st.integers(0, 10**6)),
)


@FUZZ
@given(lines=st.lists(stream_line, max_size=30), torn=st.binary(max_size=50))
def test_stream_readers_never_raise(lines, torn, tmp_path):
    run = make_private_dir(tmp_path / "fz")
    write_run_meta(run, RunMeta(run_id="fz"))
    blob = b"\n".join(lines) + (b"\n" if lines else b"") + torn.replace(b"\n", b"")
    (run / "stream-rank0.jsonl").write_bytes(blob)
    objs, offset, bad = read_stream(run / "stream-rank0.jsonl")
    assert all(isinstance(o, dict) for o in objs) and 0 <= offset <= len(blob) and bad >= 0
    chunked, off2, _ = read_stream(run / "stream-rank0.jsonl", 0, 64)
    assert off2 <= offset
    rw = RunWatch(run, window=50)
    for _ in range(100):
        rw.poll(max_records=7)
        if not rw.behind:
            break
    for recs in (rk.records for rk in rw.ranks.values()):
        for r in recs:
            assert isinstance(r.step, int) and isinstance(r.loss, float)
            assert r.grad_norm is None or isinstance(r.grad_norm, (int, float))
        evaluate(list(recs), now_s=1e9)  # never raises, whatever got through
    rw.progress()
    COUNT["stream"] += 1


def test_zz_fuzz_budget_was_spent():
    """Run last in this module: the budgets above really ran (printed for the report)."""
    print(f"\nfuzzed inputs: {COUNT['capture']} byte-level and {COUNT['structured']} structural capture "
          f"mutations, {COUNT['stream']} streams")
    assert min(COUNT.values()) >= 100
