"""Parallelism strategies, one class per `conf/world/*.yaml` (`world._target_`), and the job's layout.

Imported lazily (as `trainer` itself is): config validation reads `layout.check_degree` without torch.
"""

from importlib import import_module

_EXPORTS = {"DDP": ".ddp", "DeepSpeed": ".deepspeed", "FSDP": ".fsdp", "SingleDevice": ".base", "Strategy": ".base",
            "seed_everything": ".base", "unwrap": ".base", "Layout": ".layout"}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module 'trainer.strategies' has no attribute {name!r}")
