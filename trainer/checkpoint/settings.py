"""The settings a run saved (its config.yaml, and each checkpoint's copy), read as untrusted files and compared:
which settings a resume may change, which make another run, and which changed since a checkpoint.

`resume=auto` continues the run whose config equals this job's but for `RESUMABLE` (trainer/entry/rundir.py);
a resume says which settings changed and refuses those it may not change (trainer/checkpoint/manager.py)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from trainer.redaction import redact

# Settings a resume may change (they apply from the checkpoint on): a run that differs from this job's only in
# these is still the run `resume=auto` continues. Prefixes of flattened keys; `_target_`s never match.
RESUMABLE = ("trainer.max_steps", "trainer.max_epochs", "trainer.eval_every", "trainer.eval_every_epochs",
             "trainer.log_every", "trainer.progress", "optim.", "scheduler.", "checkpoint.", "logger.",
             "precision.reason", "world.hang_timeout", "world.auto.")  # (world=deepspeed's copies of other settings)


def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as {dotted.key: leaf value}."""
    if isinstance(tree, dict) and tree:
        out = {}
        for k, v in tree.items():
            out.update(flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def resumable(key: str) -> bool:
    return key.startswith(RESUMABLE) and not key.endswith("_target_")


# What resume=auto's search for a run (no run dir named) needs equal besides: a job of another learning rate or
# schedule is another experiment there. (Two jobs of one command but for optim.lr, the first killed: the second
# continued the first's run at its own rate, and the first, requeued, began again from step 0.) A run named by
# hydra.run.dir or resume=PATH takes them changed, and says so.
FOUND_ALIKE = ("optim.", "scheduler.")


def comparable(config: dict[str, Any], found: bool = False) -> dict[str, Any]:
    """What must be equal for two configs to be one run: all but resume, Hydra's settings and `RESUMABLE`; `found`:
    for a run resume=auto finds by itself, the `FOUND_ALIKE` settings too."""
    return {k: v for k, v in flat(with_added({k: v for k, v in config.items() if k not in ("resume", "hydra")})).items()
            if not resumable(k) or (found and k.startswith(FOUND_ALIKE))}


def read_config(path: Path) -> Any:
    """A config.yaml a run wrote, or None when it cannot be read. Read as the checkpoint reader reads one: a
    regular file of bounded size, YAML without anchors or aliases (a run dir may come from elsewhere)."""
    from trainer.checkpoint.store import CONFIG_MAX_BYTES, check_config_yaml
    from trainer.checkpoint.tensorfile import map_file
    from trainer.errors import CheckpointError

    try:
        data = bytes(map_file(path, follow_links=False, max_size=CONFIG_MAX_BYTES))
        check_config_yaml(data, path)
        return upgrade(yaml.safe_load(data))  # a run dir from before trainer's modules moved
    except (OSError, ValueError, CheckpointError, yaml.YAMLError):
        return None


def changed_settings(path: Path, cfg: DictConfig) -> list[tuple[str, Any, Any]]:
    """(key, the checkpoint's value, this run's) for every setting that differs, but for `resume`, loggers,
    precision=auto's reason (its probe's timing text differs at every start) and world=deepspeed's `world.auto`
    (copies of other settings, which are compared themselves)."""
    before = read_config(path / "config.yaml")
    if not isinstance(before, dict):
        return []
    before, now = flat(with_added(before)), flat(with_added(redact(OmegaConf.to_container(cfg, resolve=True))))
    return [(k, before.get(k), now.get(k)) for k in sorted(set(before) | set(now))
            if k != "resume" and not k.startswith(("logger.", "world.auto.")) and k != "precision.reason"
            and before.get(k) != now.get(k)]


# -- run dirs written before a setting was added ------------------------------------------------------------------
# A config without one of these compares as holding the value that does what the run did then (comparable,
# changed_settings: both sides), so resume=auto still finds that run and a resume names no change. A new setting
# of trainer/checkpoint/ema goes here, with that value (tests/test_units.py checks it is the schema's default).
ADDED = {"trainer": {"compile_mode": None, "compile_options": {}}}


def with_added(tree: Any) -> Any:
    """`tree` (a config as plain containers) with every setting of ADDED it lacks; `tree` itself is left as it is."""
    if not isinstance(tree, dict):
        return tree
    out = dict(tree)
    for section, keys in ADDED.items():
        if isinstance(tree.get(section), dict):
            out[section] = {**copy.deepcopy(keys), **tree[section]}
    return out


# -- run dirs written before trainer's flat modules became packages (trainer/parallel, trainer/loop, ...) ----
# What reads a saved config upgrades its dotted paths, so such a run dir still loads, resumes, compares its
# settings and is found by resume=auto. A config of your own naming an old path gets the new one in its error
# (trainer/config/targets.py's locate).
MOVED = {  # old module prefix -> new
    "trainer.precision.": "trainer.parallel.precision.",
    "trainer.strategies.": "trainer.parallel.",
    "trainer.schedule.": "trainer.loop.schedule.",
    "trainer.optim.": "trainer.loop.optim.",
    "trainer.callbacks.": "trainer.loop.callbacks.",
    "trainer.hf.": "trainer.models.hf.",
    "trainer.wandb_logger.": "trainer.tracking.wandb_logger.",
    "trainer.tensorboard_logger.": "trainer.tracking.tensorboard_logger.",
}


def new_path(target: Any) -> str | None:
    """The path an old dotted path moved to, or None."""
    if isinstance(target, str):
        for old, new in MOVED.items():
            if target.startswith(old) and "." not in target[len(old):]:
                return new + target[len(old):]
    return None


def upgrade(tree: Any) -> Any:
    """`tree` (a saved config as plain containers) with every moved dotted path replaced, in place."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for k, v in list(items):
        if isinstance(v, (dict, list)):
            upgrade(v)
        elif (moved := new_path(v)) is not None:
            tree[k] = moved
    return tree
