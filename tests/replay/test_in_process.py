"""The training process localizes its own incidents (``attach(..., loss_fn=)``): real training with a
planted fault, real captures, the verdict file the daemon delivers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sentineld.contracts.verdict import OUTSIDE_MODEL, REPORT_SCHEMA_VERSION, report_problems
from sentineld.contracts.verdict_file import verdict_path
from sentineld.contracts.rundir import list_captures, read_run_meta
from tests.replay.livecases import FAULT_STEP, train


def _verdict(run_dir: Path) -> dict:
    caps = [c for c in list_captures(run_dir) if c[2] == "nonfinite"]
    assert caps, f"no nonfinite capture in {sorted(p.name for p in run_dir.iterdir())}"
    path = verdict_path(caps[0][3])
    assert path.exists(), "the training process wrote no verdict"
    return json.loads(path.read_text())


@pytest.mark.parametrize("fault, phase, module, op, step, node, where", [
    ("forward", "forward", "feats", "aten.log", FAULT_STEP, None, "module 'feats' (LogFeatures)"),
    ("loss", "forward", None, "aten.log", FAULT_STEP, None, OUTSIDE_MODEL),
    # the forward op whose gradient went non-finite; its primitive (aten.div) is in evidence
    ("backward", "backward", None, "aten.sqrt", FAULT_STEP, "SqrtBackward0", OUTSIDE_MODEL),
    # RatioSGD divides a zero gradient by its zero norm; seen one step later (NaN loss), named at its step.
    ("optimizer", "optimizer", None, "aten.div", FAULT_STEP, None, "optimizer step (RatioSGD)"),
    # The scheduler sets lr=inf for the next step: recorded (and named) at the step that set it.
    ("lr", "optimizer", None, "lr", FAULT_STEP - 1, None, "learning-rate scheduler (LambdaLR)"),
    ("data", "data", None, None, FAULT_STEP, None, "input batch, batch[0]"),
])
def test_loss_fn_run_names_phase_module_op_and_step(tmp_path, fault, phase, module, op, step, node, where):
    out = train(tmp_path, f"live-{fault}", fault)
    v = _verdict(out["watch"].run_dir)
    assert (v["phase"], v["module"], v["op"], v["step"], v["where"]) == (phase, module, op, step, where), v
    assert v["reproduced"] is True and v["max_loss_deviation"] == 0.0
    assert v["autograd_node"] == node
    assert v["run_id"] == f"live-{fault}" and v["schema_version"] == REPORT_SCHEMA_VERSION
    assert v["cause_class"] and report_problems(v) == []
    if fault == "backward":
        assert v["evidence"]["primitive"] == "aten.div"
    assert v["evidence"]["in_process"]["mode"] == "thread"
    assert v["evidence"]["torch_flags"]["unisolated_random_ops"] == []
    if fault == "data":
        assert v["evidence"]["field"] == "batch[0]" and v["evidence"]["samples"] == [2]
    if fault == "forward":
        # the rebuild re-ran the steps since the snapshot (with dropout) bit for bit
        assert v["steps_rebuilt"] >= 1 and len(v["evidence"]["rebuilt_losses"]) == v["steps_rebuilt"] + 1
    assert read_run_meta(out["watch"].run_dir).extra["localize"] == "thread"


def test_without_loss_fn_or_recipe_a_forward_nan_is_named_and_the_gaps_are_said(tmp_path):
    out = train(tmp_path, "live-fwd-only", "forward_only")
    v = _verdict(out["watch"].run_dir)
    assert (v["phase"], v["module"], v["module_type"], v["op"], v["step"]) == \
        ("forward", "feats", "LogFeatures", "aten.log", FAULT_STEP)
    assert v["reproduced"] is True
    ev = v["evidence"]
    assert ev["mode"] == "forward_only" and ev["checked"] == ["forward"]
    assert ev["not_checked"][:3] == ["loss", "backward", "optimizer step"]
    assert "loss_fn=" in ev["how_to_enable"] and "recipe=" in ev["how_to_enable"]
    assert "not checked" in ev["warning"]


def test_forward_only_says_so_when_the_forward_is_finite(tmp_path):
    # The loss fault lives in the loss function, which a forward-only run never sees.
    from tests.replay import livecases

    out = livecases.train(tmp_path, "live-fwd-only-loss", "loss", localize="thread", no_loss_fn=True)
    v = _verdict(out["watch"].run_dir)
    assert v["phase"] == "none" and v["reproduced"] is False
    assert "loss_fn=" in v["fix"]
    assert "finite" in v["cause"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


@pytest.mark.parametrize("fault", ["data", "forward_only"])
def test_localization_leaves_training_bitwise_unchanged(tmp_path, fault):
    # Same loop (dropout draws from the global generator every step), once with the localization
    # running in the background during the steps after the fault, once with it off.
    on = train(tmp_path / "on", "rng-on", fault, steps=20, localize="thread", until_verdict=True)
    assert on["verdict_seen_at"] is not None and on["verdict_seen_at"] > FAULT_STEP + 2  # it overlapped
    off = train(tmp_path / "off", "rng-off", fault, steps=on["steps_run"], localize="off")
    assert off["steps_run"] == on["steps_run"]
    assert verdict_path(on["watch"].captures[0]).exists()
    assert not any(p.name.endswith(".verdict.json") for p in (off["watch"].run_dir).iterdir())
    assert torch.equal(on["rng_after"], off["rng_after"])
    for (n, a), (_, b) in zip(on["model"].named_parameters(), off["model"].named_parameters()):
        assert torch.equal(_bits(a), _bits(b)), n
    streams = []
    for r in (on, off):
        lines = (r["watch"].run_dir / "stream-rank0.jsonl").read_text().splitlines()
        streams.append([json.loads(x)["loss"] for x in lines if json.loads(x).get("kind") == "step"])
    assert json.dumps(streams[0]) == json.dumps(streams[1])  # NaN-aware, bit-for-bit as text


def test_localize_off_and_bad_settings(tmp_path):
    from sentineld.agent import attach

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="localize must be one of"):
        attach(model, opt, runs_dir=tmp_path, metrics_port=0, localize="bogus")
    with pytest.raises(ValueError, match="loss_fn must be a function"):
        attach(model, opt, runs_dir=tmp_path, metrics_port=0, loss_fn=3)
    w = attach(model, opt, runs_dir=tmp_path, metrics_port=0, localize="off", run_id="off")
    assert w._live is None and read_run_meta(w.run_dir).extra["localize"] == "off"
    w.close()
    # A recipe and no loss_fn: the daemon's replay does it, as before.
    w = attach(model, opt, runs_dir=tmp_path, metrics_port=0, recipe="m:f", run_id="rec")
    assert w._live is None and read_run_meta(w.run_dir).extra["localize"] == "off"
    w.close()


def test_memory_estimate_is_model_plus_adam_state(tmp_path):
    from sentineld.agent import attach

    model = torch.nn.Linear(100, 50)  # 5050 float32 parameters
    opt = torch.optim.Adam(model.parameters())
    w = attach(model, opt, runs_dir=tmp_path, metrics_port=0, loss_fn=lambda m, b: m(b).sum())
    assert w._live.memory_bytes == 5050 * 4 * 3  # parameters + exp_avg + exp_avg_sq
    assert read_run_meta(w.run_dir).extra["localize_memory_bytes"] == 5050 * 4 * 3
    w.close()


def test_cli_replay_of_a_run_without_recipe_is_forward_only_from_the_capture(tmp_path):
    """After the process is gone, `sentineld replay` gives the same forward-only verdict from the
    forward calls recorded in the capture and the model class recorded in run.json."""
    import subprocess
    import sys

    from sentineld.contracts.capture import open_capture
    from tests.conftest import REPO

    out = train(tmp_path, "cli-fwd-only", "forward_only", localize="thread")
    run_dir = out["watch"].run_dir
    cap = next(c[3] for c in list_captures(run_dir) if c[2] == "nonfinite")
    with open_capture(cap) as c:
        calls = c.forward_calls()
        assert sorted(calls) == c.steps and torch.equal(calls[FAULT_STEP]["args"][0][:, 0], torch.full((6,), -1000.0))
    proc = subprocess.run([sys.executable, "-m", "sentineld", "replay", str(run_dir), "--json"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    v = json.loads(proc.stdout)
    assert (v["phase"], v["module"], v["op"], v["step"], v["reproduced"]) == \
        ("forward", "feats", "aten.log", FAULT_STEP, True)
    assert v["evidence"]["mode"] == "forward_only"
    own = json.loads(verdict_path(cap).read_text())
    assert (own["phase"], own["module"], own["op"], own["step"]) == (v["phase"], v["module"], v["op"], v["step"])


def test_optimizer_fault_seen_at_a_snapshot_step_is_replayed_from_the_snapshot_before(tmp_path):
    """Regression: the optimizer broke the parameters at step 14, the NaN loss showed at step 15,
    which is also a snapshot step (every 5): the capture took snapshot 15, already corrupt, and
    the verdict was 'non-finite values were already in the rebuilt state'. Step 49 here: past the
    densely sampled first steps, so no layer sample of step 49 shows the parameters early."""
    out = train(tmp_path, "snap-late", "optimizer", fault_step=49, steps=56)
    cap = next(c for c in list_captures(out["watch"].run_dir) if c[2] == "nonfinite")
    assert cap[1] == 50
    v = _verdict(out["watch"].run_dir)
    assert (v["phase"], v["module"], v["op"], v["step"]) == ("optimizer", None, "aten.div", 49), v
    assert v["evidence"]["snapshot_step"] == 45 and v["reproduced"] is True


def test_accumulation_clipping_and_grad_scaler_replay_bitwise(tmp_path):
    """The in-process replay does what the loop did: 2 micro-batches, clipping, a GradScaler."""
    import torch.nn.functional as F

    from sentineld.agent import attach
    from tests.replay.livecases import Net, make_batch

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    model, scaler = Net(), torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def loss_fn(m, b):
        return F.cross_entropy(m(b[0]), b[1])

    watch = attach(model, opt, run_id="acc", runs_dir=tmp_path, metrics_port=0, loss_fn=loss_fn, scaler=scaler,
                   accumulation_steps=2, clip_grad_norm=0.05, snapshot_every=5)
    for step in range(FAULT_STEP + 4):
        micro = [make_batch(step, "forward" if i == 1 else "none", gen) for i in range(2)]
        opt.zero_grad(set_to_none=True)
        for mb in micro:
            loss = loss_fn(model, mb)
            scaler.scale(loss / 2).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        scaler.step(opt)
        scaler.update()
        watch.step(loss, micro)
    watch.close()
    v = _verdict(watch.run_dir)
    assert (v["phase"], v["module"], v["op"], v["step"]) == ("forward", "feats", "aten.log", FAULT_STEP), v
    assert v["reproduced"] is True and v["steps_rebuilt"] == FAULT_STEP - v["evidence"]["snapshot_step"] >= 1
    assert v["evidence"]["micro_batch"] == 1


DIES = """
import sys, torch
from tests.replay.livecases import Net, loss_for, make_batch, FAULT_STEP
from sentineld.agent import attach
torch.manual_seed(0)
gen = torch.Generator().manual_seed(1)
model = Net()
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
loss_fn = loss_for("forward")
watch = attach(model, opt, run_id="dies", runs_dir=sys.argv[1], metrics_port=0, loss_fn=loss_fn,
               snapshot_every=5)
for step in range(40):
    x, y = make_batch(step, "forward", gen)
    opt.zero_grad()
    loss = loss_fn(model, (x, y))
    loss.backward()
    opt.step()
    watch.step(loss, (x, y))
    if not torch.isfinite(loss):
        raise RuntimeError(f"loss is {loss.item()} at step {step}")  # the run dies at once
"""


def test_a_run_that_dies_at_the_nan_still_leaves_its_verdict(tmp_path):
    """The loop raises right at the NaN step (uncaught): the exit path writes the incident and
    crash captures and waits for the localization before the process ends."""
    import subprocess
    import sys

    from tests.conftest import REPO

    proc = subprocess.run([sys.executable, "-c", DIES, str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and f"RuntimeError: loss is nan at step {FAULT_STEP}" in proc.stderr, proc.stderr[-2000:]
    v = _verdict(tmp_path / "dies")
    assert (v["phase"], v["module"], v["op"], v["step"], v["reproduced"]) == \
        ("forward", "feats", "aten.log", FAULT_STEP, True)


def test_cli_replay_of_a_loss_fn_run_points_to_its_own_verdict(tmp_path):
    import subprocess
    import sys

    from tests.conftest import REPO

    out = train(tmp_path, "cli-lossfn", "forward")
    cap = next(c[3] for c in list_captures(out["watch"].run_dir) if c[2] == "nonfinite")
    proc = subprocess.run([sys.executable, "-m", "sentineld", "replay", str(out["watch"].run_dir)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    # The run's loss_fn is a closure: its recorded objects cannot be rebuilt; say why and what to do.
    assert "cannot be rebuilt" in proc.stderr and "closure" in proc.stderr and "--recipe" in proc.stderr
    assert str(verdict_path(cap)) in proc.stderr
