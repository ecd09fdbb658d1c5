"""The healthy corpus's parts (tests/signatures/corpus.py): its data streams, the two models the
harness lacks (a tiny language model, a GRU classifier), and the optimizer/scheduler helpers."""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tests.signatures.harness import digits

Batch = tuple[torch.Tensor, torch.Tensor]


def _stream(x: torch.Tensor, y: torch.Tensor, batch: int, seed: int = 0) -> Iterator[Batch]:
    g = torch.Generator().manual_seed(seed)
    while True:
        idx = torch.randint(0, x.shape[0], (batch,), generator=g)
        yield x[idx], y[idx]


def _digits(batch: int = 64, seed: int = 0, image: bool = False) -> Iterator[Batch]:
    x, y = digits(image=image)
    return _stream(x, y, batch, seed)


def _fixed(n: int, dim: int, classes: int, seed: int) -> Iterator[Batch]:
    """One batch of ``n`` random samples, again and again: a memorisable task."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, dim, generator=g), torch.randint(0, classes, (n,), generator=g)
    while True:
        yield x, y


def _noisy_labels(share: float, seed: int = 0) -> Iterator[Batch]:
    x, y = digits()
    g = torch.Generator().manual_seed(seed)
    flip = torch.rand(y.shape, generator=g) < share
    y = torch.where(flip, torch.randint(0, 10, y.shape, generator=g), y)
    return _stream(x, y, 64, seed)


def _regression(seed: int = 0) -> Iterator[Batch]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 1, generator=g)
    x = torch.randn(2048, 16, generator=g)
    y = torch.tanh(x @ w) + 0.05 * torch.randn(2048, 1, generator=g)
    return _stream(x, y, 64, seed)


def _text(seq: int = 16, batch: int = 32, seed: int = 0) -> Iterator[Batch]:
    """Next-token batches over a small generated text of 16 symbols (a tiny character LM)."""
    g = torch.Generator().manual_seed(seed)
    words = [torch.randint(0, 16, (int(n),), generator=g) for n in torch.randint(2, 6, (24,), generator=g)]
    order = torch.randint(0, len(words), (3000,), generator=g)
    text = torch.cat([words[int(i)] for i in order])
    while True:
        starts = torch.randint(0, len(text) - seq - 1, (batch,), generator=g)
        chunk = torch.stack([text[s:s + seq + 1] for s in starts.tolist()])
        yield chunk[:, :-1], chunk[:, 1:]


# ----------------------------------------------------------------------------- models
class TinyLM(nn.Module):
    """A causal pre-norm transformer over 16 symbols: (B, T) -> logits (B, T, 16)."""

    def __init__(self, vocab: int = 16, d: int = 32, seq: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(1, seq, d))
        layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok(idx) + self.pos[:, :idx.shape[1]]
        return self.head(self.norm(self.blocks(h, mask=self.mask, is_causal=True)))


class GRUClassifier(nn.Module):
    """Digits as 8 rows of 8 pixels through a GRU: (B, 64) -> (B, 10)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(8, 32, batch_first=True)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, h = self.rnn(x.reshape(-1, 8, 8))
        return self.head(h[-1])


def _lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _warmup_cosine(opt: torch.optim.Optimizer, warmup: int, total: int) -> Any:
    def f(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warmup) / max(1, total - warmup))))
    return torch.optim.lr_scheduler.LambdaLR(opt, f)


def _seeded(seed: int, make: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(seed)
    return make()


# ----------------------------------------------------------------------------- the runs
def _adam(m: nn.Module, lr: float = 1e-3, **kw: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(m.parameters(), lr, **kw)
