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
    check_choices(cfg, overrides, config_dir)
    return prepare(cfg, targets)


def check_choices(cfg: DictConfig, overrides: list[str], config_dir: str | None) -> None:
    """Refuse a group option chosen on the command line (`precision=bf16`) that the composed config does not
    hold. Hydra merges a config's inline node (a recipe's `precision: {_target_: ...}`) over the option chosen
    for that group, so the choice would be ignored without a word (or, for `precision=fp16`, mixed with the
    inline class into a node neither meant). A config selects an option in its defaults list instead
    (`override /precision: fp32`), which the command line overrides. Compares `_target_`s only: a recipe may
    change an option's other values on purpose (`optim: {lr: ...}` over `optim=sgd`)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    dotted = {o.key_or_group for o in parsed if "." in o.key_or_group}
    chosen = [(o.key_or_group, o.value()) for o in parsed
              if not ("." in o.key_or_group or "/" in o.key_or_group or o.is_delete() or o.is_sweep_override())
              and isinstance(o.value(), str)]
    if not chosen:
        return
    search = [f"hydra.searchpath=[file://{Path(config_dir).resolve()}]"] if config_dir else []
    recipe = OmegaConf.select(cfg, "hydra.runtime.choices.recipe", default=None) or \
        next((value for key, value in chosen if key == "recipe"), None)

    def alone(group: str, option: str) -> list[tuple[str, str]]:
        try:
            return _targets_under(hydra_compose(f"{group}/{option}", overrides=search), group)
        except Exception:  # noqa: BLE001 - not a group (resume=auto), or an option with a defaults list of its own
            return []

    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        for group, option in chosen:
            for path, want in alone(group, option):
                got = OmegaConf.select(cfg, f"{path}._target_", default=None)
                if got == want or any(f"{path}._target_" == k or f"{path}._target_".startswith(k + ".") for k in dotted):
                    continue  # as chosen, or a _target_ set on purpose on the command line
                from hydra.core.global_hydra import GlobalHydra

                # The option the inline node amounts to, to name in the fix.
                same = [o for o in GlobalHydra.instance().config_loader().get_group_options(group)
                        if (path, got) in alone(group, o)]
                setter = f" (recipe={recipe}?)" if recipe else ""
                raise ConfigError(
                    f"{group}={option} would be ignored: a config merged after it{setter} sets `{group}:` inline, so "
                    f"{path}._target_ stays {got!r} instead of {option}'s {want!r}. In that config, select the option "
                    f"in its defaults list instead: `defaults: [override /{group}: {same[0] if same else 'NAME'}]` "
                    "(after the `# @package _global_` line, as conf/recipe/diffusion.yaml does); then "
                    f"{group}=... on the command line wins. Or set the class itself: {path}._target_=CLASS."
                )


def _targets_under(cfg: DictConfig, group: str) -> list[tuple[str, str]]:
    """(path, _target_) of each node with a `_target_` under `group` (a group option composed alone puts its
    content at its package: `precision`, `logger.wandb`); nodes elsewhere (a `_global_` option's) are not
    the group's own."""
    found = []
    node = OmegaConf.select(cfg, group, default=None)

    def walk(n, path):
        if isinstance(n, DictConfig):
            if isinstance(n.get("_target_"), str):
                found.append((path, n._target_))
            for k in n.keys():
                walk(n[k], f"{path}.{k}")

    walk(node, group)
    return found


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
