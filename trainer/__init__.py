"""trainer: a declarative PyTorch training framework driven by Hydra configs.

Public API (imported lazily so `python -m trainer --help` does not pay for torch):
    train(cfg, run_dir)       build everything from a resolved config and train
    Trainer                   the loop, for use without Hydra
    main_process_first()      run a block on the main process first (caches), then the rest
    is_main_process(), barrier()
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "train": "trainer.run",
    "Trainer": "trainer.trainer",
    "Backend": "trainer.backend",
    "main_process_first": "trainer.backend",
    "is_main_process": "trainer.backend",
    "barrier": "trainer.backend",
    "UserError": "trainer.errors",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")
