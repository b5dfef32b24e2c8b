"""The parallel layout of a job: its degrees, checked once, and the device mesh they make.

As torchtitan's `ParallelDims`: a job of `world_size` processes is `pp` pipeline stages of `dp` data-parallel
ranks of `tp` tensor-parallel ranks each (`world_size = pp x dp x tp`). The layout checks the degrees (before
any worker starts, from the config, and again in each worker, with the world size the launcher made), builds
the ("dp",), ("dp", "tp") or ("pp", "dp"[, "tp"]) mesh, and says where this rank sits. Tensor parallelism is
applied from it, the same way for any data-parallel strategy (DDP averages the shards' gradients over `dp`,
FSDP shards them over `dp`); a strategy only decides what it does on the `dp` dimension. Pipeline parallelism
(pipeline.py) splits the model's blocks between the `pp` stages before either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainer.errors import ConfigError

if TYPE_CHECKING:
    import torch.nn as nn

# torch.distributed.pipelining's schedules (schedules.get_schedule_class), by the names it takes. The first two
# run one stage per rank; the others run VIRTUAL_STAGES stages per rank (looped, or in a V for the last two).
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
SINGLE_STAGE = ("GPipe", "1F1B")
VIRTUAL_STAGES = 2


def check_degree(tp: Any, world_size: int | None = None, key: str = "world.tp",
                 what: str = "the tensor-parallel degree") -> int:
    """`world.tp` (or `world.pp`) as a degree: an integer >= 1 that divides the number of processes (when known)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"{key}={tp!r} is invalid: expected an integer >= 1 ({what}).")
    if world_size is not None and world_size % tp:
        raise ConfigError(f"{key}={tp} is invalid: expected a divisor of the number of processes ({world_size} = "
                          f"world.nproc_per_node x world.nnodes). Change {key} or world.nproc_per_node.")
    return tp


def schedule_name(name: Any) -> str:
    """`world.pp_schedule` as torch's spelling of one of SCHEDULES (any case)."""
    found = next((s for s in SCHEDULES if isinstance(name, str) and s.lower() == name.lower()), None)
    if found is None:
        raise ConfigError(f"world.pp_schedule={name!r} is not a pipeline schedule: expected one of "
                          f"{', '.join(SCHEDULES)} (torch.distributed.pipelining's schedules).")
    return found


def stages_per_rank(schedule: str) -> int:
    return 1 if schedule in SINGLE_STAGE else VIRTUAL_STAGES


def check_pipeline(pp: Any, schedule: Any, microbatches: Any, world_size: int | None = None,
                   tp: int = 1, batch_size: Any = None) -> tuple[int, str, int]:
    """(pp, schedule, microbatches) checked together: pp divides the processes (with tp), the schedule exists,
    and the microbatches suit the schedule and divide data.batch_size. `microbatches=None` is the number of
    stages (what the schedules need at least)."""
    pp = check_degree(pp, key="world.pp", what="the pipeline-parallel degree: stages on as many ranks")
    if world_size is not None and world_size % (pp * tp):
        raise ConfigError(f"world.pp={pp} is invalid with world.tp={tp}: expected pp x tp to divide the number of "
                          f"processes ({world_size} = world.nproc_per_node x world.nnodes). Change world.pp, "
                          "world.tp or world.nproc_per_node.")
    schedule = schedule_name(schedule)
    stages = pp * stages_per_rank(schedule)
    defaulted = microbatches is None
    if microbatches is None:
        microbatches = stages
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ConfigError(f"world.microbatches={microbatches!r} is invalid: expected an integer >= 1 (how many "
                          "pieces each micro-batch is cut into for the pipeline), or null (one per stage).")
    if pp > 1 and schedule in ("1F1B", "DualPipeV", "ZBVZeroBubble") and microbatches < stages:
        raise ConfigError(f"world.microbatches={microbatches} is invalid with world.pp_schedule={schedule}: it needs at "
                          f"least one microbatch per stage ({stages} stages). Set world.microbatches={stages} or more.")
    rounds = max(1, microbatches // pp)
    if pp > 1 and schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and microbatches % rounds:
        raise ConfigError(f"world.microbatches={microbatches} is invalid with world.pp_schedule={schedule}: it must be "
                          f"a multiple of world.pp={pp} (or smaller than it). Try world.microbatches={rounds * pp}.")
    if pp > 1 and isinstance(batch_size, int) and batch_size % microbatches:
        def suits(m: int) -> bool:  # (the schedule's own rules above, for another count)
            return not ((schedule in ("1F1B", "DualPipeV", "ZBVZeroBubble") and m < stages) or
                        (schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and m % max(1, m // pp)))

        divisors = [m for m in range(1, batch_size + 1) if batch_size % m == 0 and suits(m)]
        given = f"world.microbatches={microbatches}" + (" (null: one per stage)" if defaulted else "")
        other = (f", or world.microbatches to one that divides it and suits {schedule} "
                 f"({', '.join(map(str, divisors))})" if divisors else "")
        raise ConfigError(f"{given} does not divide data.batch_size={batch_size}: each micro-batch is cut into that "
                          f"many equal pieces for the pipeline. Set data.batch_size to a multiple of {microbatches}"
                          f"{other}.")
    return pp, schedule, microbatches


@dataclass(frozen=True)
class Layout:
    world_size: int
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        check_degree(self.tp, self.world_size)
        check_degree(self.pp, self.world_size // self.tp if self.world_size % self.tp == 0 else None, "world.pp",
                     "the pipeline-parallel degree")

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches a step sees."""
        return self.world_size // (self.tp * self.pp)

    @property
    def needs_mesh(self) -> bool:
        return self.tp > 1 or self.pp > 1

    def build_mesh(self, device_type: str):
        """The ("dp",) mesh, ("dp", "tp") with tensor parallelism (tensor-parallel peers are adjacent ranks), and
        ("pp", "dp"[, "tp"]) with pipeline stages (outermost, as torchtitan: rank 0 holds the first stage)."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.pp > 1:
            shape, names = (self.pp, self.dp, self.tp), ("pp", "dp", "tp")
            keep = [i for i, n in enumerate(shape) if n > 1 or names[i] != "tp"]
            return init_device_mesh(device_type, tuple(shape[i] for i in keep),
                                    mesh_dim_names=tuple(names[i] for i in keep))
        if self.tp > 1:
            return init_device_mesh(device_type, (self.dp, self.tp), mesh_dim_names=("dp", "tp"))
        return init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("dp",))

    def apply_tensor_parallel(self, model: nn.Module, mesh) -> None:
        if self.tp > 1:
            from trainer.parallel.tensor_parallel import parallelize

            parallelize(model, mesh["tp"])


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity, where the OS has one: a SLURM job's share, not the
    machine's); torch-free, as config validation reads it too."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
