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
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ..errors import ConfigError
from .base import Strategy, seed_everything


class FSDP(Strategy):
    """Options (`world.NAME=...`):

    reshard_after_forward: free gathered parameters after each unit's forward (ZeRO-3) or keep them
        for the backward (ZeRO-2).
    cpu_offload: keep sharded parameters, gradients and optimizer state in CPU memory (CPUOffloadPolicy).
    wrap: class names of the modules that become FSDP units (like Accelerate's
        `transformer_layer_cls_to_wrap`); null = the model's `_no_split_modules` (the `lm` GPT says
        `Block`; Hugging Face models say theirs), else each child of the model's `nn.ModuleList`s.
    """

    distributed = True
    sharded = True
    needs_process_group = True
    collective_forward = True

    def __init__(self, reshard_after_forward: bool = True, cpu_offload: bool = False, wrap: list[str] | None = None):
        if wrap is not None and (isinstance(wrap, str) or not all(isinstance(w, str) for w in wrap)):
            raise ConfigError(f"world.wrap={wrap!r} is invalid: expected a list of class names, e.g. world.wrap=[Block].")
        self.reshard_after_forward, self.cpu_offload = reshard_after_forward, cpu_offload
        self.wrap = list(wrap) if wrap is not None else None
        self.mesh = None

    def setup(self, backend, precision) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        super().setup(backend, precision)
        precision.distribute()
        self.mesh = init_device_mesh(backend.device.type, (backend.world_size,), mesh_dim_names=("dp",))

    # -- the model -----------------------------------------------------------------------------------------
    def units(self, model: nn.Module) -> list[nn.Module]:
        """The submodules that become FSDP units, children before parents (fully_shard goes bottom-up)."""
        names = self.wrap if self.wrap is not None else getattr(model, "_no_split_modules", None)
        if names is None:
            found = [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]
        else:
            present = {type(m).__name__ for m in model.modules()}
            unknown = [n for n in names if n not in present]
            if unknown:
                from ..errors import suggest

                raise ConfigError(
                    f"world.wrap names {', '.join(unknown)}, which the model ({type(model).__name__}) does not "
                    f"contain.{suggest(unknown[0], present)} Its module classes: {', '.join(sorted(present))}. "
                    "Name the class of its repeated blocks, e.g. world.wrap=[Block]."
                )
            found = [m for m in model.modules() if type(m).__name__ in names and m is not model]
        return list(reversed(found))

    def check_model(self, model: nn.Module) -> None:
        """Config mistakes found on the meta-device model, before any process starts."""
        self.units(model)

    def build_model(self, factory: Callable[[], nn.Module], seed: int) -> nn.Module:
        with torch.device("meta"):
            model = factory()
        on_meta = hasattr(model, "init_weights")
        if not on_meta:  # no way to initialise shard by shard: every rank builds the whole model once
            seed_everything(seed)
            model = factory()
        self.shard(model)
        if on_meta:
            from .materialize import materialize

            device = torch.device("cpu") if self.cpu_offload else self.backend.device
            materialize(model, device, seed, seed_everything)
        return model

    def shard(self, model: nn.Module) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        dtype = self.precision.dtype
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype != torch.float32 \
            else MixedPrecisionPolicy()
        # Pinned memory needs a CUDA device: on a CPU-only machine pinning fails.
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if self.cpu_offload else OffloadPolicy()
        kwargs = {"mesh": self.dp_mesh, "mp_policy": mp, "offload_policy": offload}
        for unit in self.units(model):
            fully_shard(unit, reshard_after_forward=self.reshard_after_forward, **kwargs)
        # The root last: what no unit took (embeddings, the tied head, the final norm) is sharded with it,
        # so a tied weight stays one parameter.
        fully_shard(model, reshard_after_forward=self.reshard_after_forward, **kwargs)

    @property
    def dp_mesh(self):
        return self.mesh

    def no_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        # FSDP2 reads the flag in the backward, which runs after this context: set, not restore.
        model.set_requires_gradient_sync(not enabled)
        return contextlib.nullcontext()

    def clip_grad_norm_(self, params: list[torch.Tensor], max_norm: float | None) -> torch.Tensor:
        return clip_grad_norm_(params, max_norm)

    def full_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from torch.distributed.tensor import DTensor

        out = {}
        for k, v in state.items():  # one tensor at a time, in the same order on every rank
            whole = v.full_tensor() if isinstance(v, DTensor) else v
            if self.backend.is_main:
                out[k] = whole.detach().to("cpu", copy=True).contiguous()
        return out


def clip_grad_norm_(params: list[torch.Tensor], max_norm: float | None) -> torch.Tensor:
    """The total 2-norm of the gradients, over DTensors on any number of meshes and plain tensors alike,
    clipped to `max_norm`. torch's clip_grad_norm_ stacks the per-tensor norms, which fails across meshes
    (FSDP x tensor parallel); here each mesh's norm is reduced on its own and the squares are summed."""
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    squares = []
    for grads in groups.values():
        norm = nn.utils.get_total_norm(grads)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float() ** 2)
    total = torch.stack(squares).sum().sqrt() if squares else torch.zeros(())
    if max_norm is not None:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        local = [g.to_local() if isinstance(g, DTensor) else g for grads in groups.values() for g in grads]
        torch._foreach_mul_(local, coef.to(local[0].device) if local else coef)
    return total
