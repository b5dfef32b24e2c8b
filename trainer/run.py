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

from . import checkpoint as ckpt
from .backend import Backend
from .config import LOADER_KEYS, CheckpointConfig, EMAConfig, TrainerConfig
from .ema import EMA
from .errors import CheckpointError, ConfigError, DataError
from .loggers import JsonlLogger, LoggerGroup, NullLogger
from .metrics import Cost
from .nonfinite import NonFiniteGuard

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # all devices


def build(section: str, node: Any, *args, **kwargs) -> Any:
    """`hydra.utils.instantiate` with the config section named in the error instead of a traceback."""
    from hydra.errors import InstantiationException

    try:
        return instantiate(node, *args, **kwargs)
    except InstantiationException as e:
        cause = e.__cause__ or e
        detail = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        if isinstance(cause, DataError | ConfigError | CheckpointError):
            raise cause from None
        raise ConfigError(f"could not build '{section}' ({node.get('_target_', '?')}): {detail}. "
                          f"Check the keys under {section} (python -m trainer --cfg job).") from None


def typed(schema, node: DictConfig):
    """The config section as its dataclass (type-checked again: `train` may be called without Hydra)."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), node or {}))


def build_optimizer(cfg: DictConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """`optim` is a partial (`_partial_: true`); weight decay applies to matrices only (not norms, biases)."""
    factory = build("optim", cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    return factory([g for g in groups if g["params"]])


def build_data(cfg: DictConfig) -> tuple[Any, Any]:
    """`data._target_` builds (train, val) datasets from every key of `data` except the loader keys."""
    kwargs = {k: v for k, v in cfg.items() if k not in LOADER_KEYS}
    splits = build("data", OmegaConf.create(kwargs))
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
    for node in (cfg or {}).values():
        if node is not None:
            loggers.append(build("logger", node, run_dir=str(run_dir)))
    return LoggerGroup(loggers)


def find_resume(resume: str | None, checkpointer: ckpt.Checkpointer, restarted: bool, say) -> Path | None:
    """Which checkpoint to start from. An elastic restart always resumes from the newest one."""
    if resume is None and not restarted:
        return None
    if resume in (None, "auto"):
        path = checkpointer.latest_valid(warn=say)
        if path is None and resume == "auto":
            say(f"resume=auto: no complete checkpoint in {checkpointer.dir}; starting fresh.")
        return path
    path = Path(resume).expanduser()
    if path.is_dir() and not (path / ckpt.MANIFEST).exists():  # a run dir or its checkpoints/ dir
        inner = ckpt.Checkpointer(path / "checkpoints" if (path / "checkpoints").is_dir() else path)
        found = inner.complete()
        if not found:
            raise CheckpointError(f"resume={resume!r}: no complete checkpoint (step_*/manifest.json) under {path}.")
        path = found[-1]
    ckpt.verify(path)  # an explicit path must be intact: no silent fallback
    return path


def write_run_info(run_dir: Path, cfg: DictConfig, seed: int, backend: Backend) -> None:
    """`run_info.json`: what it takes to reproduce the run, beside config.yaml and .hydra/overrides.yaml."""
    import platform
    import subprocess
    import sys
    from importlib import metadata

    from .io import atomic_write_json
    from .redaction import scrub, secret_values

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=5)
            return out.stdout.strip() if out.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired):
            return None

    secrets = secret_values(OmegaConf.to_container(cfg))
    commit = git("rev-parse", "HEAD")
    packages = {}
    for name in ("trainer", "torch", "hydra-core", "omegaconf", "wandb", "safetensors", "tqdm"):
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            packages[name] = None
    info = {
        "command": [scrub(arg, secrets) for arg in sys.argv],
        "git_commit": commit,
        "git_dirty": bool(git("status", "--porcelain")) if commit else None,
        "seed": seed,
        "world_size": backend.world_size,
        "device": str(backend.device),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": packages,
    }
    atomic_write_json(run_dir / "run_info.json", info)


def usable_device(name: str) -> torch.device:
    """The device `world.device` names, or a ConfigError when this machine has none such."""
    from .backend import resolve_device

    device = resolve_device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"world.device={name!r} but no CUDA device is available. "
                          "Use world.device=auto or world.device=cpu.")
    return device


def preflight(cfg: DictConfig, run_dir: Path) -> None:
    """Build what can fail from a config mistake, cheaply, before any worker process starts:
    the model on the meta device (no memory), the task, the precision and the datasets (whose
    cache is then built once, here, for all workers)."""
    device = usable_device(cfg.world.device)
    with torch.device("meta"):
        build("model", cfg.model)
    build("task", cfg.task)
    build("precision", cfg.precision, device_type=device.type)
    build_data(cfg.data)
    for node in (cfg.logger or {}).values():  # trackers' constructors validate and start nothing
        if node is not None:
            build("logger", node, run_dir=str(run_dir))


def train(cfg: DictConfig, run_dir: str | Path) -> dict[str, float]:
    """Train with a resolved config, writing outputs to `run_dir`. Returns the final metrics."""
    run_dir = Path(run_dir)
    w = cfg.world
    usable_device(w.device)
    backend = Backend(device=w.device, threads=w.threads, ddp=OmegaConf.to_container(w.ddp))
    backend.setup()
    say = print if backend.is_main else (lambda *a, **k: None)
    finished = False
    try:
        tcfg: TrainerConfig = typed(TrainerConfig, cfg.trainer)
        ccfg: CheckpointConfig = typed(CheckpointConfig, cfg.get("checkpoint"))
        ecfg: EMAConfig = typed(EMAConfig, cfg.get("ema"))
        # Same seed on every rank: identical initial weights (DDP broadcasts them anyway).
        seed_everything(tcfg.seed)
        model = build("model", cfg.model)
        task = build("task", cfg.task)
        train_data, val_data = build_data(cfg.data)
        precision = build("precision", cfg.precision, device_type=backend.device.type)
        model = backend.wrap(model)
        raw_model = backend.unwrap(model)
        ema = EMA(raw_model, ecfg.decay, ecfg.warmup, ecfg.update_every) if ecfg.enabled else None
        if tcfg.compile:
            model = torch.compile(model, backend=tcfg.compile_backend)
        optimizer = build_optimizer(cfg.optim, model)
        scheduler = build("scheduler", cfg.scheduler)(optimizer, total_steps=tcfg.max_steps)
        guard = NonFiniteGuard.build(tcfg, precision.name, optimizer, backend)
        # Different randomness per rank from here on (dropout), reproducible per (seed, rank).
        seed_everything(tcfg.seed + backend.rank)

        from .redaction import redact
        from .trainer import Trainer

        checkpointer = ckpt.Checkpointer(run_dir / "checkpoints", ccfg.every_n_steps, ccfg.keep_last,
                                         ccfg.best_metric, ccfg.best_mode, ccfg.save_final, ccfg.async_save)
        loggers = build_loggers(cfg.logger, run_dir, backend.is_main)
        trainer = Trainer(
            model=model, task=task, optimizer=optimizer, scheduler=scheduler, precision=precision,
            backend=backend, train_data=train_data, val_data=val_data,
            batch_size=cfg.data.batch_size, shuffle=cfg.data.get("shuffle", True),
            num_workers=cfg.data.get("num_workers", 0), config=tcfg, loggers=loggers, run_dir=run_dir,
            ema=ema, checkpointer=checkpointer, guard=guard,
            config_yaml=OmegaConf.to_yaml(OmegaConf.create(redact(OmegaConf.to_container(cfg)))),
            cost=Cost(raw_model, backend.device, PRECISION_DTYPES.get(precision.name, torch.float32),
                      tcfg.peak_tflops, backend.world_size),
        )
        source = find_resume(cfg.get("resume"), checkpointer, backend.info.restart_count > 0, say)
        if source is not None:
            trainer.load_checkpoint(source)
            if hasattr(loggers, "rewind"):
                loggers.rewind(trainer.step)  # drop events logged after the checkpoint
            say(f"resumed from {source} at step {trainer.step}")
            if trainer.step >= tcfg.max_steps:
                say(f"the run is already finished: step {trainer.step} >= trainer.max_steps={tcfg.max_steps}. "
                    "Raise trainer.max_steps to train further.")
                loggers.finish({})
                finished = True
                return {}
        if backend.is_main:
            loggers.log_config(OmegaConf.to_container(cfg, resolve=True))
            write_run_info(run_dir, cfg, tcfg.seed, backend)
        try:
            final = trainer.fit()
            if backend.is_main:
                model_config = OmegaConf.to_container(cfg.model, resolve=True)
                export_model(raw_model.state_dict(), run_dir, "model", model_config, ccfg.max_shard_mb)
                if ema is not None:
                    export_model(ema.model_state_dict(), run_dir, "model_ema", model_config, ccfg.max_shard_mb)
        except BaseException as e:
            loggers.finish({}, exit_code=getattr(e, "exit_code", 1))  # trackers mark the run failed/preempted
            raise
        loggers.finish(final)
        finished = True
        return final
    finally:
        backend.teardown(wait_for_peers=finished)


def export_model(state: dict[str, torch.Tensor], run_dir: Path, name: str, model_config: dict,
                 max_shard_mb: float) -> None:
    """Weights as `<name>.safetensors` (keys = the model's state_dict), or, above `max_shard_mb`,
    shards `<name>-00001-of-0000N.safetensors` plus `<name>.safetensors.index.json` (Hugging Face layout).
    The model config goes beside them as `model_config.json`."""
    from .io import atomic_save_safetensors, atomic_write_json

    # Clones: tied weights share storage, which safetensors refuses; a copy keeps every key.
    tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}
    limit = int(max_shard_mb * 2**20)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in tensors.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    for old in run_dir.glob(f"{name}-*-of-*.safetensors"):  # from an earlier export of this run
        old.unlink()
    if len(shards) == 1:
        atomic_save_safetensors(run_dir / f"{name}.safetensors", tensors, metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            fname = f"{name}-{i:05d}-of-{len(shards):05d}.safetensors"
            atomic_save_safetensors(run_dir / fname, shard, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, fname))
        total = sum(v.numel() * v.element_size() for v in tensors.values())
        atomic_write_json(run_dir / f"{name}.safetensors.index.json",
                          {"metadata": {"total_size": total}, "weight_map": weight_map})
    atomic_write_json(run_dir / "model_config.json", json.loads(json.dumps(model_config)))
