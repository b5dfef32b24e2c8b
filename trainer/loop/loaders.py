"""The data side of `trainer.Runtime`: `rt.loader` (this rank's part of one global sample stream, whose position
is checkpointed), `rt.eval_loader` (this rank's share of an eval set, each sample once), and the run's position
(the optimizer step a loop of your own has reached) that `save_state` records beside them."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from trainer.errors import CheckpointError, UserError

if TYPE_CHECKING:
    from trainer.loop.runtime import Runtime


class RunPosition:
    """A hand-written loop's run state in its checkpoints: the step it saved at."""

    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        self.step = state["step"]

    def check_state(self, state: dict[str, Any], where: str = "the checkpoint") -> None:
        step = state.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 2**62:
            raise CheckpointError(f"{where}: step={step!r} is not a count.")

    def resize_notes(self, state: dict[str, Any]) -> list[str]:
        return []


class Loader:
    """This rank's micro-batches of one global sample stream (trainer/data/sampling.py's GlobalBatchSampler), on the device.

    One `for batch in loader` is one epoch: ceil(len(dataset) / global batch) optimizer steps of
    `grad_accum_steps` micro-batches each. The stream runs on across epochs (a global batch that reaches the end
    of one is completed from the next one's order), so the batches depend only on the global batch and the seed,
    never on how many ranks share them. Its position is in `state_dict`: a resumed loop continues at the sample
    it stopped at.

    An IterableDataset is read as a stream (trainer/data/streaming.py: sharded by rank and worker, its readers' position
    checkpointed): with __len__, an epoch is that many samples as above; without, a `for` never ends (stop at your
    step count)."""

    def __init__(self, rt: Runtime, dataset, batch_size: int, shuffle: bool, num_workers: int, seed: int,
                 collate=None):
        from trainer.data.sampling import Data, GlobalBatchSampler
        from trainer.data.streaming import is_stream

        self.rt, self.dataset, self.batch_size = rt, dataset, batch_size
        self.shuffle, self.num_workers, self.seed, self.collate = shuffle, num_workers, seed, collate
        self.samples_seen = 0  # stream positions consumed by all ranks together
        st = rt.strategy
        self.global_batch = batch_size * rt.grad_accum_steps * st.dp_size
        if is_stream(dataset):
            if shuffle:
                raise UserError(f"rt.loader({type(dataset).__name__}, shuffle=True): an IterableDataset is read in its "
                                "own order, which the framework cannot shuffle. Pass shuffle=False (and shuffle inside "
                                "the dataset if the order matters: its set_epoch(n) is called before pass n).")
            self._data, self._batches = Data(dataset, None, batch_size, False, num_workers, collate), None
        else:
            self._data = None
            self._stream = GlobalBatchSampler(len(dataset), batch_size, 1, st.dp_rank, st.dp_size, seed, shuffle)

    def __len__(self) -> int:
        """Micro-batches per epoch on this rank."""
        return self.steps_per_epoch * self.rt.grad_accum_steps

    @property
    def steps_per_epoch(self) -> int:
        from trainer.data.streaming import sized

        n = sized(self.dataset)
        if n is None:
            raise TypeError(f"rt.loader: {type(self.dataset).__name__} is a stream without __len__, so it has no "
                            "epochs: a `for` over its loader never ends; stop your loop at a step count.")
        return math.ceil(n / self.global_batch)

    def _left_in_epoch(self) -> int:
        """Micro-batches from the current position to the end of its epoch (all of one, at an epoch's start):
        a loop resumed in the middle of an epoch finishes that epoch, as the uninterrupted one did."""
        per_micro = self.batch_size * self.rt.strategy.dp_size
        done = self.samples_seen // per_micro  # micro-batches taken so far (on every rank alike)
        return len(self) - done % len(self)

    def _sampler(self):
        # Micro-batch m of this rank: b samples at start + (m x dp + dp_rank) x b of the stream (what the Trainer's
        # sampler gives with accumulation: micro-step i of a step is micro-batch i of its k).
        st = self.rt.strategy
        return self._data.sampler(1, st.dp_rank, st.dp_size, self.seed, start=self.samples_seen)

    def __iter__(self) -> Iterator[Any]:
        from trainer.data.sampling import GlobalBatchSampler, train_loader
        from trainer.data.streaming import sized

        st, be = self.rt.strategy, self.rt.backend
        if self._data is not None:  # a stream: one reading across epochs (its readers keep their place)
            if self._batches is None:
                self._batches = self._data.loader(self._sampler(), be.device, self.seed)
            left = self._left_in_epoch() if sized(self.dataset) is not None else None
            while left is None or left > 0:
                batch = be.to_device(next(self._batches))
                self.samples_seen += self.batch_size * st.dp_size
                left = None if left is None else left - 1
                if left is None and not self._said_endless:
                    self._say_if_a_pass_ended()
                yield batch
            return
        sampler = GlobalBatchSampler(len(self.dataset), self.batch_size, 1, st.dp_rank, st.dp_size, self.seed,
                                     self.shuffle, start=self.samples_seen)
        batches = iter(train_loader(self.dataset, sampler, self.num_workers, be.device, self.seed,
                                    collate=self.collate))
        for _ in range(self._left_in_epoch()):
            batch = be.to_device(next(batches))
            self.samples_seen += self.batch_size * st.dp_size
            yield batch

    _said_endless, _first_pass = False, None

    def _say_if_a_pass_ended(self) -> None:
        """A `for` over a stream without __len__ reads on into its next pass where torch's DataLoader would stop (an
        Accelerate loop's `for epoch in range(n): for batch in loader:` ran its first epoch for ever, silently): said
        once, by the main rank, when the readers' batches come from a second pass."""
        reading = self._batches
        passes = [n for m in (reading.delivered.values() if reading.parts else [reading.boundary or {}])
                  if isinstance(n := m.get("pass"), int)]
        if not passes:
            return
        if self._first_pass is None:  # (the pass this reading started in: a resumed one's may be any)
            self._first_pass = min(passes)
        if max(passes) <= self._first_pass:
            return
        self._said_endless = True
        if self.rt.backend.is_main:
            print(f"rt.loader: {type(self.dataset).__name__} has no __len__, and its stream has ended a pass: reading "
                  "goes on into the next one (set_epoch(n) is called first), so this `for` never ends. Stop the loop at "
                  "a step count, or give the dataset a __len__ (samples per pass): then one `for` is one epoch.",
                  flush=True)

    OPTIONAL_STATE = ("global_batch",)  # (not in the states of the first version: their run's batch is assumed)

    def state_dict(self) -> dict[str, Any]:
        if self._data is not None:
            sampler = self._sampler()
            return {"samples_seen": self.samples_seen, "fingerprint": self._data.fingerprint(sampler),
                    **self._data.position_state(sampler, self.rt.backend.gather_object)}
        return {"samples_seen": self.samples_seen, "global_batch": self.global_batch,
                "fingerprint": self._fingerprint(self.samples_seen, self.global_batch)}

    def _fingerprint(self, start: int, global_batch: int) -> str:
        from trainer.data.sampling import GlobalBatchSampler

        return GlobalBatchSampler(len(self.dataset), global_batch, seed=self.seed, shuffle=self.shuffle,
                                  start=start).fingerprint()

    def check_state(self, state: dict[str, Any], where: str) -> None:
        n = state.get("samples_seen")
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n < 2**62:
            raise CheckpointError(f"{where}.samples_seen={n!r} is not a count.")
        if self._data is not None:
            self._data.check_position({"samples_seen": n, "data_fingerprint": state.get("fingerprint"),
                                       "stream": state.get("stream")}, self._sampler(), where)
            return
        # The order is one stream of samples whatever the batch: compared over the checkpoint's global batches (a
        # state from before they were recorded: this run's), so another batch size or world size continues it.
        saved = state.get("global_batch", self.global_batch)
        if not isinstance(saved, int) or isinstance(saved, bool) or not 0 < saved < 2**62:
            raise CheckpointError(f"{where}.global_batch={saved!r} is not a batch size.")
        if state.get("fingerprint") != self._fingerprint(n, saved):
            raise CheckpointError(f"{where}: the sample stream after sample {n} differs from the checkpoint's: the "
                                  "dataset, the seed or shuffle changed.")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.samples_seen = state["samples_seen"]
        saved = state.get("global_batch")  # (absent from checkpoints written before it was recorded)
        if self._data is None and saved is not None and saved != self.global_batch and self.rt.backend.is_main:
            print(f"resume: the checkpoint was written at a global batch of {saved} samples and this loop's is "
                  f"{self.global_batch} (processes x batch_size x grad_accum_steps): it continues at sample "
                  f"{self.samples_seen} of the same sample order, {self.global_batch} samples a step.", flush=True)
        if self._data is not None:
            note = self._data.load_position({"stream": state["stream"]})
            self._batches = None  # the next `for` reads on from the loaded position
            if note and self.rt.backend.is_main:
                print(note, flush=True)


class EvalLoader:
    """This rank's share of an eval set: every world-th sample, each counted once. Where a forward is a collective
    (FSDP, tensor parallelism) a rank with fewer batches repeats one until all ranks ran as many; those repeats
    are the last rows of its outputs, and `Runtime.gather_for_metrics(outputs, loader)` drops them."""

    def __init__(self, rt: Runtime, dataset, batch_size: int, limit: int | None = None, collate=None):
        self.rt, self.dataset, self.batch_size, self.collate = rt, dataset, batch_size, collate
        self.n = len(dataset) if limit is None else min(limit, len(dataset))
        st = rt.strategy
        self.indices = list(range(st.dp_rank, self.n, st.dp_size))  # the samples this rank owns, in order

    def __iter__(self) -> Iterator[Any]:
        from trainer.data.sampling import eval_batches

        st, be = self.rt.strategy, self.rt.backend
        for batch, _counted, _indices in eval_batches(self.dataset, self.batch_size, st.dp_rank, st.dp_size, self.n,
                                                      be.device, st.collective_forward, self.collate):
            yield be.to_device(batch)
