"""Sample order and data loaders.

The training sample order is one global stream, so world size and gradient accumulation are pure
performance knobs and a resume continues exactly where the run stopped, on any world size.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields this rank's micro-batches of sample indices, cut from one global sample stream.

    The stream is the concatenation of per-epoch permutations of the dataset drawn from `seed`
    (or 0..N-1 in order when `shuffle` is off). Optimizer step s consumes stream positions
    [s*G, (s+1)*G) where G = micro_batch * accum * world. Micro-step m on rank r takes the b
    positions starting at s*G + (m*world + r)*b. The global batches therefore depend only on G and
    the seed, never on how G is split across ranks and micro-steps; `start` (samples consumed)
    fast-forwards without touching the data.
    """

    def __init__(self, num_samples: int, micro_batch: int, accum: int = 1, rank: int = 0, world: int = 1,
                 seed: int = 0, shuffle: bool = True, start: int = 0):
        if num_samples < 1:
            raise ValueError("the dataset is empty")
        self.n, self.b, self.accum, self.rank, self.world = num_samples, micro_batch, accum, rank, world
        self.seed, self.shuffle, self.start = seed, shuffle, start
        self._perms: dict[int, list[int]] = {}

    @property
    def global_batch(self) -> int:
        return self.b * self.accum * self.world

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                perm = torch.randperm(self.n, generator=g).tolist()
            else:
                perm = list(range(self.n))
            self._perms = {k: v for k, v in self._perms.items() if k >= epoch - 1}  # keep two epochs
            self._perms[epoch] = perm
        return self._perms[epoch]

    def indices(self, pos: int, count: int) -> list[int]:
        """Dataset indices at stream positions [pos, pos + count)."""
        out: list[int] = []
        while count > 0:
            epoch, i = divmod(pos, self.n)
            take = min(count, self.n - i)
            out += self._perm(epoch)[i : i + take]
            pos, count = pos + take, count - take
        return out

    def __iter__(self) -> Iterator[list[int]]:
        pos = self.start
        while True:
            for m in range(self.accum):
                yield self.indices(pos + (m * self.world + self.rank) * self.b, self.b)
            pos += self.global_batch

    def fingerprint(self, steps: int = 2) -> str:
        """A hash of the next `steps` global batches: equal iff the data order would continue the same."""
        ids = self.indices(self.start, steps * self.global_batch)
        return hashlib.sha256(repr((self.n, ids)).encode()).hexdigest()[:16]


def _collate_fn(dataset: Dataset):
    # A dataset that batches itself (via __getitems__) says how to collate with a `collate_fn`
    # attribute; otherwise torch's default_collate stacks samples.
    return getattr(dataset, "collate_fn", None)


def in_process_batches(dataset: Dataset, batch_sampler) -> Iterator[Any]:
    """What a DataLoader with num_workers=0 yields, without its per-batch bookkeeping (~30 us a step)."""
    from torch.utils.data import default_collate

    collate = _collate_fn(dataset) or default_collate
    getitems = getattr(dataset, "__getitems__", None)
    for indices in batch_sampler:
        yield collate(getitems(indices) if getitems else [dataset[i] for i in indices])


def train_loader(dataset: Dataset, sampler: GlobalBatchSampler, num_workers: int, device: torch.device,
                 seed: int):
    if num_workers == 0 and device.type == "cpu":  # on CUDA the DataLoader pins memory for async copies
        return in_process_batches(dataset, sampler)
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=_collate_fn(dataset),
        pin_memory=device.type == "cuda",
        persistent_workers=num_workers > 0,
        # A private generator: creating the iterator must not consume the global RNG (exact resume).
        generator=torch.Generator().manual_seed(seed),
    )


def eval_loader(dataset: Dataset, batch_size: int, rank: int, world: int, limit: int | None,
                num_workers: int, device: torch.device) -> DataLoader:
    """Each rank gets every world-th sample of the first `limit` samples: each counted exactly once."""
    n = len(dataset) if limit is None else min(limit, len(dataset))
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=range(rank, n, world),
        num_workers=num_workers,
        collate_fn=_collate_fn(dataset),
        pin_memory=device.type == "cuda",
    )


def eval_batches(dataset: Dataset, batch_size: int, rank: int, world: int, limit: int | None,
                 device: torch.device, lockstep: bool = False) -> Iterator[tuple[Any, bool, list[int]]]:
    """(batch, counted, sample indices) for this rank's share of the eval samples. With `lockstep`, a rank
    with fewer batches than rank 0 repeats one, uncounted, until it has run as many (forwards that are
    collectives)."""
    n = len(dataset) if limit is None else min(limit, len(dataset))
    mine = list(range(rank, n, world))
    batch, indices, count = None, [], 0
    for count, batch in enumerate(eval_loader(dataset, batch_size, rank, world, limit, 0, device), start=1):
        indices = mine[(count - 1) * batch_size : count * batch_size]
        yield batch, True, indices
    if lockstep:
        most = math.ceil(len(range(0, n, world)) / batch_size)
        if batch is None and count < most:  # this rank got no sample at all
            batch, indices = next(iter(eval_loader(dataset, batch_size, 0, 1, 1, 0, device))), [0]
        for _ in range(most - count):
            yield batch, False, indices


@dataclass
class Data:
    """The datasets and loader settings a Trainer trains and evaluates on."""

    train: Dataset
    val: Dataset | None = None
    batch_size: int = 1  # per-process micro-batch
    shuffle: bool = True
    num_workers: int = 0
