"""The agent in a real training loop: it records, captures once per incident, exports, never
perturbs or breaks training, and detaches cleanly."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request

import pytest
import torch
import torch.nn.functional as F

from sentineld.agent import AgentConfig, attach
from sentineld.contracts.capture import open_capture
from sentineld.contracts.records import record_from_json


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 3))
    return m, torch.optim.Adam(m.parameters(), 1e-2)


def _train(m, opt, watch, steps: int, nan_at: set[int] = frozenset(), seed: int = 1) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    losses = []
    for i in range(steps):
        x, y = torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)
        if i in nan_at:
            x[0, 0] = float("nan")
        opt.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        if watch is not None:
            watch.step(loss, batch=(x, y))
        losses.append(loss.item())
    return losses


def _stream(watch) -> list[dict]:
    return [json.loads(x) for x in (watch.run_dir / "stream-rank0.jsonl").read_text().splitlines()]


def test_agent_does_not_change_training_and_detaches_exactly(tmp_path):
    m1, o1 = _model()
    torch.manual_seed(5)
    bare = _train(m1, o1, None, 40)
    m2, o2 = _model()
    torch.manual_seed(5)
    watch = attach(m2, o2, run_id="same", runs_dir=tmp_path, metrics_port=0, snapshot_every=10)
    watched = _train(m2, o2, watch, 40)
    watch.close()
    assert bare == watched  # bitwise: dropout draws and parameters untouched by the agent
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p1, p2)
    assert len(m2._forward_pre_hooks) == 0 and len(m2._forward_hooks) == 0
    assert len(o2._optimizer_step_pre_hooks) == 0 and len(o2._optimizer_step_post_hooks) == 0


def test_records_hold_loss_grad_norm_lr_and_step_time(tmp_path):
    m, o = _model()
    watch = attach(m, o, run_id="rec", runs_dir=tmp_path, metrics_port=0)
    losses = _train(m, o, watch, 12)
    watch.close()
    lines = _stream(watch)
    assert lines[0]["kind"] == "start" and lines[-1]["kind"] == "end" and lines[-1]["steps"] == 12
    recs = [record_from_json(x) for x in lines if x["kind"] == "step"]
    assert [r.step for r in recs] == list(range(12))
    assert [r.loss for r in recs] == pytest.approx(losses, rel=0, abs=0)
    assert all(r.lr == 1e-2 and r.grad_norm > 0 and r.step_s > 0 for r in recs)
    assert recs[1].grads_carried is False  # zero_grad(set_to_none) ran


def test_grad_norm_equals_clip_grad_norm_reference(tmp_path):
    m, o = _model()
    seen = []
    watch = attach(m, o, run_id="gn", runs_dir=tmp_path, metrics_port=0)
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    loss = F.cross_entropy(m(x), y)
    loss.backward()
    seen.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), float("inf"))))
    o.step()
    watch.step(loss, (x, y))
    watch.close()
    rec = next(x for x in _stream(watch) if x["kind"] == "step")
    assert rec["grad_norm"] == pytest.approx(seen[0], rel=1e-6)


def test_one_capture_per_incident_and_rearm(tmp_path):
    m, o = _model()
    watch = attach(m, o, run_id="inc", runs_dir=tmp_path, metrics_port=0, snapshot_every=10, rearm_steps=5)
    _train(m, o, watch, 25, nan_at={15})  # one NaN input: the loss is NaN at 15, params go NaN after
    watch.close()
    caps = sorted(tmp_path.joinpath("inc").glob("capture-*.h5"))
    assert [c.name for c in caps] == ["capture-rank0-step000000015-nonfinite.h5"]
    with open_capture(caps[0]) as cap:
        assert cap.first_step == 15 and cap.snapshot_step == 10
        assert cap.steps == list(range(10, 18))  # post_steps=2 after the offending step
        assert torch.isnan(cap.step(15).batch[0][0, 0])
    assert watch.captures == caps


def test_second_incident_after_rearm_gets_its_own_capture(tmp_path):
    m, o = _model()
    watch = attach(m, o, run_id="two", runs_dir=tmp_path, metrics_port=0, snapshot_every=4, rearm_steps=5,
                   post_steps=0)
    g = torch.Generator().manual_seed(0)
    for i in range(30):
        x, y = torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)
        o.zero_grad()
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        o.step()
        # A recorded NaN that does not poison the parameters, so the run recovers and re-arms.
        watch.step(torch.tensor(float("nan")) if i in (8, 20) else loss, (x, y))
    watch.close()
    assert [p.name for p in sorted(watch.captures)] == [
        "capture-rank0-step000000008-nonfinite.h5", "capture-rank0-step000000020-nonfinite.h5"]


def test_internal_error_disables_the_agent_without_raising(tmp_path, caplog):
    m, o = _model()
    watch = attach(m, o, run_id="err", runs_dir=tmp_path, metrics_port=0)
    _train(m, o, watch, 3)
    watch.step("not a loss", batch=None)  # the agent's own float() fails inside
    assert watch.enabled is False
    _train(m, o, watch, 3)  # training goes on, hooks are gone
    assert len(m._forward_pre_hooks) == 0
    watch.close()
    kinds = [x["kind"] for x in _stream(watch)]
    assert kinds.count("agent_error") == 1
    assert sum("agent disabled" in r.message for r in caplog.records) == 1


def test_crash_in_watched_block_writes_a_crash_capture(tmp_path):
    m, o = _model()
    with pytest.raises(RuntimeError, match="boom"):
        with attach(m, o, run_id="crash", runs_dir=tmp_path, metrics_port=0, snapshot_every=5) as watch:
            _train(m, o, watch, 12)
            raise RuntimeError("boom")
    caps = list((tmp_path / "crash").glob("capture-*-crash.h5"))
    assert len(caps) == 1
    with open_capture(caps[0]) as cap:
        assert cap.trigger == "crash" and "RuntimeError: boom" in cap.message
        assert cap.steps[-1] == 11 and cap.snapshot_step == 10
    assert _stream(watch)[-1]["reason"] == "crashed"


def test_metrics_endpoint_serves_the_last_step(tmp_path):
    m, o = _model()
    watch = attach(m, o, run_id="prom", runs_dir=tmp_path, metrics_port=-1)
    losses = _train(m, o, watch, 7)
    body = urllib.request.urlopen(f"http://127.0.0.1:{watch.metrics_port}/metrics", timeout=5).read().decode()
    watch.close()
    values = {line.split("{")[0]: line.rsplit(" ", 1)[1] for line in body.splitlines()
              if line.startswith("sentineld_") and 'run="prom"' in line}
    assert float(values["sentineld_train_loss"]) == pytest.approx(losses[-1])
    assert float(values["sentineld_train_steps_total"]) == 7
    assert float(values["sentineld_step"]) == 6
    assert float(values["sentineld_learning_rate"]) == 0.01
    assert 'rank="0"' in body
    # host = the training host's name (d9bb298 had none: Prometheus filled in the scrape address)
    assert f'host="{socket.gethostname()}"' in body


@pytest.mark.parametrize("bad, match", [
    (dict(run_id="../x"), "run_id"), (dict(recipe="nocolon"), "recipe"),
    (dict(snapshot_every=500, window=100), "snapshot_every"), (dict(flush_s=0), "flush_s"),
    (dict(metrics_port=70000), "metrics_port"), (dict(no_such_setting=1), "unknown agent setting"),
])
def test_bad_arguments_are_named(tmp_path, bad, match):
    m, o = _model()
    with pytest.raises((ValueError, TypeError), match=match):
        attach(m, o, runs_dir=tmp_path, **{"metrics_port": 0, **bad})


def test_agent_import_does_not_pull_daemon_dependencies():
    code = ("import sys, sentineld.agent; bad = [m for m in ('apprise', 'watchdog', 'click', 'rich') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_config_defaults_are_valid():
    cfg = AgentConfig()
    assert cfg.metrics_addr == "127.0.0.1" and cfg.snapshot_every == 0 and cfg.window >= 2 * cfg.min_snapshot_every


def test_reused_run_id_gets_a_fresh_directory(tmp_path):
    """Regression: re-running a script with run_id="exp1" appended to the old stream and
    overwrote its capture, so the daemon saw no new incident."""
    ids = []
    for _ in range(3):
        m, o = _model()
        watch = attach(m, o, run_id="exp1", runs_dir=tmp_path, metrics_port=0)
        _train(m, o, watch, 2)
        watch.close()
        ids.append(watch.run_id)
    assert ids == ["exp1", "exp1.2", "exp1.3"]
    assert all(len([x for x in _stream_of(tmp_path / i) if x["kind"] == "start"]) == 1 for i in ids)


def _stream_of(run_dir):
    return [json.loads(x) for x in (run_dir / "stream-rank0.jsonl").read_text().splitlines()]


def test_zero_grad_between_forward_and_backward_is_not_carried_grads(tmp_path):
    """Regression (signatures review): the carried-gradient check ran at the forward, so a loop
    calling zero_grad() after the forward read as 'zero_grad forgotten' on every step."""
    m, o = _model()
    watch = attach(m, o, run_id="zg", runs_dir=tmp_path, metrics_port=0)
    for _ in range(4):
        x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
        loss = F.cross_entropy(m(x), y)
        o.zero_grad()
        loss.backward()
        o.step()
        watch.step(loss, (x, y))
    watch.close()
    assert [r["grads_carried"] for r in _stream(watch) if r["kind"] == "step"] == [False] * 4


def test_forgotten_zero_grad_is_recorded_as_carried(tmp_path):
    m, o = _model()
    watch = attach(m, o, run_id="nz", runs_dir=tmp_path, metrics_port=0)
    for _ in range(3):
        x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        o.step()
        watch.step(loss, (x, y))
    watch.close()
    assert [r["grads_carried"] for r in _stream(watch) if r["kind"] == "step"] == [False, True, True]


def test_sampled_steps_carry_per_layer_stats_and_export_them(tmp_path):
    m, o = _model()
    watch = attach(m, o, run_id="layers", runs_dir=tmp_path, metrics_port=-1, layer_every=5)
    _train(m, o, watch, 140)
    body = urllib.request.urlopen(f"http://127.0.0.1:{watch.metrics_port}/metrics", timeout=5).read().decode()
    watch.close()
    recs = [r for r in _stream(watch) if r["kind"] == "step"]
    sampled = [r["step"] for r in recs if r.get("layers")]
    # every step of the dense head (16), then gaps 1, 2, 4, then every 5 (probes.sampled_at)
    assert sampled == [*range(32), *range(32, 64, 2), *range(64, 128, 4), 130, 135]
    stats = recs[8]["layers"]     # a full sample (probes.full_at): norms and activations
    assert stats["0"]["grad_norm"] > 0 and 0 <= stats["1"]["dead_fraction"] <= 1
    # the dense head's other steps measure the activations only (no norms, no parameter copy)
    assert set(recs[3]["layers"]) == {"1"} and 0 <= recs[3]["layers"]["1"]["dead_fraction"] <= 1
    # full in the head: 0, 1, 2, 4, 8 and the steady cadence (every 5)
    assert [r["step"] for r in recs if r.get("layers") and "0" in r["layers"]][:9] == [0, 1, 2, 4, 5, 8, 10, 15, 16]
    host = socket.gethostname()
    assert f'sentineld_layer_grad_norm{{host="{host}",module="0",rank="0",run="layers"}}' in body


def test_per_layer_norms_stay_exported_after_an_activations_only_sample(tmp_path):
    """Regression (CI, test_oncall): a scrape after step 11 of the dense head (an
    activations-only sample) showed no sentineld_layer_grad_norm series at all, so the
    dashboard's per-layer panels were empty for the first ~50 steps of every run. A gauge shows
    the last value measured: the norms of step 8, the newest full sample."""
    m, o = _model()
    watch = attach(m, o, run_id="held", runs_dir=tmp_path, metrics_port=-1, layer_every=50)
    _train(m, o, watch, 12)
    body = urllib.request.urlopen(f"http://127.0.0.1:{watch.metrics_port}/metrics", timeout=5).read().decode()
    watch.close()
    recs = [r for r in _stream(watch) if r["kind"] == "step"]
    assert set(recs[11]["layers"]) == {"1"}  # the newest sample measured the activations only
    host = socket.gethostname()
    for module in ("0", "3"):
        line = next(x for x in body.splitlines()
                    if x.startswith(f'sentineld_layer_grad_norm{{host="{host}",module="{module}",'))
        assert float(line.split()[-1]) == pytest.approx(recs[8]["layers"][module]["grad_norm"], rel=1e-6)
    dead = next(x for x in body.splitlines() if x.startswith(f'sentineld_layer_dead_ratio{{host="{host}",module="1",'))
    assert float(dead.split()[-1]) == pytest.approx(recs[11]["layers"]["1"]["dead_fraction"])


def test_a_failed_sharded_checkpoint_is_a_notice_not_a_dead_capture_thread(tmp_path):
    """DCP's CheckpointException (a peer's dcp.save failed) derives from BaseException: the
    capture thread's ``except Exception`` let it through, the thread died with a traceback and
    the stream said nothing (found reading agent/capturer.py). Now: training goes on, the capture
    is absent and the stream carries the agent's warning."""
    from torch.distributed.checkpoint.api import CheckpointException

    class FailingSaver:  # stands in for agent/sharded.py's saver: no second rank can run here
        def save(self, *args, **kwargs):
            raise CheckpointException("save failed on rank 1", {1: (OSError("peer disk full"), None)})

    m, o = _model()
    watch = attach(m, o, run_id="dcpfail", runs_dir=tmp_path, metrics_port=0, post_steps=0)
    watch._writer.sharded = FailingSaver()
    losses = _train(m, o, watch, 6, nan_at={3})
    watch.close()
    assert len(losses) == 6
    assert not list(watch.run_dir.glob("capture-*.h5"))
    notes = [r for r in _stream(watch) if r["kind"] == "agent_warning"]
    assert any("capture not written" in r["message"] for r in notes), notes
