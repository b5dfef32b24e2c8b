"""Iterable (streaming) datasets: each rank and loader worker reads its part, and the position is checkpointed.

A *reader* is one data-loader worker of one data-parallel rank (the rank itself with data.num_workers=0): there
are world x max(1, num_workers) of them, reader index `worker * world + rank`. Two kinds of stream:

* **One stream** (any IterableDataset). The dataset yields one order, and the framework cuts it as it cuts a
  map-style dataset's unshuffled order: step s trains on stream positions [s*G, (s+1)*G) (G the global batch),
  rank r's micro-batch m on the b positions at s*G + (m*world + r)*b, and the rank's micro-batches go to its
  workers in turn. Every reader iterates the stream and keeps its own blocks (it collates nothing else): no
  duplicates, no gaps, and the same global batches on any number of ranks, workers and accumulation steps, so
  world size stays a performance knob, on resume too. The price: each reader reads the whole stream.
* **Parts** (a dataset with `read_part(index, count)`). Each reader calls it with its own index and the reader
  count, and the dataset yields only that part (files index::count, say); the framework batches what it yields.
  No reader reads another's data, but the batches depend on the reader count, and a resume needs the same
  data-parallel ranks and data.num_workers (refused otherwise, before anything is loaded).

Resume. A dataset with `state_dict()` / `load_state_dict(state)` (torchdata's protocol: the position after the
last sample its iterator yielded, as JSON-able values; the next `iter()` after a load continues there) costs O(1):
each batch carries its reader's state to the main process (so prefetched batches never count), and the checkpoint
keeps, for one stream, the state at the global batch boundary, for parts, each reader's. Without them, the
readers read and drop what was consumed (the run says how many samples, in one line).

Passes. A stream that ends starts over (after `set_epoch(n)`, where the dataset has it, for pass n). A stream with
`__len__` has epochs of that many samples (trainer.max_epochs works, and each pass must yield exactly that many);
one without has none (the epoch settings are refused: set trainer.max_steps).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from trainer.errors import CheckpointError, DataError

STATE_FN = "state_dict/load_state_dict"


def is_stream(dataset: Any) -> bool:
    return isinstance(dataset, IterableDataset)


def sized(dataset: Any) -> int | None:
    """The samples in one pass, or None for a stream without __len__."""
    try:
        return len(dataset)
    except TypeError:
        return None


def reads_parts(dataset: Any) -> bool:
    return callable(getattr(dataset, "read_part", None))


def stateful(dataset: Any) -> bool:
    return callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))


def _name(dataset: Any) -> str:
    return type(dataset).__name__


def _set_epoch(dataset: Any, n: int) -> None:
    fn = getattr(dataset, "set_epoch", None)
    if callable(fn):
        fn(n)


def _state(dataset: Any) -> str:
    try:
        return json.dumps(dataset.state_dict(), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise DataError(f"{_name(dataset)}.state_dict() returned what JSON cannot hold ({e}). A stream's state goes "
                        "into the checkpoint's state.json: return its position as numbers, strings, lists and dicts "
                        "(a file index and an offset, say), not the data.") from None


def _load(dataset: Any, text: str) -> None:
    try:
        dataset.load_state_dict(json.loads(text))
    except (DataError, CheckpointError):
        raise
    except Exception as e:  # noqa: BLE001 (the dataset's own refusal, of any kind)
        raise CheckpointError(f"{_name(dataset)}.load_state_dict() refused the checkpoint's stream state "
                              f"({type(e).__name__}: {e}). Resume with the data the checkpoint was trained on.") from None


@dataclass(frozen=True)
class StreamLayout:
    """What GlobalBatchSampler is to a map-style dataset: this rank's place in a stream's global batches, from
    stream position `start` (the samples all ranks have consumed)."""

    micro_batch: int
    accum: int = 1
    rank: int = 0
    world: int = 1
    start: int = 0

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accum * self.world


def seed_sample(seed: int, key: int | str) -> None:
    """Seed this process's torch (CPU), `random` and numpy generators from the run's seed and a sample's place (its
    stream position). Only in a loader worker, whose generators serve the data alone: a worker's own generators
    would give every rank the same draws (one seed for each rank's loader) and start them over at a resume (no
    checkpoint holds a worker's state), so a dataset's random augmentation would be neither exact on resume nor
    different across ranks. Seeded by place, a sample gets the same draws on any world size and resumed or not."""
    import random
    import sys

    h = int.from_bytes(hashlib.blake2b(f"{seed}:{key}".encode(), digest_size=8).digest(), "little")
    torch.default_generator.manual_seed(h)
    random.seed(h)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(h & 0xFFFF_FFFF)


def _drawing_nothing_until(skip: int) -> Callable[[int | None], None]:
    """A `_samples` seeding that keeps this process's generators as they were before `iter(ds)` (k None) until the
    `skip`-th sample is about to be read: what the reads before it drew is undone."""
    from trainer.checkpoint.rng import rng_state, set_rng_state

    saved: list[dict] = []

    def seeding(k: int | None) -> None:
        if k is None:
            saved[:] = [rng_state()]
        elif k == skip and saved:
            set_rng_state(saved.pop())
    return seeding


def _samples(ds, whole: bool = True, seeding: Callable[[int | None], None] | None = None) -> Iterator[Any]:
    """`ds`'s samples. `whole`: each read without torch's worker info (`_whole_stream`); the reader's own code
    between them (its collate_fn included) sees it as usual. `seeding(k)` runs before the k-th sample is read, and
    `seeding(None)` before `iter(ds)`: a loader worker's seed_sample."""
    hidden = _whole_stream if whole else contextlib.nullcontext
    if seeding is not None:
        seeding(None)
    with hidden():
        it = iter(ds)
    k = 0
    while True:
        if seeding is not None:
            seeding(k)
        with hidden():
            try:
                sample = next(it)
            except StopIteration:
                return
        yield sample
        k += 1


@contextlib.contextmanager
def _whole_stream():
    """One stream's reader sees the whole stream, and keeps its own blocks of it: a dataset that splits itself among
    a DataLoader's workers (torch's idiom: `get_worker_info()` in `__iter__`) would give each reader a part, which
    the reader then cut again, and most samples were never trained on, without a word. Inside, the dataset finds no
    worker info, as in a loader without workers. (torch's own global: the worker loop reads its local copy.)"""
    from torch.utils.data._utils import worker

    info, worker._worker_info = worker._worker_info, None
    try:
        yield
    finally:
        worker._worker_info = info


class Reader(IterableDataset):
    """One reader's micro-batches, each paired with what a resume needs: runs in a loader worker (or the rank's
    process). Errors travel as values, so they reach the main process as one paragraph, not a worker traceback."""

    def __init__(self, dataset: Any, layout: StreamLayout, workers: int, resume: dict | None, collate: Callable,
                 seed: int = 0):
        self.dataset, self.layout, self.workers, self.resume, self.collate = dataset, layout, workers, resume, collate
        self.seed, self.in_worker = seed, False

    def _seeding(self, key: str, first: int, skip: int = 0) -> Callable[[int | None], None] | None:
        """In a loader worker: the k-th sample read from here is seeded by `key` and its place `first + k`.
        In the rank's own process (num_workers=0) the samples draw from its generators, which a checkpoint keeps;
        a resume that reads a stream without state again from its pass's start, skipping `skip` samples, would
        draw them again out of the generators the checkpoint restored: they are put back as they were before the
        first sample it keeps."""
        if not getattr(self.dataset, "random_draws", True):  # (False: it says it draws none)
            return None
        if self.in_worker:
            return lambda k: seed_sample(self.seed, f"{key}start" if k is None else f"{key}{first + k}")
        return _drawing_nothing_until(skip) if skip > 0 else None

    def __iter__(self) -> Iterator[tuple[Any, dict]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        self.in_worker = info is not None
        try:
            yield from (self._part(worker) if reads_parts(self.dataset) else self._one(worker))
        except (DataError, CheckpointError) as e:
            yield None, {"error": str(e), "checkpoint": isinstance(e, CheckpointError)}

    def _one(self, worker: int) -> Iterator[tuple[Any, dict]]:
        ds, lay = self.dataset, self.layout
        b, readers, me = lay.micro_batch, lay.world * max(1, self.workers), worker * lay.world + lay.rank
        length, keep = sized(ds), stateful(ds)
        rec = self.resume or {}
        if rec.get("pass") is not None:  # the checkpoint knows the pass: continue in it (O(1) with a state)
            pass_no, pass_start = rec["pass"], rec["pass_start"]
            _set_epoch(ds, pass_no)
            if rec.get("state") is not None:
                _load(ds, rec["state"])
                pos = rec["position"]
            else:
                pos = pass_start
        else:
            pass_no = lay.start // length if length else 0  # a sized stream skips whole passes by arithmetic
            pos = pass_start = pass_no * (length or 0)
            _set_epoch(ds, pass_no)
        batch: list[Any] = []
        while True:
            got = 0
            for sample in _samples(ds, seeding=self._seeding(f"pass{pass_no}:", pos, lay.start - pos)):
                got += 1
                if pos >= lay.start and ((pos - lay.start) // b) % readers == me:
                    batch.append(sample)
                    if len(batch) == b:
                        end = pos + 1
                        meta: dict[str, Any] = {"end": end}
                        if (end - lay.start) % lay.global_batch == 0:  # a global batch ends here: where resumes start
                            meta.update({"pass": pass_no, "pass_start": pass_start, "state": _state(ds) if keep else None})
                        yield self.collate(batch), meta
                        batch = []
                pos += 1
            if length is not None and pos - pass_start != length:
                raise DataError(f"{_name(ds)} yielded {pos - pass_start} samples in pass {pass_no}, but its __len__ "
                                f"says {length}. Every pass of a stream must yield __len__ samples (the epochs and the "
                                "readers' shares are counted from it).")
            if got == 0 and pos == pass_start:
                raise DataError(f"{_name(ds)} yielded no samples (pass {pass_no}). A stream must yield at least one "
                                "sample per pass.")
            pass_no, pass_start = pass_no + 1, pos
            _set_epoch(ds, pass_no)

    def _part(self, worker: int) -> Iterator[tuple[Any, dict]]:
        ds, lay = self.dataset, self.layout
        readers = lay.world * max(1, self.workers)
        rec = self.resume
        if rec and rec.get("ranks"):
            mine = rec["ranks"][lay.rank]
            part = mine["order"][worker]
            saved = mine["parts"].get(str(part))
        else:
            part, saved = worker * lay.world + lay.rank, None
        ds.read_part(part, readers)
        pass_no, count = (saved["pass"], saved["count"]) if saved else (0, 0)
        _set_epoch(ds, pass_no)
        skip = 0
        if saved and saved.get("state") is not None:
            _load(ds, saved["state"])
        else:
            skip = count  # a stateless part is read again from its pass's start
        keep, batch = stateful(ds), []
        first = count if skip == 0 else 0  # (the place in the pass of the first sample read: a state resumes there)
        while True:
            got = 0
            for sample in _samples(ds, whole=False, seeding=self._seeding(f"part{part}.{pass_no}:", first, skip)):
                got += 1
                if skip:
                    skip -= 1
                    continue
                count += 1
                batch.append(sample)
                if len(batch) == lay.micro_batch:
                    yield self.collate(batch), {"part": part, "pass": pass_no, "count": count,
                                                "state": _state(ds) if keep else None}
                    batch = []
            if got == 0 and count == 0:
                raise DataError(f"{_name(ds)}.read_part({part}, {readers}) gave reader {part} of {readers} no samples "
                                f"(pass {pass_no}): every reader (data-parallel rank x data.num_workers) needs a part "
                                "with data. Use fewer ranks or data.num_workers, or more files.")
            pass_no, count, first = pass_no + 1, 0, 0
            _set_epoch(ds, pass_no)


def _as_is(item: Any) -> Any:
    return item


class StreamBatches:
    """This rank's micro-batches of a stream, in order. It remembers what each reader delivered to this process (not
    what a worker has prefetched), for the checkpoint (`local_record`)."""

    def __init__(self, dataset: Any, layout: StreamLayout, workers: int, device: torch.device, seed: int,
                 resume: dict | None, collate: Callable):
        self.layout, self.workers, self.parts = layout, max(1, workers), reads_parts(dataset)
        reader = Reader(dataset, layout, workers, resume, collate, seed)
        if workers == 0 and device.type == "cpu":
            self._it: Iterator = iter(reader)
        else:
            self._it = iter(DataLoader(reader, batch_size=None, num_workers=workers, collate_fn=_as_is,
                                       pin_memory=device.type == "cuda", worker_init_fn=loader_worker_init,
                                       generator=torch.Generator().manual_seed(seed)))
        self.consumed = 0
        self.boundary: dict | None = None  # one stream: the newest batch that ended a global batch
        ranks = (resume or {}).get("ranks")
        mine = ranks[layout.rank] if ranks else None
        # Parts: worker w of this loader reads part order[w]; micro-batch i comes from worker i % workers.
        self.order = list(mine["order"]) if mine else [w * layout.world + layout.rank for w in range(self.workers)]
        self.delivered: dict[str, dict] = dict(mine["parts"]) if mine else {}

    def __iter__(self) -> StreamBatches:
        return self

    def close(self) -> None:
        """End the loader's workers now (what was delivered stays recorded for local_record)."""
        shutdown = getattr(self._it, "_shutdown_workers", None)  # (torch's own, as its __del__ calls it)
        if callable(shutdown):
            shutdown()
        self._it = iter(())

    def __next__(self) -> Any:
        batch, meta = next(self._it)
        if "error" in meta:
            raise (CheckpointError if meta["checkpoint"] else DataError)(meta["error"])
        self.consumed += 1
        if self.parts:
            self.delivered[str(meta["part"])] = {k: meta[k] for k in ("pass", "count", "state")}
        elif "pass" in meta:
            self.boundary = meta
        return batch

    def local_record(self) -> dict:
        """This rank's share of the stream's position (gathered from every rank into `record`)."""
        if self.parts:  # the next batch comes from worker consumed % workers: list the parts in that order
            order = [self.order[(self.consumed + k) % self.workers] for k in range(self.workers)]
            return {"order": order, "parts": self.delivered}
        return {"boundary": self.boundary}


def initial_record(dataset: Any, layout: StreamLayout, workers: int) -> dict:
    """The position of a stream nothing has been read from yet (at `layout.start`)."""
    if reads_parts(dataset):
        return {"mode": "parts", "position": layout.start, "world": layout.world, "workers": max(1, workers),
                "ranks": None}
    return {"mode": "one", "position": layout.start, "pass": None, "pass_start": None, "state": None}


def record(dataset: Any, layout: StreamLayout, workers: int, pieces: list[dict], position: int) -> dict:
    """The stream's position at `position` from every rank's `local_record`: for one stream, the state that the
    batch ending there carried (rank world-1's last micro-batch); for parts, every reader's."""
    out = initial_record(dataset, layout, workers)
    out["position"] = position
    if out["mode"] == "parts":
        out["ranks"] = pieces
        return out
    ends = [p["boundary"] for p in pieces if p.get("boundary") and p["boundary"]["end"] == position]
    if ends:
        out.update({k: ends[0][k] for k in ("pass", "pass_start", "state")})
    return out


def loader_worker_init(worker_id: int) -> None:
    """A data-loader worker dies with the process that started it (Linux; see backend.die_with_parent): a
    SIGKILLed run's workers would live on for seconds, holding its run dir, and refuse its own resume meanwhile."""
    from trainer.parallel.backend import die_with_parent

    die_with_parent()


def fingerprint(dataset: Any, own: Any = None) -> str:
    """What a resume checks the stream against: its kind, class, length and, if it has one, its `fingerprint`
    attribute (say, a hash of its files' names, sizes and contents), or `own` in its place."""
    ident = ("stream", "parts" if reads_parts(dataset) else "one", type(dataset).__module__,
             type(dataset).__qualname__, sized(dataset), own if own is not None else getattr(dataset, "fingerprint", None))
    return hashlib.sha256(repr(ident).encode()).hexdigest()[:16]


def fingerprints(dataset: Any) -> set[str]:
    """The fingerprints a checkpoint of this stream may hold: this version's, and those of the stream's earlier ways
    of telling its data (its `earlier_fingerprints` attribute), so a checkpoint written before one changed resumes."""
    return {fingerprint(dataset), *(fingerprint(dataset, f) for f in getattr(dataset, "earlier_fingerprints", ()))}


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**62


def _text(value: Any) -> bool:
    return value is None or isinstance(value, str)


def parse_record(text: Any, where: str) -> dict:
    """The checkpoint's stream position, checked for shape (a hostile checkpoint may hold anything)."""
    from trainer.checkpoint.snapshot import parse_tree

    if not isinstance(text, str):
        raise CheckpointError(f"{where}: trainer.stream is not a string; it is not a valid trainer checkpoint.")
    rec = parse_tree(text.encode(), f"{where}: trainer.stream")
    bad = CheckpointError(f"{where}: trainer.stream is malformed; it is not a valid trainer checkpoint.")
    if not isinstance(rec, dict) or rec.get("mode") not in ("one", "parts") or not _count(rec.get("position")):
        raise bad
    if rec["mode"] == "one":
        if not (all(rec.get(k) is None or _count(rec.get(k)) for k in ("pass", "pass_start")) and _text(rec.get("state"))):
            raise bad
        return rec
    if not (_count(rec.get("world")) and _count(rec.get("workers")) and rec["world"] >= 1 and rec["workers"] >= 1):
        raise bad
    ranks = rec.get("ranks")
    if ranks is None:
        return rec
    if not isinstance(ranks, list) or len(ranks) != rec["world"]:
        raise bad
    for r, mine in enumerate(ranks):
        parts = sorted(w * rec["world"] + r for w in range(rec["workers"]))
        if not (isinstance(mine, dict) and isinstance(mine.get("order"), list) and sorted(mine["order"]) == parts
                and isinstance(mine.get("parts"), dict)):
            raise bad
        for key, saved in mine["parts"].items():
            if not (key in {str(p) for p in parts} and isinstance(saved, dict) and _count(saved.get("pass"))
                    and _count(saved.get("count")) and _text(saved.get("state"))):
                raise bad
    return rec


def check_record(rec: dict, dataset: Any, layout: StreamLayout, workers: int, samples_seen: int, where: str) -> None:
    """Whether this run can continue the checkpoint's stream: the same kind, the same position, and for parts the
    same readers."""
    live = initial_record(dataset, layout, workers)
    if rec["mode"] != live["mode"]:
        raise CheckpointError(f"{where}: the checkpoint's stream was read as {rec['mode']}, this run's as "
                              f"{live['mode']} ({_name(dataset)}{' has' if reads_parts(dataset) else ' has no'} "
                              "read_part): resume with the dataset it was trained on.")
    if rec["position"] != samples_seen:
        raise CheckpointError(f"{where}: the stream position ({rec['position']}) is not the samples seen "
                              f"({samples_seen}); it is not a valid trainer checkpoint.")
    if rec["mode"] == "parts" and (rec["world"], rec["workers"]) != (live["world"], live["workers"]):
        raise CheckpointError(
            f"{where}: {_name(dataset)} reads its own part of the data (read_part), and the checkpoint's "
            f"{rec['world']} data-parallel ranks x {rec['workers']} loader workers each stopped in their part; this "
            f"run has {live['world']} x {live['workers']}. A stream read in parts resumes only with the same readers: "
            f"rerun with {rec['world']} data-parallel ranks (world.nproc_per_node x nnodes, divided by world.tp) and "
            f"data.num_workers={rec['workers'] if rec['workers'] > 1 else 0}. (A stream without read_part has no such "
            "limit: world size stays a performance knob.)")


def resume_note(rec: dict, dataset: Any) -> str | None:
    """One line when a resume must read the stream again to get back to its position (no state_dict)."""
    if stateful(dataset) or rec["position"] == 0:
        return None
    how = f"Give {_name(dataset)} {STATE_FN} to resume instantly (trainer/data/streaming.py)."
    if rec["mode"] == "parts":
        n = sum(s["count"] for mine in rec["ranks"] or [] for s in mine["parts"].values())
        return (f"resume: {_name(dataset)} has no {STATE_FN}: each reader reads its part again from the start of its "
                f"pass and drops the samples it had delivered ({n} in all) to continue where the run stopped. {how}")
    start = rec["pass_start"] if rec.get("pass") is not None else None
    if start is None:
        length = sized(dataset)
        start = (rec["position"] // length) * length if length else 0
    n = rec["position"] - start
    if n == 0:
        return None
    return (f"resume: {_name(dataset)} has no {STATE_FN}: the stream is read again from sample {start} and the {n} "
            f"samples up to sample {rec['position']} are skipped (by every reader) to continue where the run "
            f"stopped. {how}")


def eval_batches(dataset: Any, batch_size: int, rank: int, world: int, n: int,
                 collate: Callable) -> Iterator[tuple[Any, list[int]]]:
    """(batch, positions) of this rank's share of the first `n` samples of a val stream: every world-th, as a
    map-style val split's (each sample counted once, whatever the number of ranks)."""
    batch, positions = [], []
    for i, sample in enumerate(dataset):
        if i >= n:
            break
        if i % world == rank:
            batch.append(sample)
            positions.append(i)
            if len(batch) == batch_size:
                yield collate(batch), positions
                batch, positions = [], []
    if batch:
        yield collate(batch), positions
