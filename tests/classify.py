"""Test-only classification recipe pieces: an MLP over 2-D points in 3 classes (tests/conf/recipe/classify.yaml)."""

import torch
from torch.utils.data import TensorDataset


class MLP(torch.nn.Module):
    def __init__(self, hidden: int = 32, classes: int = 3):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(2, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)


def blobs(n: int = 300, val: int = 61):
    """Three Gaussian blobs; val has an odd size so that 2 ranks split it unevenly."""
    g = torch.Generator().manual_seed(0)
    y = torch.arange(n) % 3
    centers = torch.tensor([[0.0, 2.0], [2.0, -1.0], [-2.0, -1.0]])
    x = centers[y] + 1.2 * torch.randn(n, 2, generator=g)
    return TensorDataset(x[val:], y[val:]), TensorDataset(x[:val], y[:val])
