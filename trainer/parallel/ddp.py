"""`world=ddp`: data parallel with torch's DistributedDataParallel. Every rank holds the whole model
and optimizer; gradients are all-reduced (averaged) in buckets during the last micro-step's backward.

With `world.tp=N` the layout (layout.py) first splits the model by its tensor-parallel plan over N ranks
(a 2-D mesh, dp x tp). DistributedDataParallel cannot hold DTensor parameters, so then the gradients of
each rank's shard are averaged over its data-parallel peers after the last micro-step, in one flat buffer.
With `world.pp=N` each rank holds pipeline stages (pipeline.py), whose forward and backward the schedule runs
outside DistributedDataParallel's hooks: their gradients are averaged the same way.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from trainer.parallel.layout import check_degree, check_pipeline
from trainer.parallel.strategy import Strategy


class DDP(Strategy):
    """Options are DistributedDataParallel's own (`world.bucket_cap_mb=50`), `tp`, and the pipeline's `pp`,
    `pp_schedule` and `microbatches`."""

    distributed = True

    def __init__(self, bucket_cap_mb: float | None = 25, gradient_as_bucket_view: bool = True,
                 find_unused_parameters: bool = False, static_graph: bool = False, tp: int = 1, pp: int = 1,
                 pp_schedule: str = "1F1B", microbatches: int | None = None):
        self.ddp_kwargs = {"bucket_cap_mb": bucket_cap_mb, "gradient_as_bucket_view": gradient_as_bucket_view,
                           "find_unused_parameters": find_unused_parameters, "static_graph": static_graph}
        self.tp = check_degree(tp)
        self.pp, self.pp_schedule, self.microbatches = check_pipeline(pp, pp_schedule, microbatches, tp=self.tp)

    def expect_unused_parameters(self) -> None:
        """DDP must then look for them after each forward (otherwise it waits for their gradients forever)."""
        self.ddp_kwargs["find_unused_parameters"] = True

    def wrap(self, model: nn.Module) -> nn.Module:
        """Move to the device and wrap in DDP, which broadcasts rank 0's initial weights. DistributedDataParallel
        cannot hold DTensor parameters: with tensor parallelism `reduce_gradients` averages them instead."""
        model = model.to(self.backend.device)
        if not self.backend.distributed or self.shards_parameters or self.pipeline is not None:
            return model
        if not any(p.requires_grad for p in model.parameters()):
            # A frozen model (a teacher, a feature extractor) has no gradient to average, and DistributedDataParallel
            # refuses one with a traceback; Accelerate's prepare leaves it unwrapped too. Rank 0's weights still go
            # to every rank, as DDP's would.
            self.backend.broadcast_tensors_([*model.parameters(), *model.buffers()])
            return model
        device = self.backend.device
        return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                                   **self.ddp_kwargs)

    def no_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        if enabled and isinstance(model, nn.parallel.DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()

    @property
    def reduces_gradients(self) -> bool:
        """Pipeline stages (tied weights' copies; and no DDP wrapper, so data-parallel peers too) and tensor-parallel
        shards with data-parallel peers (DDP cannot hold DTensors) have gradients to sum here."""
        return self.pipeline is not None or (self.shards_parameters and self.dp_size > 1)

    def reduce_gradients(self, params: list[torch.Tensor]) -> None:
        """The average of each tensor-parallel shard's gradient over its data-parallel peers, in one flat buffer
        (what DistributedDataParallel does for plain parameters, in its buckets)."""
        if not self.reduces_gradients:  # DistributedDataParallel averaged them in the backward
            return
        if self.pipeline is not None:
            self.pipeline.reduce_tied()  # a tied weight's copies on several stages: the sum of their gradients
        if self.dp_size == 1:
            return
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
        from torch.distributed.tensor import DTensor

        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
        flat = self.backend.all_reduce(_flatten_dense_tensors(grads), group=self.dp_group)
        flat /= self.dp_size
        for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)
