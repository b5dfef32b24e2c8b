"""What Hydra repeats within one command, done once (issue 33: start-up; issue 24: the suite's time, where Hydra's
composition was a fifth of all CPU).

- Every composition parses each YAML file of the config tree again and builds its config, and one command
  composes several times (the up-front check `cli.precheck`, each group option it checks alone in
  `compose.check_choices`). `yaml_parsed_once` keeps the config built from each file's text and hands out copies.
- Every composition deep-copies Hydra's config repository, and with it every structured config registered
  in Hydra's ConfigStore (~5 ms), though it only replaces the repository's list of sources.
  `structured_configs_shared` lets the copies share the store, which hands out copies of what it holds anyway.
- Every config of the tree builds an OmegaConf config of every choice made so far, to resolve interpolations in
  its defaults list (`db: ${db_choice}`), whether its list holds one or not (~a fifth of a composition's CPU).
  `defaults_interpolated_where_they_are` builds it only for a list that holds one.
- Before it runs, Hydra composes the whole config once more only to read `hydra.mode` (`Hydra.get_mode`),
  and once more for the run: both are the config `precheck` has composed already (a composition is ~0.15 s of
  CPU, a copy of its result ~6 ms). `precomposed_reused` answers both with it.

Each is in force only inside its `with` (`composing()` holds the first three); none changes what a command
composes (the tests compare).
"""
from __future__ import annotations

import contextlib
import copy
import io
import os
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

# YAML text -> the config `OmegaConf.load` builds from it (never handed out: each load gets a copy). The texts are
# the config tree's files: a few hundred small strings at most; the bound is for a long-lived process that composes
# configs from many directories.
_PARSED: OrderedDict[str | bytes, Any] = OrderedDict()
_BOUND = 1024


@contextlib.contextmanager
def yaml_parsed_once() -> Iterator[None]:
    """Inside, `OmegaConf.load` of an open file (how Hydra's config sources read every config) builds the config
    of a text it has read before only once. The config is a function of the text alone: each load returns a
    copy of the one `OmegaConf.load` built from it. Paths and errors go to the original."""
    original = OmegaConf.__dict__["load"]
    if getattr(original, "_parses_once", False):  # (nested: already in force)
        yield
        return

    def load(file_):
        if not hasattr(file_, "read"):
            return original.__func__(file_)
        start = file_.tell() if _seekable(file_) else None
        text = file_.read()
        cfg = _PARSED.get(text)
        if cfg is None:
            try:
                cfg = original.__func__(_again(None, None, text))
            except Exception:  # noqa: BLE001 - OmegaConf's own error, which names the file: nothing is kept
                return original.__func__(_again(file_, start, text))
            _PARSED[text] = cfg
            if len(_PARSED) > _BOUND:
                _PARSED.popitem(last=False)
        # A copy of the config built from the text (half the CPU of building it again from the parse).
        return copy.deepcopy(cfg)

    load._parses_once = True
    OmegaConf.load = staticmethod(load)
    try:
        yield
    finally:
        OmegaConf.load = original


@contextlib.contextmanager
def structured_configs_shared() -> Iterator[None]:
    """Inside, a deep copy of Hydra's structured config source (made by every composition's
    `CachingConfigRepository`) shares the ConfigStore instead of copying all it holds. The copy exists so that
    the composition can replace the repository's sources; nothing writes into the store, and `ConfigStore.load`
    hands out a deep copy of each config it loads."""
    from hydra.core.plugins import Plugins

    # Hydra's first scan of its plugins runs each module of hydra._internal.core_plugins again, which makes a new
    # StructuredConfigSource class: one patched before the scan was not the one the repository's source had, and
    # every composition of a fresh process copied the whole store (--help composes ~100 times: 2 s, not 0.7).
    Plugins.instance()
    from hydra._internal.core_plugins.structured_config_source import StructuredConfigSource

    if "__deepcopy__" in StructuredConfigSource.__dict__:  # (nested, or another Hydra's own copy)
        yield
        return
    StructuredConfigSource.__deepcopy__ = lambda self, memo: copy.copy(self)
    try:
        yield
    finally:
        del StructuredConfigSource.__deepcopy__


@contextlib.contextmanager
def defaults_interpolated_where_they_are() -> Iterator[None]:
    """Inside, Hydra's map of the choices known so far (`_create_interpolation_map`), which a config's defaults list
    resolves its interpolations against, is built only for a list that holds an interpolation. Hydra reads it only
    for a child of the config that is one, and every such child is an entry of the list it is given."""
    from hydra._internal import defaults_list as hydra_defaults

    original = hydra_defaults.__dict__.get("_create_interpolation_map")
    if original is None or getattr(original, "_where_used", False):  # (another Hydra, or nested)
        yield
        return

    def create(overrides, defaults_list, self_added):
        if not any(d.is_interpolation() for d in defaults_list):
            return None
        return original(overrides, defaults_list, self_added)

    create._where_used = True
    hydra_defaults._create_interpolation_map = create
    try:
        yield
    finally:
        hydra_defaults._create_interpolation_map = original


@contextlib.contextmanager
def composing() -> Iterator[None]:
    """`yaml_parsed_once`, `structured_configs_shared` and `defaults_interpolated_where_they_are`: where a command or
    `trainer.compose` composes."""
    with yaml_parsed_once(), structured_configs_shared(), defaults_interpolated_where_they_are():
        yield


@dataclass
class Precomposed:
    """What `cli.precheck` composed for a command: its `hydra.mode`, and for a command of one job the whole
    config (its `hydra` node included) with what it was composed from: the overrides, the config sources and
    the working directory (Hydra records it in `hydra.runtime.cwd`)."""

    mode: Any = None
    launcher: str = ""  # hydra.launcher._target_ (a sweep's too)
    overrides: list[str] | None = None
    config: DictConfig | None = None
    sources: list[tuple[str, str, str]] | None = None
    cwd: str | None = None

    def take(self, loader, config_name: str | None, overrides: list[str], run_mode) -> DictConfig | None:
        """The config Hydra's run would compose for these arguments, if it is the one precheck composed; else None.
        Hydra's run appends `hydra.mode=RUN` to the overrides when no config set a mode (`_run_app`): a value
        override, applied after composition as Hydra applies every value override, last. Handed out once
        (Hydra's run writes into it)."""
        from hydra.types import RunMode

        n = len(self.overrides or [])
        extra = list(overrides[n:])
        if (self.config is None or config_name != "config" or run_mode != RunMode.RUN or os.getcwd() != self.cwd
                or list(overrides[:n]) != self.overrides or extra not in ([], ["hydra.mode=RUN"])
                or config_sources(loader) != self.sources):
            return None
        cfg, self.config = self.config, None
        if extra:
            from hydra._internal.config_loader_impl import ConfigLoaderImpl
            from hydra.core.override_parser.overrides_parser import OverridesParser

            ConfigLoaderImpl._apply_overrides_to_config(OverridesParser.create().parse_overrides(extra), cfg)
            cfg.hydra.overrides.hydra.extend(extra)  # (where Hydra's composition records a hydra.* override)
        return cfg


def config_sources(loader) -> list[tuple[str, str, str]]:
    """A config loader's search path, before the config's own `hydra.searchpath` (which both compose alike)."""
    return [(type(s).__name__, s.provider, s.path) for s in loader.get_sources()]


@contextlib.contextmanager
def precomposed_reused(known: Precomposed) -> Iterator[None]:
    """Inside, Hydra's `get_mode` (a whole composition, only to read `hydra.mode`) returns `known.mode`, and
    Hydra's run takes the config precheck composed for the same arguments instead of composing it again (it
    compares the overrides, the config sources and the working directory; any other composition runs as
    always). Without these internals (another Hydra version), Hydra composes as it always did."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.hydra import Hydra

    get_mode = Hydra.__dict__.get("get_mode")
    load = ConfigLoaderImpl.__dict__.get("load_configuration")
    if get_mode is None or load is None:
        yield
        return

    def load_configuration(self, config_name, overrides, run_mode, *args, **kwargs):
        cfg = known.take(self, config_name, overrides, run_mode)
        return load(self, config_name, overrides, run_mode, *args, **kwargs) if cfg is None else cfg

    Hydra.get_mode = lambda self, config_name, overrides: known.mode
    ConfigLoaderImpl.load_configuration = load_configuration
    try:
        yield
    finally:
        Hydra.get_mode = get_mode
        ConfigLoaderImpl.load_configuration = load


def _seekable(file_) -> bool:
    try:
        return file_.seekable()
    except (AttributeError, OSError, ValueError):
        return False


def _again(file_, start: int | None, text):
    """`file_` as it was before this module read it."""
    if start is not None:
        file_.seek(start)
        return file_
    return io.BytesIO(text) if isinstance(text, bytes) else io.StringIO(text)
