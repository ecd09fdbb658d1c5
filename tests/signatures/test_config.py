"""SignatureConfig: defaults, from_mapping, and errors that name the bad key."""

from __future__ import annotations

from dataclasses import fields

import pytest

from sentineld.signatures import SignatureConfig


def test_defaults_and_empty_mapping() -> None:
    assert SignatureConfig.from_mapping({}) == SignatureConfig()
    assert SignatureConfig.from_mapping(None) == SignatureConfig()


def test_overrides_keep_other_defaults() -> None:
    cfg = SignatureConfig.from_mapping({"stalled": {"threshold_s": 600},
                                        "plateau": {"enabled": False},
                                        "exploding_gradients": {"max_grad_norm": None}})
    assert cfg.stalled.threshold_s == 600.0 and isinstance(cfg.stalled.threshold_s, float)
    assert cfg.stalled.min_threshold_s == SignatureConfig().stalled.min_threshold_s
    assert cfg.plateau.enabled is False
    assert cfg.nonfinite == SignatureConfig().nonfinite


@pytest.mark.parametrize("mapping, named", [
    ({"stalld": {}}, "'stalled'" and "stalld"),
    ({"stalled": {"thresh_s": 1}}, "stalled.thresh_s"),
    ({"stalled": {"threshold_s": "soon"}}, "stalled.threshold_s"),
    ({"stalled": {"threshold_s": -5}}, "stalled"),
    ({"dead_relu": {"patience": 1.5}}, "dead_relu.patience"),
    ({"dead_relu": {"enabled": "yes"}}, "dead_relu.enabled"),
    ({"dead_relu": {"max_fraction": 2}}, "dead_relu"),
    ({"plateau": 3}, "plateau"),
    ({"divergence_growth": {"span": 10, "chunk": 10}}, "divergence_growth"),
    ({"update_ratio": {"min_ratio": 2.0}}, "update_ratio"),
])
def test_errors_name_the_key(mapping: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        SignatureConfig.from_mapping(mapping)


def test_not_a_mapping() -> None:
    with pytest.raises(ValueError, match="mapping"):
        SignatureConfig.from_mapping([("stalled", {})])  # type: ignore[arg-type]


def test_every_detector_config_is_frozen_with_enabled() -> None:
    cfg = SignatureConfig()
    for f in fields(cfg):
        sub = getattr(cfg, f.name)
        assert sub.enabled is True
        with pytest.raises(AttributeError):
            sub.enabled = False  # type: ignore[misc]
        # every field documented in the class docstring
        for sf in fields(sub):
            assert f"{sf.name}:" in (type(sub).__doc__ or ""), f"{f.name}.{sf.name} undocumented"
