"""Numerical precision: one small class per mode, selected by `precision=fp32|bf16|fp16`.

Each exposes the same narrow interface the training step uses, in this order:
`autocast()` around forward + loss, `backward(loss)`, `unscale_(opt)` before clipping,
`step(opt) -> bool` (False when the step was skipped), and `state_dict()` for checkpoints; plus what
other components need to know: `dtype` (the compute dtype: FSDP's mixed-precision policy, the MFU
probe) and `scaler` (fp16's loss scaler, None otherwise).
"""

from __future__ import annotations

import contextlib

import torch

from .errors import ConfigError


class FP32:
    """Full precision: every method is the plain PyTorch call."""

    name = "fp32"
    dtype = torch.float32
    scaler: torch.amp.GradScaler | None = None

    def __init__(self, device_type: str = "cpu"):
        self.device_type = device_type

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        optimizer.step()
        return True

    def distribute(self) -> None:
        """Gradients will be sharded over ranks (FSDP, tensor parallel): see FP16."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class BF16(FP32):
    """bfloat16 autocast. Same exponent range as fp32, so no loss scaling is needed."""

    name = "bf16"
    dtype = torch.bfloat16

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device_type, dtype=self.dtype)


class FP16(FP32):
    """float16 autocast with dynamic loss scaling (`torch.amp.GradScaler`).

    A step whose gradients overflowed is skipped by the scaler; `step()` then returns False so the
    trainer neither advances the LR schedule nor updates the EMA, and counts the skip.
    """

    name = "fp16"
    dtype = torch.float16

    def __init__(self, device_type: str = "cpu", init_scale: float = 2.0**16, growth_interval: int = 2000):
        super().__init__(device_type)
        if device_type not in ("cuda", "cpu"):
            raise ConfigError(
                f"precision=fp16 is not supported on device type '{device_type}'. "
                "Use precision=bf16 or precision=fp32."
            )
        self.init_scale, self.growth_interval = init_scale, growth_interval
        self.scaler = torch.amp.GradScaler(device_type, init_scale=init_scale, growth_interval=growth_interval)

    def distribute(self) -> None:
        """With sharded gradients an overflow shows in one rank's shard only: the overflow flag is reduced
        over ranks, so every rank skips the same steps."""
        self.scaler = _ShardedGradScaler(self.device_type, init_scale=self.init_scale,
                                         growth_interval=self.growth_interval)

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        # The scaler only lowers its scale after a step it skipped; GradScaler.step already syncs
        # with the host to decide, so reading the scale here costs nothing extra.
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        return self.scaler.get_scale() >= before

    def state_dict(self) -> dict:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.scaler.load_state_dict(state)


class _ShardedGradScaler(torch.amp.GradScaler):
    """GradScaler whose overflow flag is the max over ranks. (torch's FSDP ShardedGradScaler does the same
    but keeps the flag as a 1-element tensor, which fused optimizers refuse next to their scalar steps.)"""

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        import torch.distributed as dist

        super().unscale_(optimizer)
        for found_inf in self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
