"""Two things Hydra repeats within one command, done once (issue 33: start-up; half of a short run's CPU).

- Every composition parses each YAML file of the config tree again, and one command composes several times:
  the up-front check (`cli.precheck`), each group option it checks alone (`compose.check_choices`), and
  Hydra's run. `yaml_parsed_once` keeps the parse of each file's text and hands out fresh copies.
- Before it runs, Hydra composes the whole config once more only to read `hydra.mode` (`Hydra.get_mode`),
  which `precheck` has composed already. `hydra_mode_known` answers it with that value.

Each is in force only inside its `with`; neither changes what a command composes (the tests compare).
"""

from __future__ import annotations

import contextlib
import copy
import io
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from omegaconf import OmegaConf

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


@contextlib.contextmanager
def hydra_mode_known(mode) -> Iterator[None]:
    """Inside, Hydra's `get_mode` (a whole composition, only to read `hydra.mode`) returns `mode`: the
    `hydra.mode` of the config `precheck` composed for this command (None unless a config or an override sets it).
    Without `Hydra.get_mode` (another Hydra version), Hydra composes as it always did."""
    from hydra._internal.hydra import Hydra

    original = Hydra.__dict__.get("get_mode")
    if original is None:
        yield
        return
    Hydra.get_mode = lambda self, config_name, overrides: mode
    try:
        yield
    finally:
        Hydra.get_mode = original


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
