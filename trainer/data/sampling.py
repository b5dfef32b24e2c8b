"""Sample order and data loaders.

The training sample order is one global stream, so world size and gradient accumulation are pure
performance knobs and a resume continues exactly where the run stopped, on any world size. A map-style
dataset's stream is its per-epoch permutations (`GlobalBatchSampler`); an iterable dataset's is its own order
(trainer/data/streaming.py, which also says where world size stays a knob for it and where not).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from trainer.data import streaming
from trainer.data.streaming import StreamLayout, is_stream, seed_sample
from trainer.errors import CheckpointError, DataError


class Positioned(list):
    """A micro-batch's dataset indices, with the stream position of its first sample (`position`): what a loader
    worker seeds each sample's random draws from (`SeededSamples`)."""

    position = 0


class SeededSamples(Dataset):
    """A map-style dataset as a loader worker reads it: each sample's random draws in `__getitem__` (an augmentation)
    come from generators seeded by the run's seed and the sample's stream position. The worker's own generators
    would give each rank the same draws (one seed for every rank's loader) and start them over at a resume (no
    checkpoint holds a worker's state); seeded by position, a sample gets the same draws on any world size, split
    into any micro-batches, resumed or not. A dataset that fetches whole batches (`__getitems__`) is seeded once a
    batch, from its first sample's position. A dataset whose samples draw nothing may say so (`random_draws =
    False`) and skip the seeding (~9 us a sample)."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed = dataset, seed
        self.seeded = getattr(dataset, "random_draws", True)  # (False: a dataset that says it draws nothing)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, indices: Positioned) -> list[Any]:
        first = getattr(indices, "position", None) if self.seeded else None  # (None: batches of another sampler)
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems is not None:
            if first is not None:
                seed_sample(self.seed, first)
            return getitems(indices)
        out = []
        for k, i in enumerate(indices):
            if first is not None:
                seed_sample(self.seed, first + k)
            out.append(self.dataset[i])
        return out


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
        self._perms: dict[int, torch.Tensor] = {}

    @property
    def global_batch(self) -> int:
        return self.b * self.accum * self.world

    def _perm(self, epoch: int) -> torch.Tensor:
        """Epoch `epoch`'s order, an int64 tensor: 8 bytes a sample. As a Python list it took about 40 (10 M
        samples: 400 MB a rank, and two epochs are kept), and every full garbage collection walked it."""
        if epoch not in self._perms:
            if self.shuffle:
                # (within a generator's 64 bits: a seed past ~9.2e12 overflowed it at the first batch; below, the same)
                g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**63)
                perm = torch.randperm(self.n, generator=g)
            else:
                perm = torch.arange(self.n)
            self._perms = {k: v for k, v in self._perms.items() if k >= epoch - 1}  # keep two epochs
            self._perms[epoch] = perm
        return self._perms[epoch]

    def indices(self, pos: int, count: int) -> list[int]:
        """Dataset indices at stream positions [pos, pos + count)."""
        out: list[int] = []
        while count > 0:
            epoch, i = divmod(pos, self.n)
            take = min(count, self.n - i)
            out += self._perm(epoch)[i : i + take].tolist()
            pos, count = pos + take, count - take
        return out

    def __iter__(self) -> Iterator[list[int]]:
        pos = self.start
        while True:
            for m in range(self.accum):
                batch = Positioned(self.indices(first := pos + (m * self.world + self.rank) * self.b, self.b))
                batch.position = first
                yield batch
            pos += self.global_batch

    def fingerprint(self, steps: int = 2) -> str:
        """A hash of the next `steps` global batches: equal iff the data order would continue the same."""
        ids = self.indices(self.start, steps * self.global_batch)
        return hashlib.sha256(repr((self.n, ids)).encode()).hexdigest()[:16]


def collate_fn_of(dataset: Dataset, given: Callable | None = None):
    """How `dataset`'s samples make a batch: the loop's own `given` function (rt.loader's collate_fn=), else the
    dataset's `collate_fn` attribute (a dataset that batches itself, via __getitems__, says so), else torch's
    default_collate, which stacks them (DataLoader's own default), its refusals said as the data's (Stacked)."""
    return given or getattr(dataset, "collate_fn", None) or Stacked(type(dataset).__name__)


class CollateError(DataError):
    """Samples torch's default_collate cannot make one batch of. Raised in a loader worker, torch raises it again
    in the rank as CollateError(the worker's traceback as text): the paragraph is then that text's last line's."""

    def __init__(self, message: str):
        if message.startswith("Caught ") and "\nOriginal Traceback" in message:
            message = message.rstrip().rsplit(f"{type(self).__name__}: ", 1)[-1]
        super().__init__(message)


class Stacked:
    """torch's default_collate (a class, not a closure: a loader worker under spawn gets it pickled), whose
    refusal of samples of different sizes or types was a traceback through the loader at the first batch."""

    def __init__(self, dataset_name: str):
        self.dataset_name = dataset_name

    def __call__(self, samples: list) -> Any:
        from torch.utils.data import default_collate

        try:
            return default_collate(samples)
        except (RuntimeError, TypeError) as e:
            # (in a loader worker, stacking into shared memory says "Trying to resize storage that is not resizable"
            # of samples of different sizes; any other RuntimeError is torch's own, shared memory's, say)
            if isinstance(e, RuntimeError) and not any(m in str(e) for m in ("equal size", "resize storage")):
                raise
            raise CollateError(
                f"the samples of {self.dataset_name} do not make one batch: torch's default_collate, which stacks "
                f"them, said \"{str(e).splitlines()[0]}\". Samples of different sizes (sequences of different "
                "lengths) need a function that pads them: give the dataset a `collate_fn` attribute, a function of a "
                "list of samples to one batch (rt.loader(..., collate_fn=...) in a loop of your own); or make every "
                "sample the same size and kind (tensors, numbers, or dicts and tuples of them).") from None


def in_process_batches(dataset: Dataset, batch_sampler, collate: Callable | None = None) -> Iterator[Any]:
    """What a DataLoader with num_workers=0 yields, without its per-batch bookkeeping (~30 us a step)."""
    collate = collate_fn_of(dataset, collate)
    getitems = getattr(dataset, "__getitems__", None)
    for indices in batch_sampler:
        yield collate(getitems(indices) if getitems else [dataset[i] for i in indices])


def train_loader(dataset: Dataset, sampler: GlobalBatchSampler | StreamLayout, num_workers: int,
                 device: torch.device, seed: int, resume: dict | None = None, collate: Callable | None = None):
    """This rank's micro-batches from `sampler`'s position on: a map-style dataset's by index, a stream's read by
    its readers (`resume`: the checkpoint's stream position, see trainer/data/streaming.py). `collate`: see
    collate_fn_of."""
    collate = collate_fn_of(dataset, collate)
    if isinstance(sampler, StreamLayout):
        return streaming.StreamBatches(dataset, sampler, num_workers, device, seed, resume, collate)
    if num_workers == 0:
        batches = in_process_batches(dataset, sampler, collate)
        if device.type != "cuda":
            return batches
        # Page-locked, as a DataLoader's pin_memory=True leaves them: a non-blocking copy from there did not wait for
        # the GPU's queue of work, where one from pageable memory did once the batch was large (37 MiB waited, 256 KiB
        # did not, and small ones cost the host less pageable: benchmarks/h2d.py on an H100). Cut here, not by a
        # DataLoader: its bookkeeping was about 0.1 ms of the host's time a step (the loop bench's gpt_tiny row on
        # CUDA, +0.53 -> +0.42 ms over the hand-written loop, one run of each). The pinning is the DataLoader's own, so
        # a batch type of the user's with a pin_memory() method is pinned by it, as it was under a DataLoader.
        from torch.utils.data._utils.pin_memory import pin_memory

        return (pin_memory(batch) for batch in batches)
    return DataLoader(
        SeededSamples(dataset, seed),  # (in the rank's own process, the draws come from its checkpointed generators)
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=collate,
        pin_memory=device.type == "cuda",
        persistent_workers=num_workers > 0,
        # A private generator: creating the iterator must not consume the global RNG (exact resume).
        generator=torch.Generator().manual_seed(seed),
        worker_init_fn=streaming.loader_worker_init,
    )


def eval_loader(dataset: Dataset, batch_size: int, rank: int, world: int, limit: int | None,
                num_workers: int, device: torch.device, collate: Callable | None = None) -> DataLoader:
    """Each rank gets every world-th sample of the first `limit` samples: each counted exactly once."""
    n = len(dataset) if limit is None else min(limit, len(dataset))
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=range(rank, n, world),
        num_workers=num_workers,
        collate_fn=collate_fn_of(dataset, collate),
        pin_memory=device.type == "cuda",
        worker_init_fn=streaming.loader_worker_init,
        generator=torch.Generator().manual_seed(0),  # (its iterator draws a seed: not from the training's RNG)
    )


def eval_batches(dataset: Dataset, batch_size: int, rank: int, world: int, limit: int | None,
                 device: torch.device, lockstep: bool = False,
                 collate: Callable | None = None) -> Iterator[tuple[Any, bool, list[int]]]:
    """(batch, counted, sample indices) for this rank's share of the eval samples. With `lockstep`, a rank
    with fewer batches than rank 0 repeats one, uncounted, until it has run as many (forwards that are
    collectives). A val stream (it has __len__: see config/instantiate.py's build_data) is read from its start at every eval."""
    n = len(dataset) if limit is None else min(limit, len(dataset))
    if is_stream(dataset):
        collate = collate_fn_of(dataset, collate)
        mine = streaming.eval_batches(dataset, batch_size, rank, world, n, collate)
        first = lambda: next(streaming.eval_batches(dataset, batch_size, 0, 1, 1, collate))  # noqa: E731
    else:
        owned = list(range(rank, n, world))
        mine = ((batch, owned[i * batch_size : (i + 1) * batch_size]) for i, batch in
                enumerate(eval_loader(dataset, batch_size, rank, world, limit, 0, device, collate)))
        first = lambda: (next(iter(eval_loader(dataset, batch_size, 0, 1, 1, 0, device, collate))), [0])  # noqa: E731
    batch, indices, count = None, [], 0
    for batch, indices in mine:
        count += 1
        yield batch, True, indices
    if lockstep:
        most = math.ceil(len(range(0, n, world)) / batch_size)
        if batch is None and count < most:  # this rank got no sample at all
            batch, indices = first()
        for _ in range(most - count):
            yield batch, False, indices


def epoch_length(dataset: Dataset) -> int:
    """Samples in one epoch of the training split: its length, or 0 for a stream without __len__ (which has no
    epochs: config/instantiate.py's build_data refuses the epoch settings for it, so nothing divides by this)."""
    return streaming.sized(dataset) or 0


@dataclass
class Data:
    """The datasets and loader settings a Trainer trains and evaluates on, and the training data's position.

    The loop asks it for its sampler at a position (`sampler`), the batches from there (`loader`), and the
    position's checkpoint state (`position_state`, `check_position`, `load_position`): for a map-style dataset the
    samples seen and a fingerprint of the order suffice; a stream adds where its readers stopped."""

    train: Dataset
    val: Dataset | None = None
    batch_size: int = 1  # per-process micro-batch
    shuffle: bool = True
    num_workers: int = 0
    collate: Callable | None = None  # how samples make a batch (collate_fn_of): a loop's own rt.loader(collate_fn=)

    def __post_init__(self):
        self._reading: streaming.StreamBatches | None = None  # the stream being read, for position_state
        self._resume: dict | None = None  # the checkpoint's stream position, for the next loader

    @property
    def streaming(self) -> bool:
        return is_stream(self.train)

    def sampler(self, accum: int, rank: int, world: int, seed: int, start: int = 0) -> GlobalBatchSampler | StreamLayout:
        """Where this rank's micro-batches sit in the training stream, from stream position `start`."""
        if self.streaming:
            return StreamLayout(self.batch_size, accum, rank, world, start)
        return GlobalBatchSampler(len(self.train), self.batch_size, accum, rank, world, seed, self.shuffle,
                                  start=start)

    def loader(self, sampler: GlobalBatchSampler | StreamLayout, device: torch.device, seed: int):
        """This rank's training micro-batches from `sampler` on; a stream's continue a loaded checkpoint's readers."""
        resume = self._resume if self._resume is not None and self._resume["position"] == sampler.start else None
        batches = train_loader(self.train, sampler, self.num_workers, device, seed, resume, self.collate)
        self._reading = batches if self.streaming else None
        return batches

    def fingerprint(self, sampler: GlobalBatchSampler | StreamLayout) -> str:
        """Equal iff the training order would continue the same (map-style: a hash of the next global batches)."""
        return streaming.fingerprint(self.train) if self.streaming else sampler.fingerprint()

    def check_batch(self) -> None:
        """Training only (an eval, and the batch size finder, choose their own batches): a micro-batch larger than
        the training split would hold samples twice or more (a list of 10^20 indices filled the memory)."""
        from trainer.errors import DataError

        n = streaming.sized(self.train)
        if n is not None and self.batch_size > n:
            raise DataError(f"data.batch_size={self.batch_size} is more than the {n} samples of the training split: "
                            f"every batch would hold samples twice or more. Use data.batch_size={n} or less (it is "
                            "per process and micro-step), or more data.")

    def check_readers(self, data_parallel: int) -> None:
        """Training only (an eval reads no part): a stream read in parts needs a part for every reader, and one that
        says how many it has (`num_parts`: text_stream's files) is refused here, before the first step, where the
        reader left without one stopped the run after the others had trained a few steps."""
        parts = getattr(self.train, "num_parts", None) if self.streaming and streaming.reads_parts(self.train) else None
        readers = max(1, self.num_workers) * data_parallel
        if isinstance(parts, int) and readers > parts:
            raise DataError(f"the training split ({type(self.train).__name__}) is read in parts (read_part) by "
                            f"{readers} readers (data-parallel processes x data.num_workers), but it has {parts} "
                            f"part{'s' if parts != 1 else ''} (num_parts): every reader needs a part with data. Use "
                            "fewer processes or data.num_workers, or more files.")

    def identity(self) -> str | None:
        """What a map-style training set says its contents are (its `fingerprint` attribute, e.g. the lm recipe's
        sha256 of the tokens), or None: the order's fingerprint covers only its length and order."""
        ident = None if self.streaming else getattr(self.train, "fingerprint", None)
        return ident if isinstance(ident, str) else None

    def position_state(self, sampler: GlobalBatchSampler | StreamLayout, gather) -> dict[str, Any]:
        """A stream's position for the checkpoint ({} for a map-style dataset: samples_seen is its position), as
        JSON text. `gather(obj)` returns every rank's obj: it is called on every rank alike, only once batches
        have been read (the same on every rank), so a checkpoint's template, taken before, is no collective."""
        if not self.streaming:
            return {}
        reading = self._reading
        if reading is None or reading.consumed == 0:
            rec = self._resume if self._resume is not None and self._resume["position"] == sampler.start else \
                streaming.initial_record(self.train, sampler, self.num_workers)
        else:
            rec = streaming.record(self.train, reading.layout, self.num_workers, gather(reading.local_record()),
                                   sampler.start)
        return {"stream": json.dumps(rec)}

    def check_position(self, state: dict[str, Any], sampler: GlobalBatchSampler | StreamLayout, where: str) -> None:
        """Whether this run's data continues the checkpoint's (`state`: samples_seen, global_batch, data_fingerprint
        and a stream's position); `sampler` is this run's, at any position. Raises CheckpointError."""
        if self.streaming:
            if state.get("data_fingerprint") not in streaming.fingerprints(self.train):
                raise CheckpointError(f"{where}: the checkpoint was trained on another dataset than this run's stream "
                                      f"({type(self.train).__name__}): resume with the data it was trained on.")
            rec = streaming.parse_record(state.get("stream"), where)
            streaming.check_record(rec, self.train, sampler, self.num_workers, state["samples_seen"], where)
            return
        saved, now = state.get("data_identity"), self.identity()
        if saved is not None and now is not None and saved != now:
            raise CheckpointError(
                f"{where}: the checkpoint was trained on other data than this run's: the training set's contents "
                f"differ ({type(self.train).__name__} fingerprint {now[:16]} vs {str(saved)[:16]}; a file edited in "
                "place, or another one at data.path). Resume with the data it was trained on, or start a new run from "
                "its weights on this data (finetune.weights=CHECKPOINT, which keeps none of its optimizer state or "
                "position)."
            )
        # The next two of the checkpoint's global batches, as positions of this run's stream.
        stream = GlobalBatchSampler(len(self.train), state["global_batch"], seed=sampler.seed, shuffle=self.shuffle,
                                    start=state["samples_seen"])
        if stream.fingerprint() != state["data_fingerprint"]:
            raise CheckpointError(
                f"{where}: the sample stream after step {state['step']} differs from the checkpoint's (fingerprint "
                f"{stream.fingerprint()} vs {state['data_fingerprint']}): the training data, trainer.seed or "
                "data.shuffle changed, and the run would not see the samples it was going to see."
            )

    def load_position(self, state: dict[str, Any]) -> str | None:
        """Take a checked checkpoint's stream position for the next loader; a line to show when the resume must
        read the stream again (a dataset without state_dict), else None."""
        if not self.streaming:
            return None
        self._resume = streaming.parse_record(state["stream"], "the checkpoint")
        self._reading = None
        return streaming.resume_note(self._resume, self.train)
