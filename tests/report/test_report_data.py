"""The report's data: pure functions over records, the readers, the page's fallbacks, bad input."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sentineld.contracts.records import LayerStats, StepRecord
from sentineld.contracts.verdict import notification_text
from sentineld.daemon.outbox import Notification, Outbox
from sentineld.report import data as d
from sentineld.report import default_report_path, write_report
from sentineld.report.sources import read_notifications, read_verdict


def _rec(step: int, loss: float, gn: float | None = 1.0, layers: dict | None = None) -> StepRecord:
    return StepRecord(step=step, loss=loss, grad_norm=gn, lr=0.1, layers=layers)


def test_curves_thin_long_runs_but_keep_every_nonfinite_step() -> None:
    recs = [_rec(s, math.nan if s in (12345, 99998) else 1.0, math.inf if s == 777 else 2.0) for s in range(100_000)]
    c = d.curves(recs, limit=1000)
    assert 1000 <= len(c.steps) <= 1004
    assert {12345, 99998, 777, 0, 99999} <= set(c.steps.tolist())
    i = int(np.flatnonzero(c.steps == 777)[0])
    assert math.isinf(c.grad_norm[i]) and c.grad_norm_present[i]


def test_curves_tell_missing_from_nonfinite_and_last_record_of_a_step_wins() -> None:
    c = d.curves([_rec(0, 1.0, None), _rec(1, 5.0), _rec(1, 2.0, math.nan)])
    assert c.steps.tolist() == [0, 1] and c.loss.tolist() == [1.0, 2.0]
    assert c.grad_norm_present.tolist() == [False, True] and math.isnan(c.grad_norm[1])


def test_layer_grid_keeps_module_order_and_marks_missing_cells() -> None:
    recs = [_rec(0, 1.0, layers={"b": LayerStats(grad_norm=1.0), "a": LayerStats(grad_norm=2.0)}),
            _rec(1, 1.0),  # not sampled
            _rec(2, 1.0, layers={"b": LayerStats(grad_norm=math.nan), "c": LayerStats(dead_fraction=0.5)})]
    g = d.layer_grid(recs, "grad_norm")
    assert g.modules == ["b", "a"] and g.steps.tolist() == [0, 2]
    assert g.values[0, 0] == 1.0 and math.isnan(g.values[0, 1]) and not g.missing[0, 1]  # a real NaN
    assert g.missing[1, 1]  # "a" not reported at step 2
    ds = d.dead_or_saturated_grid(recs + [_rec(3, 1.0, layers={"t": LayerStats(saturated_fraction=0.25)})])
    assert ds.modules == ["c (dead)", "t (saturated)"] and ds.values[1, -1] == 0.25


def test_layer_grid_caps_rows_keeping_modules_with_nonfinite_values() -> None:
    layers = {f"m{i}": LayerStats(grad_norm=math.inf if i == 90 else 1.0) for i in range(100)}
    g = d.layer_grid([_rec(0, 1.0, layers=layers)], "grad_norm", max_rows=5)
    assert g.modules == ["m0", "m1", "m2", "m3", "m90"] and g.total_modules == 100
    assert math.isinf(g.values[4, 0])


def test_hist_counts_nonfinite_and_keeps_the_finite_values() -> None:
    h = d.hist("w", np.array([[1.0, np.nan], [np.inf, -2.0]]), "float32")
    assert (h.numel, h.nonfinite, h.shape) == (4, 2, (2, 2)) and sorted(h.values.tolist()) == [-2.0, 1.0]


def test_notifications_of_other_runs_are_left_out_and_the_outbox_is_not_touched(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "outbox")
    box.add(Notification(id="a", kind="alert", title="t", body="b", run="mine", signature="nonfinite", step=3))
    box.add(Notification(id="b", kind="alert", title="t", body="b", run="other", signature="nonfinite", step=4))
    box.finish(Notification(id="c", kind="verdict", title="v", body="b", run="mine", signature="replay", step=3,
                            data={"phase": "forward", "step": 3}))
    inflight = tmp_path / "outbox" / "d.json.tmp"  # a save the daemon has in flight
    inflight.write_text("{}")
    notes = read_notifications(tmp_path, "mine")
    assert sorted(n.id for n in notes) == ["a", "c"]
    assert inflight.exists()
    assert [m.step for m in d.alert_markers(notes)] == [3, 3]
    # A state dir the daemon has not made an outbox in yet is read as empty and left as it is.
    assert read_notifications(tmp_path / "fresh", "mine") == [] and not (tmp_path / "fresh").exists()


def test_verdict_file_forms(tmp_path: Path) -> None:
    v = {"phase": "backward", "step": 2, "run_id": "r"}
    (tmp_path / "plain.json").write_text(json.dumps(v))
    (tmp_path / "daemon.json").write_text(json.dumps({"capture": "x", "result": "ok", "report": v}))
    (tmp_path / "other.json").write_text(json.dumps({"hello": 1}))
    assert read_verdict(tmp_path / "plain.json") == v == read_verdict(tmp_path / "daemon.json")
    with pytest.raises(ValueError, match="holds no replay verdict"):
        read_verdict(tmp_path / "other.json")


def test_verdict_message_names_the_report_path_and_command() -> None:
    cap = "/runs/r1/capture-rank0-step000000007-nonfinite.h5"
    _title, body = notification_text({"run_id": "r1", "step": 7, "phase": "forward", "capture": cap})
    lines = body.splitlines()
    assert "report: sentineld report /runs/r1" in lines and f"  writes {default_report_path('/runs/r1')}" in lines
    assert "sentineld regress /runs/r1" in body


def test_report_without_recipe_or_verdict_says_what_is_unavailable(planted_run: dict, tmp_path: Path) -> None:
    run_dir = tmp_path / "copy"
    shutil.copytree(planted_run["run_dir"], run_dir)
    meta = json.loads((run_dir / "run.json").read_text())
    meta["recipe"] = None
    (run_dir / "run.json").write_text(json.dumps(meta))
    out = write_report(run_dir, state_dir=tmp_path / "no-state")
    assert out == run_dir / "report.html" and (out.stat().st_mode & 0o777) == 0o600
    html = out.read_text()
    plots = html.split('name="sentineld-plots" content="')[1].split('"')[0].split(",")
    assert plots == ["curves", "grad_norm", "update_ratio", "dead_or_saturated", "weights"]
    assert "activations unavailable: the run recorded neither a recipe nor a loss_fn" in html
    assert "no replay verdict for this run: run `sentineld report" in html
    assert "no alerts recorded for this run" in html
    assert "<script" not in html


def test_report_escapes_text_from_the_run(planted_run: dict, tmp_path: Path) -> None:
    v = tmp_path / "v.json"
    v.write_text(json.dumps({"phase": "forward", "step": 7, "module": "<img src=x onerror=alert(1)>",
                             "cause": "a & b", "evidence": {}}))
    html = write_report(planted_run["run_dir"], tmp_path / "r.html", verdict_path=v, activations=False).read_text()
    assert "<img src=x" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html


def test_report_names_where_when_the_module_is_null(planted_run: dict, tmp_path: Path) -> None:
    # A verdict outside the model has module null (schema 2); the page says where instead.
    v = tmp_path / "v.json"
    v.write_text(json.dumps({"phase": "forward", "step": 7, "module": None, "where": "loss function, outside the model",
                             "op": "aten.log", "cause": "log(0)", "evidence": {}}))
    html = write_report(planted_run["run_dir"], tmp_path / "r.html", verdict_path=v, activations=False).read_text()
    assert "step 7: first non-finite value made in forward, loss function, outside the model, op aten.log" in html
    assert "module None" not in html


def test_report_replay_flag_shows_a_fresh_verdict(planted_run: dict, tmp_path: Path) -> None:
    out = write_report(planted_run["run_dir"], tmp_path / "r.html", replay=True, state_dir=tmp_path / "none")
    html = out.read_text()
    assert "step 7: first non-finite value made in forward, module norm (SampleNorm), op aten.div" in html
    assert 'content="curves,grad_norm,update_ratio,dead_or_saturated,weights,activations,replay"' in html


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sentineld", *args], capture_output=True, text=True, timeout=120)


def test_cli_bad_input_exits_2_with_a_reason(tmp_path: Path, planted_run: dict) -> None:
    r = _cli("report", str(tmp_path / "nope"), "--runs-dir", str(tmp_path))
    assert r.returncode == 2 and "does not exist" in r.stderr
    (tmp_path / "bad.json").write_text("[1,")
    r = _cli("report", str(planted_run["run_dir"]), "--verdict", str(tmp_path / "bad.json"))
    assert r.returncode == 2 and "not JSON" in r.stderr
    r = _cli("report", str(planted_run["run_dir"]), "--verdict", str(tmp_path / "bad.json"), "--replay")
    assert r.returncode == 2 and "not both" in r.stderr
    r = _cli("report", str(planted_run["run_dir"]), "-o", str(tmp_path / "missing-dir" / "r.html"),
             "--no-activations")
    assert r.returncode == 2 and "cannot write the report" in r.stderr


def test_without_matplotlib_the_cli_says_what_to_install(planted_run: dict) -> None:
    # matplotlib blocked in a real interpreter (sys.modules entry None makes its import fail).
    code = ("import sys; sys.modules['matplotlib'] = None; from sentineld.cli import cli; "
            f"cli(['report', {str(planted_run['run_dir'])!r}, '--no-activations'])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "pip install 'sentineld[report]'" in r.stderr, r.stderr
