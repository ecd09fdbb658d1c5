"""The replay queue is round robin over runs (daemon/replay_queue.py)."""

from __future__ import annotations

import queue

import pytest

from sentineld.daemon.replay_queue import FairQueue


def test_a_flooding_run_delays_another_by_one_item() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(3000):
        q.put("flood", f"f{i}")
    q.put("ours", "o0")
    q.put("ours", "o1")
    got = [q.get(timeout=0) for _ in range(5)]
    assert got == ["f0", "o0", "f1", "o1", "f2"]
    assert q.qsize() == 2997


def test_a_requeued_item_goes_behind_the_other_runs() -> None:
    q: FairQueue[str] = FairQueue()
    q.put("a", "a0")
    q.put("b", "b0")
    assert q.get(timeout=0) == "a0"
    q.put("a", "a0")  # still waiting for its verdict: queued again
    assert [q.get(timeout=0), q.get(timeout=0)] == ["b0", "a0"]
    with pytest.raises(queue.Empty):
        q.get(timeout=0.01)
