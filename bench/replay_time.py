"""Replay time per fault-zoo case: rebuild (load the capture, re-execute S..N-1) + localization.

Method: the zoo (``tests/zoo``) and a ~10M-parameter case are trained once with the agent attached
(a subprocess from the repository root, as the tests do). Then, in this process, after one
warm-up replay that pays torch's lazy imports (interpreter and import start-up are excluded, as
the goal says), each case is replayed ``--repeat`` times and the median of each phase is printed.
Goal (issue 3): under 5 s per replay for models up to 10M parameters on this 2-core CPU.

With ``--cli`` each case is also replayed as a user does, ``python -m sentineld replay RUN [--step N]
--json`` in a fresh process: the issue's figure (issue 23: <= 5 s from ``sentineld replay`` to the
verdict, interpreter start and imports included), printed as "cli s".

Run from the repository root: ``python bench/replay_time.py [--repeat 3] [--threads 1] [--big-threads 2]
[--cli] [case ...]``.
The thread counts are those of the training runs, which their replays reuse (bit-for-bit
reproduction needs the same count): one thread for the tiny zoo models (two threads only add
synchronisation on a shared two-core machine), both cores for the 10M-parameter case.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sentineld.replay import replay_run  # noqa: E402
from tests.zoo.cases import BENCH_ONLY, CASES, ZOO  # noqa: E402

GOAL_S = 5.0


def cli_replay(run: Path, step: int | None) -> float:
    """Seconds of ``python -m sentineld replay RUN --step STEP --json`` in a fresh process, from
    its start to its exit (the verdict printed); the interpreter start and imports included.

    Raises:
        RuntimeError: the replay exited with a code other than 0 (reproduced) or 1 (not).
    """
    t0 = time.perf_counter()
    at = [] if step is None else ["--step", str(step)]
    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "sentineld", "replay", str(run), *at, "--json"],
                          cwd=REPO, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"sentineld replay {run.name} exited {proc.returncode}: {proc.stderr[-1500:]}")
    return dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="replays per case (median reported)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the zoo runs")
    ap.add_argument("--big-threads", type=int, default=2, help="torch threads of the bench-only runs")
    ap.add_argument("--cli", action="store_true",
                    help="also time `python -m sentineld replay` in a fresh process (interpreter start included)")
    ap.add_argument("cases", nargs="*", help="case names (default: the zoo and the bench-only cases)")
    args = ap.parse_args()
    names = args.cases or [c.name for c in ZOO + BENCH_ONLY]
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory(prefix="replay-bench-") as tmp:
        runs = Path(tmp)
        t0 = time.perf_counter()
        big = {c.name for c in BENCH_ONLY}
        for group, threads in (([n for n in names if n not in big], args.threads),
                               ([n for n in names if n in big], args.big_threads)):
            if not group:
                continue
            proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "tests.zoo.run", str(runs), *group],
                                  cwd=REPO, capture_output=True, text=True,
                                  env={**os.environ, "ZOO_THREADS": str(threads)})
            if proc.returncode != 0:
                print(proc.stderr[-2000:], file=sys.stderr)
                return 1
        print(f"trained {len(names)} runs in {time.perf_counter() - t0:.1f} s "
              f"(threads: zoo {args.threads}, bench-only {args.big_threads}); load average "
              f"{os.getloadavg()[0]:.1f}")
        replay_run(runs / names[0], CASES[names[0]].replay_step)  # warm-up: lazy imports
        print("| case | params | steps rebuilt | rebuild s | localize s | total s | verdict | goal |"
              + (" cli s (goal) |" if args.cli else ""))
        print("|---|---:|---:|---:|---:|---:|---|---|" + ("---:|" if args.cli else ""))
        worst = worst_cli = 0.0
        for name in names:
            case = CASES[name]
            n_params = sum(p.numel() for p in case.factory(**case.recipe_args).model.parameters())
            times, rep = [], None
            for _ in range(args.repeat):
                rep = replay_run(runs / name, case.replay_step)
                times.append((rep.rebuild_s, rep.localize_s, rep.elapsed_s))
            rb, lo, tot = (statistics.median(t[i] for t in times) for i in range(3))
            worst = max(worst, tot) if n_params <= 10_500_000 else worst
            e = case.expect
            ok = (rep.phase, rep.module, rep.op) == (e.phase, e.module, e.op)
            verdict = f"{rep.phase}/{rep.module or '-'}/{rep.op or '-'}" + ("" if ok else " (MISMATCH)")
            cli = ""
            if args.cli:
                cli_s = statistics.median(cli_replay(runs / name, case.replay_step) for _ in range(args.repeat))
                worst_cli = max(worst_cli, cli_s) if n_params <= 10_500_000 else worst_cli
                cli = f" {cli_s:.2f} ({'ok' if cli_s <= GOAL_S else 'SLOW'}) |"
            print(f"| {name} | {n_params:,} | {rep.steps_rebuilt} | {rb:.2f} | {lo:.2f} | {tot:.2f} | "
                  f"{verdict} | {'ok' if tot < GOAL_S else 'SLOW'} |{cli}", flush=True)
        print(json.dumps({"worst_total_s": round(worst, 3), "goal_s": GOAL_S,
                          **({"worst_cli_s": round(worst_cli, 3)} if args.cli else {}),
                          "load_average": round(os.getloadavg()[0], 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
