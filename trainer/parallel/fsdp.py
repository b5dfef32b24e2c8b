"""`world=fsdp`: fully sharded data parallel on torch's FSDP2 (`torch.distributed.fsdp.fully_shard`).

Each rank holds 1/N of the parameters, gradients and optimizer state (as DTensors sharded on dim 0).
A unit (one transformer block, then the root with what is left) gathers its parameters just before its
forward and backward and frees them after; gradients are reduce-scattered in fp32. The model is built
on the meta device, sharded, then materialised shard by shard with the weights the non-sharded path
gives for the same seed (`materialize.py`), so no process ever holds the whole model.

DeepSpeed users: `reshard_after_forward=true` is ZeRO-3, `false` is ZeRO-2 (parameters stay gathered
from forward to backward: less communication, more memory); `cpu_offload=true` is ZeRO-Offload.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from trainer.errors import ConfigError
from trainer.parallel.layout import check_degree
from trainer.parallel.strategy import Strategy


class FSDP(Strategy):
    """Options (`world.NAME=...`):

    reshard_after_forward: free gathered parameters after each unit's forward (ZeRO-3) or keep them
        for the backward (ZeRO-2).
    cpu_offload: keep sharded parameters, gradients and optimizer state in CPU memory (CPUOffloadPolicy).
    wrap: class names of the modules that become FSDP units (like Accelerate's
        `transformer_layer_cls_to_wrap`); null = the model's `_no_split_modules` (the `lm` GPT says
        `Block`; Hugging Face models say theirs), else each child of the model's `nn.ModuleList`s.
    tp: tensor-parallel degree: the model is split by its plan over `tp` ranks first, then sharded over
        the data-parallel ranks (a 2-D mesh, dp x tp).
    """

    distributed = True
    shards_data_parallel = True

    def __init__(self, reshard_after_forward: bool | int = True, cpu_offload: bool = False, wrap: list[str] | None = None,
                 tp: int = 1):
        if wrap is not None and (isinstance(wrap, str) or not all(isinstance(w, str) for w in wrap)):
            example = wrap if isinstance(wrap, str) else "ClassName"
            raise ConfigError(f"world.wrap={wrap!r} is invalid: expected a list of class names, e.g. world.wrap=[{example}].")
        self.reshard_after_forward, self.cpu_offload = reshard_after_forward, cpu_offload
        self.unit_classes = list(wrap) if wrap is not None else None
        self.tp = check_degree(tp)

    # -- the model -----------------------------------------------------------------------------------------
    @property
    def param_device(self) -> torch.device:
        return torch.device("cpu") if self.cpu_offload else self.backend.device

    def check_model(self, model: nn.Module) -> None:
        self.units(model)
        super().check_model(model)

    def shard(self, model: nn.Module) -> None:
        """Each unit, then the root, sharded over the data-parallel ranks (after tensor parallelism, if any)."""
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        mp = self.precision.mixed_precision_policy()
        # Pinned memory needs a CUDA device: on a CPU-only machine pinning fails.
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if self.cpu_offload else OffloadPolicy()
        kwargs = {"mesh": self.mesh["dp"], "mp_policy": mp, "offload_policy": offload,
                  "reshard_after_forward": self.reshard_after_forward}
        for unit in self.units(model):
            fully_shard(unit, **kwargs)
        # The root last: what no unit took (embeddings, the tied head, the final norm) is sharded with it,
        # so a tied weight stays one parameter.
        fully_shard(model, **kwargs)

    def wrap(self, model: nn.Module) -> nn.Module:
        return model  # placed by parallelize / materialize

    def no_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        # FSDP2 reads the flag in the backward, which runs after this context: set, not restore.
        model.set_requires_gradient_sync(not enabled)
        return contextlib.nullcontext()
