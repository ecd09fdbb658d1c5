"""The replay's own error (the others are its parts': ``RebuildError``, ``RecipeError``,
``UntrustedError``, and the contracts' ``CaptureError`` / ``RunDirError``). Its own module so
that every part of the replay raises it without importing the engine that drives them."""

from __future__ import annotations

from sentineld.contracts.errors import BadInput

__all__ = ["ReplayError"]


class ReplayError(BadInput):
    """Bad input for a replay (no capture for the step, no recipe, a model that cannot be built)."""
