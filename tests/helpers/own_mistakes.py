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


def labels(kind: str):
    """classify.blobs with its class labels as a user may hold them: [N, 1] ("column") or floats ("float")."""
    from classify import blobs

    def changed(ds):
        x, y = ds.tensors
        return TensorDataset(x, y.unsqueeze(-1) if kind == "column" else y.float())

    return tuple(changed(ds) for ds in blobs())


class Summing(FloatMetrics):
    """A task whose loss returns a dict: `extra` says what beside the loss (each a mistake but "right")."""

    def __init__(self, extra: str = "right"):
        super().__init__()
        self.extra = extra

    def loss(self, model, batch):
        x, y = batch
        err = (model(x) - y).square()
        more = {"no_loss": {}, "string": {"acc": "hi"}, "per_sample": {"err": err.detach()},
                "reserved": {"grad_norm": err.sum().detach()},
                "right": {"close": (err < 0.1).sum(0)}}[self.extra]  # (a count of shape [1]: taken as one number)
        return {"mse": err.sum()} if self.extra == "no_loss" else {"loss": err.sum(), **more}

    def eval_metrics(self, mean_loss):
        import numpy as np

        # A 0-dim tensor and numpy's float32: taken, and logged as floats (the JSON logger refused them once).
        return {"rmse": torch.tensor(mean_loss) ** 0.5, "rmse_np": np.sqrt(np.float32(mean_loss))}

    def sample(self, model, device):
        import numpy as np

        return {"text": "a text", "quality": np.float32(0.5)}  # (numpy's number: a metric, not an image)


class EvalMistake(Summing):
    """A task whose eval-time methods return what the eval cannot take (`mistake`), found at the first eval."""

    def __init__(self, mistake: str):
        super().__init__()
        self.mistake = mistake

    def eval_metrics(self, mean_loss):
        if self.mistake == "named_loss":
            return {"loss": mean_loss}
        return {"close": mean_loss} if self.mistake == "clash" else super().eval_metrics(mean_loss)

    def predict(self, model, batch):
        x, y = batch
        err = (model(x) - y).abs().squeeze(-1)
        if self.mistake == "row_dicts":
            return [{"error": e} for e in err]
        return {"error": err[:2]} if self.mistake == "short_rows" else {"error": err}

    def score(self, outputs):
        return {"max_error": float(outputs["error"].max())}

    def sample(self, model, device):
        if self.mistake == "sample_loss":
            return {"loss": 1.0}
        return ["a text", "another"] if self.mistake == "list_sample" else {"text": "a text", "n": 1.5}


class RaisesInForward(Linear):
    """A bug in one's own forward, at the first batch."""

    def forward(self, x):
        raise ValueError("a bug in the forward of one's own model")


class Detached(PerSample):
    """A task whose summed loss lost its graph (.detach(), as a value logged and returned by mistake)."""

    def loss(self, model, batch):
        return super().loss(model, batch).sum().detach()
