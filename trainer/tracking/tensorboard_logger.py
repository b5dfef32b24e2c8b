"""TensorBoard logger: `logger=tensorboard` (conf/logger/tensorboard.yaml).

Writes TensorBoard event files with `torch.utils.tensorboard.SummaryWriter` into `<run dir>/tensorboard/`:
every metric as a scalar at its step, the resolved config (secrets redacted) and eval samples as text,
image samples as images. `tensorboard --logdir outputs` shows every run below that folder.

tensorboard is imported only when the first event is written, so `--help` and runs without this logger
never pay for it; the constructor (which the framework calls before any worker starts) only checks that
the package is installed. Events are flushed as they are logged, like metrics.jsonl, so a killed run
keeps everything it logged.

A resumed run continues the same curves, each step once, for every reader:
- `rewind(step)` rewrites the earlier event files without what they hold after `step` (as metrics.jsonl
  is rewound), so a TensorBoard started later, or any other reader of the files, sees each step once;
- each attempt's first writer starts with a `SessionLog.START` at its first step (`purge_step`), so a
  TensorBoard that read the dead attempt's events live drops those after the resume's START. The UI's
  reader (plugin_event_accumulator) ignores a run's first START: without one in the first attempt's
  file, the resume's START purged nothing.
"""

from __future__ import annotations

import os
from io import BytesIO
from pathlib import Path
from typing import Any

from trainer.errors import ConfigError
from trainer.io import atomic_write_bytes, free_name
from trainer.redaction import redact
from trainer.tracking.loggers import NullLogger

OWNER = "trainer_run.txt"  # in a logger.tensorboard.dir of the user's choosing: the run dir whose events it holds


class TensorBoardLogger(NullLogger):
    """Logs metrics, the resolved config and eval samples (text and images) as TensorBoard events.

    Args:
        dir: the folder for the event files; None = `<run_dir>/tensorboard`.
        run_dir: the run's output directory (passed by the framework).
    """

    def __init__(self, *, run_dir: str | os.PathLike, dir: str | None = None):
        try:
            import tensorboard  # noqa: F401 - only checks that it is installed; cheap (its modules load lazily)
        except ImportError:
            raise ConfigError(
                "logger=tensorboard needs the tensorboard package, which is not installed here. Install it with "
                "`pip install tensorboard` (in this repository: pip install -e '.[tensorboard]'), or drop "
                "tensorboard from logger=."
            ) from None
        if dir is not None and not isinstance(dir, (str, os.PathLike)):
            if isinstance(dir, bool) or not isinstance(dir, (int, float)):
                raise ConfigError(f"logger.tensorboard.dir={dir!r} is not a directory path: give one, or null for "
                                  "<run dir>/tensorboard.")
            dir = str(dir)  # (logger.tensorboard.dir=123 on the command line: a dir named 123, read as a number)
        self.dir = Path(dir).expanduser() if dir is not None else Path(run_dir) / "tensorboard"
        # A dir of the user's choosing may hold another run's events: TensorBoard shows one dir as one run, so
        # this run's curves would merge with those, its START purge them, a resume cut them and a rerun move them.
        self._owner = str(Path(run_dir).expanduser().resolve()) if dir is not None else None
        if self._owner is not None:
            self._check_owner(dir, Path(run_dir))
        self._writer = None  # opened at the first event: building the logger writes nothing
        self._first_step = 0  # the step a run (or a resumed run) starts from: where its config text goes
        self._session_start: int | None = 1  # the START marker of this attempt's first writer

    def _check_owner(self, given: str, run_dir: Path) -> None:
        for above in self.dir.resolve().parents:  # inside another run's dir: its restart moves this one's events too
            try:
                owner = (above / OWNER).read_text().strip()
            except OSError:
                continue
            if owner != self._owner:
                raise ConfigError(f"logger.tensorboard.dir={given} is inside {above}, the TensorBoard dir of the run "
                                  f"{owner}: that run's rerun moves its dir aside, with this run's events in it. Give "
                                  f"each run a dir beside the others, e.g. logger.tensorboard.dir={above.parent}/NAME; "
                                  f"`tensorboard --logdir {above.parent}` shows them side by side.")
        if not (self.dir.is_dir() and any(self.dir.glob("events.out.tfevents.*"))):
            return
        try:
            owner = (self.dir / OWNER).read_text().strip()
        except OSError:
            owner = None
        metrics = run_dir / "metrics.jsonl"  # (non-empty: the metrics logger, built first, makes an empty one)
        if owner is None and metrics.is_file() and metrics.stat().st_size:
            return  # (a run dir with a history of its own, from before the owner file: its events; claimed when written)
        if owner != self._owner:
            whose = f"the run {owner}" if owner else "events this run did not write"
            raise ConfigError(f"logger.tensorboard.dir={given} holds {whose}: TensorBoard shows one dir as one run, so "
                              "this run's curves would be merged with those there (and its restart would purge or "
                              "move them). Give each run a dir of its own beside it, e.g. logger.tensorboard.dir="
                              f"{self.dir.parent}/NAME; `tensorboard --logdir {self.dir.parent}` shows them side by "
                              "side.")

    def _events(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            if self._owner is not None and not (self.dir / OWNER).is_file():  # (first: events without it are refused)
                self.dir.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(self.dir / OWNER, f"{self._owner}\n".encode())
            # purge_step writes SessionLog.START at that step: readers drop earlier events at or after it.
            self._writer = SummaryWriter(log_dir=str(self.dir), purge_step=self._session_start)
            self._session_start = None  # a writer reopened within this attempt must not purge its own events
        return self._writer

    # -- the logger interface ----------------------------------------------------------------------
    def log_config(self, config: dict[str, Any]) -> None:
        from omegaconf import OmegaConf

        text = OmegaConf.to_yaml(OmegaConf.create(redact(config)))
        self._events().add_text("config", as_code_block(text), self._first_step)
        self._writer.flush()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        events = self._events()
        for key, value in metrics.items():
            events.add_scalar(key, value, step)
        events.flush()

    def log_text(self, key: str, text: str, step: int) -> None:
        # TensorBoard renders text as Markdown; an indented block keeps a sample's whitespace and symbols as generated.
        self._events().add_text(key, as_code_block(text), step)
        self._writer.flush()

    def log_image(self, key: str, image, step: int) -> None:
        from trainer.tracking.images import to_hwc_uint8

        self._events().add_image(key, to_hwc_uint8(image).numpy(), step, dataformats="HWC")
        self._writer.flush()

    def finish(self, summary: dict[str, Any], exit_code: int = 0) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def start_fresh(self) -> None:
        """A rerun into the same run dir that found no checkpoint: an earlier attempt's event files move to
        `<dir>.prev/` (an older one's to `<dir>.prev-2/`, ...), which TensorBoard shows as a run of its own."""
        self.finish({})
        if self.dir.is_dir() and any(self.dir.glob("events.out.tfevents.*")):
            self.dir.rename(free_name(self.dir, ".prev"))
        self._first_step, self._session_start = 0, 1

    def keep_copy(self) -> list[Path]:
        import shutil

        self.finish({})
        if not (self.dir.is_dir() and any(self.dir.glob("events.out.tfevents.*"))):
            return []
        copy = free_name(self.dir, ".prev")
        shutil.copytree(self.dir, copy)
        return [copy]

    def take_branch(self, after: int, suffix: str, upto: int, run_dir) -> None:
        # The branch's own events stay in its kept copy (tensorboard.prev-N/): event files are not spliced.
        self.rewind(after)

    def rewind(self, step: int) -> None:
        """On resume from a checkpoint at `step`: the earlier attempts' events after `step` are removed from
        their files, and the next writer starts with a SessionLog.START at `step + 1`."""
        self.finish({})
        for path in sorted(self.dir.glob("events.out.tfevents.*")):
            rewind_event_file(path, step)
        self._first_step, self._session_start = step, step + 1


def rewind_event_file(path: Path, step: int) -> None:
    """Rewrite the event file `path` without its events after `step` (and without a torn last record, what a
    killed writer may leave); an atomic replace, so a reader sees the old file or the new one. A file
    left with nothing but its header is removed."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    records = list(RawEventFileLoader(str(path)).Load())
    keep = [r for r in records if (e := Event.FromString(r)).step <= step or e.HasField("file_version")]
    if len(keep) == len(records) and path.stat().st_size == sum(len(r) + 16 for r in records):
        return  # nothing after `step`, no torn tail: leave the file as it is
    if all(Event.FromString(r).HasField("file_version") for r in keep):
        path.unlink()
        return
    out = BytesIO()
    writer = RecordWriter(out)
    for record in keep:
        writer.write(record)
    # The temporary name must not contain "tfevents": TensorBoard reads every such file in the folder.
    tmp = path.with_name(".rewound")
    atomic_write_bytes(tmp, out.getvalue())
    os.replace(tmp, path)


def as_code_block(text: str) -> str:
    """`text` as a Markdown code block (every line indented by four spaces), shown verbatim."""
    return "\n".join("    " + line for line in text.splitlines()) or "    "
