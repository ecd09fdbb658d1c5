"""Cost of the activation probe (sentineld.agent.acthooks and .actmode via sentineld.agent.probes), split into
unsampled and sampled steps, in CPU time of this thread (robust to other processes on the
machine, unlike wall time): bare loop vs probes on a step that is not sampled vs a sampled one,
for an MLP with ``nn.ReLU`` modules and the same MLP calling ``F.relu`` in its ``forward``.

Method: MLP 64 -> 256 -> 256 -> 10 on random data, batch 64, Adam, one thread. Configurations
interleave step by step (round-robin), ``--steps`` steps each after a warm-up; the figure is the
median per-step thread CPU time. ``--baseline FILE`` also times another probes module (e.g.
``git show REV:agent/probes.py > /tmp/old_probes.py``) the same way.

Run: ``python bench/activation_probe_cost.py [--steps 400] [--baseline /tmp/old_probes.py]``.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import statistics
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from sentineld.agent.probes import attach_probes


class FRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(F.relu(self.b(F.relu(self.a(x)))))


def _load(path: str) -> Callable[..., Any]:
    spec = importlib.util.spec_from_file_location("baseline_probes", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.attach_probes  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--baseline", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    seq = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                        nn.Linear(256, 10))
    attachers: dict[str, Callable[..., Any]] = {"new": attach_probes}
    if args.baseline:
        attachers["baseline"] = _load(args.baseline)
    runs: list[dict[str, Any]] = []
    for model_name, base in (("nn.ReLU", seq), ("F.relu", FRelu())):
        for label, attach in [("bare", None)] + list(attachers.items()):
            for sampled in ((False,) if attach is None else (False, True)):
                model = copy.deepcopy(base)
                opt = torch.optim.Adam(model.parameters(), 1e-3)
                probes = None
                if attach is not None:
                    kw = {"dense": 0} if label == "new" else {}
                    probes = attach(model, opt, every=1 if sampled else 10 ** 9, **kw)
                runs.append({"name": f"{model_name:8s} {label:8s} "
                             f"{'sampled' if sampled else ('unsampled' if attach else '')}",
                             "model": model, "opt": opt, "probes": probes, "t": []})

    def one(run: dict[str, Any], i: int) -> float:
        t0 = time.thread_time()
        if run["probes"]:
            run["probes"].begin_step(i + 1)    # step 0 is sampled for every period
        run["opt"].zero_grad()
        F.cross_entropy(run["model"](x), y).backward()
        run["opt"].step()
        if run["probes"]:
            stats = run["probes"].collect()
            if stats is not None and "F.relu" in run["name"]:
                assert any(s.dead_fraction is not None for s in stats.values()) or \
                    "baseline" in run["name"]
        return time.thread_time() - t0

    for i in range(50):
        for run in runs:
            one(run, i)
    for i in range(args.steps):
        for run in runs:
            run["t"].append(one(run, i))
    print(f"MLP 64-256-256-10, batch 64, Adam, 1 thread; median thread CPU time per step over "
          f"{args.steps} steps")
    for run in runs:
        print(f"  {run['name']:30s} {statistics.median(run['t']) * 1e3:8.3f} ms")


if __name__ == "__main__":
    main()
