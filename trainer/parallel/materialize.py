"""Materialising a model built on the meta device after it was sharded, with the very weights the
non-sharded path gives for the same seed.

A sharded parameter is a DTensor; a random init on it (`nn.init.normal_(p)`) would draw each rank's
shard from that rank's own generator: other values than the whole tensor would get, and on CPU the
same values on every rank. `ShardedInit` catches the random fills on DTensors where every init ends up,
at the dispatcher (`aten.normal_`, `aten.uniform_`, ...): it draws the whole tensor from the global
generator, exactly as the plain model would (every rank draws the same, since every rank has the same
seed), and keeps this rank's shard. The draw is on the CPU whatever the device, as the plain model's
constructor draws (a GPU's generator is another stream: seen on an H100, FSDP started from other weights
than world=single), and so are the fills of parameters left whole on a GPU. Catching them there, and not by
the name of the function called, covers every way an init is written: `torch.nn.init`, tensor methods, and wrappers such as Hugging Face's
`transformers.initialization`, which replaces `torch.nn.init`'s functions while `_init_weights` runs.
Ops that read the tensor they fill (`trunc_normal_`'s erfinv and clamp, `kaiming_uniform_`'s bounds from
the global shape) then work on the shard as they would on the whole. Two inits draw a whole matrix at once
and transform it (`orthogonal_`'s QR, `sparse_`'s per-column permutations): those are caught by name and
run on the whole tensor. So any `init_weights()` written for the plain model gives identical weights under
FSDP or tensor parallelism, and the whole model never exists on one process (one parameter at a time does).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
# The in-place random fills every random init ends in.
_RANDOM_FILLS = {getattr(getattr(_aten, name), o)
                 for name in ("normal_", "uniform_", "bernoulli_", "random_", "exponential_", "geometric_",
                              "log_normal_", "cauchy_")
                 for o in getattr(_aten, name).overloads()}
# Inits that transform a whole-matrix draw (not elementwise): run whole. Matched by name, so that Hugging
# Face's same-named wrappers of torch.nn.init's functions are matched too.
_WHOLE_MATRIX_INITS = {"orthogonal_", "sparse_"}
# The names of torch.nn.init's fills, for SkipMetaInit.
_INIT_NAMES = {"normal_", "uniform_", "trunc_normal_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
               "kaiming_normal_", "orthogonal_", "sparse_", "zeros_", "ones_", "constant_", "eye_", "dirac_"}
_INIT_MODULES = ("torch.nn.init", "transformers.initialization")


def _is_init(func, names: set[str]) -> bool:
    return getattr(func, "__name__", None) in names and getattr(func, "__module__", None) in _INIT_MODULES


def _drawn_on_cpu(like: torch.Tensor, fill: Callable[[torch.Tensor], object]) -> torch.Tensor:
    """A whole tensor shaped like `like`, filled by `fill` on the CPU, from the generator the plain model's
    constructor draws from (a GPU's generator is another stream), then moved to `like`'s device. The plain
    model's values, and the same generator state after."""
    whole = torch.empty(like.shape, dtype=like.dtype)
    fill(whole)
    return whole.to(like.to_local().device if hasattr(like, "to_local") else like.device)


def _fill_shard(target, fill: Callable[[torch.Tensor], object]) -> None:
    """Fill a DTensor with its part of a whole tensor that `fill` fills."""
    from torch.distributed.tensor import distribute_tensor

    whole = _drawn_on_cpu(target, fill)
    target.to_local().copy_(distribute_tensor(whole, target.device_mesh, target.placements,
                                              src_data_rank=None).to_local())


class _RandomFillsOnShards(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        kwargs = kwargs or {}
        if func in _RANDOM_FILLS and args and isinstance(args[0], DTensor):
            _fill_shard(args[0], lambda whole: func(whole, *args[1:], **kwargs))
            return args[0]
        if func in _RANDOM_FILLS and args and isinstance(args[0], torch.Tensor) \
                and args[0].device.type not in ("cpu", "meta"):
            # A parameter left whole (tensor parallelism's embeddings and norms) on a GPU: drawn on the CPU too.
            return args[0].copy_(_drawn_on_cpu(args[0], lambda whole: func(whole, *args[1:], **kwargs)))
        return func(*args, **kwargs)


class _WholeMatrixInits(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        kwargs = dict(kwargs or {})
        if _is_init(func, _WHOLE_MATRIX_INITS):
            target = args[0] if args else kwargs.pop("tensor", None)
            if isinstance(target, DTensor):
                _fill_shard(target, lambda whole: func(whole, *args[1:], **kwargs))
                return target
            if not args:
                kwargs["tensor"] = target
        return func(*args, **kwargs)


class ShardedInit:
    """Random fills of DTensors fill each shard with its part of a whole-tensor draw (see the module's text)."""

    def __enter__(self):
        self._modes = [_WholeMatrixInits(), _RandomFillsOnShards()]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


class SkipMetaInit(TorchFunctionMode):
    """Fills of meta tensors (which hold no values) do nothing, instead of running torch's reference
    implementations: those import torch._dynamo (~1 s), which the launcher, building the model on the meta
    device only to check it, would pay before any worker starts."""

    _FILLS = {torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.bernoulli_, torch.Tensor.random_,
              torch.Tensor.exponential_, torch.Tensor.geometric_, torch.Tensor.log_normal_, torch.Tensor.cauchy_,
              torch.Tensor.zero_, torch.Tensor.fill_}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._FILLS or _is_init(func, _INIT_NAMES):
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


def forget_initialization(model: nn.Module) -> None:
    """Clear Hugging Face's `_is_hf_initialized` marks, which its constructor leaves on every module and tensor it
    initialised: with them, a second `init_weights()` draws nothing and keeps the constructor's values (whatever the
    RNG held before it), instead of re-drawing every weight from the seed as the framework's re-initialisation and
    the sharded path (which starts from no marks) do."""
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if "_is_hf_initialized" in getattr(t, "__dict__", {}):
                del t._is_hf_initialized


def built_whole(factory: Callable[[], nn.Module], seed: int, seed_everything: Callable[[int], None]) -> nn.Module:
    """The model `factory` builds whole on this process, its weights what one process draws from `seed`: a model
    with `init_weights()` re-initialised from the seed after construction (what the sharded path gives too). The
    strategies build so where nothing is sharded; `trainer.load(checkpoint=...)` rebuilds a LoRA checkpoint's
    frozen base (which the checkpoint leaves out) so."""
    seed_everything(seed)
    model = factory()
    if hasattr(model, "init_weights"):
        # (Hugging Face marks what its constructor initialised; without forgetting, nothing is re-drawn)
        forget_initialization(model)
        seed_everything(seed)
        with torch.no_grad():
            model.init_weights()
    return model


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
