"""The command line: Hydra at the edge, turning argv into a resolved config and a call to `train`.

Composition errors (unknown keys, unknown group options, wrong types) are caught before Hydra
prints its own advice (whose "use +key=value to append" invites silent typos) and turned into one
paragraph with the nearest valid names, exit code 2.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from . import config as _config  # registers the typed schema with Hydra's ConfigStore
from .errors import ConfigError, TrainerExit, UserError, suggest
from .redaction import redact, scrub, secret_values

CONFIG_MODULE = "trainer.conf"


def debug_enabled() -> bool:
    return bool(os.environ.get("HYDRA_FULL_ERROR") or os.environ.get("TRAINER_DEBUG"))


def report(err: TrainerExit) -> None:
    print(f"error: {err}", file=sys.stderr, flush=True)


# -- friendly composition errors -------------------------------------------------------------------
def _first_of_sweeps(overrides: list[str]) -> list[str]:
    """Multirun sweeps (a=1,2) compose one job at a time; check them with their first value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    out = []
    for o in OverridesParser.create().parse_overrides(overrides):
        if o.is_sweep_override():
            out.append(f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}")
        else:
            out.append(o.input_line)
    return out


def compose(overrides: list[str], config_dir: str | None = None) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    if config_dir:
        overrides = [*overrides, f"hydra.searchpath=[file://{Path(config_dir).resolve()}]"]
    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        return hydra_compose("config", overrides=overrides)


def explain_composition_error(exc: Exception, overrides: list[str], config_dir: str | None) -> ConfigError:
    """Turn a Hydra/OmegaConf composition error into a ConfigError naming the key and the fix."""
    import re

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
    first = msg.strip().splitlines()[0] if msg.strip() else type(exc).__name__
    return ConfigError(f"{first} (see python -m trainer --help for the config groups and their options)")


def _keys_at(path: str, overrides: list[str], config_dir: str | None) -> list[str]:
    try:
        cfg = compose(overrides, config_dir)
        node = OmegaConf.select(cfg, path) if path else cfg
        return [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []
    except Exception:
        return []


def precheck(argv: list[str]) -> None:
    """Compose once up front so mistakes get our message, not Hydra's traceback-style report."""
    from hydra._internal.utils import get_args_parser

    args, _ = get_args_parser().parse_known_args(argv)
    if args.help or args.hydra_help or args.info or args.shell_completion or args.cfg:
        return
    try:
        cfg = compose(_first_of_sweeps(args.overrides), args.config_dir)
    except (Exception, OmegaConfBaseException) as exc:  # hydra raises several unrelated types
        raise explain_composition_error(exc, args.overrides, args.config_dir) from exc
    # Values and targets too, so a mistake ends here, before Hydra creates a run dir.
    _config.validate(cfg)
    _config.check_targets(resolve(cfg))


# -- resolving and recording the config ------------------------------------------------------------
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


def scrub_hydra_files(run_dir: Path, secrets: set[str]) -> None:
    """Hydra records the command line in .hydra/; take secrets given there back out."""
    from .io import atomic_write_text

    for f in (run_dir / ".hydra").glob("*.yaml") if secrets else ():
        text = f.read_text()
        clean = scrub(text, secrets)
        if clean != text:
            atomic_write_text(f, clean)


def save_config(cfg: DictConfig, run_dir: Path) -> Path:
    from .io import atomic_write_text

    path = run_dir / "config.yaml"
    atomic_write_text(path, OmegaConf.to_yaml(OmegaConf.create(redact(OmegaConf.to_container(cfg)))))
    return path


# -- the Hydra task ----------------------------------------------------------------------------------
def run_job(cfg: DictConfig) -> float | None:
    """Hydra's task function: validate, resolve, record, then train here or launch workers."""
    from hydra.core.hydra_config import HydraConfig

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        _config.validate(cfg)
        resolved = resolve(cfg)
        scrub_hydra_files(run_dir, secret_values(OmegaConf.to_container(resolved)))
        _config.check_targets(resolved)
        save_config(resolved, run_dir)
        from .launcher import WorkerFailed, run

        try:
            final = run(resolved, run_dir)
        except WorkerFailed as wf:
            # The root cause, once: a worker's own user error, or its traceback.
            text = wf.text if wf.text.startswith("error:") else f"error: worker rank {wf.rank} failed:\n{wf.text}"
            print(text.rstrip(), file=sys.stderr, flush=True)
            sys.exit(wf.exitcode if wf.exitcode > 0 else 1)
        except KeyboardInterrupt:
            print("interrupted: stopped all processes.", file=sys.stderr, flush=True)
            sys.exit(130)
    except TrainerExit as err:
        if debug_enabled():
            raise
        report(err)
        if isinstance(err, UserError):
            remove_if_unused(run_dir)
        sys.exit(err.exit_code)
    return (final or {}).get("val/loss")


def remove_if_unused(run_dir: Path) -> None:
    """A run that failed before training leaves no run dir behind (but never touches earlier results)."""
    import shutil

    if run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= {".hydra", "config.yaml", f"{Path(sys.argv[0]).stem}.log", "cli.log"}:
        shutil.rmtree(run_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["env"], ["check"]):
        from . import commands

        sys.exit(getattr(commands, argv[0])(argv[1:]))
    from .launcher import follow_torchrun_rank0, is_torchrun_follower

    if is_torchrun_follower():
        sys.exit(follow_torchrun_rank0())
    try:
        precheck(argv)
    except UserError as err:
        if debug_enabled():
            raise
        report(err)
        sys.exit(err.exit_code)
    import hydra

    sys.argv = [sys.argv[0], *argv]
    hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name="config", version_base="1.3")(run_job)()
