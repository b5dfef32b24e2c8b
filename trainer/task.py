"""The contract between the Trainer and a recipe's task object (what computes the loss).

A task is any object with these methods; `_target_` in the `task` config points at its class.
The Trainer divides summed losses by the number of targets in the whole global batch, which
makes gradient accumulation and data parallelism exact even when batches differ in length.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import torch
import torch.nn as nn

from trainer.errors import a_


class Task(Protocol):
    def num_targets(self, batch: Any) -> int | torch.Tensor:
        """How many loss terms `loss` sums over for this batch (tokens for an LM, rows for regression)."""

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor | dict[str, torch.Tensor]:
        """The SUM (not the mean) of the per-target losses of this batch, as a scalar tensor; or a dict with
        that sum as "loss" and other additive sums (correct predictions, ...) under their own names. The
        Trainer reduces each sum over micro-batches and ranks exactly like the loss and logs it divided by
        the number of targets: {"loss": ..., "accuracy": n_correct} gives train/accuracy and val/accuracy."""


def is_number(value: Any) -> bool:
    """A plain number (numpy's too), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _one_number(value: Any) -> bool:
    """A number, or a tensor of one element: what a metric or a sum may be."""
    return is_number(value) or (isinstance(value, torch.Tensor) and value.numel() == 1)


def named_numbers(value: Any, method: str, task: Any) -> dict[str, Any]:
    """A task method's metrics (`eval_metrics`, `score`): a dict of names to numbers (a one-element tensor counts),
    else one paragraph naming the method. What it returned was a traceback inside the eval that read it."""
    from trainer.errors import ConfigError

    if isinstance(value, Mapping):
        wrong = [(k, v) for k, v in value.items() if not isinstance(k, str) or not _one_number(v)]
        if not wrong:
            if "loss" in value:  # (it replaced the val loss in the logs, and in what best_metric ranked)
                raise ConfigError(f"{type(task).__name__}.{method} returned a metric named 'loss', which is the "
                                  f"framework's own val/loss (the mean loss per target): name it otherwise.")
            # (a tensor, or numpy's float32, was taken here and then failed in the JSON logger: plain floats)
            return {k: float(v.item() if isinstance(v, torch.Tensor) else v) for k, v in value.items()}
        key, v = wrong[0]
        got = f"{{{key!r}: {type(v).__name__}{' of shape ' + str(list(v.shape)) if isinstance(v, torch.Tensor) else ''}}}"
    else:
        got = a_(type(value).__name__)
    raise ConfigError(f"{type(task).__name__}.{method} returned {got:.120}: it returns a dict of metric names to "
                      f"numbers (a float, or a tensor of one element), such as {{'bpb': 1.21}}, each logged as "
                      f"val/NAME. trainer/task.py lists what a task's methods take and return.")


# Optional attribute: target_unit, what num_targets counts ("tokens", "samples", "images"; default "targets"):
# throughput is logged as train/<target_unit>_per_s. flops_unit = "samples": MFU counts 6 x parameters per sample
# (one forward of the model), where num_targets counts several terms a sample (default: per target, as a token).
# Optional methods, used when present:
#   setup(train, val, run_dir) -> None     once per process after the datasets are built, e.g. to fit a data
#                                          normaliser on the main process (trainer.main_process_first) and
#                                          share it with the others through a file in run_dir
#   write_records(run_dir) -> None         files of its own in the run dir (diffusion's normaliser), written by
#                                          the main process once the run is under way: a refused resume
#                                          leaves the run dir as it was
#   state_dict() / load_state_dict(state)  the task's own state (tensors by name): saved in checkpoints as
#                                          "task", exported beside the weights as task_state.safetensors
#   eval_metrics(mean_loss: float) -> dict[str, float]   extra val metrics, e.g. {"bpb": ...}
#   predict(model, batch) -> dict[str, Tensor]   per-sample rows of each val batch (first dim: the batch's
#                                          samples), e.g. {"score": p, "label": y}; with
#   score(outputs: dict[str, Tensor]) -> dict[str, float]   metrics no sum over ranks gives (AUROC, F1, a
#                                          median): `outputs` holds every val sample's rows exactly once, in
#                                          sample order, gathered from all ranks; computed on the main rank
#   sample(model, device) -> str | dict    at each eval, from the EMA weights when EMA is on: a string, or a
#                                          dict of named artefacts: strings (text), tensors (images: [H, W],
#                                          [H, W, C] or [C, H, W]; written to samples/step_N.png for the key
#                                          "image") and numbers (sample-quality metrics, logged as val/NAME)


class SupervisedTask:
    """A ready-made task for `model(x) -> prediction`, batches `(x, y)` (or dicts: `input_key`, `target_key`) and a
    torch loss class.

    `loss_fn` is built with reduction='sum'. With a classification loss (CrossEntropyLoss, NLLLoss) the
    accuracy is logged too (train/accuracy, val/accuracy). Example config::

        task:
          _target_: trainer.task.SupervisedTask
          loss: torch.nn.MSELoss
          input_key: null    # samples as dicts ({"pixel_values": ..., "label": ...}): the keys of x and y
          target_key: null
    """

    target_unit = "targets"  # the loss's terms: a sample's, or each of its positions' or outputs'
    # (what the Trainer says of a global batch it counted no target in: its own count, not the user's task, was read)
    no_targets = ("Every class label of that batch is at the loss's ignore_index (-100), which the loss leaves out, so "
                  "the batch has nothing to learn from: check the data's labels (padding alone?).")
    flops_unit = "samples"  # what one forward of the model computes (MFU: 6 x parameters per sample, not per term)

    def __init__(self, loss: str = "torch.nn.MSELoss", input_key: str | None = None, target_key: str | None = None):
        from hydra.utils import get_class

        cls = get_class(loss)
        self.loss_fn = cls(reduction="sum")
        self.classification = issubclass(cls, (nn.CrossEntropyLoss, nn.NLLLoss))
        self.probabilities = issubclass(cls, nn.CrossEntropyLoss)  # (NLLLoss takes class indices only)
        # Losses of a prediction and a target of one shape, which torch broadcasts when they differ (MSE of [B, 1]
        # against [B] sums every pair, with a warning only) or refuses with a traceback (BCE).
        self.same_shape = issubclass(cls, (nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss, nn.BCELoss,
                                           nn.BCEWithLogitsLoss, nn.SoftMarginLoss))
        # Losses of one term per element (torch's mean divides by every element); the others (MultiLabelSoftMargin,
        # CosineEmbedding, ...) average within each sample themselves, and torch's mean divides by the samples.
        self.elementwise = self.same_shape or issubclass(cls, (nn.KLDivLoss, nn.PoissonNLLLoss))
        self.loss_name = cls.__name__
        if (input_key is None) != (target_key is None):
            from trainer.errors import ConfigError

            raise ConfigError(f"task.input_key={input_key!r} and task.target_key={target_key!r}: give both (the keys of "
                              "the model's input and of the target in dict samples), or neither for (x, y) samples.")
        self.keys = (input_key, target_key)

    def _pair(self, batch: Any) -> tuple[Any, Any]:
        """(x, y) of a batch; a batch of another shape is one paragraph saying what this task takes (a KeyError
        traceback from inside the loop before)."""
        from trainer.errors import ConfigError

        if isinstance(batch, dict):
            missing = [k for k in self.keys if k not in batch]
            if not missing:
                return batch[self.keys[0]], batch[self.keys[1]]
            have = ", ".join(map(str, batch))
            raise ConfigError(
                f"trainer.task.SupervisedTask got batches of dicts (keys: {have}), and "
                + ("task.input_key and task.target_key are not set" if self.keys == (None, None) else
                   f"{', '.join(f'{k!r}' for k in missing)} {'is' if len(missing) == 1 else 'are'} not among them")
                + ": give the keys of the model's input and of the target in the task's config (input_key: KEY, "
                "target_key: KEY; on the command line +task.input_key=KEY +task.target_key=KEY), or have the data "
                "return (x, y) samples.")
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            return batch[0], batch[1]
        what = f"{a_(type(batch).__name__)} of {len(batch)}" if isinstance(batch, (tuple, list)) else \
            a_(type(batch).__name__)
        raise ConfigError(f"trainer.task.SupervisedTask takes batches (x, y), and this data's batches are {what}: "
                          "have the data return (x, y) samples, or dicts with task.input_key and task.target_key set, "
                          "or write a task of your own (README: Your own model, data and loss).")

    def num_targets(self, batch: Any) -> int | torch.Tensor:
        """How many terms loss() sums over: what torch's reduction='mean' divides by, so that train/loss and
        val/loss are the loss a hand-written loop reports. Every element of an elementwise loss's target ([B, 3]
        regression: 3 a sample), each class label of a classification loss but those at its ignore_index ([B, L]
        labels of a sequence labeller: L a sample), each row of class probabilities. (It counted samples: such
        losses and accuracies were L times too high, and so were the gradients that grad_clip saw.)"""
        x, y = self._pair(batch)
        if not isinstance(y, torch.Tensor):
            return len(x)
        if not self.classification:
            return y.numel() if self.elementwise else len(x)
        if y.is_floating_point():  # probabilities over dim 1
            return y.numel() // y.shape[1] if y.dim() > 1 else 1
        counted = (y != self.loss_fn.ignore_index).sum()
        return int(counted) if y.device.type == "cpu" else counted  # (a device's count is reduced there, no sync)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor | dict[str, torch.Tensor]:
        x, y = self._pair(batch)
        pred = model(x)
        if not isinstance(pred, torch.Tensor) or (self.same_shape and isinstance(y, torch.Tensor)
                                                  and pred.shape != y.shape):
            raise self._misfit(pred, y)
        if self.classification and isinstance(y, torch.Tensor) and (
                (y.shape != pred.shape or not self.probabilities) if y.is_floating_point()
                else y.shape != pred.shape[:1] + pred.shape[2:]):
            raise self._not_classes(pred, y)
        loss = self.loss_fn(pred, y)
        if not self.classification:
            return loss
        # The classes are dim 1 ([B, C], or [B, C, d1, ...] against [B, d1, ...]); probabilities: the likeliest.
        if y.is_floating_point():
            return {"loss": loss, "accuracy": (pred.argmax(1) == y.argmax(1)).sum()}
        return {"loss": loss, "accuracy": ((pred.argmax(1) == y) & (y != self.loss_fn.ignore_index)).sum()}

    def _not_classes(self, pred: torch.Tensor, y: torch.Tensor) -> Exception:
        """Targets a classification loss cannot take (labels of [B, 1], float labels): torch's traceback before."""
        from trainer.errors import ConfigError

        indices = list(pred.shape[:1] + pred.shape[2:])
        fix = " (a target of [B, 1] is y.squeeze(-1))" if list(y.shape) == [*indices, 1] else \
            " (float labels of class numbers are y.long())" if y.is_floating_point() and list(y.shape) == indices else ""
        return ConfigError(f"the model's prediction has shape {list(pred.shape)} and its target {list(y.shape)} "
                           f"({str(y.dtype).removeprefix('torch.')}): {self.loss_name} takes class indices, integers of "
                           f"shape {indices}{fix}" + (", or class probabilities, floats of the prediction's shape"
                                                      if self.probabilities else "") +
                           ". Fix the data's targets (data._target_) or the model's output (model._target_).")

    def _misfit(self, pred: Any, y: Any) -> Exception:
        from trainer.errors import ConfigError

        if not isinstance(pred, torch.Tensor):
            return ConfigError(f"the model (model._target_) returned a {type(pred).__name__} where "
                               "trainer.task.SupervisedTask takes its prediction, one tensor: have forward return "
                               "the prediction, or write a task of your own that takes it from what forward returns "
                               "(README: Your own model, data and loss).")
        return ConfigError(f"the model's prediction has shape {list(pred.shape)} and its target {list(y.shape)}: "
                           f"{self.loss_name} would broadcast the two (or refuse them) and train on another loss than "
                           "the one meant. Make them one shape: the model's output (model._target_) or the data's "
                           "targets (data._target_); a target of [B] for a prediction of [B, 1] is y.unsqueeze(-1), "
                           "or a sum with keepdim=True.")


# What the Trainer logs as train/NAME itself (with lr_PART and UNIT_per_s): a sum of the task's of one of these names
# was dropped for its own without a word.
RESERVED_TRAIN_NAMES = frozenset({"loss", "lr", "grad_norm", "step_time_ms", "skipped_steps", "peak_mem_mb", "mfu"})


def split_loss(out: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """What `task.loss` returned, as (the summed loss, the other additive sums by name: each one number, summed
    over the batch's targets like the loss; a string or a per-sample tensor was a traceback at the step or its log)."""
    if isinstance(out, dict):
        from trainer.errors import ConfigError

        if "loss" not in out:
            raise ConfigError(f"task.loss() (or the loss_fn given to rt.forward_backward) returned a dict without "
                              f"'loss' (keys: {', '.join(map(str, out))}): put the summed loss under 'loss'; the other "
                              "entries are sums reduced and logged per target beside it.")
        extra = {k: v for k, v in out.items() if k != "loss"}
        for k, v in extra.items():
            if not isinstance(k, str) or not _one_number(v):
                shown = f"a tensor of shape {list(v.shape)}" if isinstance(v, torch.Tensor) else a_(type(v).__name__)
                raise ConfigError(f"task.loss() (or rt.forward_backward's loss_fn) returned {k!r}: {shown}. Beside "
                                  "'loss', each entry is one number, "
                                  "a sum over the batch's targets (a count of correct predictions, say), which the "
                                  "Trainer sums over micro-batches and ranks and logs per target as train/NAME and "
                                  "val/NAME: sum a per-sample value (`.sum()`), and give metrics of the whole val set "
                                  "through predict and score (trainer/task.py).")
        # (a one-element tensor of shape [1] failed where the sums are stacked with the 0-dim loss, at the log)
        extra = {k: v.reshape(()) if isinstance(v, torch.Tensor) else v for k, v in extra.items()}
        return out["loss"], extra
    return out, {}


def check_sample(samples: dict[str, Any], task: Any) -> dict[str, Any]:
    """`task.sample`'s artefacts by name (its plain string is {"sample": text}): text, an image tensor ([H, W],
    [H, W, C] or [C, H, W]) or a number each; anything else was a TypeError traceback in the middle of the eval."""
    from trainer.errors import ConfigError

    for name, value in samples.items():
        image = isinstance(value, torch.Tensor) and value.dim() in (2, 3)  # (trainer/tracking/images.py's is_image)
        if isinstance(value, str) or image or is_number(value):
            continue
        shown = f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else \
            a_(type(value).__name__)
        raise ConfigError(f"{type(task).__name__}.sample returned {shown} for {name!r}: it returns text, or a dict of "
                          "named artefacts, each text, an image tensor ([H, W], [H, W, C] or [C, H, W], values in [0, 1] "
                          "for floats) or a number (a sample metric, logged as val/NAME). Several texts: one key each.")
    return samples


def _check_rows(out: Any, n: int, task: Any) -> None:
    """`task.predict`'s rows of a batch of `n` samples: a dict of names to tensors of n rows (a list of row dicts, the
    README's "rows" read literally, was an AttributeError traceback; too few rows an IndexError in the gather)."""
    if isinstance(out, Mapping) and out:
        bad = next(((k, v) for k, v in out.items() if not (isinstance(k, str) and isinstance(v, torch.Tensor) and
                                                            v.dim() >= 1 and len(v) == n)), None)
        if bad is None:
            return
        key, v = bad
        got = f"{{{key!r}: {f'a tensor of shape {list(v.shape)}' if isinstance(v, torch.Tensor) else type(v).__name__}}}"
    else:
        got = "an empty dict" if isinstance(out, Mapping) else a_(type(out).__name__)
    from trainer.errors import ConfigError

    error = ConfigError(f"{type(task).__name__}.predict returned {got} for a batch of {n} samples: it returns a dict of "
                        f"names to tensors with one row per sample (first dimension {n}), such as {{'score': probs, "
                        "'label': y}; score(outputs) then gets each name's rows of every val sample, concatenated in "
                        "sample order.")
    error.this_rank_only = True  # (another rank's batches may have passed: the Trainer saves nothing then)
    raise error


def check_sum_names(names: Iterable[str]) -> None:
    """The Trainer's first step: a sum of the task's under a name the Trainer logs itself was dropped for its own."""
    from trainer.errors import ConfigError

    for k in names:
        if k in RESERVED_TRAIN_NAMES or k.startswith("lr_") or k.endswith("_per_s"):
            raise ConfigError(f"task.loss() returned a sum named {k!r}, which the Trainer logs itself as train/{k} (and "
                              "dropped this one for): name it otherwise.")


class EvalSums:
    """One eval pass's sums, as the Trainer's eval (on every rank, then reduced) and `eval` with a device map
    (trainer/inference/finished.py, one process) both keep them: the summed loss and the targets, the task's other additive
    sums, and its per-sample `predict` rows (for a whole-set `score`)."""

    def __init__(self, task: Any, device: torch.device | str = "cpu"):
        self.task = task
        self.totals = torch.zeros(2, dtype=torch.float64, device=device)  # [loss sum, targets]
        self.sums: dict[str, torch.Tensor] = {}
        self.predicts = hasattr(task, "predict")  # per-sample outputs, for metrics over the whole val set
        self.rows: dict[str, list[torch.Tensor]] = {}
        self.owned: list[int] = []  # the val samples whose rows are here

    def forward(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict, dict]:
        """The task's loss (and its other sums) and predictions for one batch (a collective under sharding)."""
        loss, extra = split_loss(self.task.loss(model, batch))
        return loss, extra, (self.task.predict(model, batch) if self.predicts else {})

    def add(self, batch: Any, indices: list[int], outputs: tuple[torch.Tensor, dict, dict]) -> None:
        loss, extra, out = outputs
        self.totals[0] += loss.double()
        self.totals[1] += self.task.num_targets(batch)
        for name, value in extra.items():
            self.sums[name] = self.sums.get(name, 0) + torch.as_tensor(value).double()
        if self.predicts:
            _check_rows(out, len(indices), self.task)
        for name, value in out.items():
            self.rows.setdefault(name, []).append(value.detach().float())
        self.owned += indices

    def metrics(self, loss_sum: float, count: float, sums: dict[str, float], scored: dict[str, float] | None,
                prefix: str) -> dict[str, float]:
        """`prefix/loss` per target, the task's eval_metrics of it, each other sum per target, and the whole-set
        `scored` metrics, from the (reduced) totals."""
        loss = loss_sum / count
        extra = named_numbers(self.task.eval_metrics(loss), "eval_metrics", self.task) \
            if hasattr(self.task, "eval_metrics") else {}
        for more in ({n: v / count for n, v in sums.items()}, scored or {}):
            clash = sorted(set(extra) & set(more))
            if clash:  # (one replaced the other in the logs, without a word)
                from trainer.errors import ConfigError

                raise ConfigError(f"{type(self.task).__name__}: the val metric {clash[0]!r} comes from two of its "
                                  "eval_metrics, its loss's sums and its score, and one would replace the other in "
                                  f"{prefix}/{clash[0]}: name them apart.")
            extra.update(more)
        return {f"{prefix}/loss": loss, **{f"{prefix}/{k}": v for k, v in extra.items()}}
