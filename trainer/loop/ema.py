"""Exponential moving average (EMA) of a model's weights, kept in fp32.

After each real optimizer step t (t = 0, 1, ... counts EMA updates; skipped steps do not count):

    d_t   = min(decay, (1 + t) / (10 + t))  if warmup  else  decay
    ema  <- d_t * ema + (1 - d_t) * param          (torch._foreach_lerp_)

The EMA starts as a copy of the initial weights. Warmup lets early, fast-moving weights through
instead of averaging them with the random init. Buffers are copied, not averaged. Under a sharded
strategy the parameters are DTensors: the EMA keeps DTensors of the same sharding (each rank averages
its own shard; checkpoints save them sharded, exports gather them whole). Under DeepSpeed's ZeRO-3 each rank
holds a flat partition of every parameter instead: the strategy hands the EMA its `Partitions` (`attach`), and
the EMA averages this rank's partition of each parameter, gathering whole tensors only to save or export.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn


class EMA:
    def __init__(self, model: nn.Module, decay: float = 0.999, warmup: bool = False, update_every: int = 1,
                 frozen: frozenset[str] = frozenset()):
        if not 0.0 <= decay < 1.0:
            from trainer.errors import ConfigError

            raise ConfigError(f"ema.decay={decay} is invalid: expected a number in [0, 1), e.g. 0.999.")
        self.decay, self.warmup, self.update_every = decay, warmup, update_every
        self.model = model
        # named_parameters() lists a tied weight once, so it is averaged once. `frozen` (a LoRA run's base weights,
        # finetune.frozen_keys) never change: their average is themselves, so they are not copied or saved.
        self.names, self.params = zip(*[(n, p) for n, p in model.named_parameters() if n not in frozen])
        self.shadow = [p.detach().to(torch.float32, copy=True) for p in self.params]
        self.num_updates = 0
        self.parts = None  # a strategy's own partitioning of the parameters (ZeRO-3), set by `attach`

    def attach(self, strategy) -> None:
        """After the strategy set the optimizer up (ZeRO-3 partitions the parameters then): keep this rank's part
        of each average only, cut from the whole copies taken at the start."""
        self.parts = strategy.ema_partitions()
        if self.parts is not None:
            self.shadow = [self.parts.local_of(p, s) for p, s in zip(self.params, self.shadow)]

    def _live(self) -> list[torch.Tensor]:
        """This rank's part of each parameter's weights (what the average follows; fp32 master weights where a
        strategy keeps them)."""
        if self.parts is not None:
            return [self.parts.local(p) for p in self.params]
        return self._local(p.detach() for p in self.params)

    def _whole(self) -> list[torch.Tensor]:
        """Each average as a tensor of its parameter's global shape (a collective under ZeRO-3)."""
        if self.parts is None:
            return list(self.shadow)
        return [self.parts.full(p, s) for p, s in zip(self.params, self.shadow)]

    @staticmethod
    def _local(tensors) -> list[torch.Tensor]:
        """This rank's part of each tensor (a DTensor's shard; a plain tensor itself), for foreach kernels."""
        from torch.distributed.tensor import DTensor

        return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]

    def decay_at(self, t: int) -> float:
        return min(self.decay, (1 + t) / (10 + t)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Called after each real optimizer step; `step` is the number of optimizer steps done."""
        if step % self.update_every:
            return
        d = self.decay_at(self.num_updates)
        params = [p.float() for p in self._live()]  # no copy when already fp32
        torch._foreach_lerp_(self._local(self.shadow), params, 1.0 - d)
        self.num_updates += 1

    @torch.no_grad()
    def reset(self) -> None:
        """Start over from the model's current weights (a resume from a checkpoint saved without EMA)."""
        for t, p in zip(self._local(self.shadow), self._live()):
            t.copy_(p)
        self.num_updates = 0

    def state_dict(self) -> dict:
        return {"num_updates": self.num_updates, "shadow": dict(zip(self.names, self._whole()))}

    def load_state_dict(self, state: dict) -> None:
        self.num_updates = state["num_updates"]
        for t, p, name in zip(self.shadow, self.params, self.names):
            t.copy_(state["shadow"][name] if self.parts is None else self.parts.local_of(p, state["shadow"][name]))

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's full state_dict with EMA weights in place of the parameters (for export)."""
        out = dict(self.model.state_dict())
        whole = self._whole()
        by_name = dict(zip(self.names, whole))
        for name, p in self.model.named_parameters(remove_duplicate=False):
            key = name
            src = by_name.get(key)
            if src is None:  # the second name of a tied weight, or a frozen weight (its own average)
                src = next((s for n, q, s in zip(self.names, self.params, whole) if q is p), None)
            if src is None:  # frozen (LoRA's base): under ZeRO-3 a partition, gathered whole (every rank calls this)
                src = self.parts.whole_frozen(p) if self.parts is not None else p.detach()
            out[key] = src.to(p.dtype)
        return out

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Temporarily put the EMA weights into the model (for eval), then restore the raw ones."""
        if self.parts is not None:  # ZeRO-3: the strategy sets the module's copies (whole or partitioned)
            with self.parts.swapped(self.params, self.shadow):
                yield
            return
        params = self._local(p.detach() for p in self.params)
        backup = [p.clone() for p in params]
        _drop_gathered(self.model)
        with torch.no_grad():
            for p, s in zip(params, self._local(self.shadow)):
                p.copy_(s)
        try:
            yield
        finally:
            _drop_gathered(self.model)
            with torch.no_grad():
                for p, b in zip(params, backup):
                    p.copy_(b)


def _drop_gathered(model: nn.Module) -> None:
    """Free the whole parameters FSDP2 gathered, so that the next forward gathers the shards written since. With
    world.reshard_after_forward=false (ZeRO-2) a forward without a backward (an eval's) keeps them, and the EMA's
    eval then ran on the raw weights gathered by the eval before it (val_ema/* equal to val/*)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
