"""The ring's host-memory bound (agent/memory.py) for a model of ``--params`` parameters with
Adam, as the agent states it at attach; the model is built on the ``meta`` device, so nothing is
allocated. Run: ``python bench/memory_bound.py [--params 100e6] [--ring-bytes 1073741824]``."""

from __future__ import annotations

import argparse

import torch

from sentineld.agent.agent_config import AgentConfig
from sentineld.agent.memory import memory_bound


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--ring-bytes", type=int, default=AgentConfig().ring_bytes)
    args = ap.parse_args()
    width = 4096
    layers = max(1, round(args.params / (width * width)))
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    n = sum(p.numel() for p in model.parameters())
    cfg = AgentConfig(ring_bytes=args.ring_bytes)
    for fwd, what in ((False, "loss_fn or recipe given (no forward-arg copies)"),
                      (True, "neither (forward-only localization keeps forward args)")):
        b = memory_bound(model, torch.optim.Adam(model.parameters()), cfg, forward_only_localizer=fwd)
        print(f"{n / 1e6:.1f}M params float32, Adam, ring_bytes {cfg.ring_bytes / 2**30:.2f} GiB, {what}: "
              f"{b.describe()} = {b.total / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
