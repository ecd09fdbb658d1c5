"""A Hugging Face Trainer script changed only by adding SentineldCallback, with a planted fault.

A tiny BERT (2 layers, hidden 16) built from a config: nothing is downloaded.

    python hf_train.py RUNS_DIR SPEC [SPEC...]      SPEC = RUN_ID:FAULT[:ACCUMULATE[:bf16]]

Several specs train one after another in one process. ``FAULT+override`` trains with a Trainer
subclass that overrides ``compute_loss``. Each run's Trainer log history goes to
``RUNS_DIR/RUN_ID.trainer-log.json`` (it shows what ``logging_nan_inf_filter`` made of the NaN).

FAULT (at optimizer step ``FAULT_STEP``): none | data (NaN in ``inputs_embeds``) | forward
(float32-max embeddings: the embeddings' LayerNorm overflows) | loss (every label -100: the
cross-entropy mean over no target is 0/0) | optimizer (``adam_epsilon=0``: Adam divides 0 by 0
for the parameters whose gradient is exactly zero, at the first step) | backward (a model class
defined in this script, ``TinyModel``: sqrt'(0) = inf inside its ``root``) | crash (loading the
fault step's batch raises, uncaught).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

FAULT_STEP = 3
BATCH, SEQ, HIDDEN = 4, 6, 16


from torch import nn  # noqa: E402
from transformers import PretrainedConfig, PreTrainedModel  # noqa: E402
from transformers.modeling_outputs import SequenceClassifierOutput  # noqa: E402


class TinyConfig(PretrainedConfig):
    model_type = "sentineld-tiny"

    def __init__(self, width: int = HIDDEN, classes: int = 3, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.width, self.classes = width, classes


class Root(nn.Module):
    """sqrt(|x * scale|): finite everywhere, its derivative infinite at exactly zero."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt((x * self.scale).abs())


class TinyModel(PreTrainedModel):
    """A model of the user's own, defined in this script (``__main__``); no ``**kwargs`` in
    forward, so the Trainer divides the loss by the accumulation steps."""

    config_class = TinyConfig

    def __init__(self, config: TinyConfig) -> None:
        super().__init__(config)
        self.root = Root(config.width)
        self.head = nn.Linear(config.width, config.classes)
        self.post_init()

    def forward(self, inputs_embeds: torch.Tensor, labels: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> SequenceClassifierOutput:
        logits = self.head(self.root(inputs_embeds).mean(dim=1))
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


class Embedded(torch.utils.data.Dataset):
    """Samples as the model's keyword arguments: ``inputs_embeds``, ``attention_mask``, ``labels``."""

    def __init__(self, fault: str, accumulate: int, steps: int) -> None:
        g = torch.Generator().manual_seed(0)
        n = steps * accumulate * BATCH
        self.x = torch.randn(n, SEQ, HIDDEN, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)
        lo = (FAULT_STEP * accumulate + accumulate - 1) * BATCH  # the fault step's last micro-batch
        if fault == "data":
            self.x[lo + 1, 2, 3] = float("nan")
        elif fault == "forward":
            self.x[lo + 2] = torch.finfo(torch.float32).max
        elif fault == "loss":
            self.y[lo:lo + BATCH] = -100
        elif fault == "backward":
            self.x[lo + 1, 2, 5] = 0.0  # sqrt(|0|) is finite, its derivative is not (TinyModel)

        self.crash_at = lo if fault == "crash" else None

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if i == self.crash_at:
            raise RuntimeError(f"planted crash loading sample {i}")
        return {"inputs_embeds": self.x[i], "attention_mask": torch.ones(SEQ, dtype=torch.long),
                "labels": self.y[i]}


def train(runs_dir: str, run_id: str, fault: str, accumulate: int = 1, bf16: bool = False) -> None:
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    from sentineld.integrations.transformers import SentineldCallback

    class WeightedTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = model(**inputs)
            return (out.loss * 2.0, out) if return_outputs else out.loss * 2.0

    fault, _, override = fault.partition("+")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=32, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, num_labels=3)
    model = TinyModel(TinyConfig()) if fault == "backward" else BertForSequenceClassification(config)
    steps = FAULT_STEP + 3
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=BATCH, learning_rate=1e-3,
            gradient_accumulation_steps=accumulate, bf16=bf16, use_cpu=True, report_to=[],
            save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0, dataloader_num_workers=0,
            adam_epsilon=0.0 if fault == "optimizer" else 1e-8, warmup_steps=2,
            train_sampling_strategy="sequential")
        cls = WeightedTrainer if override else Trainer
        trainer = cls(model=model, args=args, train_dataset=Embedded(fault, accumulate, steps),
                      callbacks=[] if os.environ.get("NO_SENTINELD")  # a baseline for the memory figure
        else [SentineldCallback(run_id=run_id, runs_dir=runs_dir, metrics_port=0)])
        trainer.train()
        with open(os.path.join(runs_dir, f"{run_id}.trainer-log.json"), "w") as f:
            json.dump(trainer.state.log_history, f)


def main() -> None:
    runs_dir = sys.argv[1]
    for spec in sys.argv[2:]:
        run_id, fault, *rest = spec.split(":")
        train(runs_dir, run_id, fault, int(rest[0]) if rest else 1, len(rest) > 1 and rest[1] == "bf16")


if __name__ == "__main__":
    main()
