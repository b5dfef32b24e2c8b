"""Materialising a model built on the meta device after it was sharded, with the very weights the
non-sharded path gives for the same seed.

A sharded parameter is a DTensor; a random init on it (`nn.init.normal_(p)`) would draw each rank's
shard from that rank's own generator: other values than the whole tensor would get, and on CPU the
same values on every rank. `ShardedInit` intercepts the random in-place ops (`normal_`, `uniform_`,
...) on DTensors: it draws the whole tensor from the global generator, exactly as the plain model
would (every rank draws the same, since every rank has the same seed), and keeps this rank's shard.
So any `init_weights()` written for the plain model, whether with `torch.nn.init` or with tensor
methods, gives identical weights under FSDP or tensor parallelism, and the whole model never exists
on one process (one parameter at a time does).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

# Random in-place fills: tensor methods, and torch.nn.init's functions (which hand DTensors to torch
# functions modes under their own name, before they reach the tensor methods).
_RANDOM_INPLACE = {
    torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.bernoulli_, torch.Tensor.random_,
    torch.Tensor.exponential_, torch.Tensor.geometric_, torch.Tensor.log_normal_, torch.Tensor.cauchy_,
    nn.init.normal_, nn.init.uniform_, nn.init.trunc_normal_, nn.init.xavier_uniform_, nn.init.xavier_normal_,
    nn.init.kaiming_uniform_, nn.init.kaiming_normal_, nn.init.orthogonal_, nn.init.sparse_,
}


class ShardedInit(TorchFunctionMode):
    """Random in-place ops on a DTensor fill it with its shard of a whole-tensor draw."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor, distribute_tensor

        kwargs = dict(kwargs or {})
        if func in _RANDOM_INPLACE:
            # torch.nn.init passes the tensor by keyword; tensor methods pass it first.
            target = args[0] if args else kwargs.pop("tensor", None)
            if isinstance(target, DTensor):
                local = target.to_local()
                whole = torch.empty(target.shape, dtype=target.dtype, device=local.device)
                func(whole, *args[1:], **kwargs)  # the whole tensor's draw: the plain model's values
                local.copy_(distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None).to_local())
                return target
            if not args:
                kwargs["tensor"] = target
        return func(*args, **kwargs)


class SkipMetaInit(TorchFunctionMode):
    """Fills of meta tensors (which hold no values) do nothing, instead of running torch's reference
    implementations: those import torch._dynamo (~1 s), which the launcher, building the model on the meta
    device only to check it, would pay before any worker starts."""

    _FILLS = _RANDOM_INPLACE | {torch.Tensor.zero_, torch.Tensor.fill_, nn.init.zeros_, nn.init.ones_,
                                nn.init.constant_, nn.init.eye_, nn.init.dirac_}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._FILLS:
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


def materialize(model: nn.Module, device: torch.device, seed: int, seed_everything: Callable[[int], None]) -> None:
    """Allocate a sharded meta-device model's shards on `device` and run its `init_weights()` under `seed`."""
    tied = tied_parameters(model)
    model.to_empty(device=device)  # gives each name of a shared plain parameter its own tensor
    retie(model, tied)
    seed_everything(seed)
    with torch.no_grad(), ShardedInit():
        model.init_weights()


def tied_parameters(model: nn.Module) -> list[list[str]]:
    """Groups of names that share one parameter (an embedding tied to the output head)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def retie(model: nn.Module, groups: list[list[str]]) -> None:
    """Make every name of each group point at the group's first parameter again."""
    for names in groups:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, attr, first)
