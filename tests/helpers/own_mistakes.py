"""Test-only model, data and task pieces with the mistakes a recipe of one's own makes (tests/test_user_pitfalls.py),
on recipe=classify's keys: a regression of 2-D points, each piece replaced by one override."""

import torch
from torch.utils.data import TensorDataset


class Linear(torch.nn.Linear):
    """[B, 2] -> [B, out]: the right model for `points` with out=1."""

    def __init__(self, out: int = 1):
        super().__init__(2, out)


class NoParams(torch.nn.Module):
    def forward(self, x):
        return x.sum(-1, keepdim=True)


class Frozen(Linear):
    def __init__(self):
        super().__init__()
        self.requires_grad_(False)


class TupleOut(Linear):
    def forward(self, x):
        return super().forward(x), x


def points(flat: bool = False):
    """y = x0 + x1, as [N, 1] (or [N] with flat=True, the `sum` without keepdim)."""
    x = torch.randn(64, 2, generator=torch.Generator().manual_seed(0))
    y = x.sum(1, keepdim=not flat)
    return TensorDataset(x[16:], y[16:]), TensorDataset(x[:16], y[:16])


class ZeroTargets:
    """A task that counts no targets."""

    def __init__(self):
        from trainer.task import SupervisedTask

        self.inner = SupervisedTask()

    def num_targets(self, batch):
        return 0

    def loss(self, model, batch):
        return self.inner.loss(model, batch)


class PerSample(ZeroTargets):
    """A task whose loss is left per sample ([B, 1]) instead of summed."""

    def num_targets(self, batch):
        return len(batch[0])

    def loss(self, model, batch):
        x, y = batch
        return (model(x) - y) ** 2


class FloatMetrics:
    """A task whose eval_metrics returns a bare float (the metric), not a dict of it."""

    def __init__(self):
        from trainer.task import SupervisedTask

        self.inner = SupervisedTask(loss="torch.nn.MSELoss")

    def num_targets(self, batch):
        return self.inner.num_targets(batch)

    def loss(self, model, batch):
        return self.inner.loss(model, batch)

    def eval_metrics(self, mean_loss):
        return mean_loss ** 0.5


class VectorScore(FloatMetrics):
    """A task whose score returns a metric per sample (a tensor of many elements) where one number is wanted."""

    def eval_metrics(self, mean_loss):
        return {"rmse": torch.tensor(mean_loss) ** 0.5}  # (a one-element tensor: taken)

    def predict(self, model, batch):
        x, y = batch
        return {"error": (model(x) - y).abs().squeeze(-1)}

    def score(self, outputs):
        return {"error": outputs["error"]}
