"""Entry point of each worker process started by the elastic launcher: `python -m trainer.entry.worker`.

The prepared config arrives in $TRAINER_CONFIG (JSON), the run dir in $TRAINER_RUN_DIR. A failure
is written to torchelastic's per-worker error file instead of stderr, so the parent can print the
root cause once rather than once per rank.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

# What the launcher sets for each worker (this module reads them; the launcher imports the names).
CONFIG_ENV, RUN_DIR_ENV, ENTRY_ENV = "TRAINER_CONFIG", "TRAINER_RUN_DIR", "TRAINER_ENTRY"
LAUNCHER_ENV = "TRAINER_LAUNCHER_PID"  # the launching process: workers die with it (trainer/entry/rundir.py)
def run_worker(cfg: DictConfig, run_dir: Path, entry) -> int:
    """Run the entry point `entry` (a function of trainer.entry.run.ENTRY_POINTS) on this rank; its exit code."""
    from trainer.entry.rundir import hold_as_worker
    from trainer.errors import TrainerExit

    hold_as_worker(run_dir)  # until this process ends, no other job starts in this run dir
    try:
        entry(cfg, run_dir)
        return 0
    except KeyboardInterrupt:  # Ctrl-C reached every process of the job; the parent says so once
        return 130
    except TrainerExit as e:
        _record(f"error: {e}", "")
        return e.exit_code
    except Exception as e:  # noqa: BLE001 - reported once by the parent, with its traceback
        _record(f"{type(e).__name__}: {e}", traceback.format_exc())
        return 1


def _record(message: str, stack: str) -> None:
    """Write torchelastic's error file (what ChildFailedError reads), or stderr without a launcher."""
    import time

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        print(stack or message, file=sys.stderr, flush=True)
        return
    now = time.time_ns()  # torchelastic reads whole seconds; the launcher orders failures by the nanosecond
    info = {"py_callstack": stack, "timestamp": str(now // 10**9), "time_ns": now}
    payload = {"message": {"message": message, "extraInfo": info}}
    with open(path, "w") as f:
        json.dump(payload, f)


def main() -> int:
    if os.environ.get(LAUNCHER_ENV):
        from trainer.entry.rundir import die_with_parent

        die_with_parent(int(os.environ[LAUNCHER_ENV]))  # a SIGKILLed launcher takes its workers with it
    cfg = OmegaConf.create(json.loads(os.environ[CONFIG_ENV]))
    OmegaConf.set_struct(cfg, True)
    from trainer.entry.run import ENTRY_POINTS

    return run_worker(cfg, Path(os.environ[RUN_DIR_ENV]), ENTRY_POINTS[os.environ[ENTRY_ENV]])


def exit_now(code: int) -> None:
    """Leave without running interpreter and C++ static teardown. By now the run is complete or its error
    recorded, files closed and trackers finished, and the process group destroyed; what is left to tear down
    is gloo's threads, whose destructors at exit can abort a process whose peer left first ("terminate called
    without an active exception"), turning a finished job into a failed one."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
