"""Where this process sits in the job (rank, world size, device) and the collectives around it.

This is the only module that reads RANK / WORLD_SIZE / LOCAL_RANK. Everything else asks a
`Backend` (`backend.is_main`, `backend.all_reduce`) or uses the helpers at the bottom
(`is_main_process`, `main_process_first`, `barrier`), which recipes may use too.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import os
import sys
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainer.parallel.layout import available_cores  # (also imported from here: trainer/entry/commands.py)


def map_tensors(fn, batch: Any) -> Any:
    """`batch` with `fn` applied to each of its tensors, through mappings, lists, tuples and named tuples (what
    `Backend.to_device` moves). A mapping keeps its type where it can (a Hugging Face BatchEncoding is a UserDict),
    as the DataLoader's pinning keeps it."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        mapped = {k: map_tensors(fn, v) for k, v in batch.items()}
        try:
            if isinstance(batch, MutableMapping):
                clone = copy.copy(batch)
                clone.update(mapped)
                return clone
            return type(batch)(mapped)
        except TypeError:  # a mapping that cannot be copied or built from a dict
            return mapped
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple takes its fields as arguments
        return type(batch)(*(map_tensors(fn, v) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(fn, v) for v in batch)
    return batch


@dataclass(frozen=True)
class WorldInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    restart_count: int = 0  # how often the elastic launcher restarted the workers


def world_info() -> WorldInfo:
    """The position of this process as set by the elastic launcher (torchrun or ours)."""
    env = os.environ
    return WorldInfo(
        rank=int(env.get("RANK", 0)),
        local_rank=int(env.get("LOCAL_RANK", 0)),
        world_size=int(env.get("WORLD_SIZE", 1)),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
        restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
    )


def default_pg_backend(device: torch.device | None = None) -> str:
    """gloo for CPU tensors, plus nccl for CUDA tensors when the run is on a GPU (`device`; None: when this
    machine has one). A CPU run on a GPU machine (world.device=cpu, more processes than GPUs) gets gloo alone,
    so nothing of it can reach for a GPU that is not its own."""
    cuda = torch.cuda.is_available() if device is None else device.type == "cuda"
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """'auto' picks cuda:LOCAL_RANK when a GPU is present, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    return device


def usable_device(name: str | torch.device, local_rank: int = 0, named: str = "world.device={!r}") -> torch.device:
    """The device `name` names (`resolve_device`), or a ConfigError when it names no device torch knows or one this
    machine lacks: the one place that says "no CUDA". `named` shows the setting (`Runtime(device={!r})`)."""
    from trainer.errors import ConfigError

    try:
        device = resolve_device(name, local_rank) if isinstance(name, (str, torch.device)) else None
    except RuntimeError:  # (torch's "Expected one of cpu, cuda, ... device type at start of device string")
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"{named.format(name)} is not a device: expected 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'.")
    if device.type == "cuda" and not torch.cuda.is_available() or \
            device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{named.format(name)} is invalid here: this machine (this torch build) has no "
                          f"{device.type.upper()} device. Use 'auto' (a GPU where there is one, else the CPU) or 'cpu'.")
    return device


class Backend:
    """Device placement, process group and collectives for one process (how the model is wrapped and
    synchronised is the strategy's part: trainer/parallel/).

    With `world_size == 1` every collective is the identity and nothing touches torch.distributed,
    so the single-process path pays nothing for the distributed one.
    """

    def __init__(self, device: str = "auto", threads: int | str = "auto", timeout_s: int = 1800):
        self.info = world_info()
        self.device = resolve_device(device, self.info.local_rank)
        self.threads = threads
        self.timeout_s = timeout_s

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def is_main(self) -> bool:
        return self.info.rank == 0

    @property
    def distributed(self) -> bool:
        return self.info.world_size > 1

    def setup(self, process_group: bool = False) -> None:
        """Threads, device, and the process group when there are several processes (or `process_group`)."""
        if self.threads == "auto":
            # Share the cores among the workers on this machine instead of oversubscribing them.
            if self.info.local_world_size > 1:
                torch.set_num_threads(max(1, available_cores() // self.info.local_world_size))
        else:
            torch.set_num_threads(int(self.threads))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if dist.is_initialized():
            return
        device_id = self.device if self.device.type == "cuda" else None
        timeout = datetime.timedelta(seconds=self.timeout_s)
        if self.distributed:
            dist.init_process_group(backend=default_pg_backend(self.device), timeout=timeout, device_id=device_id)
        elif process_group:  # a strategy built on DTensor (FSDP at one process) needs a group of one
            dist.init_process_group(backend=default_pg_backend(self.device), store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timeout, device_id=device_id)

    def teardown(self, wait_for_peers: bool = False) -> None:
        """Leave the process group. `wait_for_peers` (after a run that finished on every rank): all ranks
        leave together. A gloo process that destroys its group while a peer is still working (rank 0
        exporting weights) can abort at exit ("terminate called without an active exception"). Not after
        a failure: the peers may be gone, and the barrier would wait for them until the timeout."""
        if dist.is_available() and dist.is_initialized():
            if wait_for_peers:
                dist.barrier()
            dist.destroy_process_group()

    # -- data ----------------------------------------------------------------------------------
    def to_device(self, batch: Any) -> Any:
        if self.device.type == "cpu":  # batches are built on the CPU
            return batch
        non_blocking = self.device.type == "cuda"  # (from the loader's pinned memory: trainer/data/sampling.py)
        return map_tensors(lambda t: t.to(self.device, non_blocking=non_blocking), batch)

    # -- collectives ---------------------------------------------------------------------------
    def all_reduce(self, value: torch.Tensor | float | int, op: str = "sum", on_host: bool = False,
                   group: Any = None) -> torch.Tensor | float | int:
        """Sum (or max/min) over the ranks of `group` (default: all). Numbers stay numbers when there is
        only one process.

        `on_host` reduces in CPU memory (gloo) instead of on the device: for small host-side values,
        whose reduction must not wait for the GPU's queue of work."""
        if not self.distributed:
            return value
        t = torch.as_tensor(value, device="cpu" if on_host else self.device)
        t = t.clone() if t is value else t
        op_ = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        dist.all_reduce(t, op=op_, group=group)
        return t

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """`obj` from rank `src`, on every rank (small objects: a checkpoint path, an error message)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        barrier()

    def gather_object(self, obj: Any, group: Any = None) -> list[Any]:
        """Every rank's `obj` (of `group`, default all), in rank order, on every rank (small objects only: RNG
        states, flags)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out

    def broadcast_tensor(self, tensor: torch.Tensor | None, src: int, group: Any = None,
                         like: torch.Tensor | None = None) -> torch.Tensor:
        """Rank `src`'s `tensor` (any shape and dtype; the others pass None) on every rank of `group`, on the
        device: its shape and dtype go first, then its values (pipeline stages handing on activations). With
        `like` (every rank: a tensor of its shape and dtype) only the values go."""
        if not self.distributed:
            return tensor
        if like is not None:
            out = tensor.contiguous() if self.rank == src else torch.empty_like(like, device=self.device)
            dist.broadcast(out, src=src, group=group)
            return out
        dtypes = _WIRE_DTYPES
        header = torch.zeros(9, dtype=torch.int64, device=self.device)
        if self.rank == src:
            if tensor.dim() > 7:
                raise ValueError(f"broadcast_tensor: {tensor.dim()} dimensions (at most 7)")
            header[:2] = torch.tensor([dtypes.index(tensor.dtype), tensor.dim()])
            header[2:2 + tensor.dim()] = torch.tensor(tensor.shape)
        dist.broadcast(header, src=src, group=group)
        dtype, ndim, *shape = header.tolist()
        out = tensor.contiguous() if self.rank == src else torch.empty(shape[:ndim], dtype=dtypes[dtype],
                                                                         device=self.device)
        dist.broadcast(out, src=src, group=group)
        return out

    def side_group(self) -> Any:
        """A process group of all ranks beside the training one (gloo, host memory), for work in a background
        thread whose collectives must never interleave with the training group's (a checkpoint's async save:
        gloo would deadlock on FSDP's all-gathers). Every rank must call it, in the same order."""
        return dist.new_group(backend="gloo") if self.distributed else None

    def broadcast_tensors_(self, tensors: list[torch.Tensor]) -> None:
        """In place, rank 0's values of `tensors` on every rank (a model each rank built before it is sharded)."""
        if self.distributed:
            with torch.no_grad():
                for t in tensors:
                    dist.broadcast(t.data, src=0)

    def all_gather_cat(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` (the same shape on all), concatenated along dim 0 in rank order."""
        if not self.distributed:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts)

    def gather_samples(self, indices: list[int], rows: torch.Tensor) -> torch.Tensor:
        """Per-sample `rows` of every rank (row i is sample `indices[i]`), as one tensor ordered by sample index,
        on every rank. Each rank's samples are its own, so every sample is there exactly once."""
        if not self.distributed:
            order = torch.as_tensor(indices, dtype=torch.long).argsort()
            return rows[order.to(rows.device)]
        gathered = self.gather_object((list(indices), rows.detach().cpu()))
        # Tensor-parallel peers evaluate the same samples: each index is kept once.
        first: dict[int, int] = {}
        for position, i in enumerate(i for idx, _ in gathered for i in idx):
            first.setdefault(i, position)
        stacked = torch.cat([r for _, r in gathered])
        return stacked[torch.as_tensor([first[i] for i in sorted(first)], dtype=torch.long)].to(rows.device)

    def monitored_barrier(self, timeout_s: float, group: Any = None) -> str | None:
        """A barrier that gives up after `timeout_s` and says which ranks never came (None when all did), over a
        gloo group (`side_group`): torch's monitored_barrier."""
        if not self.distributed:
            return None
        try:
            dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
        except RuntimeError as e:
            text = str(e).strip().splitlines()[0] if str(e).strip() else "some rank"
            return text[:300]
        return None

    def gather_object_to_main(self, obj: Any, group: Any = None) -> list[Any] | None:
        """Every rank's `obj`, in rank order, on the main rank (None on the others)."""
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, out, dst=0, group=group)
        return out


_WIRE_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
                torch.int8, torch.uint8, torch.bool]


# -- helpers for code that has no Backend at hand (recipes, data builders) -------------------------
def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_main_process() -> bool:
    """True on global rank 0 (or when not distributed)."""
    return (dist.get_rank() if _initialized() else world_info().rank) == 0


def is_local_main_process() -> bool:
    """True on the first process of each machine: the one that should touch machine-local files."""
    return world_info().local_rank == 0


def barrier() -> None:
    if _initialized():
        dist.barrier()


def all_reduce_max_(tensor: torch.Tensor) -> None:
    """In place, the max over all ranks (a flag any rank may raise: fp16's overflow under sharded gradients)."""
    if _initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)


def broadcast_from_main(obj: Any) -> Any:
    """The main process's `obj` on every process (as given when there is no process group). Every process must
    call it; the others may pass None. For what the main process computed once and the others must use bit for
    bit (a fitted normaliser): sent between the processes of this job, never read back from a file another
    process could have replaced."""
    if not _initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def share_before_setup(payload: list) -> list:
    """`payload` as rank 0 has it, on every rank of a job that torchrun started, before any Backend exists (rank 0's
    resolved config): joins the default process group, which the Backend later reuses."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available() and local_rank < torch.cuda.device_count():  # else a CPU job on a GPU machine
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend=default_pg_backend())
    dist.broadcast_object_list(payload, src=0)
    return payload


@contextlib.contextmanager
def main_process_first(local: bool = True) -> Iterator[None]:
    """Run the body on the main process first while the others wait, then on the others.

    The pattern for work that must happen once, such as building a dataset cache::

        with main_process_first():
            data = build_or_load_cache(path)

    `local=True` (default) elects one process per machine, for caches on machine-local disks.
    """
    first = is_local_main_process() if local else is_main_process()
    if not first:
        barrier()
    try:
        yield
    finally:
        if first:
            barrier()


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies, so that no worker outlives a SIGKILLed launcher
    and trains on beside the next job: a training worker (its parent, the launcher's forkserver, dies with the
    launcher the same way: trainer/entry/forkserver_guard.py) and a data-loader worker (its parent, the rank).
    Linux only (prctl PR_SET_PDEATHSIG); elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG = 1
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)
