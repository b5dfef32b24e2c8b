"""Using a finished run: its model with weights (`trainer.load`), its task (for sampling), its config with
new overrides (for `python -m trainer eval`), and the checkpoint an eval reads.

Everything here reads what a run wrote: `model_config.json` and the exported weights
(`model.safetensors`, `model_ema.safetensors`, or their sharded index), `task_state.safetensors`,
`config.yaml` and `checkpoints/`. The `_target_`s in them go through the same trust model as a config's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import yaml
from omegaconf import DictConfig, OmegaConf, open_dict

from .errors import CheckpointError, ConfigError


def _run_dir(run_dir: str | Path) -> Path:
    path = Path(run_dir).expanduser()
    if not (path / "config.yaml").is_file():
        raise ConfigError(f"{path} is not a run dir (it has no config.yaml). Pass the directory a run wrote, e.g. "
                          "outputs/2026-01-01/12-00-00.")
    return path


def _instantiate_checked(node: dict, where: str) -> Any:
    from hydra.utils import instantiate

    from .config import iter_targets, locate

    cfg = OmegaConf.create(node)
    for key, target in iter_targets(cfg, where):
        locate(key, target)  # the trust model: a run dir may come from elsewhere too
    return instantiate(cfg)


def exported_weights(run_dir: Path, name: str = "model") -> dict[str, torch.Tensor]:
    """`<name>.safetensors`, or the shards its Hugging Face index lists."""
    from safetensors.torch import load_file

    single, index = run_dir / f"{name}.safetensors", run_dir / f"{name}.safetensors.index.json"
    if single.is_file():
        return load_file(str(single))
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        out: dict[str, torch.Tensor] = {}
        for shard in shards:
            if "/" in shard or shard.startswith("."):
                raise CheckpointError(f"{index} names {shard!r}, outside the run dir.")
            out.update(load_file(str(run_dir / shard)))
        return out
    raise CheckpointError(f"{run_dir} has no {name}.safetensors: the run did not finish its export. Resume it with "
                          f"resume=auto (a finished run writes a missing export), or evaluate a checkpoint.")


def load(run_dir: str | Path, ema: bool = False, device: str | torch.device = "cpu") -> nn.Module:
    """The model of a finished run, built from its `model_config.json`, with its final weights (the EMA's with
    `ema=True`), in eval mode. `model = trainer.load("outputs/2026-01-01/12-00-00")`."""
    path = _run_dir(run_dir)
    try:
        model_config = json.loads((path / "model_config.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path / 'model_config.json'} cannot be read ({e}): the run did not finish its "
                              "export. Resume it with resume=auto.") from None
    model = _instantiate_checked(model_config, "model")
    if ema and not ((path / "model_ema.safetensors").is_file() or (path / "model_ema.safetensors.index.json").is_file()):
        raise ConfigError(f"{path} has no EMA weights (it was trained without ema.enabled); load it with ema=False.")
    model.load_state_dict(exported_weights(path, "model_ema" if ema else "model"))
    return model.to(device).eval()


def load_task(run_dir: str | Path, overrides: dict[str, Any] | None = None) -> Any:
    """The run's task, built from its config.yaml with `overrides` of its keys (`{"sample_tokens": 200}`), with
    its exported state (a data normaliser) if it has one."""
    from safetensors.torch import load_file

    path = _run_dir(run_dir)
    task_node = (yaml.safe_load((path / "config.yaml").read_text()) or {}).get("task")
    if not isinstance(task_node, dict) or "_target_" not in task_node:
        raise ConfigError(f"{path / 'config.yaml'} has no task with a _target_.")
    if overrides:
        from .config import check_keywords, locate

        check_keywords("task", locate("task._target_", task_node["_target_"]), overrides)  # a typo is named
        task_node.update(overrides)
    task = _instantiate_checked(task_node, "task")
    if (path / "task_state.safetensors").is_file() and hasattr(task, "load_state_dict"):
        task.load_state_dict(load_file(str(path / "task_state.safetensors")))
    return task


# -- python -m trainer eval RUN_DIR ------------------------------------------------------------------------
def config_of(run_dir: str | Path, overrides: list[str]) -> DictConfig:
    """The run's config.yaml with `overrides` applied: `key=value`, or `group=option` for a group whose options
    live in the package's conf/ (world=ddp, precision=bf16, ...). Loggers are off (an eval logs nothing)."""
    from dataclasses import asdict
    from importlib.resources import files

    from omegaconf.errors import OmegaConfBaseException

    from .config import LaunchConfig
    from .errors import suggest

    path = _run_dir(run_dir)
    cfg = OmegaConf.load(path / "config.yaml")
    OmegaConf.set_struct(cfg, True)  # a key that is not there is a typo, not a new key
    conf = files("trainer.conf")
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep:
            raise ConfigError(f"{override!r} is not an override: write KEY=VALUE (e.g. world=ddp, trainer.eval_samples=null).")
        option = conf / key / f"{value}.yaml"
        if "." not in key and option.is_file():
            node = OmegaConf.create(yaml.safe_load(option.read_text()) or {})
            if "defaults" in node:
                raise ConfigError(f"{key}={value} selects a config with its own defaults; set its keys one by one.")
            with open_dict(cfg):  # (world's launch keys default as in a fresh config)
                cfg[key] = OmegaConf.merge(asdict(LaunchConfig()), node) if key == "world" else node
            continue
        try:
            OmegaConf.update(cfg, key, yaml.safe_load(value) if value else None)
        except OmegaConfBaseException:
            parent, _, leaf = key.rpartition(".")
            node = OmegaConf.select(cfg, parent) if parent else cfg
            names = [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []
            raise ConfigError(f"unknown config key '{key}' in {path / 'config.yaml'}.{suggest(leaf, names)}") from None
    with open_dict(cfg):
        cfg.logger = {}
    return cfg


def checkpoint_of(run_dir: str | Path, which: str = "latest") -> Path:
    """`latest` (the most recently written complete checkpoint: the final one for a finished run), `best`
    (what checkpoints/best.json names), or a checkpoint's path."""
    from .checkpoint import Checkpointer

    path = _run_dir(run_dir)
    if which == "latest":
        found = Checkpointer(path / "checkpoints").complete()
        if not found:
            raise CheckpointError(f"{path} has no complete checkpoint (checkpoints/step_*/manifest.json) to evaluate.")
        return found[-1]
    if which == "best":
        try:
            return path / "checkpoints" / str(json.loads((path / "checkpoints" / "best.json").read_text())["checkpoint"])
        except (OSError, ValueError, KeyError):
            raise ConfigError(f"{path} has no checkpoints/best.json: it was trained without checkpoint.best_metric. "
                              "Use checkpoint=latest or a checkpoint's path.") from None
    return Path(which).expanduser()
