"""A tiny Hugging Face model of the tests' own (no download): Linear -> tanh -> Linear."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import SequenceClassifierOutput

from .clipnets import CLASSES, WIDTH, data


class TinyConfig(PretrainedConfig):
    model_type = "sentineld-clipnet"

    def __init__(self, width: int = WIDTH, classes: int = CLASSES, gain: float = 1.0, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.width, self.classes, self.gain = width, classes, gain


class TinyModel(PreTrainedModel):
    config_class = TinyConfig

    def __init__(self, config: TinyConfig) -> None:
        super().__init__(config)
        self.fc = nn.Linear(config.width, 8)
        self.head = nn.Linear(8, config.classes)
        self.post_init()

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> SequenceClassifierOutput:
        logits = self.head(torch.tanh(self.fc(x)))
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels) * self.config.gain
        return SequenceClassifierOutput(loss=loss, logits=logits)


class Rows(torch.utils.data.Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


def rows(n: int, scale: float = 1.0) -> Rows:
    return Rows(*data(n, scale))
