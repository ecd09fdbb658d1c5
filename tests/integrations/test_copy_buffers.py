"""The in-process copy of a model keeps its non-persistent buffers' values (issue 22: BERT's
``position_ids`` is in no state_dict, so no snapshot brings it; the copy held empty memory and
the HF Trainer's in-process localization failed with "index 140575219122560 is out of bounds")."""

from __future__ import annotations

import torch
from torch import nn


class Positions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 4)
        self.register_buffer("position_ids", torch.arange(16).expand((1, -1)), persistent=False)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, n: int) -> torch.Tensor:
        return self.emb(self.position_ids[:, :n]) * self.scale


def test_a_copy_keeps_non_persistent_buffers_and_loads_the_rest() -> None:
    from sentineld.replay.inmemory import copy_module

    live = Positions()
    copy = copy_module(live)
    assert "position_ids" not in live.state_dict()
    assert torch.equal(copy.position_ids, live.position_ids)
    assert copy.position_ids.data_ptr() != live.position_ids.data_ptr()  # a copy, not the live tensor
    copy.load_state_dict(live.state_dict())
    assert torch.equal(copy(5), live(5))
