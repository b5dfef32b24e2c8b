"""Test-only model for the batch-size finder: the lm GPT, which on rank 1 alone also touches `mb_per_sample` MB
per sample of its batch in each forward, so that rank runs out of a memory budget at a smaller batch."""

import os

import torch

from trainer.recipes.lm.model import GPT


class HogGPT(GPT):
    def __init__(self, mb_per_sample: int = 24, **kwargs):
        super().__init__(**kwargs)
        self.mb_per_sample = mb_per_sample

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out = super().forward(idx)
        if int(os.environ.get("RANK", "0")) == 1:
            hog = torch.ones(idx.shape[0], self.mb_per_sample * 2**18)  # float32, written: resident memory
            out = out + 0 * hog.sum()
        return out
