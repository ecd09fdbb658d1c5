"""Preflight on a real Lightning module and a real transformers model (tiny, built here, no hub):
the optimizer and loss come from the framework as the integrations take them; a healthy model
has no FAIL, a planted bug FAILs its check, and the user's model is unchanged afterwards."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from sentineld.preflight import FAIL, check
from sentineld.preflight.frameworks import HF_ADAMW, framework_of
from sentineld.preflight.runner import check_hf, check_lightning

os.environ.setdefault("HF_HUB_OFFLINE", "1")
L = pytest.importorskip("lightning.pytorch")
transformers = pytest.importorskip("transformers")


class TinyModule(L.LightningModule):
    """Five classes from 20 features; ``seen`` records the batch_idx training_step got."""

    def __init__(self, lr: float = 1e-2, frozen: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))
        if frozen:  # the planted bug: the first layer never trains
            self.net[0].requires_grad_(False)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        self.seen.append(batch_idx)
        x, y = batch
        return {"loss": F.cross_entropy(self(x), y)}

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 10)}


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(20, 5, generator=g)
    x = torch.randn(96, 20, generator=g)
    return DataLoader(TensorDataset(x, (x @ w).argmax(1)), batch_size=32)


def _by_name(checks: list) -> dict[str, Any]:
    return {c.name: c for c in checks}


def _fails(checks: list) -> list[str]:
    return [c.name for c in checks if c.status == FAIL]


def test_healthy_lightning_module_passes_through_check_and_is_unchanged() -> None:
    torch.manual_seed(0)
    module = TinyModule()
    before = copy.deepcopy(module.state_dict())
    checks = check(module, batches=_loader(), overfit_steps=200)
    assert _fails(checks) == [], [(c.name, c.message) for c in checks if c.status == FAIL]
    c = _by_name(checks)
    assert c["initial_loss"].status == "PASS" and c["overfit_one_batch"].status == "PASS"
    # the optimizer is configure_optimizers()'s Adam at the module's lr
    assert c["overfit_one_batch"].evidence["lr"] == pytest.approx(1e-2)
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert all(p.grad is None for p in module.parameters())
    assert module.seen == []  # training_step ran on the copies only


def test_frozen_layer_in_lightning_module_fails_gradient_flow() -> None:
    torch.manual_seed(0)
    module = TinyModule(frozen=True)
    checks = check_lightning(module, _loader(), overfit_steps=50)
    flow = _by_name(checks)["gradient_flow"]
    assert flow.status == FAIL and "net.0" in json.dumps(flow.evidence), flow
    assert module.net[0].weight.requires_grad is False  # the user's module keeps its setting


def _bert(num_labels: int = 3) -> Any:
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16, num_labels=num_labels,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg)


def _hf_batches(label_max: int = 3) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 50, (16, 8), generator=g)
    labels = torch.randint(0, label_max, (16,), generator=g)
    return [{"input_ids": ids[i:i + 8], "attention_mask": torch.ones(8, 8, dtype=torch.long),
             "labels": labels[i:i + 8]} for i in (0, 8)]


def test_healthy_bert_has_no_fail_and_is_unchanged() -> None:
    model = _bert()
    assert framework_of(model) == "hf" and framework_of(nn.Linear(1, 1)) is None
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    checks = check(model, opt, batches=_hf_batches(), overfit_steps=150)
    assert _fails(checks) == [], [(c.name, c.message) for c in checks if c.status == FAIL]
    c = _by_name(checks)
    assert c["labels"].status == "PASS" and c["initial_loss"].status == "PASS"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_bert_default_optimizer_is_the_trainers_adamw() -> None:
    checks = check_hf(_bert(), _hf_batches(), overfit_steps=2)
    assert _by_name(checks)["overfit_one_batch"].evidence["lr"] == HF_ADAMW["lr"]


def test_bert_labels_out_of_range_fail_the_labels_check() -> None:
    checks = check(_bert(num_labels=3), batches=_hf_batches(label_max=5), overfit_steps=5)
    labels = _by_name(checks)["labels"]
    assert labels.status == FAIL, labels


def test_plain_module_without_optimizer_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match="optimizer and loss_fn are required"):
        check(nn.Linear(2, 2), batches=[torch.zeros(1, 2)])


CLI_MODULE = textwrap.dedent('''
    import torch, torch.nn as nn, torch.nn.functional as F
    import lightning.pytorch as L
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5), nn.Softmax(dim=1))
        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self.net(batch[0]), batch[1])
        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    def make_module():
        torch.manual_seed(0)
        return Tiny()

    def data():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 20, generator=g)
        return DataLoader(TensorDataset(x, (x @ torch.randn(20, 5, generator=g)).argmax(1)), batch_size=32)
''')


@pytest.mark.slow  # the real CLI in a subprocess, importing Lightning (~10-20 s)
def test_cli_takes_a_lightning_module(tmp_path: Path) -> None:
    tmp_path.chmod(0o700)
    (tmp_path / "pfl_train.py").write_text(CLI_MODULE)
    exe = Path(sys.executable).with_name("sentineld")
    out = subprocess.run([str(exe), "preflight", "pfl_train:make_module", "--data", "pfl_train:data", "--json",
                          "--steps", "30"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 1, out.stderr
    got = json.loads(out.stdout)
    status = {c["name"]: c["status"] for c in got["checks"]}
    assert got["ok"] is False and status["output_vs_loss"] == FAIL  # the double softmax
