"""The recipe, under the name users import it by: ``from sentineld.recipe import Recipe``.

The contract itself is defined once, in :mod:`sentineld.contracts.recipe` (the agent, the
replay and preflight import it from there); this module only gives it its public, stable name,
so recipe modules written against earlier releases keep working.
"""

from sentineld.contracts.recipe import Recipe, train_step

__all__ = ["Recipe", "train_step"]
