"""Test-only classification recipe pieces: an MLP over 2-D points in 3 classes (tests/conf/recipe/classify.yaml)."""

import torch
from torch.utils.data import TensorDataset


class MLP(torch.nn.Module):
    def __init__(self, hidden: int = 32, classes: int = 3):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(2, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)


class WithUnused(MLP):
    """An MLP with a layer its forward never uses (a mistake under DDP without world.find_unused_parameters)."""

    def __init__(self, hidden: int = 32, classes: int = 3):
        super().__init__(hidden, classes)
        self.extra = torch.nn.Linear(2, 1)


def blobs(n: int = 300, val: int = 61):
    """Three Gaussian blobs; val has an odd size so that 2 ranks split it unevenly."""
    g = torch.Generator().manual_seed(0)
    y = torch.arange(n) % 3
    centers = torch.tensor([[0.0, 2.0], [2.0, -1.0], [-2.0, -1.0]])
    x = centers[y] + 1.2 * torch.randn(n, 2, generator=g)
    return TensorDataset(x[val:], y[val:]), TensorDataset(x[:val], y[:val])


def drawn(n: int = 120, val: int = 41):
    """Blobs drawn from torch's global generator, as a factory of one's own draws them (torch.randn, the README's
    regression example): the same data only under the seed the run builds its data with."""
    y = torch.arange(n) % 3
    centers = torch.tensor([[0.0, 2.0], [2.0, -1.0], [-2.0, -1.0]])
    x = centers[y] + 1.2 * torch.randn(n, 2)
    return TensorDataset(x[val:], y[val:]), TensorDataset(x[:val], y[:val])


def ignored(n: int = 120, val: int = 41):
    """blobs with every label at CrossEntropyLoss's ignore_index (-100): nothing to learn from."""
    train, valid = blobs(n, val)
    return (TensorDataset(train.tensors[0], torch.full_like(train.tensors[1], -100)),
            TensorDataset(valid.tensors[0], torch.full_like(valid.tensors[1], -100)))


class Ranking:
    """The classification task with a metric that is not a sum over ranks: the AUROC of "class 0 vs the rest"
    (task.predict / task.score, trainer/task.py)."""

    def __init__(self):
        from trainer.task import SupervisedTask

        self.inner = SupervisedTask("torch.nn.CrossEntropyLoss")
        self.num_targets, self.loss = self.inner.num_targets, self.inner.loss

    def predict(self, model, batch):
        x, y = batch
        return {"score": model(x).softmax(-1)[:, 0], "positive": (y == 0).float()}

    def score(self, outputs):
        return {"auroc": auroc(outputs["score"], outputs["positive"]), "scored": float(len(outputs["score"]))}


def auroc(score: torch.Tensor, positive: torch.Tensor) -> float:
    """The probability that a positive outscores a negative (ties count half): the Mann-Whitney U statistic."""
    pos, neg = score[positive == 1], score[positive == 0]
    greater = (pos[:, None] > neg[None, :]).double().sum() + 0.5 * (pos[:, None] == neg[None, :]).double().sum()
    return (greater / (len(pos) * len(neg))).item()


def global_blobs(n: int = 300, val: int = 61):
    """The blobs drawn from torch's global generator, as a user's `torch.randn` data factory would."""
    y = torch.arange(n) % 3
    x = torch.tensor([[0.0, 2.0], [2.0, -1.0], [-2.0, -1.0]])[y] + 1.2 * torch.randn(n, 2)
    return TensorDataset(x[val:], y[val:]), TensorDataset(x[:val], y[:val])
