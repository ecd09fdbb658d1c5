"""Agent overhead: step time of the watched loop vs a bare loop, same process, same data.

Method: identical models (same init), one per variant: ``bare``; ``gradnorm`` (the loop computes
the fused global grad norm itself, on device, never read: the floor a NaN check cannot avoid);
``sentineld`` (the agent at its defaults: ring, snapshots, probes, stream, metrics all on);
``disk_ring`` (the same with ``disk_ring=True``); ``anomaly`` (``torch.autograd.detect_anomaly``);
on request ``no_probes`` (the agent with ``layer_every=0``: what the sampled layer probes cost).
Blocks of ``--block`` steps run the variants in turn, the order rotated every block so drift in
machine speed (+-10% minute to minute on this shared VM) hits all alike. Per block we take each
variant's median step wall time and its process CPU time per step; the figure is the median over
blocks of the per-block ratio variant/bare, with the 10th-90th percentile of those ratios (the
spread), which resolves a 2% difference once there are ~30 blocks.

Models: an MLP whose step takes a few ms here, a small CNN with batch norm, a small transformer.
Run: ``python bench/overhead.py [--blocks 30] [--block 20] [--models mlp,cnn,transformer]
[--variants bare,gradnorm,sentineld,disk_ring,anomaly]``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import tempfile
import time
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn


def mlp() -> tuple[nn.Module, Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]]:
    model = nn.Sequential(nn.Linear(512, 768), nn.ReLU(), nn.Linear(768, 768), nn.ReLU(), nn.Linear(768, 10))

    def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(64, 512, generator=g), torch.randint(0, 10, (64,), generator=g)

    return model, batch


def cnn() -> tuple[nn.Module, Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]]:
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 128), nn.ReLU(), nn.Linear(128, 10))

    def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)

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
    """Median wall seconds per step and mean CPU seconds per step over ``batches`` (used by
    bench/disk_ring_cost.py)."""
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


class Variant:
    """One loop under test: its own model copy and optimizer, and what it adds to each step."""

    def __init__(self, label: str, model: nn.Module, runs_dir: str) -> None:
        from sentineld.agent import attach
        from sentineld.agent.readback import grad_norm

        self.label, self.model = label, model
        self.opt = torch.optim.Adam(model.parameters(), 1e-4)
        self.watch = None
        self.norm: Callable[[], Any] | None = None
        if label in ("sentineld", "disk_ring", "no_probes"):
            self.watch = attach(model, self.opt, run_id=f"bench-{label}", runs_dir=runs_dir,
                                metrics_port=-1, disk_ring=label == "disk_ring",
                                layer_every=0 if label == "no_probes" else 50)
        elif label == "gradnorm":
            self.norm = lambda: grad_norm(self.opt)
        self.anomaly = label == "anomaly"

    def block(self, batches: list[Any]) -> tuple[float, float]:
        """Median wall seconds per step and mean CPU seconds per step over ``batches``."""
        model, opt, watch = self.model, self.opt, self.watch
        times = []
        c0 = time.process_time()
        for x, y in batches:
            t0 = time.perf_counter()
            opt.zero_grad()
            with torch.autograd.detect_anomaly(check_nan=True) if self.anomaly else contextlib.nullcontext():
                loss = loss_of(model, x, y)
                loss.backward()
            if self.norm is not None:
                self.norm()
            opt.step()
            if watch is not None:
                watch.step(loss, batch=(x, y))
            times.append(time.perf_counter() - t0)
        return statistics.median(times), (time.process_time() - c0) / len(batches)


def measure(name: str, build: Callable[[], Any], labels: list[str], blocks: int, block: int,
            warmup: int = 0) -> dict[str, Any]:
    """Per variant: median and 10th/90th percentile of per-block wall ratios to bare, CPU ratio,
    after ``warmup`` steps of each variant (not measured)."""
    torch.manual_seed(0)
    base, make_batch = build()
    runs = tempfile.mkdtemp(prefix="sentineld-bench-")
    variants = [Variant(lab, copy.deepcopy(base), runs) for lab in ["bare", *labels]]
    g = torch.Generator().manual_seed(0)
    batches = [make_batch(g) for _ in range(block)]
    for v in variants:  # warm-up: at least one block; --warmup-steps for the steady state
        for _ in range(max(1, -(-warmup // block))):
            v.block(batches)
    wall: dict[str, list[float]] = {v.label: [] for v in variants}
    cpu: dict[str, list[float]] = {v.label: [] for v in variants}
    bare_s = []
    for i in range(blocks):
        k = i % len(variants)
        res = {v.label: v.block(batches) for v in variants[k:] + variants[:k]}
        for lab, (w, c) in res.items():
            wall[lab].append(w / res["bare"][0])
            cpu[lab].append(c / res["bare"][1])
        bare_s.append(res["bare"][0])
    out: dict[str, Any] = {"model": name, "params": sum(p.numel() for p in base.parameters()),
                           "bare_step_ms": 1e3 * statistics.median(bare_s), "ratios": {}}
    for v in variants[1:]:
        q = statistics.quantiles(wall[v.label], n=10)
        out["ratios"][v.label] = (statistics.median(wall[v.label]), q[0], q[-1],
                                  statistics.median(cpu[v.label]))
        if v.watch is not None:
            out.setdefault("snapshot_every", {})[v.label] = v.watch.snapshot_every
            v.watch.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=30)
    ap.add_argument("--block", type=int, default=20)
    ap.add_argument("--models", default="mlp,cnn,transformer")
    ap.add_argument("--variants", default="gradnorm,sentineld,disk_ring,anomaly")
    ap.add_argument("--warmup-steps", type=int, default=0,
                    help="steps each variant runs before measuring; 800 passes the agent's dense "
                         "layer sampling of a run's first steps (every step, then backing off to "
                         "layer_every by about step 800: a one-time cost per run), so the table "
                         "shows the steady state; 0 (default) includes it")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads; 1 by default: on this shared 2-core VM a second intra-op "
                         "thread that gets descheduled stalls every op (our measurement)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    builders = {"mlp": mlp, "cnn": cnn, "transformer": transformer}
    labels = [v for v in args.variants.split(",") if v and v != "bare"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, blocks={args.blocks} x "
          f"{args.block} steps after {args.warmup_steps} warm-up steps; wall x = median per-block ratio "
          "to bare [p10, p90]; cpu x = CPU time ratio")
    print("| model (bare step) | " + " | ".join(labels) + " |")
    print("|---|" + "---|" * len(labels))
    for name in args.models.split(","):
        r = measure(name, builders[name], labels, args.blocks, args.block, args.warmup_steps)
        cells = [f"{w:.3f}x [{lo:.2f}, {hi:.2f}] cpu {c:.3f}x" for w, lo, hi, c in
                 (r["ratios"][lab] for lab in labels)]
        print(f"| {name} {r['params'] / 1e6:.2f}M ({r['bare_step_ms']:.2f} ms) | " + " | ".join(cells) + " |",
              flush=True)


if __name__ == "__main__":
    main()
