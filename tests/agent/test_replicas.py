"""The replica check's pure parts: the checksum and the comparison (agent/replicas.py)."""

from __future__ import annotations

import pytest
import torch

from sentineld.agent.replicas import Divergence, checksums, compare

NAMES = ["a", "b", "c"]


def test_checksum_is_order_sensitive_and_sees_one_element() -> None:
    torch.manual_seed(0)
    w = torch.randn(1000)
    base = checksums([w])
    swapped = w.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert not torch.equal(checksums([swapped]), base)  # a XOR (torch.hash_tensor) would not see it
    nudged = w.clone()
    nudged[999] = torch.nextafter(nudged[999], torch.tensor(float("inf")))  # one ulp, last element
    assert not torch.equal(checksums([nudged]), base)
    assert torch.equal(checksums([w.clone()]), base)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8])
def test_checksum_of_every_dtype_changes_with_one_element(dtype: torch.dtype) -> None:
    t = torch.arange(64).reshape(8, 8).to(dtype)
    u = t.clone()
    u[7, 7] += 1
    assert checksums([t, t.t()]).shape == (2,)  # a non-contiguous view is summed too
    assert checksums([t])[0] != checksums([u])[0]


def test_compare_truth_table() -> None:
    same = {0: [1, 2, 3], 1: [1, 2, 3], 2: [1, 2, 3]}
    assert compare(25, same, NAMES) is None
    # One odd rank out of three: it alone is named, with the first differing parameter.
    assert compare(25, {**same, 1: [1, 9, 9]}, NAMES) == Divergence(25, [1], "b")
    # Two ranks: no majority, both are named.
    assert compare(5, {0: [1, 2, 3], 1: [1, 2, 4]}, NAMES) == Divergence(5, [0, 1], "c")
    # Four ranks split 2:2: no strict majority, every rank named.
    four = compare(0, {0: [1, 1, 1], 1: [1, 1, 1], 2: [2, 1, 1], 3: [2, 1, 1]}, NAMES)
    assert four == Divergence(0, [0, 1, 2, 3], "a")
    assert "rank(s) [1] of 3" in Divergence(25, [1], "b").message(3)
