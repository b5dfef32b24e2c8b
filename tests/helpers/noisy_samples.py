"""A map-style regression dataset whose samples draw random numbers in `__getitem__` (an augmentation's habit),
from torch's, Python's and numpy's global generators of the process that reads them; and, with `sigterm_at=N`, a
SIGTERM to that process at its N-th sample read (once: `once` is a marker file), in the middle of a step's samples."""

import os
import random
import signal
from pathlib import Path

import numpy as np
import torch


class NoisySamples(torch.utils.data.Dataset):
    def __init__(self, n: int, sigterm_at: int | None = None, once: str | None = None):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=g)
        self.sigterm_at, self.once, self.reads = sigterm_at, once, 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.reads += 1
        if self.reads == self.sigterm_at and not Path(self.once).exists():
            Path(self.once).touch()
            os.kill(os.getpid(), signal.SIGTERM)
        x = self.x[i] + 0.1 * torch.randn(4) + 0.01 * random.random() + 0.01 * float(np.random.rand())
        return x, self.x[i].sum(0, keepdim=True)


def regression(sigterm_at: int | None = None, once: str | None = None, **settings):
    return NoisySamples(96, sigterm_at, once), NoisySamples(32)
