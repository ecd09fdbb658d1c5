"""Tuning or silencing a signature for one run (issue 21): ``attach(..., signatures={...})``
writes the run's overrides to run.json; the daemon judges that run with them over its own config
(``run_signature_config``, called by sentineld.daemon.alerting for every evaluation)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from sentineld.agent import attach
from sentineld.contracts.records import StepRecord
from sentineld.contracts.rundir import read_run_meta
from sentineld.signatures import SignatureConfig, merge_run_overrides, run_signature_config
from tests.signatures.chain import notifications

LN3 = math.log(3)


def _flat(n: int = 150) -> list[StepRecord]:
    return [StepRecord(step=i, loss=LN3 * (1 + 0.01 * math.sin(i)), grad_norm=0.2, time_s=1.7e9 + i)
            for i in range(n)]


def test_attach_stores_the_overrides_and_the_daemon_config_takes_them(tmp_path: Path) -> None:
    m = nn.Linear(4, 3)
    w = attach(m, torch.optim.SGD(m.parameters(), 0.1), run_id="quiet", runs_dir=tmp_path, metrics_port=0,
               localize="off", signatures={"plateau": {"enabled": False}, "exploding_gradients": {"ratio": 20}})
    w.close()
    extra = json.loads((Path(w.run_dir) / "run.json").read_text())["extra"]
    assert extra["signatures"] == {"plateau": {"enabled": False}, "exploding_gradients": {"ratio": 20}}
    meta = read_run_meta(w.run_dir)  # as the daemon reads it
    base = SignatureConfig.from_mapping({"exploding_gradients": {"confirm_steps": 6}})
    cfg = run_signature_config(base, meta.extra)
    assert cfg.plateau.enabled is False
    assert cfg.exploding_gradients.ratio == 20.0 and cfg.exploding_gradients.confirm_steps == 6  # daemon's kept
    assert cfg.vanishing_gradients == base.vanishing_gradients


def test_a_silenced_signature_notifies_nothing_for_that_run_only() -> None:
    records = _flat()
    assert [k for _, k, _ in notifications(records, None)] == ["plateau"]
    silenced = run_signature_config(SignatureConfig(), {"signatures": {"plateau": {"enabled": False}}})
    assert notifications(records, None, silenced) == []


@pytest.mark.parametrize("bad, says", [
    ({"plateu": {"enabled": False}}, "plateu"),
    ({"plateau": {"patiense": 3}}, "plateau.patiense"),
    ({"plateau": {"patience": "long"}}, "plateau.patience"),
    ({"plateau": False}, "plateau"),
])
def test_a_bad_override_is_refused_at_attach_naming_it(tmp_path: Path, bad: dict, says: str) -> None:
    m = nn.Linear(4, 3)
    with pytest.raises(ValueError, match=says):
        attach(m, torch.optim.SGD(m.parameters(), 0.1), run_id="bad", runs_dir=tmp_path, metrics_port=0,
               localize="off", signatures=bad)


def test_a_hand_edited_override_that_no_longer_parses_keeps_the_daemon_config() -> None:
    base = SignatureConfig()
    assert run_signature_config(base, {"signatures": {"nope": {}}}) is base
    assert run_signature_config(base, {"signatures": "x"}) is base
    assert run_signature_config(base, None) is base


def test_a_partly_bad_override_applies_its_valid_settings_and_names_the_rest() -> None:
    # On 3793601 the one bad key dropped the whole override: plateau stayed on, ratio stayed 10.
    base = SignatureConfig.from_mapping({"exploding_gradients": {"confirm_steps": 6}})
    cfg, problems = merge_run_overrides(base, {"signatures": {
        "plateau": {"enabled": False, "patiense": 3, "patience": "x" * 500},
        "exploding_gradients": {"ratio": 20}, "oscillation": 5, "nope\n": {}}})
    assert cfg.plateau == replace(base.plateau, enabled=False)
    assert cfg.exploding_gradients == replace(base.exploding_gradients, ratio=20.0)
    assert cfg.oscillation == base.oscillation
    assert len(problems) == 4, problems
    assert "'plateau.patiense'" in problems[0]
    assert "plateau.patience must be an integer, got 'xxx" in problems[1] and len(problems[1]) < 300
    assert "oscillation = 5 must be a mapping" in problems[2]
    assert "unknown signature 'nope\\n'" in problems[3] and "\n" not in "".join(problems)
    assert all("the daemon's" in p or "known:" in p for p in problems)


def test_a_combination_its_detector_rejects_is_refused_whole() -> None:
    base = SignatureConfig()
    cfg, [problem] = merge_run_overrides(base, {"signatures": {"plateau": {"enabled": False, "patience": 3}}})
    assert cfg.plateau == base.plateau  # not "off" from half of what was asked
    assert "plateau.patience must be >= chunk" in problem and "plateau settings are kept" in problem


def test_overrides_that_are_not_a_mapping_are_named_too() -> None:
    base = SignatureConfig()
    assert merge_run_overrides(base, {"signatures": "x"}) == (base, [
        "signature overrides must be a mapping of signature id to settings, got str: none applied; fix "
        "extra.signatures in the run's run.json (or attach(..., signatures=...))"])
    assert merge_run_overrides(base, {}) == (base, [])
