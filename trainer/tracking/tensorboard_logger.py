"""TensorBoard logger: `logger=tensorboard` (conf/logger/tensorboard.yaml).

Writes TensorBoard event files into `<run dir>/tensorboard/`, with the summaries of `torch.utils.tensorboard`:
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
  file, the resume's START purged nothing;
- each attempt's file is named to sort after every earlier one (`EventFile`): TensorBoard reads a folder's
  files in the order of their names and, reading live, never goes back to a name before its current one.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
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
            if self._owner is not None and not (self.dir / OWNER).is_file():  # (first: events without it are refused)
                self.dir.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(self.dir / OWNER, f"{self._owner}\n".encode())
            self._writer = EventFile(self.dir, purge_step=self._session_start)
            self._session_start = None  # a writer reopened within this attempt must not purge its own events
        return self._writer

    # -- the logger interface ----------------------------------------------------------------------
    def log_config(self, config: dict[str, Any]) -> None:
        from omegaconf import OmegaConf
        from torch.utils.tensorboard.summary import text as text_summary

        text = OmegaConf.to_yaml(OmegaConf.create(redact(config)))
        self._events().write([text_summary("config", as_code_block(text))], self._first_step)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from torch.utils.tensorboard.summary import scalar

        self._events().write([scalar(key, value) for key, value in metrics.items()], step)

    def log_text(self, key: str, text: str, step: int) -> None:
        from torch.utils.tensorboard.summary import text as text_summary

        # TensorBoard renders text as Markdown; an indented block keeps a sample's whitespace and symbols as generated.
        self._events().write([text_summary(key, as_code_block(text))], step)

    def log_image(self, key: str, image, step: int) -> None:
        from torch.utils.tensorboard.summary import image as image_summary

        from trainer.tracking.images import to_hwc_uint8

        self._events().write([image_summary(key, to_hwc_uint8(image).numpy(), dataformats="HWC")], step)

    def finish(self, summary: dict[str, Any], exit_code: int = 0) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def start_fresh(self) -> None:
        """A rerun into the same run dir that found no checkpoint: an earlier attempt's event files move to
        `<dir>.prev/` (an older one's to `<dir>.prev-2/`, ...), which TensorBoard shows as a run of its own."""
        self.finish({})
        self._set_aside(copy=False)
        self._first_step, self._session_start = 0, 1

    def keep_copy(self) -> list[Path]:
        self.finish({})
        copy = self._set_aside(copy=True)
        return [copy] if copy is not None else []

    def _set_aside(self, copy: bool) -> Path | None:
        """The event files (moved, or copied) into `<dir>.prev/`. A dir of event files alone moves whole (one
        rename); from one that holds other files too (a dir of one's own, `logger.tensorboard.dir=.`), the event
        files alone: the whole dir was renamed (the user's files with it), and `.` was a ValueError traceback
        after the run dir's other records had been set aside."""
        import shutil

        here = self.dir.absolute()
        events = sorted(here.glob("events.out.tfevents.*")) if here.is_dir() else []
        if not events:
            return None
        target = free_name(here, ".prev")
        if copy:
            target.mkdir(parents=True)
            for f in events:
                shutil.copy2(f, target / f.name)
        elif len(events) == len(list(here.iterdir())) and here != Path.cwd():
            here.rename(target)
        else:
            target.mkdir(parents=True)
            for f in events:
                os.replace(f, target / f.name)
        return target

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


_files_made = itertools.count()  # (the number in an event file's name: two made in one second differ)


class EventFile:
    """One attempt's event file, written as each event is logged (a killed run keeps what it logged).

    TensorBoard reads a folder's event files in the order of their names and, reading live, never goes back
    to a name before the one it is on. SummaryWriter names its file by clock second, host, pid and a count,
    so an attempt started in the same second as the last (a second `train()` in one process: count 10 after
    9) or on a node whose clock is behind got a name before the earlier attempt's, and a TensorBoard open
    since then never showed it. This file takes the same form of name, extended where needed to sort after
    every event file already in `dir`.

    Args:
        dir: the folder (made if missing).
        purge_step: a SessionLog.START at this step first (as SummaryWriter's purge_step): readers drop the
            events of earlier files at or after it.
    """

    def __init__(self, dir: Path, purge_step: int | None = None):
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event = Event
        dir.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_files_made)}"
        newest = max((p.name for p in dir.glob("events.out.tfevents.*")), default="")
        self.path = dir / (name if name > newest else f"{newest}.1")  # (a name's extension sorts after it)
        self._file = open(self.path, "xb")  # noqa: SIM115 - held open for the attempt, closed by close()
        self._records = RecordWriter(self._file)
        self._add(Event(wall_time=time.time(), file_version="brain.Event:2"))
        if purge_step is not None:  # (what SummaryWriter(purge_step=) writes)
            self._add(Event(step=purge_step, file_version="brain.Event:2"))
            self._add(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))
        self._file.flush()

    def _add(self, event) -> None:
        self._records.write(event.SerializeToString())

    def write(self, summaries: list, step: int) -> None:
        """Each summary (from torch.utils.tensorboard.summary) as an event at `step`, then flushed."""
        wall_time = time.time()
        for summary in summaries:
            self._add(self._event(wall_time=wall_time, step=int(step), summary=summary))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


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
