"""From command-line overrides to a checked, resolved config, without Hydra's run machinery.

`compose` builds the config Hydra would build; `prepare` validates it, resolves every interpolation
and checks its `_target_`s, once. The CLI prepares every job of a command before Hydra writes
anything; `trainer.train(cfg)` prepares what it is given. Composition errors (unknown keys,
unknown group options, wrong types) become one paragraph with the nearest valid names.
"""

from __future__ import annotations

import re
from itertools import product
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from . import config as _config  # registers the typed schema with Hydra's ConfigStore
from .errors import ConfigError, suggest

CONFIG_MODULE = "trainer.conf"


def compose(overrides: list[str], config_dir: str | None = None) -> DictConfig:
    """The job config for `overrides` (no sweeps), as `python -m trainer OVERRIDES` would compose it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    if config_dir:
        overrides = [*overrides, f"hydra.searchpath=[file://{Path(config_dir).resolve()}]"]
    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        return hydra_compose("config", overrides=overrides)


def sweep_jobs(overrides: list[str], limit: int = 256) -> list[list[str]]:
    """The override lists of every job of a multirun sweep (`a=1,2 b=x,y`: four), the first `limit` of them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    choices = []
    for o in OverridesParser.create().parse_overrides(overrides):
        if o.is_sweep_override():
            key = o.get_key_element()
            choices.append([f"{key}={v}" for v in o.sweep_string_iterator()])
        else:
            choices.append([o.input_line])
    jobs = []
    for combo in product(*choices):
        jobs.append(list(combo))
        if len(jobs) >= limit:
            break
    return jobs


def resolve(cfg: DictConfig) -> DictConfig:
    """Resolve every interpolation once (in the parent), so workers see exactly the same values."""
    from omegaconf.errors import MissingMandatoryValue

    try:
        container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as e:
        key = getattr(e, "full_key", "?")
        raise ConfigError(f"{key} is required but not set. Pass it on the command line, e.g. {key}=VALUE.") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"{getattr(e, 'full_key', '')}: {str(e).splitlines()[0]}") from None
    resolved = OmegaConf.create(container)
    OmegaConf.set_struct(resolved, True)
    return resolved


def prepare(cfg: DictConfig, targets: bool = True) -> DictConfig:
    """Validate, resolve and (with `targets`) check every `_target_`: the config a run starts from."""
    resolved = resolve(cfg)
    _config.validate(resolved)
    if targets:
        _config.check_targets(resolved)
    return resolved


def load(overrides: list[str], config_dir: str | None = None, targets: bool = True) -> DictConfig:
    """`compose` + `prepare`, with composition errors explained."""
    try:
        cfg = compose(overrides, config_dir)
    except (Exception, OmegaConfBaseException) as exc:  # hydra raises several unrelated types
        raise explain(exc, overrides, config_dir) from exc
    return prepare(cfg, targets)


def explain(exc: Exception, overrides: list[str], config_dir: str | None) -> ConfigError:
    """Turn a Hydra/OmegaConf composition error into a ConfigError naming the key and the fix."""
    from hydra.errors import MissingConfigException

    msg = str(exc)
    cause = exc.__cause__ or exc
    if isinstance(exc, MissingConfigException) or "Could not find" in msg:
        m = re.search(r"Could not (?:find|load) '([^']+)/([^']+)'", msg)
        if m:
            group, option = m.groups()
            options = list(exc.options or []) if isinstance(exc, MissingConfigException) else []
            if not options:
                options = re.findall(r"^\t(\S+)$", msg, flags=re.M)
            return ConfigError(
                f"{group}={option} is not an option of config group '{group}'. "
                f"Available: {', '.join(options) or '(none)'}.{suggest(option, options)}"
            )
    full_key = getattr(cause, "full_key", None)
    m = re.search(r"Could not override '([^']+)'", msg)
    if m and ("To append" in msg or "not in" in str(cause)):
        key = m.group(1)
        parent, _, leaf = key.rpartition(".")
        others = [o for o in overrides if o.split("=")[0].lstrip("+~") != key]
        valid = _keys_at(parent, others, config_dir)
        where = f"under '{parent}'" if parent else "at the top level"
        return ConfigError(
            f"unknown config key '{key}'.{suggest(leaf, valid)} Valid keys {where}: {', '.join(sorted(valid))}. "
            f"To add a new key on purpose, write +{key}=VALUE."
        )
    if full_key and cause is not exc:
        first = str(cause).splitlines()[0]
        return ConfigError(f"{full_key}: {first}. See the expected types with: python -m trainer --cfg job")
    lines = [line.strip() for line in msg.strip().splitlines() if line.strip()] or [type(exc).__name__]
    first = lines[0]
    # Keep what Hydra says under its summary line ("... while composing config:" / "Key 'recipe' not in
    # 'Config'"): it is the cause.
    detail = str(cause).strip().splitlines()[0] if cause is not exc and str(cause).strip() else ""
    if not detail and first.endswith(":") and len(lines) > 1:
        detail = lines[1]
    if detail and detail not in first:
        first = f"{first.rstrip(':')}: {detail}"
    hint = "see python -m trainer --help for the config groups and their options"
    m = re.match(r"In '([^'/]+)/([^']+)'", first)
    if m and re.search(r"Key '[^']+' not in '", first):
        # A group option that sets keys outside its group (a recipe) is read into the group's node unless its
        # first line is the package header.
        hint = (f"if {m.group(1)}/{m.group(2)}.yaml sets top-level keys, its first line must be "
                "'# @package _global_': Hydra reads that header on the first line only")
    return ConfigError(f"{first} ({hint})")


def _keys_at(path: str, overrides: list[str], config_dir: str | None) -> list[str]:
    try:
        cfg = compose(overrides, config_dir)
        node = OmegaConf.select(cfg, path) if path else cfg
        return [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []
    except Exception:
        return []
