"""This machine's defaults, as `accelerate config` keeps them, as a Hydra config rather than a second system.

`python -m trainer config world=ddp world.nproc_per_node=2 precision=bf16 outputs=/scratch/runs` writes
`machine/default.yaml` into the user's config dir (`$TRAINER_CONFIG_HOME`, default `~/.config/trainer`).
conf/config.yaml puts that dir on Hydra's search path and selects `machine: default` (optional) right after
the recipe, so every later run composes it: over the recipe's choices, under `debug=smoke` and the command
line. Group choices become `override /GROUP: OPTION` entries of its defaults list, dotted keys become values,
and `outputs=DIR` is the root of the timestamped run and sweep dirs. `python -m trainer env` shows it.
"""

from __future__ import annotations

import os
from pathlib import Path

from trainer.errors import ConfigError

HOME_ENV = "TRAINER_CONFIG_HOME"  # conf/config.yaml's hydra.searchpath reads the same variable
GROUPS = ("world", "precision", "logger", "callbacks")  # what a machine decides; recipes choose the rest
USAGE = ("python -m trainer config [world=NAME] [world.nproc_per_node=N] [precision=NAME] [logger=NAME] "
         "[outputs=DIR] [KEY=VALUE ...]  (no arguments: show them; --reset: remove them)")


def home() -> Path:
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".config" / "trainer")


def defaults_file() -> Path:
    return home() / "machine" / "default.yaml"


def describe() -> str:
    """What `env` and `config` print: the file and its settings, or how to save some."""
    path = defaults_file()
    if not path.is_file():
        return f"none ({path} does not exist; python -m trainer config KEY=VALUE ... saves them)"
    return f"{path}:\n" + "\n".join(f"  {line}" for line in path.read_text().splitlines() if not line.startswith("#"))


def render(overrides: list[str]) -> str:
    """The Hydra config for `overrides`: a `_global_` option of the `machine` group."""
    import yaml
    from omegaconf import OmegaConf

    from trainer.config.compose import yaml_value

    defaults, values = [], OmegaConf.create({})
    for override in overrides:
        key, sep, value = override.partition("=")
        if not sep or not key or key.startswith(("+", "~", "-")):
            raise ConfigError(f"{override!r} is not a setting: {USAGE}")
        if key == "outputs":
            root = str(Path(value).expanduser().resolve())
            for kind, folder in (("run", root), ("sweep", f"{root}/multirun")):
                OmegaConf.update(values, f"hydra.{kind}.dir", f"{folder}/${{now:%Y-%m-%d}}/${{now:%H-%M-%S}}")
        elif "." not in key:
            if key not in GROUPS:
                raise ConfigError(f"{key}={value}: a machine's defaults choose {', '.join(GROUPS)} (and keys under "
                                  f"them, and outputs=DIR); {key} is the recipe's to choose.")
            defaults.append({f"override /{key}": yaml_value(override)})
        else:
            OmegaConf.update(values, key, yaml_value(override), force_add=True)
    body = OmegaConf.to_container(values)
    text = yaml.safe_dump({**({"defaults": defaults} if defaults else {}), **body}, sort_keys=False)
    return ("# @package _global_\n"
            "# This machine's defaults, read by every run (python -m trainer env shows them). Written by:\n"
            f"# python -m trainer config {' '.join(overrides)}\n" + text)


def check(text: str) -> None:
    """Compose a run with `text` as the machine's defaults, in a scratch config dir: a mistake is a ConfigError
    before anything is written."""
    import tempfile

    from trainer.config.compose import load

    with tempfile.TemporaryDirectory(prefix="trainer-config-") as scratch:
        (Path(scratch) / "machine").mkdir()
        (Path(scratch) / "machine" / "default.yaml").write_text(text)
        before = os.environ.get(HOME_ENV)
        os.environ[HOME_ENV] = scratch
        try:
            load([])
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
    check(text)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, text)
    except OSError as e:
        from trainer.errors import StorageError

        raise StorageError(f"could not write {path} ({e.strerror or e}): nothing was saved. Set {HOME_ENV} to a "
                           "directory this user can write, or fix the permissions of that one.") from None
    print(f"saved {path} (replacing any earlier defaults). Every run now starts from: {' '.join(argv)}; "
          "debug=smoke and the command line still override them; python -m trainer config --reset removes them.")
    return 0
