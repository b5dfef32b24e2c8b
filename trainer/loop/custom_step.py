"""A task's own training step: several optimizers (a GAN's generator and discriminator, a student and its frozen
teacher's head), each with its own schedule, inside the Trainer.

A task that defines `training_step(step)` is handed a `TrainingStep` for each optimizer step instead of the
Trainer's one-loss step. The Trainer still owns everything around it: the data order and the micro-batches of the
global batch, accumulation, the non-finite guard, EMA, logging, checkpoints, preemption and resume. The step reads
top to bottom, as a hand-written one would::

    def training_step(self, step):
        d_loss = 0
        for batch in step.micro_batches():              # accumulation, and each sample's noise stream
            with step.autocast():
                loss = step.model(batch, mode="discriminator")   # summed over the batch's targets
            step.backward(loss)                          # divided by the global batch's targets
            d_loss += loss.detach()
        step.optimizer_step("discriminator")             # clip, guard, step, schedule, zero its gradients
        ... the same for "generator" ...
        return {"loss": g_loss, "d_loss": d_loss}        # summed: logged divided by the targets

The model stays one module (its parts are children: `model.generator`, `model.discriminator`), called through
its own forward so that DDP and FSDP see every call; `optim` and `scheduler` in the config give one optimizer per
part (see `build_optimizers` in trainer/entry/run.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from trainer import noise


class TrainingStep:
    def __init__(self, trainer, batches: list[Any], n_global):
        self.trainer, self.rt, self.model = trainer, trainer.rt, trainer.model
        self.optimizers, self.schedulers = trainer.optimizers, trainer.schedulers
        self.batches, self.scale = batches, trainer.strategy.dp_size / n_global
        self.number = trainer.step + 1  # the optimizer step this is
        self.grad_norms: dict[str, torch.Tensor] = {}
        self.applied: dict[str, bool] = {}

    def micro_batches(self) -> Iterator[Any]:
        """This rank's micro-batches of the step, each in its accumulation context (gradients synced in the last)
        and with the noise stream of its samples (trainer.noise): call it once per optimizer."""
        tr = self.trainer
        b, dp = tr.data.batch_size, tr.strategy.dp_size
        for i, batch in enumerate(self.batches):
            first = tr.samples_seen + (i * dp + tr.strategy.dp_rank) * b
            with self.rt.micro_step(self.model, ends_step=i == len(self.batches) - 1), noise.for_samples(torch.arange(first, first + b), tr.cfg.seed):
                yield batch

    def autocast(self) -> contextlib.AbstractContextManager:
        return self.rt.autocast()

    def backward(self, loss_sum: torch.Tensor) -> None:
        """Backward of a loss summed over this micro-batch's targets, normalised by the global batch's targets."""
        self.rt.backward(loss_sum, scale=self.scale)

    def optimizer_step(self, name: str) -> bool:
        """Clip the gradients of optimizer `name`'s parameters (trainer.grad_clip), then step it unless they are
        not finite (trainer.nonfinite) or fp16 skipped it; its schedule advances only after a real update. Its
        gradients are zeroed either way. Returns whether the update was applied."""
        tr = self.trainer
        if name not in self.optimizers:
            from trainer.errors import ConfigError

            raise ConfigError(f"the task's training_step steps the optimizer {name!r}, but the config has "
                              f"{', '.join(self.optimizers)}: set optim.{name} (one optimizer per model part).")
        opt = self.optimizers[name]
        params = [p for group in opt.param_groups for p in group["params"]]
        norm = self.rt.clip_grad_norm_(params, tr.cfg.grad_clip)
        applied = False
        if tr.guard.allows(norm, self.number):
            with tr.guard.skip_on_device(opt):
                applied = self.rt.step(opt, zero_grad=False)
        opt.zero_grad(set_to_none=True)
        if applied:
            self.schedulers[name].step()
        self.grad_norms[name], self.applied[name] = norm, applied
        return applied

    def grad_norm(self) -> torch.Tensor:
        """The norm of all the step's gradients together (each optimizer's clipped separately)."""
        norms = list(self.grad_norms.values())
        return torch.stack([n.float() ** 2 for n in norms]).sum().sqrt() if norms else torch.zeros(())


class Schedules:
    """The schedules of several optimizers, saved in checkpoints under their optimizers' names."""

    def __init__(self, schedulers: dict[str, Any]):
        self.schedulers = schedulers

    def get_last_lr(self) -> list[float]:
        return [lr for s in self.schedulers.values() for lr in s.get_last_lr()]

    def state_dict(self) -> dict[str, Any]:
        return {name: s.state_dict() for name, s in self.schedulers.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, s in self.schedulers.items():
            s.load_state_dict(state[name])
