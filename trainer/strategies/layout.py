"""The parallel layout of a job: its degrees, checked once, and the device mesh they make.

As torchtitan's `ParallelDims`: a job of `world_size` processes is `dp` data-parallel ranks of `tp`
tensor-parallel ranks each (`world_size = dp x tp`). The layout checks the degrees (before any worker starts,
from the config, and again in each worker, with the world size the launcher made), builds the ("dp",) or
("dp", "tp") mesh, and says where this rank sits. Tensor parallelism is applied from it, the same way for any
data-parallel strategy (DDP averages the shards' gradients over `dp`, FSDP shards them over `dp`); a strategy
only decides what it does on the `dp` dimension.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:
    import torch.nn as nn


def check_degree(tp: Any, world_size: int | None = None) -> int:
    """`world.tp` as a degree: an integer >= 1 that divides the number of processes (when known)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"world.tp={tp!r} is invalid: expected an integer >= 1 (the tensor-parallel degree).")
    if world_size is not None and world_size % tp:
        raise ConfigError(f"world.tp={tp} is invalid: expected a divisor of the number of processes ({world_size} = "
                          "world.nproc_per_node x world.nnodes). Change world.tp or world.nproc_per_node.")
    return tp


@dataclass(frozen=True)
class Layout:
    world_size: int
    tp: int = 1

    def __post_init__(self) -> None:
        check_degree(self.tp, self.world_size)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches a step sees."""
        return self.world_size // self.tp

    def build_mesh(self, device_type: str):
        """The ("dp",) mesh, or ("dp", "tp") with tensor parallelism (tensor-parallel peers are adjacent ranks)."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.tp > 1:
            return init_device_mesh(device_type, (self.dp, self.tp), mesh_dim_names=("dp", "tp"))
        return init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("dp",))

    def apply_tensor_parallel(self, model: nn.Module, mesh) -> None:
        if self.tp > 1:
            from .tensor_parallel import parallelize

            parallelize(model, mesh["tp"])
