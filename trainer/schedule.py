"""Learning-rate schedules as `torch.optim.lr_scheduler.LambdaLR` multipliers.

The multipliers are small callable objects rather than lambdas so the scheduler's `state_dict`
holds plain numbers (JSON in checkpoints) and a resumed run computes exactly the same LR.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.optim.lr_scheduler import LambdaLR


@dataclass
class WarmupCosine:
    """Linear warmup from lr/warmup_steps to lr, then cosine decay to lr * min_lr_ratio at total_steps."""

    total_steps: int
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class WarmupConstant:
    warmup_steps: int = 0

    def __call__(self, step: int) -> float:
        return (step + 1) / self.warmup_steps if step < self.warmup_steps else 1.0


def cosine(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0,
           min_lr_ratio: float = 0.1) -> LambdaLR:
    return LambdaLR(optimizer, WarmupCosine(total_steps, warmup_steps, min_lr_ratio))


def constant(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0) -> LambdaLR:
    return LambdaLR(optimizer, WarmupConstant(warmup_steps))
