"""A finite loss spike of a ``torch.compile``'d run (tests/replay/spikecases.py's ``data`` case,
compiled with the backend of tests/e2e/test_compiled_replay.py): its spike verdict says the replay
ran eagerly and whether eager made the spike, as a compiled run's non-finite verdict does, in
JSON and in the text verdict.

On 3793601 the spike verdict of a compiled run had ``compiled`` false and no ``eager_reproduced``
nor ``evidence.compiled`` (engine.py built it without the compiled check), and neither text
verdict showed the compiled evidence.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from sentineld.agent import attach
from sentineld.contracts.recipe import train_step
from sentineld.contracts.rundir import list_captures
from sentineld.contracts.verdict import render_text
from sentineld.replay.engine import replay_run
from tests.e2e.test_compiled_replay import BACKEND
from tests.replay import spikecases as sc

REPO = Path(__file__).resolve().parents[2]


def _train(runs: Path, outside: bool) -> Path:
    """The compiled ``data`` run; ``outside``: its spike is made outside anything the capture holds
    (clean batches; step AT's loss and gradient x50 by a term the recipe lacks), so no replay makes it."""
    torch._dynamo.reset()
    rec = sc.make_data()
    model = torch.compile(rec.model, backend=BACKEND)
    watch = attach(model, rec.optimizer, run_id="outside" if outside else "data", runs_dir=runs, metrics_port=0,
                   snapshot_every=4, layer_every=0, recipe="tests.replay.spikecases:make_data")
    g = torch.Generator().manual_seed(1)
    with watch:
        for s in range(sc.AT + 12):
            batch = sc.batch_of("data" if not outside else "none", s, g)
            # at AT of the ``outside`` run: a loss (and its gradient) x50 that the recipe's loss_fn
            # does not compute, as a loss term outside the capture would
            loss_fn = (lambda m, b: sc.ce(m, b) * 50.0) if outside and s == sc.AT else rec.loss_fn
            loss = train_step(replace(rec, model=model, loss_fn=loss_fn), batch)
            watch.step(loss, batch)
    return Path(watch.run_dir)


@pytest.fixture(scope="module")
def spike_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    runs = tmp_path_factory.mktemp("compiled-spike")
    out = {"data": _train(runs, False), "outside": _train(runs, True)}
    torch._dynamo.reset()
    return out


@pytest.mark.slow
def test_a_compiled_runs_spike_verdict_carries_the_compiled_check(spike_runs: dict[str, Path],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # run.json's cwd: where tests.replay.spikecases is imported from
    run = spike_runs["data"]
    assert [t for *_x, t, _p in list_captures(run)] == ["spike"]
    report = replay_run(run)
    assert report.kind == "spike" and report.cause_class == "data" and report.step == sc.AT
    assert report.compiled is True and report.eager_reproduced is True and report.reproduced
    ev = report.evidence["compiled"]
    assert ev["backend"] == BACKEND and ev["replayed"] == "eager" and ev["eager_reproduced"] is True
    assert ev["max_deviation"] <= ev["tolerance"] and "note" not in ev
    text = render_text(report)
    assert (f"compiled: backend {BACKEND}, replayed eagerly; eager replay made the run's loss spike: True"
            in text), text


@pytest.mark.slow
def test_a_spike_eager_does_not_make_is_said_and_exits_1(spike_runs: dict[str, Path],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from sentineld.replay.main import command  # noqa: PLC0415

    monkeypatch.chdir(REPO)
    run = spike_runs["outside"]
    res = CliRunner().invoke(command, [str(run), "--json", "--trust"])
    assert res.stdout.strip(), res.output
    v = json.loads(res.stdout)
    assert v["kind"] == "spike" and v["cause_class"] == "not_reproduced" and res.exit_code == 1
    assert v["compiled"] is True and v["eager_reproduced"] is False
    note = v["evidence"]["compiled"]["note"]
    assert note.startswith("the eager replay does not make the run's loss spike")
    assert "TORCHDYNAMO_REPRO_AFTER=aot" in note
    assert "compiled_rerun" not in v["evidence"]["compiled"]  # that re-run looks for a non-finite value only
    text = CliRunner().invoke(command, [str(run), "--trust"]).stdout
    assert "eager replay made the run's loss spike: False" in text and f"compiled note: {note}" in text, text
