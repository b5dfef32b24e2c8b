"""From command-line overrides to a checked, resolved config, without Hydra's run machinery.

`compose` builds the config Hydra would build; `prepare` validates it, resolves every interpolation
and checks its `_target_`s, once. The CLI prepares every job of a command before Hydra writes
anything; `trainer.train(cfg)` prepares what it is given. Composition errors (unknown keys,
unknown group options, wrong types) become one paragraph with the nearest valid names.
"""

from __future__ import annotations

import contextlib
import re
import sys
import warnings
from itertools import product
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.config import schema as _config  # registers the typed schema with Hydra's ConfigStore
from trainer.config.targets import check_targets
from trainer.errors import ConfigError, suggest

CONFIG_MODULE = "trainer.conf"
# conf/config.yaml puts the user's config dir on the search path for this machine's defaults (trainer/config/machine.py),
# and Hydra warns at every composition about a search path that does not exist: on most machines, this one. (With
# --config-dir the list comes from the command line, `search_path`; a --config-dir that is missing is Hydra's error.)
SEARCHPATH_WARNING = r"provider=hydra\.searchpath in (main|command-line), path=.* is not available"
warnings.filterwarnings("ignore", message=SEARCHPATH_WARNING)


def compose(overrides: list[str], config_dir: str | None = None) -> DictConfig:
    """The job config for `overrides` (no sweeps), as `python -m trainer OVERRIDES` would compose it."""
    from trainer.errors import ConfigError

    if isinstance(overrides, str) or not isinstance(overrides, (list, tuple)) or \
            not all(isinstance(o, str) for o in overrides):
        shown = f"[{overrides!r}]" if isinstance(overrides, str) else "['recipe=lm', 'optim.lr=1e-3']"
        raise ConfigError(f"trainer.compose takes a list of KEY=VALUE strings, as the command line gives them: "
                          f"compose({shown}); got {type(overrides).__name__} {overrides!r:.80}.")
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    from trainer.config.machine import config_home, home_for

    _, filtered = home_for(overrides)  # (the machine's defaults without the groups these overrides choose)
    with config_home(filtered), initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        return hydra_compose("config", overrides=[*overrides, *search_path(config_dir)])


def search_path(config_dir: str | None) -> list[str]:
    """The override that adds `config_dir` (`--config-dir`) to Hydra's search path. It replaces conf/config.yaml's
    list, so the machine's defaults dir (trainer/config/machine.py) is named again, as `--config-dir` keeps it."""
    from trainer.config.machine import home

    return [f"hydra.searchpath=[file://{Path(config_dir).resolve()},file://{home()}]"] if config_dir else []


def sweep_jobs(overrides: list[str], limit: int = 256) -> list[list[str]]:
    """The override lists of every job of a multirun sweep (`a=1,2 b=x,y`: four), the first `limit` of them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException as exc:
        raise unparsable(overrides, exc) from None
    choices = []
    for o in parsed:
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
    from trainer.config.schema import agree_hf_sizes, spell_as_torch

    agree_hf_sizes(container)
    spell_as_torch(container)
    resolved = OmegaConf.create(container)
    OmegaConf.set_struct(resolved, True)
    return resolved


def prepare(cfg: DictConfig, targets: bool = True) -> DictConfig:
    """Validate, resolve and (with `targets`) check every `_target_`: the config a run starts from."""
    resolved = resolve(cfg)
    _config.validate(resolved)
    if targets:
        check_targets(resolved)
    return resolved


def load(overrides: list[str], config_dir: str | None = None, targets: bool = True) -> DictConfig:
    """`compose` + `prepare`, with composition errors explained."""
    from trainer.config.shortcuts import composing

    if config_dir is not None:  # (trainer.compose(..., config_dir=D): a recipe/lm.yaml of D's was passed over)
        check_config_dir(Path(str(config_dir)).expanduser(), str(config_dir))

    with composing():  # (check_choices composes again: each file read once)
        try:
            cfg = compose(overrides, config_dir)
        except (Exception, OmegaConfBaseException) as exc:  # hydra raises several unrelated types
            raise explain(exc, overrides, config_dir) from exc
        check_choices(cfg, overrides, config_dir)
        check_read(cfg, overrides)
    return prepare(cfg, targets)


def check_read(cfg: DictConfig, overrides: list[str], sweep: bool = False) -> list[str]:
    """Refuse a setting given on the command line that the run would never read: `ema.decay=0.99` while the EMA is
    off (its defaults are numbers, so only the command line tells a choice from a default). A sweep's point gets
    the keys back instead: `ema.enabled=true,false ema.decay=0.99` compares a run with and without an EMA, and the
    sweep is refused only when none of its points reads them (trainer/entry/cli.py)."""
    keys = [o.lstrip("+~").split("=", 1)[0] for o in overrides]
    _one_value_per_hf_size(cfg, overrides)
    _refuse_counts_for_switches(cfg, overrides)
    if not sweep:
        _refuse_what_every_part_overrides(cfg, overrides)
    given = [k for k in keys if k.startswith("ema.") and k != "ema.enabled"]
    if not given or (cfg.get("ema") or {}).get("enabled", False):
        return []
    if sweep:
        return given
    raise ConfigError(inert_message(given))


def _refuse_counts_for_switches(cfg: DictConfig, overrides: list[str]) -> None:
    """`trainer.activation_checkpointing=2`: OmegaConf takes any number but 0 as true for a true/false setting, so
    a count meant for one (every 2nd block, as other frameworks' checkpointing options take) switched it on
    without a word. 0 and 1 stay the switch's values."""
    from omegaconf.nodes import BooleanNode

    for override in overrides:
        key, sep, value = override.lstrip("+~").partition("=")
        number = value.strip().strip("'\"")  # (quoted, '2' was taken as true as well)
        if not sep or number in ("0", "1") or not re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", number):
            continue
        section, _, leaf = key.rpartition(".")
        parent = OmegaConf.select(cfg, section) if section else cfg
        if isinstance(parent, DictConfig) and isinstance(parent._get_node(leaf, throw_on_missing_key=False),
                                                         BooleanNode):
            raise ConfigError(f"{key}={value}: {key} is a switch, not a number (any number other than 0 would "
                              f"have switched it on). Pass {key}=true or {key}=false.")


def _refuse_what_every_part_overrides(cfg: DictConfig, overrides: list[str]) -> None:
    """`recipe=gan optim.lr=0.1`: every part (optim.generator, optim.discriminator) sets its own lr, so the base
    optim.lr is read by none, and the run trained at the recipe's rates without a word (optim.lr=-1 too)."""
    for override in overrides:
        key, sep, value = override.lstrip("+").partition("=")
        section, _, leaf = key.partition(".")
        node = cfg.get(section) if section in ("optim", "scheduler") and sep and leaf and "." not in leaf else None
        # (keys and nodes, not values: an interpolation given there that does not resolve is named later, as for
        # any section; items() resolved it here, a traceback)
        parts = [k for k in node if isinstance(node._get_node(k), DictConfig)] if isinstance(node, DictConfig) else []
        if parts and leaf not in parts and all(leaf in node[p] for p in parts):
            each = " ".join(f"{section}.{p}.{leaf}={value}" for p in parts)
            raise ConfigError(f"{key}={value}: every part of {section} sets its own {leaf} ("
                              f"{', '.join(f'{section}.{p}.{leaf}' for p in parts)}), so {key} is read by none of "
                              f"them. Set the parts' instead: {each}.")


def check_top_level_adds(cfg: DictConfig, overrides: list[str]) -> None:
    """Refuse `+lr=1e-3`: a top-level key of one's own is read only through an interpolation (`${lr}`), so one that
    none reads and that names a setting of a section (optim.lr) trained at the default in silence. `cfg` holds the
    `hydra` node, whose interpolations (hydra.run.dir: runs/${name}) count as readers."""
    tree = None
    for o in overrides:
        key, _, value = o.partition("=")
        if not key.startswith("+") or not _ or any(c in key for c in "./@"):
            continue
        given, key = key, key.lstrip("+")
        if group_options(key):  # (+experiment=NAME chooses a config group's option)
            continue
        if tree is None:
            tree = OmegaConf.to_container(cfg, resolve=False)
            # (Hydra's records of the command line, which hold the override itself and any `${...}` given there)
            for records in ("overrides", "job"):
                (tree.get("hydra") or {}).pop(records, None)
        if _interpolates(tree, key):
            continue
        named = [p for p in _leaf_paths(tree) if "." in p and not p.startswith("hydra.") and
                 p.rpartition(".")[2] == key]
        if named:
            raise ConfigError(f"{given}={value} adds a top-level key of its own, which nothing reads (a key of one's "
                              f"own is read only through an interpolation, ${{{key}}}), while the setting of that "
                              f"name is {' or '.join(named)}. Set it there: {named[0]}={value}.")


def _interpolates(tree, key: str) -> bool:
    """Whether a string of the plain config tree `tree` reads the top-level `key` (`${key}`, `${key.x}`)."""
    if isinstance(tree, dict):
        return any(_interpolates(v, key) for v in tree.values())
    if isinstance(tree, list):
        return any(_interpolates(v, key) for v in tree)
    # (`${lr}`, `${lr.x}`, a relative `${..lr}`; not `${optim.lr}`)
    return isinstance(tree, str) and "${" in tree and re.search(rf"(?<![\w.])\.*{re.escape(key)}(?![\w])", tree) \
        is not None


def _one_value_per_hf_size(cfg: DictConfig, overrides: list[str]) -> None:
    """`model=llama_tiny model.num_hidden_layers=4 model.n_layer=2`: a Hugging Face model's own size key wins over
    the lm recipe's name for it (which debug=smoke sets: schema.agree_hf_sizes), so the 2 was dropped in silence
    when the command line gave both."""
    from trainer.config.schema import HF_CAUSAL_LM, HF_SIZE_ALIASES

    if OmegaConf.select(cfg, "model._target_", default=None) != HF_CAUSAL_LM:
        return
    given = {o.lstrip("+").split("=", 1)[0]: o.split("=", 1)[1] for o in overrides if "=" in o}
    for alias, own in HF_SIZE_ALIASES.items():
        a, b = given.get(f"model.{alias}"), given.get(f"model.{own}")
        if a is not None and b is not None and _value(a) != _value(b):  # (by value: 2 and 02 are one size)
            raise ConfigError(f"model.{alias}={a} and model.{own}={b} name one size of this Hugging Face model "
                              f"({alias} is the lm recipe's name for its {own}) with two values. Give one of them "
                              f"(model.{own}={b}).")


def _value(text: str):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def inert_message(given: list[str], where: str = "") -> str:
    return (f"{', '.join(given)}: the EMA is off (ema.enabled=false){where}, so {'these do' if len(given) > 1 else 'this does'} "
            "nothing. Add ema.enabled=true to keep an EMA of the weights (evaluated as val_ema/ and exported as "
            "model_ema.safetensors), or leave them out.")


def check_choices(cfg: DictConfig, overrides: list[str], config_dir: str | None) -> None:
    """Refuse a group option chosen on the command line (`precision=bf16`) that the composed config does not
    hold. Hydra merges a config's inline node (a recipe's `precision: {_target_: ...}`) over the option chosen
    for that group, so the choice would be ignored without a word (or, for `precision=fp16`, mixed with the
    inline class into a node neither meant). A config selects an option in its defaults list instead
    (`override /precision: fp32`), which the command line overrides. Compares `_target_`s only: a recipe may
    change an option's other values on purpose (`optim: {lr: ...}` over `optim=sgd`)."""
    from hydra import initialize_config_module
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    for o in parsed:  # world=[single,ddp]: Hydra merges both options, the last one's keys winning, without a word
        if (isinstance(o.value(), list) and len(o.value()) > 1 and not o.is_delete()
                and o.key_or_group not in _config.LIST_GROUPS and "." not in o.key_or_group
                and group_options(o.key_or_group)):
            group, options = o.key_or_group, ",".join(map(str, o.value()))
            raise ConfigError(f"{group}=[{options}] chooses several options of {group}, which takes one (only "
                              f"{', '.join(_config.LIST_GROUPS)} take a list): pick one ({group}={o.value()[-1]}), or compare "
                              f"them in a sweep: python -m trainer -m {group}={options} ...")
    dotted = {o.key_or_group for o in parsed if "." in o.key_or_group}
    chosen = [(o.key_or_group, o.value()) for o in parsed
              if not ("." in o.key_or_group or "/" in o.key_or_group or o.is_delete() or o.is_sweep_override())
              and isinstance(o.value(), str)]
    chosen = list(dict(chosen).items())  # precision=bf16 ... precision=fp32: the last one is the choice
    if not chosen:
        return
    search = search_path(config_dir)
    recipe = OmegaConf.select(cfg, "hydra.runtime.choices.recipe", default=None) or \
        next((value for key, value in chosen if key == "recipe"), None)

    def alone(group: str, option: str) -> list[tuple[str, str]]:
        try:
            return _targets_under(option_alone(group, option, search), group)
        except Exception:  # noqa: BLE001 - not a group (resume=auto), or an option with a defaults list of its own
            return []

    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        for group, option in chosen:
            if group == "optim" and "optim.lr" not in dotted:
                _say_whose_lr(cfg, option, search, recipe)
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


def _say_whose_lr(cfg: DictConfig, option: str, search: list[str], recipe: str | None) -> None:
    """A note when `optim=OPTION` chosen on the command line runs at a learning rate other than its own: a recipe
    sets `optim.lr` tuned for its own optimizer (lm: AdamW's 5e-3), which Hydra merges over the option's (Muon's
    0.02), without a word. Not for the recipe's own optimizer, which its rate was tuned for."""
    try:
        recipe = recipe or _default_option("recipe", None, search)
        if option == _default_option("optim", recipe, search):
            return
        own = OmegaConf.select(option_alone("optim", option, search), "optim.lr", default=None)
    except Exception:  # noqa: BLE001 - an option of one's own with a defaults list: nothing to compare
        return
    got = OmegaConf.select(cfg, "optim.lr", default=None)
    if own is not None and got is not None and own != got:
        setter = f"recipe={recipe}'s, tuned for its own optimizer" if recipe else "set by a config merged after it"
        print(f"note: optim={option} runs at optim.lr={got} ({setter}), not at its own default {own}. Pass "
              f"optim.lr=VALUE to choose (optim.lr={own} for {option}'s).", file=sys.stderr, flush=True)


def _default_option(group: str, recipe: str | None, search: list[str]) -> str | None:
    """The option of `group` a run of `recipe` takes when the command line names none: the recipe's
    `override /group: X`, else the root config's default. Inside `initialize_config_module`."""
    from hydra.core.global_hydra import GlobalHydra

    _, repo = GlobalHydra.instance().config_loader()._parse_overrides_and_create_caching_repo("config", search)
    for name in ([f"recipe/{recipe}"] if recipe else []) + ["config"]:
        for d in repo.load_config(name).defaults_list or []:
            if getattr(d, "group", None) in (group, f"/{group}") and isinstance(getattr(d, "value", None), str):
                return d.value
    return None


def option_alone(group: str, option: str, search: list[str]) -> DictConfig:
    """The group option `group/option` composed as the primary config, as `hydra.compose(f"{group}/{option}")`
    composes it, less Hydra's own `hydra` node: the same defaults tree and merge, without the dozen configs of
    that node (a seventh of the time: ~10 ms, not ~70). Inside `initialize_config_module`."""
    from hydra import compose as hydra_compose
    from hydra._internal.defaults_list import create_defaults_list
    from hydra.core.global_hydra import GlobalHydra

    name, loader = f"{group}/{option}", GlobalHydra.instance().config_loader()
    if not all(hasattr(loader, f) for f in ("_parse_overrides_and_create_caching_repo",
                                             "_compose_config_from_defaults_list")):  # (another Hydra version)
        return hydra_compose(name, overrides=search)
    _, repo = loader._parse_overrides_and_create_caching_repo(name, search)  # (search: --config-dir's path)
    tree = create_defaults_list(repo=repo, config_name=name, overrides_list=[], prepend_hydra=False,
                                skip_missing=False)
    return loader._compose_config_from_defaults_list(defaults=tree.defaults, repo=repo)


def _targets_under(cfg: DictConfig, group: str) -> list[tuple[str, str]]:
    """(path, _target_) of each node with a `_target_` under `group` (a group option composed alone puts its
    content at its package: `precision`, `logger.wandb`); nodes elsewhere (a `_global_` option's) are not
    the group's own. Read unresolved: an option's interpolations (`${data.seq_len}`) point outside it."""
    found = []
    node = OmegaConf.select(cfg, group, default=None)

    def walk(n, path):
        if isinstance(n, dict):
            if isinstance(n.get("_target_"), str):
                found.append((path, n["_target_"]))
            for k, v in n.items():
                walk(v, f"{path}.{k}")

    walk(OmegaConf.to_container(node, resolve=False) if isinstance(node, DictConfig) else None, group)
    return found


def missing_configs() -> str:
    """Why `trainer.conf` (conf/, mapped in by the install) is not importable, and the way out."""
    here = Path(__file__).resolve().parents[1]  # the trainer package python imported
    if (here.parent / "conf").is_dir() and not (here / "conf").exists():
        return (f"the configs (conf/) are not importable as trainer.conf: python imported trainer from the source "
                f"tree {here} (the current directory comes first on sys.path), where conf/ and recipes/ become "
                "trainer.conf and trainer.recipes only through an editable install. Install it with "
                f"`pip install -e {here.parent}` (what `make` does), or run from another directory.")
    return (f"the configs (trainer.conf) are missing from the installed package at {here}. Reinstall it "
            "(`pip install --force-reinstall` of the same source), or install from a checkout with `pip install -e .`.")


def group_options(group: str) -> list[str]:
    """The shipped options of config group `group` ([] if they cannot be listed: this is for a message)."""
    try:
        from hydra import initialize_config_module
        from hydra.core.global_hydra import GlobalHydra

        if GlobalHydra.instance().is_initialized():
            return list(GlobalHydra.instance().config_loader().get_group_options(group))
        with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
            return list(GlobalHydra.instance().config_loader().get_group_options(group))
    except Exception:  # noqa: BLE001
        return []


def _unchosen_option(key: str, composed: DictConfig | None) -> str | None:
    """The message for `logger.wandb.project=...` without logger=wandb (None for any other key, and where the run
    does choose it: `logger=wandb logger.wandb.projct=x` is a typo of a key, named as such)."""
    group, _, rest = key.partition(".")
    option = rest.split(".", 1)[0]
    if group not in _config.LIST_GROUPS or not option or option not in group_options(group):
        return None
    if composed is not None and OmegaConf.select(composed, f"{group}.{option}", default=None) is not None:
        return None
    return (f"{key} is a setting of {group}={option}, which this run does not choose: add {group}={option} (several: "
            f"{group}=[{option},...]) and keep {key}=... as it is.")


def _key_of_other_options(key: str) -> str | None:
    """The message for a key of a group option the run does not choose (precision.init_scale, fp16's, under
    precision=bf16): the generic one offered +precision.init_scale, which the chosen option then refuses."""
    import importlib.resources

    group, _, rest = key.partition(".")
    leaf = rest.split(".", 1)[0]
    if not leaf or group in _config.LIST_GROUPS:
        return None
    having = []
    for option in group_options(group):
        try:
            node = yaml.safe_load(importlib.resources.files(CONFIG_MODULE).joinpath(group, f"{option}.yaml").read_text())
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(node, dict) and leaf in node:
            having.append(option)
    if not having:
        return None
    return (f"{key} is a setting of {' and '.join(f'{group}={o}' for o in having)}, which this run does not choose: add "
            f"{group}={having[0]} and keep {key}=... as it is.")


def _group_given_no_name(overrides: list[str]) -> ConfigError | None:
    """`optim=5`, `world=null`, `logger=[1,2]`: a config group given something other than its options' names."""
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if not key.strip():
            return ConfigError(f"{override!r} has no key: an override is KEY=VALUE.")
        options = group_options(key) if "." not in key else []
        try:
            given = yaml.safe_load(value) if value else None
        except yaml.YAMLError:
            continue
        names = isinstance(given, str) or (isinstance(given, list) and all(isinstance(x, str) for x in given))
        if options and not names:
            real = [o for o in options if o != "none"] or options
            several = f" (several: {key}=[{real[0]},...])" if key in _config.LIST_GROUPS else ""
            return ConfigError(f"{key}={value} is not an option of {key}: choose one of {', '.join(options)} by its "
                               f"name{several}, or set one of its settings with {key}.KEY=VALUE.")
    return None


def explain(exc: Exception, overrides: list[str], config_dir: str | None) -> ConfigError:
    """Turn a Hydra/OmegaConf composition error into a ConfigError naming the key and the fix."""
    from hydra.errors import MissingConfigException

    msg = str(exc)
    cause = exc.__cause__ or exc
    marked = next((e for e in (exc, exc.__cause__, exc.__context__) if isinstance(e, yaml.MarkedYAMLError)), None)
    if marked is not None and marked.problem_mark is not None:  # a config file's YAML: its file, line and column
        mark = marked.problem_mark
        what = " ".join(x for x in (marked.context, marked.problem) if x)
        try:
            line = Path(mark.name).read_text().splitlines()[mark.line]
        except (OSError, IndexError, ValueError):
            line = ""
        quote = " (a `${...}` inside a `{...}` or `[...]` needs quotes: key: '${...}')" if "${" in line else ""
        return ConfigError(f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}: not valid YAML ({what}). "
                           f"Fix that file{quote}.")
    if "Config group override must be a string or a list" in msg or "is not iterable" in msg:
        named = _group_given_no_name(overrides)  # (Hydra's own words named neither the group nor its options)
        if named is not None:
            return named
    appended = re.search(r"Could not append to config\. An item is already at '([^']+)'", msg)
    if appended:  # (+optim.lr=1: `+` adds a key; this one is there already)
        key = appended.group(1)
        value = next((o.split("=", 1)[1] for o in overrides if o.lstrip("+").split("=")[0] == key and "=" in o), "VALUE")
        return ConfigError(f"+{key}={value}: {key} is already in the config, and `+` adds a new key. Set it without "
                           f"the `+`: {key}={value}.")
    package = re.search(r"In '([^']+)': Could not override '[^'@]+@(\w+)\.", msg)
    if package and package.group(1).startswith(package.group(2) + "/"):  # (a defaults list's `override /precision`)
        return ConfigError(f"{package.group(1)}.yaml chooses other configs' options (`override /GROUP: NAME` in its "
                           "defaults list), which needs `# @package _global_` as the file's first line (Hydra reads "
                           "the file's keys under its own group otherwise). Add that line; see conf/recipe/lm.yaml.")
    if "Primary config module 'trainer.conf' not found" in msg:
        return ConfigError(missing_configs())
    if isinstance(exc, MissingConfigException) or "Could not find" in msg:
        m = re.search(r"Could not (?:find|load) '([^']+)/([^']+)'", msg)
        if m:
            group, option = m.groups()
            options = list(exc.options or []) if isinstance(exc, MissingConfigException) else []
            if not options:
                options = re.findall(r"^\t(\S+)$", msg, flags=re.M)
            if not options:  # (a list of options, logger=[wandb,tensorbord]: Hydra's message lists none)
                options = group_options(group)
            if group == "hydra/launcher" and option.startswith("submitit") and \
                    not any(o.startswith("submitit") for o in options):  # (installed: a typo, named below)
                return ConfigError(f"hydra/launcher={option} comes with the hydra-submitit-launcher package, which is "
                                   "not installed here. Install it with `pip install hydra-submitit-launcher` (in this "
                                   "repository: pip install -e '.[slurm]'), or leave hydra/launcher out (the basic "
                                   "launcher runs the points one after another).")
            return ConfigError(
                f"{group}={option} is not an option of config group '{group}'{_chosen_in(group, option, config_dir)}. "
                f"Available: {', '.join(options) or '(none)'}.{suggest(option, options)}"
            )
    from hydra.errors import OverrideParseException

    if isinstance(exc, OverrideParseException):
        return unparsable(overrides, exc)
    full_key = getattr(cause, "full_key", None)
    m = re.search(r"Could not override '([^']+)'", msg)
    if m and ("To append" in msg or "not in" in str(cause)):
        key = m.group(1)
        parent, _, leaf = key.rpartition(".")
        others = [o for o in overrides if o.split("=")[0].lstrip("+~") != key]
        value = next((o.split("=", 1)[1] for o in overrides if o.split("=")[0].lstrip("+~") == key and "=" in o), None)
        composed = _composed(others, config_dir)
        if composed is None:  # (another mistake among them, a second unknown key: the groups' choices alone)
            composed = _composed([o for o in others if "=" in o and "." not in o.split("=")[0]], config_dir)
        node = OmegaConf.select(composed, parent, default=None) if parent and composed is not None else composed
        valid = [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []
        where = f"under '{parent}'" if parent else "at the top level"
        # A key another strategy has (pipeline stages are world=ddp's): say which, before the generic list.
        elsewhere = (" Pipeline stages (world.pp, world.pp_schedule, world.microbatches) are an option of world=ddp."
                     if key in ("world.pp", "world.pp_schedule", "world.microbatches") else "")
        from trainer.config.schema import HF_CAUSAL_LM, HF_SIZE_ALIASES

        own_name = HF_SIZE_ALIASES.get(leaf) if parent == "model" else None
        if own_name and composed is not None and OmegaConf.select(composed, "model._target_", default=None) == \
                HF_CAUSAL_LM and own_name in (node or {}):  # (model=llama_tiny model.n_layer=2)
            return ConfigError(f"unknown config key '{key}': this Hugging Face model's config calls it {own_name}. "
                               f"Set model.{own_name}={value if value is not None else 'VALUE'} (model.{leaf} is the lm "
                               "recipe's name, read where a config such as debug=smoke sets it).")
        unchosen = _unchosen_option(key, composed) or (None if elsewhere else _key_of_other_options(key))
        if unchosen:  # (the `+` the generic message proposes would add a settings node with no logger behind it)
            return ConfigError(unchosen)
        # The sections the framework reads itself take no key of one's own (schema._known_keys refuses it).
        own = ("" if parent in ("trainer", "checkpoint", "ema") or parent.split(".")[0] in _config.LIST_GROUPS else
               f" To add a new key on purpose, write +{key}=VALUE.")
        keys = (f"Valid keys {where}: {', '.join(sorted(valid))}." if valid else
                # (Hydra's own node is composed apart: "The config has no 'hydra.launcher'" was false)
                f"python -m trainer --cfg hydra, with this command's group choices, lists the keys of '{parent}'."
                if parent.split(".")[0] == "hydra" else
                f"The config has no '{parent}'." if composed is not None and node is None else
                f"'{parent}' has no keys yet.")
        return ConfigError(f"unknown config key '{key}'.{elsewhere}{did_you_mean(key, value, composed)} {keys}{own}")
    if full_key and cause is not exc:
        first = str(cause).splitlines()[0]
        if "is not a ListConfig, list or tuple" in first:  # a list key given one value: say how to write a list
            value = next((o.split("=", 1)[1] for o in overrides if o.split("=")[0].lstrip("+~") == full_key), "...")
            return ConfigError(f"{full_key}={value} is not a list: write {full_key}=[{value}] (several: "
                               f"{full_key}=[a,b]).")
        if "is not a subclass of" in first and "." not in full_key:  # a section given one value: checkpoint=best
            value = next((o.split("=", 1)[1] for o in overrides if o.split("=")[0].lstrip("+~") == full_key), "...")
            eval_option = (f" ({full_key}={value} is an option of `python -m trainer eval RUN_DIR`)"
                           if full_key == "checkpoint" else "")
            return ConfigError(f"{full_key}={value}: `{full_key}` is a section of settings, not one value{eval_option}. "
                               f"Set its keys instead, e.g. {full_key}.KEY=VALUE (python -m trainer --cfg job lists "
                               "them).")
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
    ambiguous = re.match(r"Ambiguous value for argument '([^=']+)=(.*)'$", first)
    if ambiguous:  # (Hydra's ways out come on its next lines, which the first line alone dropped)
        key, value = ambiguous.groups()
        return ConfigError(f"{key}={value}: a comma makes several values. To sweep over them add -m (python -m "
                           f"trainer -m ... {key}={value}); for a list write {key}=[{value}]; for one string quote it: "
                           f"\"{key}='{value}'\".")
    m = re.match(r"In '([^'/]+)/([^']+)'", first)
    full = getattr(exc.__cause__ or exc.__context__, "full_key", None)  # (Hydra raises it from within its except)
    if m and re.search(r"Key '[^']+' not in '", first) and full and str(full).split(".")[0] != m.group(1):
        # The file's keys reached the top level (its header is there): the key itself is the mistake.
        groups = [o for o in overrides if "=" in o and "." not in o.split("=")[0] and not o.startswith(m.group(1))]
        near = nearest_keys(str(full), _composed(groups, config_dir))
        where = f"{m.group(1)}/{m.group(2)}.yaml"
        if where == "machine/default.yaml":  # (the user's file, by its path: `python -m trainer config` wrote it)
            from trainer.config.machine import shown_file

            where = f"this machine's defaults file {shown_file()} (python -m trainer config)"
        return ConfigError(f"{where} sets {full}, a key the config does not have."
                           + (f" Did you mean {near[0]}?" if near else "")
                           + " python -m trainer --cfg job lists the keys there are.")
    if m and re.search(r"Key '[^']+' not in '", first):
        # A group option that sets keys outside its group (a recipe) is read into the group's node unless its
        # first line is the package header.
        hint = (f"if {m.group(1)}/{m.group(2)}.yaml sets top-level keys, its first line must be "
                "'# @package _global_': Hydra reads that header on the first line only")
    return ConfigError(f"{first} ({hint})")


def _chosen_in(group: str, option: str, config_dir: str | None) -> str:
    """Where a config file of `config_dir` (a recipe of one's own), or the machine's defaults file (edited by hand:
    `python -m trainer config` checks what it saves), chooses `group: option` in its defaults list (Hydra names no
    file): ", chosen in FILE", or ""."""
    line = re.compile(rf"^\s*-\s*(override\s+)?/?{re.escape(group)}\s*:\s*{re.escape(option)}\s*(#.*)?$", re.M)
    for root in [Path(config_dir)] if config_dir else []:
        for f in sorted(root.rglob("*.yaml")):
            with contextlib.suppress(OSError, UnicodeDecodeError):
                if line.search(f.read_text()):
                    return f", chosen in {f}"
    from trainer.config.machine import defaults_file, shown_file

    with contextlib.suppress(OSError, UnicodeDecodeError):
        if defaults_file().is_file() and line.search(defaults_file().read_text()):
            return (f", chosen in this machine's defaults ({shown_file()}; python -m trainer config KEY=VALUE ... "
                    "saves others, config --reset removes them)")
    return ""


def _composed(overrides: list[str], config_dir: str | None) -> DictConfig | None:
    try:
        return compose(overrides, config_dir)
    except Exception:  # noqa: BLE001 - another mistake among the overrides: no suggestions then
        return None


def nearest_keys(key: str, cfg: DictConfig | None) -> list[str]:
    """The keys of `cfg` an unknown `key` probably means: its underscore spelling (Accelerate treats - and _
    in flag names alike: world.nproc-per-node -> world.nproc_per_node), else a close name at the same level
    (trainer.max_stepz -> trainer.max_steps), else the nested keys whose last part is, or is close to, its
    last part (lr -> optim.lr, trainer.lr -> optim.lr, batch_size -> data.batch_size)."""
    if cfg is None:
        return []
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent, default=None) if parent else cfg
    here = [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []
    prefix, fixed = f"{parent}." if parent else "", leaf.replace("-", "_")
    if fixed in here:
        return [prefix + fixed]
    close = _closest(fixed, here)
    if close:
        return [prefix + c for c in close]
    leaves = [p for p in _leaf_paths(OmegaConf.to_container(cfg, resolve=False)) if p != key]
    exact = [p for p in leaves if p.rpartition(".")[2] == fixed]
    if exact:
        return exact[:3]
    by_leaf: dict[str, list[str]] = {}
    for p in leaves:
        by_leaf.setdefault(p.rpartition(".")[2], []).append(p)
    return [p for name in _closest(fixed, list(by_leaf), cutoff=0.8) for p in by_leaf[name]][:3]


def did_you_mean(key: str, value: str | None, cfg: DictConfig | None) -> str:
    """' Did you mean optim.lr=1e-3?' (with the value when it is known), or '' when no key is close. Not for a
    `_target_`-style key (`optim.discriminator._target_`): that is no misspelt setting but a node given a class."""
    if key.rsplit(".", 1)[-1].startswith("_"):
        return ""
    found = nearest_keys(key, cfg)
    shown = [f"{k}={value}" if value is not None else k for k in found]
    return f" Did you mean {' or '.join(shown)}?" if shown else ""


def _closest(name: str, choices: list[str], cutoff: float = 0.6) -> list[str]:
    """errors.suggest's choice: the close names, or the one clearly closer than the rest."""
    import difflib

    close = difflib.get_close_matches(name, choices, n=3, cutoff=cutoff)
    score = {c: difflib.SequenceMatcher(None, c, name).ratio() for c in close}
    return [c for c in close if score[c] >= score[close[0]] - 0.1] if close else []


def _leaf_paths(tree, path: str = "") -> list[str]:
    """Dotted paths of the values (not the sections) of a plain config tree; `_target_`-style keys left out."""
    if not isinstance(tree, dict):
        return [path] if path else []
    return [p for k, v in tree.items() if not str(k).startswith("_")
            for p in _leaf_paths(v, f"{path}.{k}" if path else str(k))]


def unparsable(overrides: list[str], exc: Exception) -> ConfigError:
    """Hydra's override parser names no override ("mismatched input '=' expecting <EOF>"): name it, and how to
    quote its value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    for override in overrides:
        try:
            parser.parse_override(override)
        except Exception as e:  # noqa: BLE001 - hydra's OverrideParseException, among others
            key, sep, value = override.partition("=")
            if not sep:
                return ConfigError(f"{override!r} is not an override: write KEY=VALUE (python -m trainer --cfg job "
                                   "lists the keys).")
            why = str(e).strip().splitlines()[0] if str(e).strip() else detail
            return ConfigError(
                f"the value of {key} does not parse as Hydra reads overrides ({why}): a value with =, spaces, quotes, "
                f"brackets, braces or a leading ~ must be quoted for Hydra, the quotes inside the shell's: "
                f"'{key}=\"{value}\"'.")
    return ConfigError(f"an override does not parse ({detail}); quote values that hold =, spaces or brackets: "
                       "'KEY=\"VALUE\"'.")


def flag_value(key: str, text: str) -> bool:
    """A command's true/false option (`ema=false`): true, false, yes, no, 1 or 0; anything else is one paragraph
    (`ema=maybe` once meant false)."""
    value = str(text).strip().lower()
    if value in ("true", "yes", "1"):
        return True
    if value in ("false", "no", "0"):
        return False
    raise ConfigError(f"{key}={text} is not true or false: pass {key}=true or {key}=false.")


def path_value(key: str, text: str) -> str:
    """A command's path option (`out=PATH`, `save=`, `offload_dir=`, `checkpoint=`, `outputs=`) unquoted, as Hydra
    unquotes an override's value (`out='my plot.png'`: the quotes were kept, and the file went into a folder
    named `'`). An empty one is one paragraph: it would be the current directory."""
    value = str(text)
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        value = value[1:-1].replace("\\" + value[0], value[0])
    if not value.strip():
        raise ConfigError(f"{key}={text} is empty: give a path ({key}=PATH).")
    return value


def yaml_value(override: str) -> Any:
    """The value of a KEY=VALUE override, read as YAML (`null`, `0.8`, `[1, 2]`); a syntax error is one paragraph."""
    key, _, value = override.partition("=")
    try:
        return yaml.safe_load(value) if value else None
    except yaml.YAMLError as e:
        raise ConfigError(f"the value of {key} is not YAML ({str(e).splitlines()[0]}): quote a string, e.g. "
                          f"'{key}=\"...\"'.") from None


def check_config_dir(path: Path, given: str) -> None:
    """`--config-dir` exists, and none of its files has the name of one the framework ships: Hydra's search path
    has the shipped configs first, so `model/gpt_tiny.yaml` of yours would be passed over without a word."""
    import importlib.resources

    if not path.is_dir():
        kind = "a file, not a directory" if path.exists() else "there is no such directory"
        raise ConfigError(f"--config-dir {given}: {kind}. Give the directory that holds "
                          "your own config files (model/NAME.yaml, recipe/NAME.yaml, ...), or leave --config-dir out.")
    shipped = Path(str(importlib.resources.files(CONFIG_MODULE)))
    if path.resolve() == shipped.resolve():
        return  # (the shipped dir itself, named from the repository)
    # (the shipped files looked up in the user's dir, not the user's dir walked: it may be a whole project)
    shadowed = sorted(str(rel) for rel in (f.relative_to(shipped) for f in shipped.rglob("*.yaml"))
                      if len(rel.parts) > 1 and (path / rel).is_file())  # (a group's option, not a root file)
    if shadowed:
        listed = ", ".join(shadowed[:5]) + (f" and {len(shadowed) - 5} more" if len(shadowed) > 5 else "")
        raise ConfigError(f"--config-dir {given} has {listed}, which the framework ships under the same name: the "
                          "shipped file would be used and yours passed over. Give yours a name of its own (e.g. "
                          f"{Path(shadowed[0]).parent}/my_{Path(shadowed[0]).name}) and select it with that name.")
