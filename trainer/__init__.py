"""trainer: a declarative PyTorch training framework driven by Hydra configs.

Public API (imported lazily so `python -m trainer --help` does not pay for torch):
    compose(overrides)        the checked, resolved config of `python -m trainer OVERRIDES`
    build(cfg, run_dir)       the Trainer a run of `cfg` starts from (model, data, optimizer, ... built)
    build_data(cfg.data)      the (train, val) datasets a config's `data` section builds
    train(cfg, run_dir)       build, resume, fit and export
    load(run_dir, ema=False)  a finished run's model with its weights; with device_map=, max_memory=,
                              offload_dir= placed over the GPUs, the CPU and disk (trainer/inference/device_map.py);
                              with checkpoint="latest"|"best"|PATH (or a checkpoint's path) a checkpoint's weights
    Trainer                   the loop, for use without Hydra
    Runtime                   the framework under a loop of your own (setup, accumulate, backward, step,
                              save_state, ...; trainer/loop/runtime.py): what the Trainer itself runs on
    main_process_first()      run a block on the main process first (caches), then the rest
    is_main_process(), barrier(), broadcast_from_main(obj)
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "compose": "trainer.config.compose",
    "build": "trainer.entry.run",
    "build_data": "trainer.config.instantiate",
    "train": "trainer.entry.run",
    "load": "trainer.inference.finished",
    "Trainer": "trainer.loop.trainer",
    "Runtime": "trainer.loop.runtime",
    "Backend": "trainer.parallel.backend",
    "main_process_first": "trainer.parallel.backend",
    "is_main_process": "trainer.parallel.backend",
    "barrier": "trainer.parallel.backend",
    "broadcast_from_main": "trainer.parallel.backend",
    "UserError": "trainer.errors",
}

__all__ = list(_EXPORTS)


_RENAMED = {"compose": "load"}  # public name -> name in its module


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), _RENAMED.get(name, name))
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")
