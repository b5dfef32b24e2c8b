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

    def log_image(self, key: str, image, step: int) -> None:
        """`image`: a tensor [H, W], [H, W, C] or [C, H, W], uint8 or float in [0, 1] (see trainer/tracking/images.py)."""

    def finish(self, summary: dict[str, Any], exit_code: int = 0) -> None:
        pass

    def rewind(self, step: int) -> None:
        """On resume from a checkpoint at `step`: forget what was logged after it."""

    def take_branch(self, after: int, suffix: str, upto: int, run_dir: Path) -> None:
        """Going back to step `upto` of a branch set aside, which left the run's line after step `after`: this
        history keeps its events up to `after`, then that branch's own (its kept copy, named with `suffix`:
        metrics.prev-2.jsonl for ".prev-2") up to `upto`. Where they cannot be copied, those of the branch left
        are dropped after `after`; a logger whose history is a tracker's run (wandb) rewinds to `upto`."""
        self.rewind(upto)

    def start_fresh(self) -> None:
        """A run dir's run starts over (no usable checkpoint): set what an earlier attempt logged aside."""

    def keep_copy(self) -> list[Path]:
        """Before a rollback's rewind: copy what was logged (the abandoned branch's whole history) to where a fresh
        start would set it aside; returns the copies."""
        return []

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class JsonlLogger(NullLogger):
    """One JSON object per event in `metrics.jsonl`, eval samples in `samples.jsonl` (text, and the paths of
    images written as PNG under `samples/`), flushed as it goes."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.samples_path = Path(run_dir) / "samples.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        images = self.path.parent / "samples"
        if os.path.lexists(images) and not images.is_dir():  # (the first eval's image stopped the run, after its
            from trainer.errors import ConfigError  # steps, saying to free disk space)

            raise ConfigError(f"{images} is a file where the run's eval images go (samples/step_N.png); nothing was "
                              "trained. Move it, or give the run another dir (hydra.run.dir=...).")
        try:
            self._file = _appending(self.path)
        except OSError as e:  # (a directory in its place, a read-only file: a traceback before the first step)
            from trainer.errors import StorageError

            raise StorageError(f"could not open {self.path} to append the run's metrics ({e.strerror or e}); nothing "
                               "was trained. Make it a writable file (or move what is in its place), or give the run "
                               "another dir (hydra.run.dir=...).") from None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        try:
            _append(self._file, json.dumps({"step": step, **metrics}) + "\n")
        except OSError as e:
            raise _unwritable(self.path, e, step) from None

    def log_text(self, key: str, text: str, step: int) -> None:
        self._sample({"step": step, "key": key, "text": text})

    def log_image(self, key: str, image, step: int) -> None:
        from trainer.io import atomic_write_bytes
        from trainer.tracking.images import png_bytes

        name = key.rsplit("/", 1)[-1]
        path = self.path.parent / "samples" / (f"step_{step}.png" if name == "image" else f"{name}_step_{step}.png")
        try:
            atomic_write_bytes(path, png_bytes(image))
        except OSError as e:
            raise _unwritable(path, e, step) from None
        self._sample({"step": step, "key": key, "image": str(path.relative_to(self.path.parent))})

    def _sample(self, event: dict) -> None:
        try:
            with _appending(self.samples_path) as f:
                _append(f, json.dumps(event) + "\n")
        except OSError as e:
            raise _unwritable(self.samples_path, e, event["step"]) from None

    def rewind(self, step: int) -> None:
        """On resume: drop events after `step`, so the file reads as if the run had never stopped."""
        from trainer.io import atomic_write_text

        self._file.close()
        for path in (self.path, self.samples_path):
            if path.exists():
                keep = [ln for ln in path.read_text().splitlines(keepends=True)
                        if ln.strip() and _step_of(ln) is not None and _step_of(ln) <= step]
                atomic_write_text(path, "".join(keep))
        self._file = _appending(self.path)

    def take_branch(self, after: int, suffix: str, upto: int, run_dir: Path) -> None:
        self.rewind(after)
        self._file.close()
        for path in (self.path, self.samples_path):
            kept = path.with_name(path.stem + suffix + path.suffix)
            if kept.is_file():
                lines = [ln for ln in kept.read_text().splitlines(keepends=True)
                         if ln.strip() and _step_of(ln) is not None and after < _step_of(ln) <= upto]
                with open(path, "a") as f:
                    f.writelines(ln if ln.endswith("\n") else ln + "\n" for ln in lines)
        self._file = _appending(self.path)

    def start_fresh(self) -> None:
        """Keep an earlier attempt's events as `metrics.prev.jsonl` (and `samples.prev.jsonl`; where those exist, as
        `metrics.prev-2.jsonl`, then -3, ...: the highest number is the newest), start empty."""
        from trainer.io import free_name

        self._file.close()
        for path in (self.path, self.samples_path):
            if path.exists() and path.stat().st_size:
                path.replace(free_name(path, ".prev", before_suffix=True))
        self._file = _appending(self.path)

    def keep_copy(self) -> list[Path]:
        import shutil

        from trainer.io import free_name

        self._file.flush()
        copies = []
        for path in (self.path, self.samples_path):
            if path.exists() and path.stat().st_size:
                copies.append(free_name(path, ".prev", before_suffix=True))
                shutil.copyfile(path, copies[-1])
        return copies

    def finish(self, summary: dict[str, Any], exit_code: int = 0) -> None:
        try:
            self._file.close()
        except OSError:  # (its buffered line could not be written either: the write that failed said so)
            pass

    def __del__(self) -> None:  # (a run refused after its loggers were made never finishes them: trainer.train in a
        file = getattr(self, "_file", None)  # notebook held the file open, then the collector warned of it)
        if file is not None:
            try:
                file.close()
            except OSError:
                pass


def _appending(path: Path):
    """The file opened to append, unbuffered: each line goes to the file in the write `_append` makes."""
    return open(path, "ab", buffering=0)


def _append(f, line: str) -> None:
    """`line` appended whole, or not at all: a write that fails part way (a full disk) is cut back to where the file
    ended, so that no reader (a dashboard, pandas, a run that is not resumed) meets a torn last line."""
    data = memoryview(line.encode())
    end = os.fstat(f.fileno()).st_size
    try:
        while data:
            data = data[f.write(data):]
    except OSError:
        try:
            os.ftruncate(f.fileno(), end)
        except OSError:
            pass
        raise


def _unwritable(path: Path, e: OSError, step: int):
    """A metrics file that cannot be written (a full disk): the run stops there (exit 74), as at a checkpoint."""
    from trainer.errors import StorageError

    return StorageError(f"could not write {path} at step {step} ({e.strerror or e}), so the run stopped; its "
                        "checkpoints are as they were. Free disk space (or make the run dir writable) and continue "
                        "with resume=auto: from the newest checkpoint, writing the events after it again.")


def last_step(path: Path) -> int | None:
    """The step of the last readable event of a metrics.jsonl (None when it has none)."""
    steps = [_step_of(line) for line in path.read_text().splitlines() if line.strip()]
    return next((s for s in reversed(steps) if s is not None), None)


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None  # a torn last line from a killed run


class LoggerGroup(NullLogger):
    """Fans out to several loggers. Text (a generated sample may echo anything) is redacted here, once for
    all of them: every secret value of the environment and of the config's secret keys is replaced."""

    def __init__(self, loggers: list[NullLogger]):
        self.loggers = loggers
        self._config: dict[str, Any] | None = None

    def log_config(self, config):
        self._config = config
        for lg in self.loggers:
            lg.log_config(config)

    def log_metrics(self, metrics, step):
        for lg in self.loggers:
            lg.log_metrics(metrics, step)

    def log_text(self, key, text, step):
        from trainer.redaction import redact_text

        text = redact_text(text, self._config)
        for lg in self.loggers:
            lg.log_text(key, text, step)

    def log_image(self, key, image, step):
        for lg in self.loggers:
            lg.log_image(key, image, step)

    def finish(self, summary, exit_code=0):
        for lg in self.loggers:
            lg.finish(summary, exit_code)

    def rewind(self, step: int) -> None:
        for lg in self.loggers:
            lg.rewind(step)

    def take_branch(self, after: int, suffix: str, upto: int, run_dir: Path) -> None:
        for lg in self.loggers:
            lg.take_branch(after, suffix, upto, run_dir)

    def start_fresh(self) -> None:
        for lg in self.loggers:
            lg.start_fresh()

    def keep_copy(self) -> list[Path]:
        return [p for lg in self.loggers for p in lg.keep_copy()]

    def state_dict(self):
        return {type(lg).__name__: lg.state_dict() for lg in self.loggers}

    def load_state_dict(self, state):
        for lg in self.loggers:
            lg.load_state_dict(state.get(type(lg).__name__, {}))
