"""The fault zoo: every planted fault is localized to its phase, module, op, parameters and cause
class, and every healthy run replays to ``none``, bit for bit."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from sentineld.contracts.verdict import CAUSE_CLASSES, report_problems
from sentineld.replay import replay_run, render_text
from tests.zoo.cases import ZOO, Case

FAULTY = [c for c in ZOO if c.expect.phase != "none"]
HEALTHY = [c for c in ZOO if c.expect.phase == "none"]


def test_zoo_size() -> None:
    assert len(FAULTY) >= 15 and len(HEALTHY) >= 5
    assert len({(c.expect.phase, c.expect.module, c.expect.op, c.name) for c in FAULTY}) == len(FAULTY)
    assert all(c.expect.cause in CAUSE_CLASSES for c in ZOO)


@pytest.mark.parametrize("case", FAULTY, ids=lambda c: c.name)
def test_fault_is_localized(zoo: tuple[Path, dict[str, Any]], case: Case) -> None:
    runs, summary = zoo
    assert summary[case.name]["captures"], f"{case.name}: the agent wrote no capture"
    r = replay_run(runs / case.name)
    e = case.expect
    got = (r.phase, r.module, r.op, r.cause_class)
    want = (e.phase, e.module, e.op, e.cause)
    assert got == want, f"{case.name}: {got} != {want}\n{render_text(r)}"
    assert set(e.parameters) <= set(r.parameters), (r.parameters, e.parameters)
    if e.step is not None:
        assert r.step == e.step
    if e.where is not None:
        assert r.where == e.where
    if r.module is not None:  # a qualified name of the model, never a made-up one
        assert r.module in {n for n, _ in case.factory(**case.recipe_args).model.named_modules()}
    if r.phase == "backward" and r.autograd_node != "AccumulateGrad":
        assert r.evidence["primitive"].startswith("aten.") and r.evidence["forward_op"] == r.op
    if e.node is not None:
        assert r.autograd_node == e.node
    if e.field is not None:
        assert (r.evidence["field"], tuple(r.evidence["samples"])) == (e.field, e.samples)
    if e.state_entry is not None:
        assert r.evidence["state_entry"] == e.state_entry
    # Rebuild: each re-executed loss equals the recorded one bit for bit.
    assert r.reproduced and r.max_loss_deviation == 0.0, render_text(r)
    assert r.cause and r.fix and r.evidence["nan_table_row"]
    assert report_problems(json.loads(r.to_json())) == []  # strict JSON, NaN included; schema holds


@pytest.mark.parametrize("case", HEALTHY, ids=lambda c: c.name)
def test_healthy_step_replays_to_none_bit_for_bit(zoo: tuple[Path, dict[str, Any]], case: Case) -> None:
    runs, _ = zoo
    r = replay_run(runs / case.name, case.replay_step)
    assert (r.phase, r.step, r.cause_class) == ("none", case.replay_step, "finite")
    assert r.steps_rebuilt == case.replay_step > 0
    assert r.reproduced and r.max_loss_deviation == 0.0
    assert not r.recorded_nonfinite
    assert r.evidence["replayed_loss"] == r.evidence["recorded_loss"]


def test_finite_step_before_a_fault_is_none(zoo: tuple[Path, dict[str, Any]]) -> None:
    runs, _ = zoo
    r = replay_run(runs / "lr_too_high", 4)
    assert (r.phase, r.reproduced, r.recorded_nonfinite) == ("none", True, False)


def test_forward_evidence_has_op_and_module_stats(zoo: tuple[Path, dict[str, Any]]) -> None:
    runs, _ = zoo
    r = replay_run(runs / "fp16_overflow")
    out, ins = r.evidence["op_output"], r.evidence["op_inputs"]
    assert out["dtype"] == "float16" and out["posinf"] + out["neginf"] > 0
    assert all(s["nonfinite"] == 0 for s in ins)
    assert max(s["finite_max_abs"] for s in ins) <= 65504
    assert r.evidence["module_call"]["output"]["nonfinite"] > 0
    assert "float16" in r.cause and r.evidence["precision"]["autocast_dtype"] == "float16"


def test_clipping_names_the_inf_gradient_origin(zoo: tuple[Path, dict[str, Any]]) -> None:
    runs, _ = zoo
    r = replay_run(runs / "clip_inf_grad")
    origin = r.evidence["inf_gradient_origin"]
    assert (origin["module"], origin["autograd_node"], origin["kind"]) == ("scale", "SqrtBackward0", "inf")


def test_scheduler_verdict_names_the_lr(zoo: tuple[Path, dict[str, Any]]) -> None:
    runs, _ = zoo
    r = replay_run(runs / "warmup_zero")
    sched = r.evidence["scheduler"]
    assert sched["type"] == "LambdaLR" and math.isfinite(sched["lr_used_by_step"])
    assert math.isnan(sched["lr_set_for_next_step"])


def test_adam_eps_evidence(zoo: tuple[Path, dict[str, Any]]) -> None:
    runs, _ = zoo
    r = replay_run(runs / "adam_eps_fp16")
    assert r.evidence["eps"] == {"eps": 1e-8, "in_param_dtype": 0.0, "param_dtype": "float16"}
    assert "eps" in r.cause


def test_precision_is_kept_from_the_snapshot(zoo: tuple[Path, dict[str, Any]]) -> None:
    runs, _ = zoo
    r = replay_run(runs / "healthy_bf16", 6)
    assert r.evidence["precision"]["param_dtypes"] == ["bfloat16"]
    assert r.evidence["precision"]["recast_from_snapshot"]  # the factory built float32
    assert r.reproduced


def test_auto_mode_follows_a_finite_trigger_step(zoo: tuple[Path, dict[str, Any]]) -> None:
    # The agent saw step 1's fault at step 1 (NaN loss) but the optimizer broke it at step 0.
    runs, summary = zoo
    assert summary["adam_eps_fp16"]["captures"][0].endswith("step000000001-nonfinite.h5")
    r = replay_run(runs / "adam_eps_fp16")
    assert (r.requested_step, r.step) == (1, 0)


def test_rng_restore_is_what_makes_random_runs_reproduce(zoo: tuple[Path, dict[str, Any]],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # Negative control: without restoring the recorded RNG states, dropout and noise draw other
    # numbers and the rebuilt losses differ from the recorded ones.
    import contextlib

    from sentineld.replay import rebuild

    runs, _ = zoo
    monkeypatch.setattr(rebuild, "_rng_at_first_forward", lambda model, rng: contextlib.nullcontext())
    r = replay_run(runs / "healthy_dropout_noise", 9)
    assert not r.reproduced and r.max_loss_deviation > 0


def test_custom_backward_is_not_called_an_explosion(zoo: tuple[Path, dict[str, Any]]) -> None:
    # Seen wrong: "gradient explosion, clip gradients" for an overflow inside a hand-written backward.
    r = replay_run(zoo[0] / "custom_backward")
    assert (r.evidence["primitive"], r.evidence["custom_function"], r.evidence["kind"]) == \
        ("aten.exp", "StableSoftplus", "inf")
    assert "StableSoftplus.backward" in r.fix and "gradcheck" in r.fix and "cannot help" in r.fix


def test_pow_at_zero_is_not_told_to_fix_a_log(zoo: tuple[Path, dict[str, Any]]) -> None:
    # Seen wrong: the first birth was log(0) in pow's exponent gradient, which pow masks itself;
    # the gradient that went non-finite is p * 0 ** (p - 1).
    r = replay_run(zoo[0] / "pow_base_zero")
    assert r.evidence["primitive"] == "aten.pow" and "log" not in r.fix
    masked = [b for b in r.evidence["births"] if b["masked"]]
    assert [b["op"] for b in masked][:2] == ["aten.log", "aten.mul"]
    assert "clamp the base" in r.fix


def test_where_branch_says_mask_the_input(zoo: tuple[Path, dict[str, Any]]) -> None:
    # Seen wrong: a 0/0 in the branch torch.where did not select was blamed on sqrt at 0.
    r = replay_run(zoo[0] / "where_branch")
    assert (r.evidence["primitive"], r.evidence["kind"], r.evidence["where_branch"]) == ("aten.div", "nan", True)
    assert "mask the input before sqrt" in r.fix


def test_loss_outside_the_model_has_no_module(zoo: tuple[Path, dict[str, Any]]) -> None:
    r = replay_run(zoo[0] / "log_zero_loss")
    assert (r.module, r.module_type, r.where) == (None, None, "loss function, outside the model")
    assert "in the loss function, outside the model" in render_text(r)
