"""One intra-op thread for these tiny models: on the shared 2-core machine, torch's default two
threads spin against other processes and make a 0.1 s preflight take seconds."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
