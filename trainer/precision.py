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
        self.scaler = torch.amp.GradScaler(device_type, init_scale=init_scale, growth_interval=growth_interval)

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
