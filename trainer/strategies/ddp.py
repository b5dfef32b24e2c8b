"""`world=ddp`: data parallel with torch's DistributedDataParallel. Every rank holds the whole model
and optimizer; gradients are all-reduced (averaged) in buckets during the last micro-step's backward."""

from __future__ import annotations

import contextlib

import torch.nn as nn

from .base import Strategy


class DDP(Strategy):
    """Options are DistributedDataParallel's own (`world.bucket_cap_mb=50`)."""

    distributed = True

    def __init__(self, bucket_cap_mb: float = 25, gradient_as_bucket_view: bool = True,
                 find_unused_parameters: bool = False, static_graph: bool = False):
        self.ddp_kwargs = {"bucket_cap_mb": bucket_cap_mb, "gradient_as_bucket_view": gradient_as_bucket_view,
                           "find_unused_parameters": find_unused_parameters, "static_graph": static_graph}

    def wrap(self, model: nn.Module) -> nn.Module:
        """Move to the device and wrap in DDP, which broadcasts rank 0's initial weights."""
        model = model.to(self.backend.device)
        if not self.backend.distributed:
            return model
        device = self.backend.device
        return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                                   **self.ddp_kwargs)

    def no_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        if enabled and isinstance(model, nn.parallel.DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()
