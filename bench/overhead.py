"""Agent overhead: median step time with the agent attached vs a bare loop, same process, same data.

Method: two identical models (same init), one watched by the agent at default settings, one bare.
Blocks of ``--block`` steps alternate between them (bare first in even blocks, agent first in odd
ones) so drift in machine speed (+-10% minute to minute here) hits both alike. Per block we take
the median step wall time and the process CPU time per step; the figure is the median over blocks
of the per-block ratio agent/bare, with the 10th-90th percentile of those ratios, which resolves a
2% difference once there are ~30 blocks.

Models: an MLP whose step takes ~8 ms here, and a small transformer whose step takes tens of ms.
Run: ``python bench/overhead.py [--blocks 30] [--block 20]``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn


def mlp() -> tuple[nn.Module, Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]]:
    model = nn.Sequential(nn.Linear(512, 768), nn.ReLU(), nn.Linear(768, 768), nn.ReLU(), nn.Linear(768, 10))

    def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(64, 512, generator=g), torch.randint(0, 10, (64,), generator=g)

    return model, batch


class TinyTransformer(nn.Module):
    """Decoder-only LM: (B, T) tokens -> (B, T, V) logits; 2 layers, d=128, 4 heads."""

    def __init__(self, vocab: int = 512, d: int = 128, layers: int = 2, seq: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(1, seq, d))
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.1, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens) + self.pos[:, : tokens.shape[1]]
        return self.head(self.blocks(h, mask=self.mask, is_causal=True))


def transformer() -> tuple[nn.Module, Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]]:
    model = TinyTransformer()

    def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.randint(0, 512, (8, 33), generator=g)
        return t[:, :-1], t[:, 1:]

    return model, batch


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def run_block(model: nn.Module, opt: torch.optim.Optimizer, batches: list[Any], watch: Any) -> tuple[float, float]:
    """Median wall seconds per step and mean CPU seconds per step over ``batches``."""
    times = []
    c0 = time.process_time()
    for x, y in batches:
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        if watch is not None:
            watch.step(loss, batch=(x, y))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), (time.process_time() - c0) / len(batches)


def measure(name: str, build: Callable[[], Any], blocks: int, block: int) -> dict[str, float]:
    from sentineld.agent import attach

    torch.manual_seed(0)
    bare, make_batch = build()
    watched = copy.deepcopy(bare)
    opt_b = torch.optim.Adam(bare.parameters(), 1e-4)
    opt_w = torch.optim.Adam(watched.parameters(), 1e-4)
    runs = tempfile.mkdtemp(prefix="sentineld-bench-")
    watch = attach(watched, opt_w, run_id=f"bench-{name}", runs_dir=runs, metrics_port=-1)
    g = torch.Generator().manual_seed(0)
    batches = [make_batch(g) for _ in range(block)]
    run_block(bare, opt_b, batches, None)  # warm-up both
    run_block(watched, opt_w, batches, watch)
    ratios, cpu_ratios, bare_s = [], [], []
    for i in range(blocks):
        order = [("bare", bare, opt_b, None), ("agent", watched, opt_w, watch)]
        if i % 2:
            order.reverse()
        res = {}
        for label, m, o, w in order:
            res[label] = run_block(m, o, batches, w)
        ratios.append(res["agent"][0] / res["bare"][0])
        cpu_ratios.append(res["agent"][1] / res["bare"][1])
        bare_s.append(res["bare"][0])
    watch.close()
    q = statistics.quantiles(ratios, n=10)
    nparams = sum(p.numel() for p in bare.parameters())
    return {"model": name, "params": nparams, "bare_step_ms": 1e3 * statistics.median(bare_s),
            "wall_ratio": statistics.median(ratios), "p10": q[0], "p90": q[-1],
            "cpu_ratio": statistics.median(cpu_ratios), "snapshot_every": watch.snapshot_every}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=30)
    ap.add_argument("--block", type=int, default=20)
    ap.add_argument("--models", default="mlp,transformer")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads; 1 by default: on this shared 2-core VM a second intra-op "
                         "thread that gets descheduled stalls every op (our measurement)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    builders = {"mlp": mlp, "transformer": transformer}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, blocks={args.blocks} x {args.block} steps")
    print(f"{'model':<12}{'params':>10}{'bare ms':>9}{'wall x':>8}{'p10':>7}{'p90':>7}{'cpu x':>8}{'K':>5}")
    for name in args.models.split(","):
        r = measure(name, builders[name], args.blocks, args.block)
        print(f"{r['model']:<12}{r['params']:>10}{r['bare_step_ms']:>9.2f}{r['wall_ratio']:>8.3f}"
              f"{r['p10']:>7.3f}{r['p90']:>7.3f}{r['cpu_ratio']:>8.3f}{r['snapshot_every']:>5}")


if __name__ == "__main__":
    main()
