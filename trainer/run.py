"""Build every component from a resolved config and train: the one place config becomes objects.

`train(cfg, run_dir)` takes a plain (already composed and resolved) config, so tests, workers and
the CLI all call the same function; Hydra never reaches below this module.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from .backend import Backend
from .config import LOADER_KEYS, TrainerConfig
from .errors import ConfigError, DataError
from .loggers import JsonlLogger, LoggerGroup, NullLogger


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # all devices


def build_optimizer(cfg: DictConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """`optim` is a partial (`_partial_: true`); weight decay applies to matrices only (not norms, biases)."""
    factory = instantiate(cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    return factory([g for g in groups if g["params"]])


def build_data(cfg: DictConfig) -> tuple[Any, Any]:
    """`data._target_` builds (train, val) datasets from every key of `data` except the loader keys."""
    kwargs = {k: v for k, v in cfg.items() if k not in LOADER_KEYS}
    splits = instantiate(kwargs)
    if not (isinstance(splits, tuple) and len(splits) == 2):
        raise DataError(f"data._target_={cfg._target_!r} must return a (train, val) pair of datasets; "
                        f"val may be None. It returned {type(splits).__name__}.")
    train, val = splits
    if len(train) == 0:
        raise DataError(f"the training split built by data._target_={cfg._target_!r} is empty.")
    return train, val


def build_loggers(cfg: DictConfig, run_dir: Path, is_main: bool) -> NullLogger:
    if not is_main:
        return NullLogger()
    loggers = [JsonlLogger(run_dir)]
    for name, node in (cfg or {}).items():
        if node is not None:
            loggers.append(instantiate(node, run_dir=str(run_dir)))
    return LoggerGroup(loggers)


def train(cfg: DictConfig, run_dir: str | Path) -> dict[str, float]:
    """Train with a resolved config, writing outputs to `run_dir`. Returns the final metrics."""
    run_dir = Path(run_dir)
    w = cfg.world
    backend = Backend(device=w.device, threads=w.threads, ddp=OmegaConf.to_container(w.ddp))
    if backend.device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"world.device={w.device!r} but no CUDA device is available. Use world.device=auto or cpu.")
    backend.setup()
    try:
        tcfg: TrainerConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainerConfig), cfg.trainer))
        # Same seed on every rank: identical initial weights (DDP broadcasts them anyway).
        seed_everything(tcfg.seed)
        model = instantiate(cfg.model)
        task = instantiate(cfg.task)
        train_data, val_data = build_data(cfg.data)
        precision = instantiate(cfg.precision, device_type=backend.device.type)
        model = backend.wrap(model)
        if tcfg.compile:
            model = torch.compile(model)
        optimizer = build_optimizer(cfg.optim, model)
        scheduler = instantiate(cfg.scheduler)(optimizer, total_steps=tcfg.max_steps)
        # Different randomness per rank from here on (dropout), reproducible per (seed, rank).
        seed_everything(tcfg.seed + backend.rank)

        loggers = build_loggers(cfg.logger, run_dir, backend.is_main)
        from .trainer import Trainer

        trainer = Trainer(
            model=model, task=task, optimizer=optimizer, scheduler=scheduler, precision=precision,
            backend=backend, train_data=train_data, val_data=val_data,
            batch_size=cfg.data.batch_size, shuffle=cfg.data.get("shuffle", True),
            num_workers=cfg.data.get("num_workers", 0), config=tcfg, loggers=loggers, run_dir=run_dir,
        )
        if backend.is_main:
            loggers.log_config(OmegaConf.to_container(cfg, resolve=True))
        final = trainer.fit()
        if backend.is_main:
            save_model(backend.unwrap(model), run_dir, OmegaConf.to_container(cfg.model, resolve=True))
        loggers.finish(final)
        return final
    finally:
        backend.teardown()


def save_model(model: torch.nn.Module, run_dir: Path, model_config: dict) -> None:
    """Final weights as `model.safetensors` (keys = the model's state_dict) and `model_config.json`."""
    from .io import atomic_save_safetensors, atomic_write_json

    # Clones: tied weights share storage, which safetensors refuses; a copy keeps every key.
    tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}
    atomic_save_safetensors(run_dir / "model.safetensors", tensors, metadata={"format": "pt"})
    atomic_write_json(run_dir / "model_config.json", json.loads(json.dumps(model_config)))
