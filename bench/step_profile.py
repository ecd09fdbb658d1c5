"""What each part of the agent's per-step path costs, in microseconds per step (CPU, one thread).

Method: an MLP (bench/overhead.py's, ~1M parameters, Adam) is trained a few hundred steps with the
agent attached, so every part holds real state (gradients, Adam moments, a full ring). Then each
part of the per-step path is called on its own ``--reps`` times in a loop and timed with
``time.perf_counter`` (median of ``--rounds`` rounds): the fused grad norm, RNG capture, the batch
copy to host, the ring bookkeeping, the readback into a record, the stream line, the localizer's
forward-argument copy, the probe hooks (forward hooks on every module), the snapshot (amortized
over the current cadence). The last line times one whole watched step minus a bare step, same
process, interleaved, in training-thread CPU time (``time.thread_time``: immune to the other
processes on this shared VM), with and without the per-layer probes, as a check on the parts.

Run: ``python bench/step_profile.py [--reps 2000] [--rounds 5] [--disk-ring]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.overhead import mlp  # noqa: E402


def per_call_us(fn: Callable[[], Any], reps: int, rounds: int) -> float:
    """Median over ``rounds`` of the mean microseconds per call of ``fn``."""
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        out.append((time.perf_counter() - t0) / reps * 1e6)
    return statistics.median(out)


def train_steps(model: Any, opt: Any, batches: list[Any], watch: Any, n: int) -> float:
    """Mean CPU seconds of the training thread per step over ``n`` steps (``watch`` may be None).
    Thread CPU time, not wall: on this shared VM wall time swings +-50% with other processes,
    while the training thread's own CPU time is what the agent adds to it."""
    t0 = time.thread_time()
    for i in range(n):
        x, y = batches[i % len(batches)]
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if watch is not None:
            watch.step(loss, batch=(x, y))
    return (time.thread_time() - t0) / n


def parts(watch: Any, batch: Any, loss: torch.Tensor) -> dict[str, tuple[Callable[[], Any] | None, Callable[[], Any]]]:
    """The per-step parts: ``name -> (how the agent did it before this change or None, now)``."""
    from sentineld.agent.incidents import batch_check
    from sentineld.agent.readback import grad_norm
    from sentineld.agent.ring import HostCopies, Ring, RingEntry, to_host_sized
    from sentineld.agent.rngread import RngReader
    from sentineld.contracts.records import record_to_json
    from sentineld.contracts.rng import capture_rng
    from sentineld.contracts.treecodec import map_tensors

    rec = watch._rec
    entry = rec.ring.entries[-1]
    record = watch.latest.record
    reader, copies = RngReader(), HostCopies()

    def old_copy(tree: Any) -> tuple[Any, int]:  # map_tensors copy, then a second walk for bytes
        host = map_tensors(tree, lambda t: t.detach().clone())
        n = 0

        def add(t: torch.Tensor) -> torch.Tensor:
            nonlocal n
            n += t.numel() * t.element_size()
            return t

        map_tensors(host, add)
        return host, n

    def old_batch_and_args() -> None:  # forward args copied at the forward, the batch again at step
        old_copy(((batch[0],), {}))
        old_copy(batch)

    def new_batch_and_args() -> None:
        copies.copy(((batch[0],), {}))
        copies.copy(batch)
        copies.clear()

    ring = Ring(rec.ring.window, rec.ring.max_bytes)  # a copy: the watched run's ring stays as it is

    def ring_add() -> None:
        ring.add_step(RingEntry(step=entry.step, batch=entry.batch, rng=None, record=None,
                                    nbytes=entry.nbytes))

    def readback() -> None:
        vals = [loss.detach().float().reshape(()), torch.tensor(1.0), None, None, torch.tensor(0.5)]
        rec.readback.push(0, vals, {"step": 0, "step_s": 0.0, "time_s": 0.0, "optimizer_skipped": False,
                                    "layers": None, "rank": 0, "grads_carried": None, "lr": 1e-4}, entry)
        for _ in rec.readback.ready():
            pass

    def stream_line() -> None:
        json.dumps(record_to_json(record), separators=(",", ":"))

    state = rec.ring.snapshots[-1].state
    return {
        "grad norm (fused _foreach_norm)": (None, lambda: grad_norm(watch.optimizer)),
        "RNG states": (capture_rng, reader.read),
        "batch + forward-arg copies": (old_batch_and_args, new_batch_and_args),
        "batch check (sum, on device)": (None, lambda: batch_check(batch)),
        "ring bookkeeping": (None, ring_add),
        "readback -> StepRecord": (None, readback),
        "record_to_json + json line": (None, stream_line),
        "snapshot copy (amortized)": (lambda: old_copy(state), lambda: to_host_sized(state)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=200, help="steps per block in the whole-step check")
    ap.add_argument("--blocks", type=int, default=9, help="blocks in the whole-step check")
    ap.add_argument("--disk-ring", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from sentineld.agent import attach

    torch.manual_seed(0)
    model, make = mlp()
    bare, _ = mlp()
    bare.load_state_dict(model.state_dict())
    opt = torch.optim.Adam(model.parameters(), 1e-4)
    opt_b = torch.optim.Adam(bare.parameters(), 1e-4)
    g = torch.Generator().manual_seed(0)
    batches = [make(g) for _ in range(20)]
    watch = attach(model, opt, run_id="profile", runs_dir=tempfile.mkdtemp(prefix="sentineld-prof-"),
                   metrics_port=-1, disk_ring=args.disk_ring)
    train_steps(model, opt, batches, watch, 300)
    x, y = batches[0]
    loss = F.cross_entropy(model(x), y)
    print(f"torch {torch.__version__}, 1 thread; MLP {sum(p.numel() for p in model.parameters()):,} params, "
          f"Adam; snapshot every {watch.snapshot_every} steps")
    print(f"{'part':<36}{'before us':>10}{'now us':>9}")
    tot_b = tot_n = 0.0
    for name, (before, now) in parts(watch, (x, y), loss).items():
        reps = args.reps if "snapshot" not in name else 20
        div = max(1, watch.snapshot_every) if "snapshot" in name else 1
        us_n = per_call_us(now, reps, args.rounds) / div
        us_b = per_call_us(before, reps, args.rounds) / div if before is not None else us_n
        tot_b, tot_n = tot_b + us_b, tot_n + us_n
        print(f"{name:<36}{us_b:>10.1f}{us_n:>9.1f}")
    print(f"{'sum of parts':<36}{tot_b:>10.1f}{tot_n:>9.1f}")
    # Whole steps: bare, agent without probes, agent at defaults; interleaved, thread CPU time.
    nop, _ = mlp()
    nop.load_state_dict(bare.state_dict())
    opt_n = torch.optim.Adam(nop.parameters(), 1e-4)
    w_nop = attach(nop, opt_n, run_id="profile-noprobes", runs_dir=tempfile.mkdtemp(prefix="sentineld-prof-"),
                   metrics_port=-1, layer_every=0, disk_ring=args.disk_ring)
    loops = {"bare": (bare, opt_b, batches, None), "agent, probes off": (nop, opt_n, batches, w_nop),
             "agent, defaults": (model, opt, batches, watch)}
    per: dict[str, list[float]] = {k: [] for k in loops}
    for i in range(args.blocks):
        names = list(loops)[i % 3:] + list(loops)[:i % 3]
        for k in names:
            per[k].append(train_steps(*loops[k], args.steps) * 1e6)
    bare_us = statistics.median(per["bare"])
    print(f"whole step, training-thread CPU us (median of {args.blocks} blocks x {args.steps} steps):")
    print(f"  bare {bare_us:.0f}")
    for k in list(loops)[1:]:
        added = [a - b for a, b in zip(per[k], per["bare"])]
        print(f"  {k}: +{statistics.median(added):.0f} ({statistics.median(per[k]) / bare_us:.3f}x; "
              f"blocks {min(added):.0f}..{max(added):.0f})")
    w_nop.close()
    watch.close()


if __name__ == "__main__":
    main()
