"""Two things Hydra repeats within one command, done once (issue 33: start-up; half of a short run's CPU).

- Every composition parses each YAML file of the config tree again, and one command composes several times:
  the up-front check (`cli.precheck`), each group option it checks alone (`compose.check_choices`), and
  Hydra's run. `yaml_parsed_once` keeps the parse of each file's text and hands out fresh copies.
- Before it runs, Hydra composes the whole config once more only to read `hydra.mode` (`Hydra.get_mode`),
  and once more for the run: both are the config `precheck` has composed already (a composition is ~0.15 s of
  CPU, a copy of its result ~6 ms). `precomposed_reused` answers both with it.

Each is in force only inside its `with`; neither changes what a command composes (the tests compare).
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

# YAML text -> its parse (plain dicts, lists and scalars). The texts are the config tree's files: a few hundred
# small strings at most; the bound is for a long-lived process that composes configs from many directories.
_PARSED: OrderedDict[str | bytes, Any] = OrderedDict()
_BOUND = 1024
_UNSEEN = object()


@contextlib.contextmanager
def yaml_parsed_once() -> Iterator[None]:
    """Inside, `OmegaConf.load` of an open file (how Hydra's config sources read every config) parses a text it
    has parsed before only once. A YAML parse is a function of the text alone: the config each load returns is
    a new one, built as `OmegaConf.load` builds it, from a copy of the parse. Paths and errors go to the original."""
    original = OmegaConf.__dict__["load"]
    if getattr(original, "_parses_once", False):  # (nested: already in force)
        yield
        return

    def load(file_):
        if not hasattr(file_, "read"):
            return original.__func__(file_)
        start = file_.tell() if _seekable(file_) else None
        text = file_.read()
        obj = _PARSED.get(text, _UNSEEN)
        if obj is _UNSEEN:
            import yaml
            from omegaconf._utils import get_yaml_loader

            try:
                obj = yaml.load(text, Loader=get_yaml_loader())
                usable = obj is None or isinstance(obj, (list, dict, str))
            except yaml.YAMLError:
                usable = False
            if not usable:  # OmegaConf's own error, which names the file: nothing is kept
                return original.__func__(_again(file_, start, text))
            _PARSED[text] = obj
            if len(_PARSED) > _BOUND:
                _PARSED.popitem(last=False)
        obj = copy.deepcopy(obj)
        return OmegaConf.create() if obj is None else OmegaConf.create(obj)

    load._parses_once = True
    OmegaConf.load = staticmethod(load)
    try:
        yield
    finally:
        OmegaConf.load = original


@dataclass
class Precomposed:
    """What `cli.precheck` composed for a command: its `hydra.mode`, and for a command of one job the whole
    config (its `hydra` node included) with what it was composed from: the overrides, the config sources and
    the working directory (Hydra records it in `hydra.runtime.cwd`)."""

    mode: Any = None
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
