"""The run directory as a place one job owns: an exclusive lock, finding the run `resume=auto` continues,
and the command line that continues a run.

* Lock: `<run dir>/.lock`, held (fcntl) by the job's launching process for the whole run. The OS
  releases it when that process dies, so a SIGKILLed run never blocks its own resume; a second job in
  the same run dir stops with one paragraph naming the holder's PID.
* `resume=auto` without `hydra.run.dir`: the default run dir is new at every start (a timestamp), so
  there is nothing in it to resume. Then the run to continue is the newest unfinished run under the
  same outputs root (`outputs/*/*/`) whose config equals this job's (but for `resume` and Hydra's
  settings). It is said in one line, and the job runs there.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError

LOCK = ".lock"


class RunDirLock:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK
        self._fd: int | None = None

    def acquire(self) -> RunDirLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise ConfigError(
                f"run dir {self.path.parent} is in use by process {holder}: two jobs in one run dir would "
                "interleave their metrics and checkpoints. Wait for it to end (or stop it), or give this job its "
                "own hydra.run.dir."
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing releases the lock; the file stays (harmless, hidden)
            self._fd = None


# -- which run resume=auto continues ---------------------------------------------------------------------
def comparable(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in ("resume", "hydra")}


def is_finished(run_dir: Path) -> bool:
    try:
        return (run_dir / "export.json").is_file() and "step" in json.loads((run_dir / "export.json").read_text())
    except (OSError, ValueError):
        return False


def find_run_to_continue(run_dir: Path, config: dict[str, Any], depth: int = 2) -> Path | None:
    """The newest other run dir `depth` levels under the outputs root of `run_dir` (outputs/DATE/TIME) with a
    complete checkpoint, not finished, whose config.yaml equals `config` (as saved: resolved, redacted)."""
    root = run_dir
    for _ in range(depth):
        root = root.parent
    want = comparable(config)
    found = []
    for cand in root.glob("/".join("*" * depth)):
        if cand == run_dir or not (cand / "checkpoints").is_dir() or is_finished(cand):
            continue
        if not any((p / "manifest.json").is_file() for p in (cand / "checkpoints").glob("step_*")):
            continue
        try:
            saved = yaml.safe_load((cand / "config.yaml").read_text()) or {}
        except (OSError, yaml.YAMLError):
            continue
        if comparable(saved) == want:
            found.append(cand)
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def continue_command(run_dir: Path, argv: list[str] | None = None) -> str:
    """The command line that continues the run in `run_dir`: this one, pinned to the run dir, resume=auto."""
    argv = sys.argv[1:] if argv is None else argv
    kept = [a for a in argv if not a.lstrip("+~").startswith(("resume=", "hydra.run.dir="))]
    return shlex.join(["python", "-m", "trainer", *kept, f"hydra.run.dir={run_dir}", "resume=auto"])
