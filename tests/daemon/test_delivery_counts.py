"""Delivered notifications are counted per signature (the ``sentineld_alerts_sent_total``
``signature`` label was always ``any``): a real outbox, delivered to the notification log."""

from __future__ import annotations

from sentineld.daemon.delivery import LOG_TARGET, deliver_due
from sentineld.daemon.outbox import Notification, Outbox


def test_delivered_counts_by_signature(tmp_path):
    box = Outbox(tmp_path / "outbox")
    for i, sig in enumerate(["nonfinite", "nonfinite", "plateau", "replay"]):
        kind = "verdict" if sig == "replay" else "alert"
        assert box.add(Notification(id=f"n{i}", kind=kind, title="t", body="b", run="r", signature=sig,
                                    targets={LOG_TARGET: "pending"}))
    res = deliver_due(box, [], tmp_path / "notifications.jsonl", initial_s=1.0, max_s=2.0)
    assert res.delivered == 4 and res.failed == 0
    assert res.by_signature == {"nonfinite": 2, "plateau": 1, "replay": 1}
    assert box.pending_count() == 0
