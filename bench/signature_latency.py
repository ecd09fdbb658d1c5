"""Signature latency and false alarms on the tiny CPU runs of tests/signatures.

For every faulty run: the signature it must raise, the step of the fault, the first step after
which the signature fired (evaluated as the daemon does: once per new record over the last 200
records), the latency in steps against the bound the tests assert, and the other signatures the
run raised. Then the false alarms over the healthy runs (with and without ``num_classes``), and
the cost of one ``evaluate`` call on a full 200-record window.

Run from the repository root: ``python bench/signature_latency.py``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sentineld.signatures import SignatureConfig, evaluate  # noqa: E402
from tests.signatures.scenarios import (FAULTY, HEALTHY, WINDOW, records_of,  # noqa: E402
                                        replay_daemon)


def main() -> None:
    print(f"{'signature':22s} {'faulty run':28s} {'fault@':>6s} {'fired@':>6s} {'latency':>7s} "
          f"{'bound':>5s}  also raised")
    for sc in FAULTY:
        records = records_of(sc.name)
        verdicts = replay_daemon(records, sc.num_classes)
        first: dict[str, int] = {}
        for r, vs in zip(records, verdicts):
            for v in vs:
                first.setdefault(v.signature, r.step)
        fired = first.get(sc.expect or "")
        lat = "-" if fired is None else str(fired - sc.fault_step)
        others = ", ".join(f"{k}@{s}" for k, s in sorted(first.items(), key=lambda kv: kv[1])
                           if k != sc.expect)
        print(f"{sc.expect or '':22s} {sc.name:28s} {sc.fault_step:6d} "
              f"{'-' if fired is None else fired:>6} {lat:>7s} {sc.max_latency:5d}  {others}")
    cfg = SignatureConfig()
    rec = records_of("mlp_adam")[:121]
    limit = cfg.stalled.threshold_s
    fired_at = next(t for t in range(0, 4000, 10)
                    if any(v.signature == "stalled"
                           for v in evaluate(rec, cfg, now_s=rec[-1].time_s + t, num_classes=10)))
    print(f"{'stalled':22s} {'mlp_adam cut at step 120':28s} {120:6d} {'-':>6s} "
          f"{fired_at:>6d}s {int(limit):>4d}s  (latency in seconds of daemon clock)")

    print()
    total = steps = 0
    for known in (True, False):
        alarms: dict[str, int] = {}
        for sc in HEALTHY:
            records = records_of(sc.name)
            n = sum(len(vs) for vs in replay_daemon(records, sc.num_classes if known else None))
            alarms[sc.name] = n
            total += n
            steps += len(records)
        label = "with num_classes" if known else "without num_classes"
        print(f"healthy runs {label}: {sum(alarms.values())} verdicts over {len(HEALTHY)} runs "
              f"({sum(len(records_of(s.name)) for s in HEALTHY)} evaluated windows)")
        for name, n in alarms.items():
            if n:
                print(f"    {name}: {n}")
    print("   runs: " + ", ".join(f"{s.name}" for s in HEALTHY))

    window = records_of("mlp_adam")[-WINDOW:]
    n = 300
    t0 = time.perf_counter()
    for _ in range(n):
        evaluate(window, cfg, now_s=window[-1].time_s, num_classes=10)
    per = (time.perf_counter() - t0) / n
    print(f"\nevaluate() on a {len(window)}-record window (layers every 5 steps): "
          f"{per * 1e6:.0f} us per call")


if __name__ == "__main__":
    main()
