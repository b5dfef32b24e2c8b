"""Callbacks: code that runs at fixed points of the loop, selected by config (`callbacks=early_stopping`).

A callback implements any of the hooks below; each gets the Trainer. They run on every rank, in config
order; a callback that writes files should do so on the main rank (`trainer.backend.is_main`). A stateful
callback's `state_dict()` is saved in checkpoints (under its config name) and restored on resume. To stop
the run, call `trainer.request_stop(reason)`: every rank sees the same metrics at an eval, so they stop at
the same step, with a final checkpoint and export as after the last step.

    on_step_end(trainer)              after each optimizer step
    on_eval_end(trainer, metrics)     after each eval (metrics: val/..., and sample metrics)
    on_save(trainer, path)            after a checkpoint is handed to the checkpointer
    on_fit_end(trainer, metrics)      after the loop (metrics: the final ones)
"""

from __future__ import annotations

import math
from typing import Any

from trainer.config.targets import call_refused
from trainer.errors import ConfigError

HOOKS = ("on_step_end", "on_eval_end", "on_save", "on_fit_end")


class Callback:
    """The do-nothing base: override the hooks you need."""

    def on_step_end(self, trainer) -> None:
        pass

    def on_eval_end(self, trainer, metrics: dict[str, float]) -> None:
        pass

    def on_save(self, trainer, path) -> None:
        pass

    def on_fit_end(self, trainer, metrics: dict[str, float]) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Callbacks(Callback):
    """The configured callbacks by name, called in turn; their states saved under their names."""

    def __init__(self, callbacks: dict[str, Any] | None = None):
        self.callbacks = dict(callbacks or {})
        for name, cb in self.callbacks.items():
            if not any(callable(getattr(cb, h, None)) for h in HOOKS):
                raise ConfigError(f"callbacks.{name} ({type(cb).__name__}) has none of the hooks {', '.join(HOOKS)}.")
            for hook, args in (("on_step_end", 1), ("on_eval_end", 2), ("on_save", 2), ("on_fit_end", 2)):
                fn = getattr(cb, hook, None)
                # (a wrong signature was a bare TypeError at the first eval, the steps unsaved)
                if callable(fn) and call_refused(fn, *[None] * args):
                    takes = "trainer" if args == 1 else f"trainer, {'path' if hook == 'on_save' else 'metrics'}"
                    raise ConfigError(f"callbacks.{name}.{hook} ({type(cb).__name__}) must take ({takes}): "
                                      f"def {hook}(self, {takes}).")
            saves, loads = hasattr(cb, "state_dict"), hasattr(cb, "load_state_dict")
            if saves != loads:  # (its state was saved and never given back at a resume: started over in silence)
                raise ConfigError(f"callbacks.{name} ({type(cb).__name__}) has {'state_dict' if saves else 'load_state_dict'}"
                                  f" but no {'load_state_dict' if saves else 'state_dict'}: a checkpoint keeps a "
                                  "callback's state with the one and a resume gives it back with the other. Define "
                                  "both (or neither, for a callback without state).")

    def _each(self, hook: str, *args) -> None:
        for cb in self.callbacks.values():
            fn = getattr(cb, hook, None)
            if fn is not None:
                fn(*args)

    def on_step_end(self, trainer) -> None:
        self._each("on_step_end", trainer)

    def on_eval_end(self, trainer, metrics) -> None:
        self._each("on_eval_end", trainer, metrics)

    def on_save(self, trainer, path) -> None:
        self._each("on_save", trainer, path)

    def on_fit_end(self, trainer, metrics) -> None:
        self._each("on_fit_end", trainer, metrics)

    def state_dict(self) -> dict[str, Any]:
        return {name: cb.state_dict() for name, cb in self.callbacks.items() if hasattr(cb, "state_dict")}

    def check_state(self, state: dict[str, Any], where: str) -> None:
        """Refuse a saved state a callback could not use (checked before anything of a checkpoint is applied)."""
        for name, cb in self.callbacks.items():
            if hasattr(cb, "check_state") and name in state:
                cb.check_state(state[name], f"{where}.{name}")

    def settings_changed(self, keys: list[str]) -> list[str]:
        """After a resume: the settings (dotted keys) that differ from the checkpoint's, passed to each callback that
        keeps state by them (`settings_changed(its own keys)`); what they say."""
        said = []
        for name, cb in self.callbacks.items():
            own = {k[len(f"callbacks.{name}."):] for k in keys if k.startswith(f"callbacks.{name}.")}
            if own and hasattr(cb, "settings_changed"):
                said += cb.settings_changed(own, f"callbacks.{name}")
        return said

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, cb in self.callbacks.items():
            if hasattr(cb, "load_state_dict") and name in state:
                cb.load_state_dict(state[name])


class EarlyStopping(Callback):
    """Stop when `monitor` (an eval metric) has not improved by more than `min_delta` for `patience` evals in a
    row. As Lightning's: mode=min for a loss, max for an accuracy."""

    def __init__(self, monitor: str = "val/loss", mode: str = "min", patience: int = 3, min_delta: float = 0.0):
        if not isinstance(monitor, str) or not monitor.startswith(("val/", "val_ema/")):  # (found at the first eval)
            raise ConfigError(f"callbacks.early_stopping.monitor={monitor!r} is invalid: expected a metric logged at "
                              "eval, e.g. val/loss, val_ema/loss or a sample metric (val/class_match).")
        if mode not in ("min", "max"):
            raise ConfigError(f"callbacks.early_stopping.mode={mode!r} is invalid: expected 'min' or 'max'.")
        if not isinstance(patience, int) or patience < 1:
            raise ConfigError(f"callbacks.early_stopping.patience={patience!r} is invalid: expected an integer >= 1.")
        if not min_delta >= 0:
            raise ConfigError(f"callbacks.early_stopping.min_delta={min_delta!r} is invalid: expected a number >= 0.")
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, min_delta
        self.best: float | None = None
        self.bad_evals = 0

    def on_eval_end(self, trainer, metrics: dict[str, float]) -> None:
        if self.monitor not in metrics:
            raise ConfigError(f"callbacks.early_stopping.monitor={self.monitor!r} is not among this run's eval metrics "
                              f"({', '.join(sorted(metrics))}). Pick one of them.")
        value = metrics[self.monitor]
        better = math.isfinite(value) and (self.best is None or (
            value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta))
        if better:
            self.best, self.bad_evals = value, 0
            return
        self.bad_evals += 1
        if self.bad_evals >= self.patience:
            trainer.request_stop(f"early stopping: {self.monitor} has not improved on {self.best:.6g} for "
                                 f"{self.bad_evals} evals (patience={self.patience}, min_delta={self.min_delta})")

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_evals": self.bad_evals}

    def check_state(self, state: dict[str, Any], where: str) -> None:
        from trainer.errors import CheckpointError

        best, bad = state.get("best"), state.get("bad_evals", 0)
        if best is not None and (isinstance(best, bool) or not isinstance(best, (int, float))):
            raise CheckpointError(f"{where}.best={best!r} is not a metric value.")
        if isinstance(bad, bool) or not isinstance(bad, int) or not 0 <= bad < 2**62:
            raise CheckpointError(f"{where}.bad_evals={bad!r} is not a count.")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.bad_evals = state.get("best"), int(state.get("bad_evals", 0))

    def settings_changed(self, keys: set[str], where: str) -> list[str]:
        """A resume with another monitor or mode: the checkpoint's best is the old metric's (a loss's best against an
        accuracy), so the best and the count of evals without improvement start over."""
        if not keys & {"monitor", "mode"} or self.best is None:
            return []
        old, self.best, self.bad_evals = self.best, None, 0
        return [f"resume: {where} watches {self.monitor} ({self.mode}) where the checkpoint's watched another metric "
                f"or mode (its best, {old:.6g}, was that one's): the best and the patience count start over at the "
                "next eval."]
