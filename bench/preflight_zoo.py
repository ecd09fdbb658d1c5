"""Preflight on the planted-bug zoo and the healthy models: detected / missed / false FAIL counts.

A planted bug is *detected* when the check meant for it (``tests/preflight/zoo.py``, ``expect``)
FAILs, *flagged* when it only WARNs, *missed* otherwise; other checks that fail on a planted case
are listed as collateral (a crash in the user's loss fails every check that runs it). A healthy
model must get no FAIL: each one it gets is a *false FAIL*. Wall and CPU time are per full preflight
(10 checks, plus the LR range test with ``--lr-range``), after one warm-up; the CPU time
is the honest figure on a shared machine, where the wall time includes waiting for a core.

Run from the repository root: ``python bench/preflight_zoo.py [--lr-range] [--threads 1] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from sentineld.preflight import FAIL, WARN, check  # noqa: E402
from tests.preflight.zoo import CASES, HEALTHY  # noqa: E402


def run_case(case, lr_range: bool, plot_dir: Path) -> dict:
    model, opt, loss_fn, batches, extra = case.build()
    t0, c0 = time.perf_counter(), time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        checks = check(model, opt, loss_fn, batches, lr_range=lr_range,
                       lr_plot=plot_dir / f"{case.name}.png", **extra)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    by = {c.name: c for c in checks}
    row = {"case": case.name, "expect": case.expect, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
           "fails": [c.name for c in checks if c.status == FAIL],
           "warns": [c.name for c in checks if c.status == WARN]}
    if case.expect:
        status = by[case.expect].status
        row["outcome"] = {"FAIL": "detected", "WARN": "flagged"}.get(status, "missed")
        row["message"] = by[case.expect].message
    else:
        row["outcome"] = "false FAIL" if row["fails"] else "clean"
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lr-range", action="store_true", help="also run the LR range test (check 11)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        run_case(HEALTHY[0], args.lr_range, Path(tmp))  # warm-up: lazy imports, first-call costs
        rows = [run_case(c, args.lr_range, Path(tmp)) for c in CASES]
    planted = [r for r in rows if r["expect"]]
    healthy = [r for r in rows if not r["expect"]]
    summary = {"planted": len(planted),
               "detected": sum(r["outcome"] == "detected" for r in planted),
               "flagged_only": sum(r["outcome"] == "flagged" for r in planted),
               "missed": sum(r["outcome"] == "missed" for r in planted),
               "healthy": len(healthy), "false_fail": sum(len(r["fails"]) for r in healthy),
               "healthy_warns": sum(len(r["warns"]) for r in healthy),
               "max_wall_s": max(r["wall_s"] for r in rows), "max_cpu_s": max(r["cpu_s"] for r in rows),
               "threads": args.threads,
               "lr_range": args.lr_range}
    if args.json:
        print(json.dumps({"summary": summary, "rows": rows}, indent=2))
        return
    for r in rows:
        extra = [f for f in r["fails"] if f != r["expect"]]
        print(f"{r['case']:30s} {str(r['expect']):18s} {r['outcome']:10s} {r['wall_s']:6.2f}s wall {r['cpu_s']:5.2f}s cpu"
              + (f"  also FAIL: {', '.join(extra)}" if extra else "")
              + (f"  WARN: {', '.join(r['warns'])}" if r["warns"] else ""))
    print(f"\nplanted {summary['planted']}: detected {summary['detected']}, flagged only "
          f"{summary['flagged_only']}, missed {summary['missed']}; healthy {summary['healthy']}: "
          f"false FAIL {summary['false_fail']}, WARN {summary['healthy_warns']}; slowest preflight "
          f"{summary['max_wall_s']:.2f}s wall, {summary['max_cpu_s']:.2f}s cpu ({args.threads} thread(s), lr range {'on' if args.lr_range else 'off'})")


if __name__ == "__main__":
    main()
