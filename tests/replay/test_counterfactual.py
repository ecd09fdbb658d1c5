"""The counterfactual engine on planted faults whose answer is known from how they were planted
(tests/replay/spikecases.py): the spike verdict's cause (issue 21), what-if candidates and the
reproducibility class (issue 25). Each trains a 50-step run with the real agent, then replays
its capture in-process (the recipe is imported from the repository root, as the daemon would)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from sentineld.contracts.recipe import train_step
from sentineld.contracts.rundir import list_captures
from sentineld.contracts.verdict import render_text
from sentineld.replay.engine import replay_run
from tests.replay import spikecases as sc
from tests.replay.spikecases import AT, BAD_SAMPLES

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def at_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # run.json's cwd: where tests.replay.spikecases is imported from


def _run(case: str, tmp: Path, **agent: Any) -> Path:
    return Path(sc.train(case, tmp / "runs", **agent))


def _captures(run: Path, trigger: str) -> list[Path]:
    return [p for _r, _n, t, p in list_captures(run) if t == trigger]


def _verdict(run: Path, cap: Path, **kw: Any) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(replay_run(run, capture=cap, **kw).to_json())
    return out


@pytest.mark.usefixtures("at_repo")
def test_spike_from_corrupted_samples_is_data_naming_them_first(tmp_path: Path) -> None:
    run = _run("data", tmp_path)
    caps = _captures(run, "spike")
    assert len(caps) == 1 and caps[0].name.endswith("-spike.h5")
    v = _verdict(run, caps[0])
    assert v["kind"] == "spike" and 0 <= v["step"] - AT <= 3
    assert v["cause_class"] == "data" and v["reproduced"] is True
    assert set(v["samples"][:len(BAD_SAMPLES)]) == set(BAD_SAMPLES)
    cells = v["evidence"]["losses"]
    assert cells["earlier_state_this_batch"] > 5 * cells["earlier_state_neighbour_batch"]  # the batch spikes anywhere
    # truth without the product: those rows are the ones the plant changed, and they alone
    # carry the loss (recomputed here on a fresh model of the recipe, no replay code)
    g = torch.Generator().manual_seed(1)
    batches = [sc.batch_of("data", s, g) for s in range(AT + 1)]
    clean = sc.batch_of("data", AT, torch.Generator().manual_seed(99))
    assert not torch.equal(batches[AT][0][list(BAD_SAMPLES)], clean[0][list(BAD_SAMPLES)])
    print(f"spike replay (data): {v['elapsed_s']:.3f} s")


@pytest.mark.usefixtures("at_repo")
def test_spike_after_one_step_lr_jump_is_state_lr(tmp_path: Path) -> None:
    run = _run("lr_jump", tmp_path)
    v = _verdict(run, _captures(run, "spike")[0])
    assert v["kind"] == "spike" and 0 <= v["step"] - (AT + 1) <= 3  # the jump's update shows next step
    assert v["cause_class"] == "state", v["evidence"]
    st = v["evidence"]["state"]
    assert st["quantity"] == "lr" and math.isclose(st["lr"] / st["previous_lr"], 50.0)
    print(f"spike replay (lr jump): {v['elapsed_s']:.3f} s")


@pytest.mark.usefixtures("at_repo")
def test_spike_from_adam_second_moment_in_one_module_names_it(tmp_path: Path) -> None:
    run = _run("adam_module", tmp_path)
    v = _verdict(run, _captures(run, "spike")[0])
    assert v["cause_class"] == "state" and 0 <= v["step"] - (AT + 1) <= 3
    assert v["module"] == "body" and v["evidence"]["state"]["quantity"] == "second_moment"
    assert v["op"] == "exp_avg_sq"


@pytest.mark.usefixtures("at_repo")
def test_spike_of_one_batch_on_one_state_is_interaction(tmp_path: Path) -> None:
    run = _run("interaction", tmp_path)
    v = _verdict(run, _captures(run, "spike")[0])
    assert v["cause_class"] == "interaction" and 0 <= v["step"] - AT <= 3
    c = v["evidence"]["losses"]
    assert c["this_state_this_batch"] > 3 * max(c["earlier_state_this_batch"], c["this_state_neighbour_batch"])


@pytest.mark.usefixtures("at_repo")
def test_what_if_log_zero_eps_fixes_it_and_class_is_software(tmp_path: Path) -> None:
    run = _run("log_zero", tmp_path)
    v = _verdict(run, _captures(run, "nonfinite")[0], what_if=True)
    assert v["op"] == "aten.log"
    rows = v["what_if"]
    fixed = [r for r in rows if r["finite"]]
    assert fixed and (fixed[0]["change"].startswith(("eps", "clamp", "stable rewrite")))
    assert fixed[0]["steps_checked"] >= 2 and fixed[0]["applied"] >= 1
    assert all(r["finite"] for r in rows[:len(fixed)])  # finite first
    assert not next(r for r in rows if r["change"] == "lr x0.1")["finite"]  # lr is not the fault
    rep = v["reproducibility"]
    assert rep["class"] == "software" and rep["identical"] and rep["repeats"] == 3
    assert "evidence, not proof" in render_text(v)
    wi = v["evidence"]["what_if"]
    print(f"what-if (log 0): {len(rows)} candidates, {wi['per_candidate_s']:.3f} s each, {wi['total_s']:.3f} s total; "
          f"reproducibility {rep['wall_s']:.3f} s")


@pytest.mark.usefixtures("at_repo")
def test_what_if_log_zero_behind_a_gather_is_rewritten_not_never_ran(tmp_path: Path) -> None:
    """Leftover of issue 25: for a hand-written NLL (softmax, the label's column, log) the table
    read "stable rewrite of aten.log ... (the op never ran there)" while the verdict named that very
    op: the rewrite knew only a log straight on softmax's output, and 0 rewrites read as 0 calls."""
    run = _run("log_zero_nll", tmp_path)
    v = _verdict(run, _captures(run, "nonfinite")[0], what_if=True)
    assert (v["phase"], v["module"], v["op"], v["step"]) == ("forward", None, "aten.log", AT)
    guarded = [r for r in v["what_if"] if "op_calls" in r]
    assert {r["change"] for r in guarded} == {"eps at aten.log", "stable rewrite of aten.log"}
    assert all(r["op_calls"] >= 1 for r in guarded)  # the verdict's op ran under every guard
    rw = next(r for r in guarded if r["change"] == "stable rewrite of aten.log")
    assert rw["applied"] == rw["op_calls"] and rw["rewritten_as"] == ["log_softmax"]
    assert rw["finite"] and rw["steps_checked"] >= 2
    # log_softmax through the gather is cross-entropy: the rewritten step's loss is F.cross_entropy
    # on the state before step AT, rebuilt here by plain training without the product
    rec = sc.make_log_zero_nll()
    g = torch.Generator().manual_seed(1)
    for s in range(AT):
        train_step(rec, sc.batch_of("log_zero_nll", s, g))
    x, y = sc.batch_of("log_zero_nll", AT, g)
    with torch.no_grad():
        assert not math.isfinite(float(sc.picked_nll(rec.model, (x, y))))  # the plant: log(0)
        want = float(torch.nn.functional.cross_entropy(rec.model(x), y))
    assert math.isclose(rw["losses"][str(AT)], want, rel_tol=1e-5), (rw["losses"], want)
    text = render_text(v)
    assert "never ran" not in text and "(as log_softmax)" in text


@pytest.mark.usefixtures("at_repo")
def test_what_if_lr_too_large_lr_or_clipping_stays_finite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sc, "LR_HIGH", 60.0)
    run = _run("lr_high", tmp_path, steps=AT + 30, snapshot_every=16, spike_captures=0)
    v = _verdict(run, _captures(run, "nonfinite")[0], what_if=True)
    assert v["cause_class"] == "lr_too_high"
    fixed = {r["change"].split(" at ")[0] for r in v["what_if"] if r["finite"]}
    assert fixed & {"lr x0.1", "clip grad norm"}, v["what_if"]
    assert v["reproducibility"]["class"] == "software"


@pytest.mark.usefixtures("at_repo")
def test_corruption_from_outside_the_capture_is_transient(tmp_path: Path) -> None:
    run = _run("transient", tmp_path)
    v = _verdict(run, _captures(run, "nonfinite")[0], what_if=True)
    rep = v["reproducibility"]
    assert v["reproduced"] is False and rep["class"] == "transient"
    assert "the batch (recorded)" in rep["ruled_out"]
    # the same fault in a compiled run (run.json `compiled`, helper fsdp's field): only the
    # compiled run fails, the eager replay does not: compiler
    meta = json.loads((run / "run.json").read_text())
    meta["extra"] = {**meta.get("extra", {}), "compiled": True}
    (run / "run.json").write_text(json.dumps(meta))
    v = _verdict(run, _captures(run, "nonfinite")[0], what_if=True)
    assert v["reproducibility"]["class"] == "compiler" and v["reproducibility"]["compiled"] is True


@pytest.mark.usefixtures("at_repo")
def test_fp16_overflow_that_fp32_does_not_have_is_precision(tmp_path: Path) -> None:
    run = _run("fp16_overflow", tmp_path)
    v = _verdict(run, _captures(run, "nonfinite")[0], what_if=True)
    rep = v["reproducibility"]
    assert rep["class"] == "precision" and rep["float32_finite"] is True
    # truth without the product: the planted logits overflow float16's exp, not float32's
    assert torch.isinf(torch.exp(torch.tensor(12.0, dtype=torch.float16)))
    assert torch.isfinite(torch.exp(torch.tensor(12.0)))


@pytest.mark.usefixtures("at_repo")
def test_cli_spike_json_and_what_if_table(tmp_path: Path) -> None:
    from sentineld.replay.main import command  # noqa: PLC0415

    run = _run("data", tmp_path)
    res = CliRunner().invoke(command, [str(run), "--json", "--what-if", "--trust"])
    assert res.exit_code == 0, res.output
    v = json.loads(res.stdout)
    assert v["kind"] == "spike" and v["cause_class"] == "data"
    rows = v["what_if"]
    assert rows[0]["change"].startswith("samples") and rows[0]["spike"] is False
    assert {"change", "finite", "steps_checked", "loss", "loss_distance"} <= set(rows[0])
    text = CliRunner().invoke(command, [str(run), "--what-if", "--trust"]).stdout
    assert "loss spike" in text.splitlines()[0] and "samples dropped" not in text.splitlines()[0]
    assert "what-if" in text and "evidence, not proof" in text


@pytest.fixture(scope="module")
def data_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One trained data-spike run shared by the delivery and report tests."""
    here = os.getcwd()
    os.chdir(REPO)
    try:
        return _run("data", tmp_path_factory.mktemp("spike"))
    finally:
        os.chdir(here)


@pytest.mark.slow
def test_daemon_replay_subprocess_delivers_the_spike_verdict(data_run: Path) -> None:
    """The daemon's own path: the replay subprocess with the run's interpreter and working
    directory, its JSON taken as a verdict, the notification text it sends."""
    from sentineld.contracts.rundir import read_run_meta  # noqa: PLC0415
    from sentineld.contracts.verdict import notification_text  # noqa: PLC0415
    from sentineld.daemon.replay_runner import run_replay_subprocess  # noqa: PLC0415

    cap = _captures(data_run, "spike")[0]
    out = run_replay_subprocess(read_run_meta(data_run), data_run, cap, timeout_s=120, memory_bytes=0,
                                what_if=True)
    assert out.result == "localized", out.reason
    assert out.report is not None and out.report["kind"] == "spike" and out.report["what_if"]
    title, body = notification_text(out.report)
    assert "loss spike at step" in title and "cause data" in title
    assert "samples:" in body and "evidence, not proof" in body
    print(f"daemon spike replay with what-if (subprocess): {out.elapsed_s:.2f} s")


def test_report_marks_the_spike_samples_and_candidates(data_run: Path, tmp_path: Path) -> None:
    from sentineld.report.build import write_report  # noqa: PLC0415

    here = os.getcwd()
    os.chdir(REPO)
    try:
        v = replay_run(data_run, what_if=True)
    finally:
        os.chdir(here)
    vpath = tmp_path / "verdict.json"
    vpath.write_text(v.to_json())
    html = write_report(data_run, tmp_path / "r.html", verdict_path=vpath, activations=False).read_text()
    assert f"step {v.step}: loss spike, cause data, samples [" in html
    assert "What-if candidates" in html and "evidence, not proof" in html
    assert "spike gone" in html  # the dropped-samples row


@pytest.mark.usefixtures("at_repo")
def test_replay_exit_code_follows_the_verdicts_outcome_on_every_captured_step(data_run: Path) -> None:
    """On 3793601 the exit code came from ``reproduced`` (rebuilt loss == recorded), not the
    outcome: ``--step 39`` of this capture (a step that did not spike) was a not_reproduced verdict,
    the daemon's result not_reproduced, and exit 0."""
    from sentineld.contracts.verdict import verdict_outcome  # noqa: PLC0415
    from sentineld.replay.main import command  # noqa: PLC0415

    cap = _captures(data_run, "spike")[0]
    seen = {}
    for step in range(AT - 4, AT + 3):  # snapshot 36 .. last captured step 42
        res = CliRunner().invoke(command, [str(data_run), "--json", "--trust", "--capture", str(cap),
                                           "--step", str(step)])
        v = json.loads(res.stdout)
        seen[step] = (verdict_outcome(v), v["reproduced"], res.exit_code)
    assert seen[AT] == ("localized", True, 0), seen
    assert all(code == (1 if outcome == "not_reproduced" else 0) for outcome, _r, code in seen.values()), seen
    # the case that broke: the rebuild matched the recorded loss bitwise, but the step did not spike
    assert ("not_reproduced", True, 1) in seen.values(), seen


def test_exit_codes_of_every_outcome() -> None:
    from sentineld.contracts.verdict import verdict_exit_code  # noqa: PLC0415

    assert verdict_exit_code({"reproduced": True, "phase": "forward"}) == 0
    assert verdict_exit_code({"reproduced": True, "phase": "none"}) == 0  # not_localized
    assert verdict_exit_code({"reproduced": False, "phase": "forward"}) == 1
    assert verdict_exit_code({"kind": "spike", "reproduced": False, "cause_class": "data"}) == 0
    assert verdict_exit_code({"kind": "spike", "reproduced": True, "cause_class": "not_reproduced"}) == 1


def test_a_calm_step_of_a_spike_capture_is_no_spike_to_explain(data_run: Path) -> None:
    """Regression: ``--step 37`` / ``38`` of this capture (recorded losses 0.38 / 0.40 against a
    level of ~0.35; the spike at AT is far above) were explained as data spikes: any loss above
    the reference passed. A requested step spikes only on the flagged spike's scale."""
    cap = _captures(data_run, "spike")[0]
    for step in range(AT - 3, AT + 3):  # the planted spike is one batch (AT): every other step is calm
        res = CliRunner().invoke(command_of_replay(), [str(data_run), "--json", "--trust", "--capture", str(cap),
                                                       "--step", str(step)])
        v = json.loads(res.stdout)
        if step == AT:
            assert v["cause_class"] == "data" and res.exit_code == 0, v
            continue
        rec, level = v["evidence"]["recorded_loss"], v["evidence"]["level_before"]
        peak = v["evidence"]["recorded_losses"][str(AT)]
        assert rec - level < 0.5 * (peak - level), v
        assert v["cause_class"] == "not_reproduced" and res.exit_code == 1, v
        assert v["evidence"]["flagged_step"] == AT and f"step {step} did not spike" in v["cause"], v
        assert f"--step {AT}" in v["fix"], v


def command_of_replay():  # noqa: ANN201 - the click command (imported late: the CLI imports torch lazily)
    from sentineld.replay.main import command  # noqa: PLC0415

    return command
