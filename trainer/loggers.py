"""Metric loggers. The main process gets real ones; other ranks get `NullLogger`.

Every logger has the same small interface; `LoggerGroup` fans out to several, so the training
loop calls `loggers.log_metrics(...)` once and never asks which trackers are on.
`metrics.jsonl` (`JsonlLogger`) is always written; trackers such as wandb come from `logger=...`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class NullLogger:
    """Does nothing. Base class and the logger of non-main ranks."""

    def log_config(self, config: dict[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_text(self, key: str, text: str, step: int) -> None:
        pass

    def finish(self, summary: dict[str, Any], exit_code: int = 0) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class JsonlLogger(NullLogger):
    """One JSON object per event in `metrics.jsonl` (and eval samples in `samples.jsonl`), flushed as it goes."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.samples_path = Path(run_dir) / "samples.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a")

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()

    def log_text(self, key: str, text: str, step: int) -> None:
        with open(self.samples_path, "a") as f:
            f.write(json.dumps({"step": step, "key": key, "text": text}) + "\n")

    def rewind(self, step: int) -> None:
        """On resume: drop events after `step`, so the file reads as if the run had never stopped."""
        from .io import atomic_write_text

        self._file.close()
        for path in (self.path, self.samples_path):
            if path.exists():
                keep = [ln for ln in path.read_text().splitlines(keepends=True)
                        if ln.strip() and _step_of(ln) is not None and _step_of(ln) <= step]
                atomic_write_text(path, "".join(keep))
        self._file = open(self.path, "a")

    def finish(self, summary: dict[str, Any], exit_code: int = 0) -> None:
        self._file.close()


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None  # a torn last line from a killed run


class LoggerGroup(NullLogger):
    def __init__(self, loggers: list[NullLogger]):
        self.loggers = loggers

    def log_config(self, config):
        for lg in self.loggers:
            lg.log_config(config)

    def log_metrics(self, metrics, step):
        for lg in self.loggers:
            lg.log_metrics(metrics, step)

    def log_text(self, key, text, step):
        for lg in self.loggers:
            lg.log_text(key, text, step)

    def finish(self, summary, exit_code=0):
        for lg in self.loggers:
            lg.finish(summary, exit_code)

    def rewind(self, step: int) -> None:
        for lg in self.loggers:
            if hasattr(lg, "rewind"):
                lg.rewind(step)

    def state_dict(self):
        return {type(lg).__name__: lg.state_dict() for lg in self.loggers}

    def load_state_dict(self, state):
        for lg in self.loggers:
            lg.load_state_dict(state.get(type(lg).__name__, {}))
