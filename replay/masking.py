"""Which births were masked: their non-finite values dropped before they could do harm.

Derivative formulas guard themselves: ``pow``'s exponent gradient computes ``result * log(base)``
for every element, so ``log(0) = -inf`` and ``0 * -inf = NaN`` are born, then ``where(base == 0,
0, ...)`` drops them; the gradient that does go non-finite comes from another birth in the same
node (``base ** (p - 1)`` at base 0). The first birth of a step is therefore not always the one
that mattered.

:class:`Provenance` follows non-finite tensors from birth to birth: a birth's tensor carries its
own index, a tensor computed from non-finite inputs carries theirs, and an op that turns
non-finite inputs into a finite output (a selector, ``exp(-inf) = 0``) marks their births
*masked*. The verdict takes the first birth that is not masked and names its earliest ancestor.
Bounded: at most :data:`MAX_TRACKED` tensors are followed (references kept so ids stay unique).
"""

from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["Provenance", "MAX_TRACKED"]

#: Most non-finite tensors followed in one step (each is kept alive until the step ends).
MAX_TRACKED = 4096


class Provenance:
    """Births each non-finite tensor descends from, and the births that were masked."""

    def __init__(self) -> None:
        self._origin: dict[int, tuple[frozenset[int], torch.Tensor]] = {}
        self.masked: set[int] = set()
        #: index of a birth -> the births it descends from (itself included).
        self.ancestry: dict[int, frozenset[int]] = {}

    def parents(self, ins: Iterable[torch.Tensor]) -> frozenset[int]:
        """Births the tensors ``ins`` descend from (empty when none is tracked)."""
        if not self._origin:
            return frozenset()
        out: set[int] = set()
        for t in ins:
            o = self._origin.get(id(t))
            if o is not None and o[1] is t:
                out |= o[0]
        return frozenset(out)

    def _tag(self, outs: Iterable[torch.Tensor], origin: frozenset[int]) -> None:
        for t in outs:
            if len(self._origin) < MAX_TRACKED or id(t) in self._origin:
                self._origin[id(t)] = (origin, t)

    def born(self, index: int, bad: Iterable[torch.Tensor], parents: frozenset[int]) -> None:
        """Birth ``index`` made the non-finite tensors ``bad`` (from inputs descending from ``parents``)."""
        origin = parents | {index}
        self.ancestry[index] = origin
        self._tag(bad, origin)

    def carried(self, bad: Iterable[torch.Tensor], parents: frozenset[int]) -> None:
        """An op passed non-finite values of ``parents`` on into ``bad`` (no new birth)."""
        self._tag(bad, parents)

    def dropped(self, parents: frozenset[int]) -> None:
        """An op turned non-finite inputs of ``parents`` into finite outputs."""
        self.masked |= parents

    def root(self, index: int) -> int:
        """The earliest birth ``index`` descends from."""
        return min(self.ancestry.get(index, frozenset({index})))

    def clear(self) -> None:
        self._origin.clear()
