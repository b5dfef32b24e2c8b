"""Turning SIGTERM / SIGUSR1 (a scheduler's preemption notice) into a flag the loop checks.

The handler only sets a flag. The loop reduces it over ranks at the next step boundary, so every
rank stops at the same step, a checkpoint is saved, and the process exits with `Preempted.exit_code`.
"""

from __future__ import annotations

import signal
import threading


class PreemptionFlag:
    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.requested = False
        self.signum: int | None = None
        self._previous = {}

    def _handler(self, signum, frame):
        # The first signal is the one to name: a scheduler's SIGUSR1 notice followed by its SIGTERM is one preemption.
        if not self.requested:
            self.requested, self.signum = True, signum

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def install(self) -> PreemptionFlag:
        if not self._previous and threading.current_thread() is threading.main_thread():  # handlers live there only
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handler)
            if _early is not None and _early is not self and _early.installed:  # the run's flag takes the command's over
                self.requested, self.signum = _early.requested, _early.signum
                self._previous = dict(_early._previous)
                _early._previous.clear()
        return self

    def uninstall(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()


_early: PreemptionFlag | None = None


def hold_early() -> PreemptionFlag:
    """A flag from a training command's first lines (`python -m trainer ...`), before the run's own exists: a stop
    signal while Python imports and Hydra composes is kept, not fatal (exit 143 with nothing said). The first flag
    the run installs takes it over, signal included, so the run stops with exit 75 before its first step as
    documented; a command that installs none releases it (`release_early`) and stops there with exit 75."""
    global _early
    _early = PreemptionFlag().install()
    return _early


def release_early() -> int | None:
    """The signal the command's early flag caught, if no run took it over; the default handlers back either way."""
    flag = _early
    if flag is None or not flag.installed:
        return None
    flag.uninstall()
    return flag.signum if flag.requested else None
