"""The contract between the Trainer and a recipe's task object (what computes the loss).

A task is any object with these methods; `_target_` in the `task` config points at its class.
The Trainer divides summed losses by the number of targets in the whole global batch, which
makes gradient accumulation and data parallelism exact even when batches differ in length.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn as nn


class Task(Protocol):
    def num_targets(self, batch: Any) -> int | torch.Tensor:
        """How many loss terms `loss` sums over for this batch (tokens for an LM, rows for regression)."""

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The SUM (not the mean) of the per-target losses of this batch, as a scalar tensor."""


# Optional methods, used when present:
#   setup(train, val, run_dir) -> None     once per process after the datasets are built, e.g. to fit a data
#                                          normaliser on the main process (trainer.main_process_first) and
#                                          share it with the others through a file in run_dir
#   state_dict() / load_state_dict(state)  the task's own state (tensors by name): saved in checkpoints as
#                                          "task", exported beside the weights as task_state.safetensors
#   eval_metrics(mean_loss: float) -> dict[str, float]   extra val metrics, e.g. {"bpb": ...}
#   sample(model, device) -> str | dict    at each eval, from the EMA weights when EMA is on: a string, or a
#                                          dict of named artefacts: strings (text), tensors (images: [H, W],
#                                          [H, W, C] or [C, H, W]; written to samples/step_N.png for the key
#                                          "image") and numbers (sample-quality metrics, logged as val/NAME)


class SupervisedTask:
    """A ready-made task for `model(x) -> prediction`, batches `(x, y)` and a torch loss class.

    `loss_fn` is built with reduction='sum'. Example config::

        task:
          _target_: trainer.task.SupervisedTask
          loss: torch.nn.MSELoss
    """

    def __init__(self, loss: str = "torch.nn.MSELoss"):
        from hydra.utils import get_class

        self.loss_fn = get_class(loss)(reduction="sum")

    def num_targets(self, batch: Any) -> int:
        return len(batch[0])

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return self.loss_fn(model(x), y)
