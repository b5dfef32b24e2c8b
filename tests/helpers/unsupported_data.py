"""Test-only `data._target_`s that return what the framework does not take: a DataLoader (Accelerate's habit:
`accelerator.prepare(loader)`), and a sized object samples cannot be indexed in. (An IterableDataset is read as a
stream: tests/helpers/stream_data.py.) They take the keys of conf/data/stdlib.yaml, so `data._target_=unsupported_data.NAME`
is the only override. (And `no_val`, which the framework takes: training data without a val split.)"""

import torch
from torch.utils.data import DataLoader, TensorDataset


def loader(seq_len: int = 256, cache_dir: str | None = None, val_every: int = 20):
    data = TensorDataset(torch.zeros(64, seq_len + 1, dtype=torch.long))
    return DataLoader(data, batch_size=4), None


def unindexable(seq_len: int = 256, cache_dir: str | None = None, val_every: int = 20):
    return {i: torch.zeros(seq_len + 1, dtype=torch.long) for i in range(1, 65)}.values(), None


def no_val(seq_len: int = 256, cache_dir: str | None = None, val_every: int = 20):
    """Training samples and no val split."""
    return TensorDataset(torch.zeros(64, seq_len + 1, dtype=torch.long)), None
