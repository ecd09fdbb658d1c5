"""All detector settings in one frozen dataclass, built from a plain mapping (daemon config file).

Example::

    cfg = SignatureConfig.from_mapping({
        "stalled": {"threshold_s": 600},
        "plateau": {"enabled": False},
    })

An unknown detector or key raises ValueError naming it, so a typo never silently keeps a default.
One run can tune or silence signatures for itself: ``attach(..., signatures={"plateau":
{"enabled": False}})`` stores the mapping in run.json (``extra["signatures"]``) and the daemon
judges that run with :func:`run_signature_config` (docs/signatures.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping

from .activations import DeadReluConfig, SaturationConfig
from .divergence import DivergenceGrowthConfig, DivergenceSpikeConfig
from .gradients import ExplodingConfig, MissingGradientsConfig, VanishingConfig
from .liveness import StalledConfig
from .loss import InitialLossConfig, OscillationConfig, PlateauConfig
from .numerics import LossScaleConfig, NonfiniteConfig
from .replicas import ReplicaDivergenceConfig
from .spike import LossSpikeConfig
from .updates import NotAppliedConfig, UpdateRatioConfig
from .zero_grad import ZeroGradConfig

__all__ = ["SignatureConfig", "run_signature_config", "merge_run_overrides"]


@dataclass(frozen=True)
class SignatureConfig:
    """One config per detector, keyed by signature id (see each class for defaults and sources)."""

    nonfinite: NonfiniteConfig = field(default_factory=NonfiniteConfig)
    divergence_spike: DivergenceSpikeConfig = field(default_factory=DivergenceSpikeConfig)
    divergence_growth: DivergenceGrowthConfig = field(default_factory=DivergenceGrowthConfig)
    loss_spike: LossSpikeConfig = field(default_factory=LossSpikeConfig)
    exploding_gradients: ExplodingConfig = field(default_factory=ExplodingConfig)
    vanishing_gradients: VanishingConfig = field(default_factory=VanishingConfig)
    dead_relu: DeadReluConfig = field(default_factory=DeadReluConfig)
    saturated_activation: SaturationConfig = field(default_factory=SaturationConfig)
    plateau: PlateauConfig = field(default_factory=PlateauConfig)
    oscillation: OscillationConfig = field(default_factory=OscillationConfig)
    gradients_not_applied: NotAppliedConfig = field(default_factory=NotAppliedConfig)
    missing_gradients: MissingGradientsConfig = field(default_factory=MissingGradientsConfig)
    forgotten_zero_grad: ZeroGradConfig = field(default_factory=ZeroGradConfig)
    update_ratio: UpdateRatioConfig = field(default_factory=UpdateRatioConfig)
    initial_loss: InitialLossConfig = field(default_factory=InitialLossConfig)
    loss_scale_collapse: LossScaleConfig = field(default_factory=LossScaleConfig)
    stalled: StalledConfig = field(default_factory=StalledConfig)
    replica_divergence: ReplicaDivergenceConfig = field(default_factory=ReplicaDivergenceConfig)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None) -> "SignatureConfig":
        """Build from ``{signature_id: {key: value}}``; missing entries keep their defaults.

        Args:
            values: e.g. ``{"stalled": {"threshold_s": 600}}``; None or {} gives the defaults.

        Returns:
            The config.

        Raises:
            ValueError: an unknown signature id or key (named in the message), a value of the
                wrong type, or a value the detector's config rejects.
        """
        if values is None:
            return cls()
        if not isinstance(values, Mapping):
            raise ValueError(f"signature config must be a mapping, got {type(values).__name__}")
        known = {f.name: f for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for name, sub in values.items():
            if name not in known:
                raise ValueError(f"unknown signature config key {_shown(name)}; known: "
                                 f"{', '.join(sorted(known))}")
            sub_cls = _sub_cls(known[name])
            if isinstance(sub, sub_cls):
                kwargs[name] = sub
                continue
            if not isinstance(sub, Mapping):
                raise ValueError(f"signature config {_shown(name)} must be a mapping, got "
                                 f"{type(sub).__name__}")
            kwargs[name] = _build(sub_cls, name, sub)
        return cls(**kwargs)


    def with_overrides(self, values: Mapping[str, Any] | None) -> "SignatureConfig":
        """This config with some keys changed, e.g. one run's ``{"plateau": {"enabled": False}}``
        over the daemon's config (keys not named keep this config's values, not the defaults).

        Raises:
            ValueError: as :meth:`from_mapping`.
        """
        if not values:
            return self
        if not isinstance(values, Mapping):
            raise ValueError(f"signature config must be a mapping, got {type(values).__name__}")
        known = {f.name for f in fields(self)}
        changes: dict[str, Any] = {}
        for name, sub in values.items():
            if name not in known:
                raise ValueError(f"unknown signature config key {_shown(name)}; known: {', '.join(sorted(known))}")
            if not isinstance(sub, Mapping):
                raise ValueError(f"signature config {_shown(name)} must be a mapping, got {type(sub).__name__}")
            current = getattr(self, name)
            merged = {f.name: getattr(current, f.name) for f in fields(current)}
            merged.update(sub)
            changes[name] = _build(type(current), name, merged)
        return replace(self, **changes)


#: Longest an untrusted key or value is shown in a message (run.json is another user's file).
SHOWN_CHARS = 60


def run_signature_config(base: SignatureConfig, extra: Mapping[str, Any] | None) -> SignatureConfig:
    """The config one run is judged with (:func:`merge_run_overrides` without its problems)."""
    return merge_run_overrides(base, extra)[0]


def merge_run_overrides(base: SignatureConfig, extra: Mapping[str, Any] | None
                        ) -> tuple[SignatureConfig, list[str]]:
    """``base`` (the daemon's config) with the run's own ``signatures`` overrides from its run.json
    ``extra`` (``attach(..., signatures={...})``), and what of them was refused.

    run.json is written by the run's owner, not by the daemon's user, and may have been edited by
    hand after attach checked it: every part is judged on its own. A setting that parses is
    applied; one that does not (unknown signature or key, wrong type, a value the detector's
    config rejects) is refused and the daemon's setting for it stays in force. A detector whose
    config rejects the combination of its keys (``plateau.patience`` below ``plateau.chunk``) is
    refused whole: half of a combination is not what the run asked for.

    Args:
        base: the daemon's config.
        extra: the run's run.json ``extra`` (any JSON value; None: no overrides).

    Returns:
        ``(config, problems)``: problems are one message per refused part, naming it (keys and
        values shown as ``repr``, at most :data:`SHOWN_CHARS` characters: no control characters
        reach a log line) and what to do. Never raises.
    """
    over = extra.get("signatures") if isinstance(extra, Mapping) else None
    if over is None:
        return base, []
    fix = "fix extra.signatures in the run's run.json (or attach(..., signatures=...))"
    if not isinstance(over, Mapping):
        return base, [f"signature overrides must be a mapping of signature id to settings, got "
                      f"{type(over).__name__}: none applied; {fix}"]
    known = {f.name for f in fields(base)}
    changes: dict[str, Any] = {}
    problems: list[str] = []
    for name, sub in over.items():
        if name not in known:
            problems.append(f"refused: unknown signature {_shown(name)} (known: {', '.join(sorted(known))}); {fix}")
            continue
        if not isinstance(sub, Mapping):
            problems.append(f"refused: {name} = {_shown(sub)} must be a mapping of settings, e.g. "
                            f"{{'enabled': false}}; the daemon's {name} settings are kept; {fix}")
            continue
        current = getattr(base, name)
        merged = {f.name: getattr(current, f.name) for f in fields(current)}
        good = {}
        for key, value in sub.items():
            try:
                good.update(_checked(type(current), name, {key: value}))
            except ValueError as exc:
                problems.append(f"refused: {exc}; the daemon's setting is kept; {fix}")
        if not good:
            continue
        merged.update(good)
        try:
            changes[name] = _build(type(current), name, merged)
        except ValueError as exc:
            problems.append(f"refused together: {name} overrides {_shown(dict(good))} ({exc}); the "
                            f"daemon's {name} settings are kept; {fix}")
    return (replace(base, **changes) if changes else base), problems


def _shown(x: Any) -> str:
    """``repr`` of an untrusted value, cut to :data:`SHOWN_CHARS` (repr escapes control characters)."""
    r = repr(x)
    return r if len(r) <= SHOWN_CHARS else r[:SHOWN_CHARS - 3] + "..."


def _sub_cls(f: Any) -> type:
    return type(f.default_factory())


def _checked(sub_cls: type, name: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` coerced to ``sub_cls``'s field types. Raises ValueError naming a bad key."""
    sub_fields = {f.name: f for f in fields(sub_cls)}
    defaults = sub_cls()
    kwargs = {}
    for key, value in values.items():
        if key not in sub_fields:
            raise ValueError(f"unknown signature config key {_shown(f'{name}.{key}')}; known: "
                             f"{', '.join(sorted(sub_fields))}")
        kwargs[key] = _coerce(f"{name}.{key}", str(sub_fields[key].type), getattr(defaults, key),
                              value)
    return kwargs


def _build(sub_cls: type, name: str, values: Mapping[str, Any]) -> Any:
    kwargs = _checked(sub_cls, name, values)
    try:
        return sub_cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"signature config {name}: {exc}") from None


def _coerce(path: str, annotation: str, default: Any, value: Any) -> Any:
    optional = "None" in annotation
    if value is None:
        if optional:
            return None
        raise ValueError(f"signature config {path} must not be None")
    if isinstance(default, bool) or annotation.startswith("bool"):
        if not isinstance(value, bool):
            raise ValueError(f"signature config {path} must be true/false, got {_shown(value)}")
        return value
    if annotation.startswith("int"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"signature config {path} must be an integer, got {_shown(value)}")
        return value
    if "float" in annotation:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"signature config {path} must be a number, got {_shown(value)}")
        if not math.isfinite(value):  # a NaN threshold compares false: it silently turned the signature off
            sig = path.split(".")[0]
            raise ValueError(f"signature config {path} must be a finite number, got {_shown(value)}; to turn "
                             f"the signature off pass {{'{sig}': {{'enabled': False}}}}")
        return float(value)
    return value
