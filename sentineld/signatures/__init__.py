"""Signatures: the debugging method's checklist as live detectors over per-step records.

Pure functions, no I/O, no torch: the same code runs in the daemon (on every new record of a
run's stream) and in the agent. Usage::

    from sentineld.signatures import SignatureConfig, evaluate

    cfg = SignatureConfig.from_mapping({"stalled": {"threshold_s": 600}})
    for verdict in evaluate(window, cfg, now_s=time.time(), num_classes=10):
        print(verdict.severity, verdict.signature, verdict.step, verdict.message)

One module per detector family: ``numerics`` (nonfinite, loss_scale_collapse), ``loss``
(divergence_spike, divergence_growth, plateau, oscillation, initial_loss), ``gradients``
(exploding_gradients, vanishing_gradients, missing_gradients, forgotten_zero_grad), ``updates``
(gradients_not_applied, update_ratio), ``activations`` (dead_relu, saturated_activation),
``liveness`` (stalled), ``replicas`` (replica_divergence). :mod:`.floors` is the look at the
loss the gradient rules share (a tiny gradient at a converged loss is not vanishing);
:mod:`.resolve` says when a signature that fired has resolved (the daemon's RESOLVED notices).
"""

from .activations import DeadReluConfig, SaturationConfig, detect_dead_relu, detect_saturated_activation
from .base import SIGNATURES, Severity, Verdict
from .divergence import DivergenceGrowthConfig, DivergenceSpikeConfig, detect_divergence_growth, detect_divergence_spike
from .evaluate import evaluate
from .gradients import (
                          ExplodingConfig,
                          MissingGradientsConfig,
                          VanishingConfig,
                          detect_exploding_gradients,
                          detect_missing_gradients,
                          detect_vanishing_gradients,
)
from .liveness import StalledConfig, detect_stalled
from .loss import (
                          InitialLossConfig,
                          OscillationConfig,
                          PlateauConfig,
                          detect_initial_loss,
                          detect_oscillation,
                          detect_plateau,
)
from .numerics import LossScaleConfig, NonfiniteConfig, detect_loss_scale_collapse, detect_nonfinite
from .replicas import ReplicaDivergenceConfig, detect_replica_divergence
from .resolve import shown_resolved, unresolved
from .signature_config import SignatureConfig, merge_run_overrides, run_signature_config
from .spike import LossSpikeConfig, SpikeTracker, detect_loss_spike
from .updates import NotAppliedConfig, UpdateRatioConfig, detect_gradients_not_applied, detect_update_ratio
from .zero_grad import ZeroGradConfig, detect_forgotten_zero_grad

__all__ = [
    "evaluate", "run_signature_config", "merge_run_overrides", "unresolved", "shown_resolved",
    "Verdict", "Severity", "SIGNATURES", "SignatureConfig",
    "NonfiniteConfig", "LossScaleConfig", "DivergenceSpikeConfig", "DivergenceGrowthConfig",
    "PlateauConfig", "OscillationConfig", "InitialLossConfig", "ExplodingConfig",
    "VanishingConfig", "MissingGradientsConfig", "ZeroGradConfig", "NotAppliedConfig",
    "UpdateRatioConfig", "DeadReluConfig", "SaturationConfig", "StalledConfig",
    "detect_nonfinite", "detect_loss_scale_collapse", "detect_divergence_spike",
    "detect_divergence_growth", "detect_plateau", "detect_oscillation", "detect_initial_loss",
    "detect_exploding_gradients", "detect_vanishing_gradients", "detect_missing_gradients",
    "detect_forgotten_zero_grad", "detect_gradients_not_applied", "detect_update_ratio",
    "detect_dead_relu", "detect_saturated_activation", "detect_stalled",
    "LossSpikeConfig", "SpikeTracker", "detect_loss_spike",
    "ReplicaDivergenceConfig", "detect_replica_divergence",
]
