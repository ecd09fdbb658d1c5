"""Whole-process CPU profile by thread of an MLP run with the agent at its defaults (issue 23).

Runs the MLP of ../shared/bench/peers.py (64 -> 4x512 ReLU -> 10, batch 128, Adam, one torch
thread) for ``--steps`` watched steps under ``py-spy record --threads`` (py-spy's raw
collapsed-stack output), then prints, per thread, the share of samples, and the
top costs of the agent: samples whose stack passes through ``sentineld`` code, grouped by the
outermost sentineld frame below the training loop (the hook or call that the loop paid for) and
by the innermost sentineld frame (where inside the agent the time went).

Run: ``python bench/agent_profile.py [--steps 600] [--rate 250] [--out /tmp/mlp.folded]
[--model mlp|cnn|transformer]``
(needs ``pip install py-spy``; with ``--child`` it is the profiled training process itself;
``--gil`` samples only the thread holding the GIL; ``--disk-ring`` profiles ``disk_ring=True``).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time


def child(steps: int, start_after: int, agent: bool, disk_ring: bool = False, model_name: str = "mlp") -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1234)
    if model_name == "mlp":
        layers: list[nn.Module] = [nn.Linear(64, 512), nn.ReLU()]
        for _ in range(3):
            layers += [nn.Linear(512, 512), nn.ReLU()]
        model: nn.Module = nn.Sequential(*layers, nn.Linear(512, 10))
        data = [(torch.randn(128, 64, generator=g), torch.randint(0, 10, (128,), generator=g)) for _ in range(8)]
    else:  # bench/overhead.py's CNN or transformer, same data as there
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import overhead  # noqa: PLC0415

        model, make = {"cnn": overhead.cnn, "transformer": overhead.transformer}[model_name]()
        data = [make(g) for _ in range(8)]
    opt = torch.optim.Adam(model.parameters(), 1e-3)

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = model(x)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    watch = None
    if agent:
        from sentineld.agent import attach
        watch = attach(model, opt, run_id=f"prof{time.time_ns()}", runs_dir=tempfile.mkdtemp(), metrics_port=0,
                       disk_ring=disk_ring)
    t0 = time.perf_counter()
    for i in range(steps):
        if i == start_after:
            print(f"MARK {time.perf_counter() - t0:.3f}", flush=True)
        x, y = data[i % 8]
        opt.zero_grad()
        loss = loss_of(x, y)
        loss.backward()
        opt.step()
        if watch is not None:
            watch.step(loss, batch=(x, y))
    dt = time.perf_counter() - t0
    for line in _thread_cpu():
        print(line, flush=True)
    if watch is not None:
        watch.close()
    print(f"STEPS {steps} {1e3 * dt / steps:.3f} ms/step", flush=True)


def _thread_cpu() -> list[str]:
    """CPU seconds used so far by each thread of this process (Linux /proc; py-spy counts a
    thread blocked in a timed lock wait as busy, this does not)."""
    out = []
    tick = os.sysconf("SC_CLK_TCK")
    for tid in sorted(os.listdir("/proc/self/task")):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out.append(f"THREAD_CPU {name:16s} {(int(fields[11]) + int(fields[12])) / tick:8.2f} s")
    return out


def _ours(frame: str) -> bool:
    """A frame of sentineld's code (installed, or editable: ``(agent/watch.py:12)``)."""
    return "sentineld/" in frame or "(agent/" in frame or "(replay/" in frame or "/wt/" in frame and "/agent/" in frame


def _func(frame: str) -> str:
    """``name (path:line)`` -> ``name (path)``: group a function's lines."""
    return frame.rsplit(":", 1)[0] + ")" if frame.endswith(")") else frame


def summarize(path: str, top: int) -> None:
    threads: collections.Counter[str] = collections.Counter()
    outer: collections.Counter[str] = collections.Counter()
    inner: collections.Counter[str] = collections.Counter()
    leaf: collections.Counter[str] = collections.Counter()
    agent: collections.Counter[str] = collections.Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            k = int(n)
            frames = stack.split(";")
            total += k
            thread = frames[0]
            threads[thread] += k
            ours = [fr for fr in frames[1:] if _ours(fr)]
            if ours:
                name = thread.split(": ")[-1]
                outer[f"{name} | {_func(ours[0])}"] += k
                inner[f"{name} | {_func(ours[-1])}"] += k
                leaf[ours[-1]] += k
                agent[name] += k
    print(f"\n{total} samples")
    print("\nper thread (share of all samples):")
    for t, k in threads.most_common():
        print(f"  {100 * k / total:5.1f}%  {t}")
    print("\nsamples inside the agent's code, per thread (share of all samples):")
    for t, k in agent.most_common():
        print(f"  {100 * k / total:5.1f}%  {t}")
    for title, c in (("outermost agent frame (what the loop or thread paid for)", outer),
                     ("innermost agent frame (where in the agent)", inner),
                     ("innermost agent line", leaf)):
        print(f"\n{title}:")
        for fr, k in c.most_common(top):
            print(f"  {100 * k / total:5.1f}%  {fr}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--rate", type=int, default=250)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--out", default="")
    ap.add_argument("--bare", action="store_true", help="the loop without the agent")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--disk-ring", action="store_true", help="the agent with disk_ring=True")
    ap.add_argument("--gil", action="store_true", help="sample only the thread holding the GIL")
    ap.add_argument("--model", choices=("mlp", "cnn", "transformer"), default="mlp",
                    help="the issue's MLP, or bench/overhead.py's CNN or transformer")
    args = ap.parse_args()
    if args.child:
        child(args.steps, 0, not args.bare, args.disk_ring, args.model)
        return
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    out = args.out or tempfile.mktemp(suffix=".folded")
    cmd = [spy, "record", "--threads", *(["--gil"] if args.gil else []), "-r", str(args.rate), "-f", "raw",
           "-o", out, "--", sys.executable, __file__, "--child", "--steps", str(args.steps),
           *(["--bare"] if args.bare else []), *(["--disk-ring"] if args.disk_ring else []),
           "--model", args.model]
    subprocess.run(cmd, check=True)
    summarize(out, args.top)


if __name__ == "__main__":
    main()
