from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class Split:
    """Fixed-length token blocks. labels=None means the LM target is input_ids itself (the model
    shifts); otherwise labels are aligned with input_ids and -100 marks ignored positions."""

    input_ids: torch.Tensor  # [N, T] int64
    labels: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def batch(self, index: torch.Tensor) -> dict[str, torch.Tensor]:
        ids = self.input_ids[index]
        return {"input_ids": ids, "labels": ids if self.labels is None else self.labels[index]}


@dataclass
class Data:
    train: Split
    val: Split
    vocab_size: int
    tokenizer: object | None = None  # a transformers tokenizer (None for synthetic tasks)
    bytes_per_token: float | None = None  # UTF-8 bytes per val token, for bits per byte
    # Extra evaluation for synthetic tasks: fn(model, device) -> {metric name: value}.
    extra_eval: Callable | None = None
    info: dict = field(default_factory=dict)
