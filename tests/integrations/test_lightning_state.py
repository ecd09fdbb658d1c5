"""Lightning replays with the trainer's state (issue 22): a module whose ``training_step`` reads
``self.global_step`` / ``self.current_epoch`` and calls ``self.log`` is rebuilt bit for bit, and a
manual-optimization GAN (two optimizers, ``manual_backward``, ``opt.step()``) is replayed through
its own ``training_step``. Real Lightning fits in this process; the replay is the engine of
``sentineld replay`` (``replay_run``) in this process too.

On 49179bb: the annealing module read ``global_step == 0`` in the replay, its planted NaN (at
``global_step == 5``) did not happen and the verdict blamed non-determinism; the GAN's replay
refused ("the replay cannot know its steps")."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from . import clipnets  # noqa: E402

NAN_AT = 5


def _replay(run_dir: Path, **kw: object):  # noqa: ANN202
    from sentineld.replay.engine import replay_run

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = replay_run(run_dir, **kw)
    return report, [str(w.message) for w in caught]


@pytest.fixture(scope="module")
def anneal_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    runs = tmp_path_factory.mktemp("lit-state")
    torch.manual_seed(0)
    x, y = clipnets.data(8 * clipnets.BATCH)
    # Two epochs of 4 batches: current_epoch changes the loss at step 4.
    clipnets.fit(clipnets.LitNet(anneal=True, nan_at=NAN_AT), torch.utils.data.TensorDataset(x[:16], y[:16]),
                 8, str(runs), "anneal")
    return runs / "anneal"


def test_a_module_reading_global_step_and_current_epoch_replays_bit_for_bit(anneal_run: Path) -> None:
    report, caught = _replay(anneal_run)
    assert (report.step, report.phase, report.module, report.op) == (NAN_AT, "forward", None, "aten.mul")
    assert report.reproduced is True and report.steps_rebuilt == NAN_AT
    assert report.cause_class != "nondeterministic"
    # self.log ran in every replayed training_step without a word.
    assert not [m for m in caught if "self.log" in m], caught
    # The recorded batch carries the state training_step read.
    from sentineld.contracts.capture import open_capture

    cap = next(anneal_run.glob("capture-*-nonfinite.h5"))
    with open_capture(cap) as c:
        micro = c.step(4).batch
    assert (micro["global_step"], micro["current_epoch"]) == (4, 1)


def test_the_training_process_localized_the_incident_itself(anneal_run: Path) -> None:
    meta = json.loads((anneal_run / "run.json").read_text())
    assert meta["extra"]["localize"] == "thread"
    v = json.loads(next(anneal_run.glob("*.verdict.json")).read_text())
    assert (v["step"], v["phase"], v["op"], v["reproduced"]) == (NAN_AT, "forward", "aten.mul", True)


def test_trainer_state_the_replay_does_not_restore_is_named(tmp_path: Path) -> None:
    from sentineld.replay.engine import ReplayError
    from sentineld.integrations.lightning_state import ReplayTrainer

    torch.manual_seed(0)
    x, y = clipnets.data(4 * clipnets.BATCH)
    clipnets.fit(clipnets.LitNet(nan_at=2, peek="callback_metrics"), torch.utils.data.TensorDataset(x, y),
                 4, str(tmp_path), "peek")
    v = json.loads(next((tmp_path / "peek").glob("*.verdict.json")).read_text())
    assert v["result"] == "failed" and "does not restore trainer.callback_metrics" in v["reason"]
    with pytest.raises(ReplayError, match="does not restore trainer.callback_metrics"):
        _replay(tmp_path / "peek")

    t = ReplayTrainer({"max_steps": 8})
    t.enter({"global_step": 3, "current_epoch": 1})
    assert (t.global_step, t.current_epoch, t.max_steps) == (3, 1, 8)
    with pytest.raises(AttributeError, match="does not restore trainer.callback_metrics"):
        _ = t.callback_metrics
    assert t.unrestored == ["callback_metrics"]


@pytest.fixture(scope="module")
def gan_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    runs = tmp_path_factory.mktemp("lit-gan")
    torch.manual_seed(0)
    # Batch 5 (rows 20..23) holds a constant noise row: gen.0 divides 0 by 0 at step 5.
    clipnets.fit(clipnets.LitGAN(), clipnets.gan_data(8 * clipnets.BATCH, constant_row=5 * clipnets.BATCH + 2),
                 16, str(runs), "gan")  # max_steps counts both optimizers' steps: 8 batches
    return runs / "gan"


def test_a_manual_optimization_gan_is_replayed_through_its_training_step(gan_run: Path) -> None:
    steps = [json.loads(x) for x in (gan_run / "stream-rank0.jsonl").read_text().splitlines() if x.strip()]
    steps = [s for s in steps if s.get("kind") == "step"]
    first_nan = next(s["step"] for s in steps if s["loss"] != s["loss"])
    assert first_nan == 5
    report, _ = _replay(gan_run)
    assert (report.step, report.phase, report.module, report.module_type, report.op) == (
        5, "forward", "gen.0", "Standardize", "aten.div")
    assert report.reproduced is True and report.steps_rebuilt >= 1
    # Both optimizers' states came from the snapshot: the rebuilt losses equal the recorded ones.
    rebuilt = report.evidence["rebuilt_losses"]
    recorded = {str(s["step"]): s["loss"] for s in steps}
    assert all(rebuilt[k] == recorded[k] for k in rebuilt if k != "5")
