"""Parallelism: where this process sits (backend), the layout of the job's degrees and its mesh, the strategies
(one class per `conf/world/*.yaml`, `world._target_`), tensor and pipeline parallelism, and precision.

Imported lazily (as `trainer` itself is): config validation reads `layout.check_degree` without torch.
"""

from importlib import import_module

_EXPORTS = {"DDP": ".ddp", "DeepSpeed": ".deepspeed", "FSDP": ".fsdp", "SingleDevice": ".strategy", "Strategy": ".strategy",
            "seed_everything": ".strategy", "unwrap": ".strategy", "Layout": ".layout"}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module 'trainer.parallel' has no attribute {name!r}")
