"""Capture triggers: why a capture was written, the last part of its file name
(``capture-rank<R>-step<N>-<trigger>.h5``) and its ``trigger`` attribute."""

from __future__ import annotations

__all__ = ["NONFINITE", "CRASH", "MANUAL", "REGRESS", "SPIKE", "TRIGGERS"]

#: A non-finite step (the agent's incident policy).
NONFINITE = "nonfinite"
#: The training process ended abnormally (exception, SIGTERM, or SIGKILL via the on-disk ring).
CRASH = "crash"
#: ``Watch.capture_now()`` without a trigger.
MANUAL = "manual"
#: A regression fixture trimmed from a capture by ``sentineld regress`` (outside any run dir).
REGRESS = "regress"

#: A finite loss spike (``loss_spike``, :mod:`sentineld.signatures.spike`): the replay explains it.
SPIKE = "spike"

TRIGGERS = (NONFINITE, CRASH, MANUAL, REGRESS, SPIKE)
