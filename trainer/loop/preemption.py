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
        return self

    def uninstall(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()
