"""Loggers of a user's own, for `+logger.mine._target_=own_logger.X` (tests/test_metrics.py): one that subclasses
NullLogger and records what the run gives it in a JSON-lines file of its own, and a plain class that does not."""

from __future__ import annotations

import json
from pathlib import Path

from trainer.tracking.loggers import NullLogger


class Recorder(NullLogger):
    def __init__(self, run_dir: str, name: str = "mine"):
        self.path = Path(run_dir) / f"{name}.jsonl"

    def _write(self, kind: str, **fields) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"kind": kind, **fields}) + "\n")

    def log_config(self, config):
        self._write("config", lr=config["optim"]["lr"])

    def log_metrics(self, metrics, step):
        self._write("metrics", step=step, keys=sorted(metrics))

    def finish(self, summary, exit_code=0):
        self._write("finish", exit_code=exit_code)


class NotALogger:
    def __init__(self, run_dir: str):
        self.run_dir = run_dir

    def log_metrics(self, metrics, step):
        pass
