"""This machine's defaults, as `accelerate config` keeps them, as a Hydra config rather than a second system.

`python -m trainer config world=ddp world.nproc_per_node=2 precision=bf16 outputs=/scratch/runs` writes
`machine/default.yaml` into the user's config dir (`$TRAINER_CONFIG_HOME`, default `~/.config/trainer`).
conf/config.yaml puts that dir on Hydra's search path and selects `machine: default` (optional) right after
the recipe, so every later run composes it: over the recipe's choices, under `debug=smoke` and the command
line. Group choices become `override /GROUP: OPTION` entries of its defaults list, dotted keys become values,
and `outputs=DIR` is the root of the timestamped run and sweep dirs. `python -m trainer env` shows it.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from trainer.errors import ConfigError, suggest

HOME_ENV = "TRAINER_CONFIG_HOME"  # conf/config.yaml's hydra.searchpath reads the same variable
GROUPS = ("world", "precision", "logger", "callbacks")  # what a machine decides; recipes choose the rest
USAGE = ("python -m trainer config [world=NAME] [world.nproc_per_node=N] [precision=NAME] [logger=NAME] "
         "[outputs=DIR] [KEY=VALUE ...]  (no arguments: show them; --reset: remove them)")


SHOWN_ENV = "TRAINER_MACHINE_DEFAULTS"  # the user's file, while a command composes a filtered copy (home_for)


def home() -> Path:
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".config" / "trainer")


def defaults_file() -> Path:
    return home() / "machine" / "default.yaml"


def shown_file() -> Path:
    """The machine's defaults file as the user knows it (not the filtered copy a command may compose)."""
    return Path(os.environ.get(SHOWN_ENV) or defaults_file())


def describe() -> str:
    """What `env` and `config` print: the file and its settings, or how to save some."""
    path = defaults_file()
    if not path.is_file():
        return f"none ({path} does not exist; python -m trainer config KEY=VALUE ... saves them)"
    from trainer.redaction import scrub

    # (a file saved before its values were checked for secrets, or edited by hand: printed redacted, as runs print)
    return scrub(f"{path}:\n" + "\n".join(f"  {line}" for line in path.read_text().splitlines()
                                           if not line.startswith("#")), secrets())


def secrets() -> set[str]:
    """The secret values a command must not print: the environment's, and those of secret-looking keys in the
    machine's defaults file (env_set's WANDB_API_KEY written there by hand: `env`, `config` and `--cfg hydra`
    printed it)."""
    import yaml

    from trainer.redaction import secret_values

    try:
        parsed = yaml.safe_load(defaults_file().read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        parsed = None
    return secret_values(parsed)


def render(overrides: list[str]) -> str:
    """The Hydra config for `overrides`: a `_global_` option of the `machine` group."""
    import yaml
    from omegaconf import OmegaConf

    from trainer.config.compose import path_value, yaml_value
    from trainer.redaction import MIN_SECRET_LENGTH, is_secret_env, is_secret_key

    defaults, values = [], OmegaConf.create({})
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep or not key or key.startswith(("+", "~", "-")):
            raise ConfigError(f"{override!r} is not a setting: {USAGE}")
        if key.startswith("hydra.") and not key.startswith("hydra.job.env_set."):
            # (hydra.run.dir=X: every later run in the one dir X; hydra.mode=MULTIRUN: every run a sweep)
            raise ConfigError(f"{override}: a machine's defaults keep hydra.job.env_set.NAME=... (its environment), "
                              "and say where runs go with outputs=DIR (each run then gets DIR/DATE/TIME, each sweep "
                              "DIR/multirun/DATE/TIME); other hydra.* settings are not saved. Give "
                              f"{key} on the command line of the run that needs it.")
        held = [name for name, secret in os.environ.items() if is_secret_env(name) and len(secret) >= MIN_SECRET_LENGTH
                and secret in value]
        if held:  # (the file is plain text, printed by `env` for bug reports)
            raise ConfigError(f"{key}=...: the value holds the secret in ${held[0]}, which is not saved in the "
                              f"machine's defaults. Save its name instead: '{key}=${{oc.env:{held[0]}}}' (each run "
                              "reads the value from the environment). Nothing was saved.")
        if key.startswith("hydra.job.env_set.") and is_secret_key(key.rsplit(".", 1)[-1]):
            raise ConfigError(f"{key}=...: a secret is not saved in the machine's defaults (a plain file, printed by "
                              "`python -m trainer env`): keep it in the environment (export it, or your shell's "
                              "profile), where runs read it.")
        if key == "outputs":
            value = path_value("outputs", value)
            root = str(Path(value).expanduser().resolve())
            blocked = _file_in_the_way(Path(root))
            if blocked:  # (saved, it would stop every later run, on any machine sharing the file)
                raise ConfigError(f"outputs={value}: runs cannot be written there ({blocked}). Give a directory "
                                  "this user can write (it is made when the first run starts): nothing was saved.")
            for kind, folder in (("run", root), ("sweep", f"{root}/multirun")):
                OmegaConf.update(values, f"hydra.{kind}.dir", f"{folder}/${{now:%Y-%m-%d}}/${{now:%H-%M-%S}}")
        elif "." not in key:
            if key not in GROUPS:
                others = _groups()
                what = (f"{key} is the recipe's to choose" if key in others else
                        f"{key} is no config group ({', '.join(sorted({*GROUPS, *others}))})")
                raise ConfigError(f"{key}={value}: a machine's defaults choose the groups {', '.join(GROUPS)} and "
                                  "outputs=DIR, and keep settings by their dotted keys (world.nproc_per_node=2, "
                                  f"optim.lr=1e-3); {what}. Nothing was saved."
                                  + ("" if key in others else suggest(key, [*GROUPS, "outputs"])))
            # (given twice, the last choice, as on a run's command line: both were saved, and the first won)
            defaults[:] = [d for d in defaults if f"override /{key}" not in d]
            defaults.append({f"override /{key}": yaml_value(override)})
        else:
            OmegaConf.update(values, key, yaml_value(override), force_add=True)
    body = OmegaConf.to_container(values)
    text = yaml.safe_dump({**({"defaults": defaults} if defaults else {}), **body}, sort_keys=False)
    return ("# @package _global_\n"
            "# This machine's defaults, read by every run (python -m trainer env shows them). Written by:\n"
            f"# python -m trainer config {' '.join(overrides)}\n" + text)


def _groups() -> list[str]:
    """The config groups conf/ has (for a message; [] where they cannot be listed)."""
    from importlib.resources import files

    try:
        return sorted(p.name for p in files("trainer.conf").iterdir() if p.is_dir() and not p.name.startswith("_"))
    except (ModuleNotFoundError, OSError):
        return []


def _file_in_the_way(path: Path) -> str | None:
    """The first existing part of `path` when it is a file, not a directory (wherever this home dir is shared)."""
    from trainer.io import first_existing

    found = first_existing(path)
    return None if found.is_dir() else f"{found} is not a directory"


def host_notes(overrides: list[str], cfg) -> list[str]:
    """What would stop a run from these defaults on this machine, where another that shares the file (a home dir on
    a cluster's login and compute nodes) may run it: the outputs dir cannot be made here, or the processes
    `world.nproc_per_node=auto` starts here (one per GPU) do not fit the layout. Said, not refused."""
    from omegaconf import OmegaConf

    from trainer.config import schema
    from trainer.config.compose import path_value
    from trainer.io import unwritable

    notes = []
    for override in overrides:
        key, _, value = override.partition("=")
        if key == "outputs" and value:
            value = path_value("outputs", value)
            problem = unwritable(Path(value).expanduser().resolve())
            if problem:
                notes.append(f"runs cannot be written to outputs={value} on this machine ({problem})")
    if schema.launch_config(cfg.world).nproc_per_node == "auto":
        counted = cfg.copy()
        OmegaConf.update(counted, "world.nproc_per_node", schema.nproc_per_node("auto"))
        try:
            schema.validate(counted)
        except ConfigError as e:
            notes.append(f"{str(e).rstrip('.')}, as world.nproc_per_node=auto starts {schema.nproc_per_node('auto')} "
                         "process(es) on this machine (save world.nproc_per_node=N with it to run here)")
    return notes


def replaced_groups(overrides: list[str]) -> tuple[list[str], str | None]:
    """The groups this machine's defaults choose that `overrides` choose otherwise (`logger=none` over the machine's
    `logger=wandb`), and the machine's defaults without them, their choices and the keys under them: the command
    line wins, and the machine's `logger.wandb.project` is not left over under another logger (a traceback) or
    another world (an error about a key the command line never gave)."""
    import yaml

    from trainer.config import schema

    path = defaults_file()
    if not path.is_file():
        return [], None
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return [], None  # (composing it says what is wrong with it)
    if not isinstance(data, dict) or not isinstance(data.get("defaults", []), list):
        return [], None
    machine = {next(iter(e))[len("override /"):]: next(iter(e.values())) for e in data.get("defaults", [])
               if isinstance(e, dict) and len(e) == 1 and str(next(iter(e))).startswith("override /")}
    chosen = {}
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep and key in machine and not key.startswith(("+", "~", "-")):
            try:
                chosen[key] = yaml.safe_load(value)  # (a list of callbacks, [a,b], as the file holds it)
            except yaml.YAMLError:
                chosen[key] = value
    replaced = [g for g, value in chosen.items() if value != machine[g]]
    if not replaced:
        return [], None
    kept = {k: v for k, v in data.items() if k not in replaced}
    for g in replaced:  # several loggers (logger=[wandb,tensorboard]): the machine's settings of those chosen stay
        options = chosen[g] if isinstance(chosen[g], list) else [chosen[g]]
        if g in schema.LIST_GROUPS and isinstance(data.get(g), dict):
            mine = {o: v for o, v in data[g].items() if o in options}
            if mine:
                kept[g] = mine
    kept["defaults"] = [e for e in data.get("defaults", [])
                        if not (isinstance(e, dict) and any(str(k) in {f"override /{g}" for g in replaced} for k in e))]
    if not kept["defaults"]:
        del kept["defaults"]
    text = "# @package _global_\n# (this machine's defaults without the groups the command line chose)\n"
    return replaced, text + (yaml.safe_dump(kept, sort_keys=False) if kept else "{}\n")


_FILTERED: dict[str, str] = {}  # the text of a filtered machine-defaults file -> the scratch dir holding it


def home_for(overrides: list[str]) -> tuple[list[str], str | None]:
    """(the replaced groups, a config home holding the machine's defaults without them), or ([], None)."""
    replaced, text = replaced_groups(overrides)
    if text is None:
        return [], None
    if text not in _FILTERED:
        import atexit
        import shutil
        import tempfile

        scratch = tempfile.mkdtemp(prefix="trainer-machine-")
        (Path(scratch) / "machine").mkdir()
        (Path(scratch) / "machine" / "default.yaml").write_text(text)
        atexit.register(shutil.rmtree, scratch, True)
        _FILTERED[text] = scratch
    return replaced, _FILTERED[text]


def check(text: str):
    """Compose a run with `text` as the machine's defaults, in a scratch config dir, and build its trackers and
    callbacks (whose constructors check their settings and start nothing: logger.wandb.mode=ofline or
    callbacks.early_stopping.patience=-1, saved, would stop every run):
    a mistake is a ConfigError before anything is written. Returns the composed config."""
    import tempfile

    from trainer.config.compose import load
    from trainer.config.instantiate import build_node

    with tempfile.TemporaryDirectory(prefix="trainer-config-") as scratch:
        (Path(scratch) / "machine").mkdir()
        (Path(scratch) / "machine" / "default.yaml").write_text(text)
        with config_home(scratch):
            cfg = load([])
            for node in (cfg.get("logger") or {}).values():
                if node is not None:
                    build_node("logger", node, run_dir=scratch)
            for name, node in (cfg.get("callbacks") or {}).items():  # (their constructors check their settings)
                if node is not None:
                    build_node(f"callbacks.{name}", node)
    return cfg


def _check_as_a_command_line(overrides: list[str]) -> None:
    """Compose `overrides` (outputs= aside) as a run's command line, without machine defaults: a ConfigError naming
    the key and the valid ones when they hold a mistake."""
    import tempfile

    from trainer.config.compose import load

    with tempfile.TemporaryDirectory(prefix="trainer-config-") as scratch, config_home(scratch):
        try:
            load([o for o in overrides if o.split("=", 1)[0] != "outputs"])
        except ConfigError as e:  # (a run's `+KEY=VALUE` for a key of one's own is not a machine default)
            raise ConfigError(str(e).split(" To add a new key on purpose")[0]) from None


@contextlib.contextmanager
def config_home(path: str | None) -> Iterator[None]:
    """$TRAINER_CONFIG_HOME set to `path` for what composes inside (None: as it is), then put back."""
    if path is None:
        yield
        return
    before = os.environ.get(HOME_ENV)
    os.environ[HOME_ENV] = path
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(HOME_ENV, None)
        else:
            os.environ[HOME_ENV] = before


def config(argv: list[str]) -> int:
    """`python -m trainer config ...`: save (replacing any earlier ones), show, or remove this machine's defaults."""
    from trainer.io import atomic_write_text

    path = defaults_file()
    if not argv:
        print(f"machine defaults: {describe()}")
        return 0
    if argv == ["--reset"]:
        if path.is_file():
            path.unlink()
            print(f"removed {path}: runs start from the recipes' defaults again.")
        else:
            print(f"no machine defaults to remove ({path} does not exist).")
        return 0
    text = render(argv)
    try:
        cfg = check(text)
    except ConfigError:
        _check_as_a_command_line(argv)  # names the key, as a run would (Hydra blames the file: "In 'machine/default'")
        raise
    notes = host_notes(argv, cfg)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text)
    except OSError as e:
        from trainer.errors import StorageError

        raise StorageError(f"could not write {path} ({e.strerror or e}): nothing was saved. Set {HOME_ENV} to a "
                           "directory this user can write, or fix the permissions of that one.") from None
    print(f"saved {path} (replacing any earlier defaults). Every run now starts from: {' '.join(argv)}; "
          "debug=smoke and the command line still override them; python -m trainer config --reset removes them.")
    for note in notes:
        print(f"note: {note}.", file=sys.stderr)
    return 0
