"""Learning-rate schedules as `torch.optim.lr_scheduler.LambdaLR` multipliers.

The multipliers are small callable objects rather than lambdas so the scheduler's `state_dict`
holds plain numbers (JSON in checkpoints) and a resumed run computes exactly the same LR.

On resume the schedule's shape (base LR, warmup, length) comes from the run's current config and only
its position (optimizer steps done) from the checkpoint: resuming with a higher `trainer.max_steps`
stretches the schedule to the new length, and a new `optim.lr` applies from the resumed step on.
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


class Schedule(LambdaLR):
    """A LambdaLR whose `load_state_dict` takes the position from the checkpoint and keeps the shape
    (base LRs and multiplier) this run was built with, then sets the LR for that position."""

    def load_state_dict(self, state_dict: dict) -> None:
        self.last_epoch, self._step_count = state_dict["last_epoch"], state_dict["_step_count"]
        self._set_position_lr()

    def retotal(self, total_steps: int) -> None:
        """The schedule's length set to `total_steps` (a multiplier without one, constant, is left as it is), its
        position kept: the learning rate from here on is the new shape's at this step."""
        for fn in self.lr_lambdas:
            if hasattr(fn, "total_steps"):
                fn.total_steps = total_steps
        self._set_position_lr()

    def _set_position_lr(self) -> None:
        lrs = [base * fn(self.last_epoch) for base, fn in zip(self.base_lrs, self.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = lrs


def cosine(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0,
           min_lr_ratio: float = 0.1) -> LambdaLR:
    return Schedule(optimizer, WarmupCosine(total_steps, warmup_steps, min_lr_ratio))


def constant(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0) -> LambdaLR:
    return Schedule(optimizer, WarmupConstant(warmup_steps))
