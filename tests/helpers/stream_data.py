"""Test-only streams (IterableDatasets) whose samples say where they come from: sample i of pass p is the
number p * 1000 + i, so a test reads the stream positions a batch holds off its values. Each kind of stream the
framework tells apart: with or without state_dict, __len__, read_part; and `data._target_`s returning them with
the keys of conf/data/stdlib.yaml (for the errors of build_data)."""

import torch
from torch.utils.data import IterableDataset


class Numbers(IterableDataset):
    """n samples a pass, no state_dict, no __len__. `produced` counts the samples its iterators made."""

    def __init__(self, n: int = 50):
        self.n, self.epoch, self.produced = n, 0, 0
        self.part = (0, 1)
        self._next, self._resume = 0, None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _indices(self):
        index, count = self.part
        return range(index, self.n, count)

    def __iter__(self):
        start, self._resume = self._resume or 0, None
        for i in self._indices():
            if i < start:
                continue
            self.produced += 1
            self._next = i + 1
            yield torch.tensor(self.epoch * 1000 + i)


class Sized(Numbers):
    def __len__(self) -> int:
        return self.n


class SplitByWorker(Sized):
    """torch's idiom for loader workers: each yields every num_workers-th sample (get_worker_info in __iter__)."""

    def _indices(self):
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        return range(info.id, self.n, info.num_workers) if info is not None else range(self.n)


class Stateful(Sized):
    def state_dict(self) -> dict:
        return {"next": self._next}

    def load_state_dict(self, state: dict) -> None:
        self._resume = state["next"]


class UnsizedStateful(Numbers):
    state_dict, load_state_dict = Stateful.state_dict, Stateful.load_state_dict


class Parts(Stateful):
    """Reader `index` of `count` reads samples index, index + count, ...: its own part."""

    def read_part(self, index: int, count: int) -> None:
        self.part = (index, count)


class StatelessParts(Sized):
    read_part = Parts.read_part


class Lying(Stateful):
    """Says 50 samples a pass, yields 40."""

    def _indices(self):
        return range(0, 40)


class Unjsonable(Stateful):
    def state_dict(self) -> dict:
        return {"next": torch.tensor(self._next)}


# -- data._target_s (the keys of conf/data/stdlib.yaml) ---------------------------------------------------------
def windows(seq_len: int = 256, cache_dir: str | None = None, val_every: int = 20):
    return Stream(seq_len), None


def windows_without_a_cache(seq_len: int = 256, val_every: int = 20):
    """A user's data function that takes no cache_dir, under conf/data/stdlib.yaml's `cache_dir: null`."""
    return Stream(seq_len), None


def unsized_val(seq_len: int = 256, cache_dir: str | None = None, val_every: int = 20):
    return Stream(seq_len), _Unsized(seq_len)


class Stream(IterableDataset):
    """(x, y) windows of seq_len bytes, 64 a pass, with __len__: what the lm task trains on."""

    def __init__(self, seq_len: int):
        self.seq_len = seq_len

    def __len__(self) -> int:
        return 64

    def __iter__(self):
        for i in range(64):
            w = torch.arange(i, i + self.seq_len + 1) % 256
            yield w[:-1], w[1:]


class _Unsized(IterableDataset):
    def __init__(self, seq_len: int):
        self.inner = Stream(seq_len)

    def __iter__(self):
        return iter(self.inner)


def unsized(seq_len: int = 256, cache_dir: str | None = None, val_every: int = 20):
    return _Unsized(seq_len), None


def windows_and_val(seq_len: int = 256, cache_dir: str | None = None, val_every: int = 20):
    return Stream(seq_len), Stream(seq_len)


def _draws() -> list[float]:
    """One draw from each generator a dataset's augmentation may use: torch's, `random`'s and numpy's."""
    import random

    import numpy as np

    return [torch.rand(()).item(), random.random(), float(np.random.rand())]


class NoisyMap(torch.utils.data.Dataset):
    """Map-style, n samples: sample i is [i, three random draws] (an augmentation's noise)."""

    def __init__(self, n: int = 50):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, *_draws()], dtype=torch.float64)


class NoisyStateful(Stateful):
    """Stateful Stateful's samples as [value, three random draws]."""

    def __iter__(self):
        for value in super().__iter__():
            yield torch.tensor([float(value), *_draws()], dtype=torch.float64)


class NoisySized(Sized):
    """Sized's samples (no state_dict: a resume reads its pass again) as [value, three random draws]."""

    def __iter__(self):
        for value in super().__iter__():
            yield torch.tensor([float(value), *_draws()], dtype=torch.float64)


class NoisyStatelessParts(StatelessParts):
    def __iter__(self):
        for value in super().__iter__():
            yield torch.tensor([float(value), *_draws()], dtype=torch.float64)


class NoisyParts(Parts):
    def __iter__(self):
        for value in super().__iter__():
            yield torch.tensor([float(value), *_draws()], dtype=torch.float64)


class QuietNoisyMap(NoisyMap):
    """NoisyMap saying it draws nothing (it does, to show the seeding is skipped)."""

    random_draws = False


class _Reshaped(Stream):
    """Stream's windows as dicts {"x", "y"} or as the input alone (samples the lm task does not take), or as int32
    ids (a memmap's, which it takes)."""

    def __init__(self, seq_len: int, shape: str):
        super().__init__(seq_len)
        self.shape = shape

    def __iter__(self):
        for x, y in super().__iter__():
            yield {"x": x, "y": y} if self.shape == "dicts" else (x.int(), y.int()) if self.shape == "int32" else x


def dicts(seq_len: int = 256, cache_dir: str | None = None, val_every: int = 20):
    return _Reshaped(seq_len, "dicts"), None


def int32_ids(seq_len: int = 256, cache_dir: str | None = None, val_every: int = 20):
    return _Reshaped(seq_len, "int32"), None


def inputs_only(seq_len: int = 256, cache_dir: str | None = None, val_every: int = 20):
    return _Reshaped(seq_len, "inputs"), None
