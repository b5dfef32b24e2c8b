"""Entry point of each worker process started by the elastic launcher: `forked`, called in a process forked from
the launcher's forkserver, which has imported torch once for all of them (trainer/entry/launcher.py).

The prepared config arrives in $TRAINER_CONFIG (JSON), the run dir in $TRAINER_RUN_DIR. A failure
is written to torchelastic's per-worker error file instead of stderr, so the parent can print the
root cause once rather than once per rank.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import traceback
from multiprocessing import forkserver
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

# What the launcher sets for each worker (this module reads them; the launcher imports the names).
CONFIG_ENV, RUN_DIR_ENV, ENTRY_ENV = "TRAINER_CONFIG", "TRAINER_RUN_DIR", "TRAINER_ENTRY"
LAUNCHER_ENV = "TRAINER_LAUNCHER_PID"  # the launching process: workers die with it (trainer/runlock.py)
# What the launcher's forkserver preloads, so that a worker forked from it starts with these imported: torch and
# the parts every run reaches (an optimizer's first param group imports torch._dynamo, ~1.7 s on its own; DTensor
# comes with the checkpoint and parallel code). About 3.4 s of CPU a worker, paid once a launch instead.
PRELOAD = ("trainer.entry.forkserver_guard", "torch", "torch._dynamo", "torch.distributed.tensor",
           "torch.distributed.checkpoint",
           "trainer.entry.worker", "trainer.entry.run", "trainer.loop.trainer", "trainer.parallel.ddp")
# The environment of the process that imported this module: in a forked worker, the forkserver's (see `forked`).
_BOOT_ENV = dict(os.environ)


def run_worker(cfg: DictConfig, run_dir: Path, entry) -> int:
    """Run the entry point `entry` (a function of trainer.entry.run.ENTRY_POINTS) on this rank; its exit code."""
    from trainer.errors import TrainerExit
    from trainer.runlock import hold_as_worker

    hold_as_worker(run_dir)  # until this process ends, no other job starts in this run dir
    try:
        entry(cfg, run_dir)
        return 0
    except KeyboardInterrupt:  # Ctrl-C reached every process of the job; the parent says so once
        return 130
    except TrainerExit as e:
        _record(f"error: {e}", "", e.exit_code)
        return e.exit_code
    except Exception as e:  # noqa: BLE001 - reported once by the parent, with its traceback
        from trainer.entry.run import script_traceback

        _record(f"{type(e).__name__}: {e}", script_traceback(e) or traceback.format_exc(), 1)
        return 1


def _record(message: str, stack: str, exitcode: int) -> None:
    """Write torchelastic's error file (what ChildFailedError reads), or stderr without a launcher."""
    import time

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        print(stack or message, file=sys.stderr, flush=True)
        return
    now = time.time_ns()  # torchelastic reads whole seconds; the launcher orders failures by the nanosecond
    # exitcode: a rank torch.multiprocessing did not report itself is read back from here (launcher.every_failure).
    info = {"py_callstack": stack, "timestamp": str(now // 10**9), "time_ns": now, "exitcode": exitcode}
    payload = {"message": {"message": message, "extraInfo": info}}
    with open(path, "w") as f:
        json.dump(payload, f)


def main() -> int:
    if os.environ.get(LAUNCHER_ENV):
        from trainer.parallel.backend import die_with_parent

        die_with_parent()  # a SIGKILLed launcher takes its workers with it
    cfg = OmegaConf.create(json.loads(os.environ[CONFIG_ENV]))
    OmegaConf.set_struct(cfg, True)
    from trainer.entry.run import ENTRY_POINTS

    return run_worker(cfg, Path(os.environ[RUN_DIR_ENV]), ENTRY_POINTS[os.environ[ENTRY_ENV]])


class Streams:
    """The launcher's stdout and stderr at this launch, for its workers. A worker forked from a forkserver has the
    forkserver's file descriptors, which are those of whoever started it, and when (a forkserver started for an
    earlier launch, or around one with its output sent elsewhere: `check`'s log). Pickled into the worker's
    arguments as duplicates of the two descriptors, which multiprocessing hands over with the fork request."""

    def __init__(self, fds: tuple[int, int] = (1, 2)):
        self.fds = fds

    def __reduce__(self):
        from multiprocessing import reduction

        return _received, tuple(reduction.DupFd(fd) for fd in self.fds)

    def take(self) -> None:
        """Make the descriptors this process's stdout and stderr."""
        for fd, target in zip(self.fds, (1, 2)):
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)


def _received(*duplicates) -> Streams:
    return Streams(tuple(d.detach() for d in duplicates))


def forked(launcher_env: dict[str, str], streams: Streams | None = None) -> int:
    """A worker, in a process forked from the launcher's forkserver. A forkserver keeps the environment and the
    stdout/stderr its process had when it started, stale where the launch did not start it (one was running
    already): the worker takes the launcher's environment of this launch, plus what torchelastic set for this
    rank (RANK, MASTER_PORT, ...: what differs from the forkserver's), and the launcher's `streams`."""
    if streams is not None:
        streams.take()
    _let_go_of_forkserver()
    # The launcher forwards SIGINT (Ctrl-C, kill -INT) to its workers, which stop with KeyboardInterrupt. A launcher
    # started with SIGINT ignored (a job that a non-interactive shell put in the background) passes that on to its
    # forkserver and to every worker, which then ignored it until the agent's SIGKILL, 30 s later.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # (and the stop signals the forkserver ignores, which a fork inherits: a worker takes them as a fresh process does,
    # until the Trainer's preemption handler takes them over)
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    env = worker_environment(launcher_env, _BOOT_ENV, dict(os.environ))
    os.environ.clear()
    os.environ.update(env)
    try:
        code = main()
    except SystemExit as e:  # (a launched script's sys.exit(N): leaving through here runs its atexit handlers too)
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:  # (sys.exit("message"): printed, exit 1, as the interpreter does)
            print(e.code, file=sys.stderr, flush=True)
            code = 1
    if code:
        exit_now(code)  # (the error is in torchelastic's error file; the exit code says which kind)
    _flush()
    return 0  # torchelastic waits for this value; the process then ends without interpreter teardown (os._exit)


def worker_environment(launcher: dict, boot: dict, current: dict) -> dict:
    """A forked worker's environment: the launcher's (`launcher`, at this launch), and over it what torchelastic
    set for this rank, which is what `current` holds differently from the forkserver's start (`boot`)."""
    return {**launcher, **{k: v for k, v in current.items() if boot.get(k) != v}}


def _let_go_of_forkserver() -> None:
    """Undo what a process forked from a forkserver inherits and a fresh interpreter does not have.
    - The write end of the pipe that keeps the forkserver alive (multiprocessing hands one to every child it forks,
      so that the child could fork through it too). The forkserver exits when every copy is closed; with the
      workers holding copies, a SIGKILLed launcher would leave it, and so its workers (whose parent-death signal
      is the forkserver's death: backend.die_with_parent), running.
    - "forkserver" as the default start method: the DataLoader's workers would start through a forkserver of
      their own (importing torch again, and outliving the worker), where a fresh interpreter forks them."""
    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        os.close(fd)
        server._forkserver_alive_fd = None
    multiprocessing.set_start_method(None, force=True)  # (None: the platform's default again)


def _flush() -> None:
    """What the interpreter runs as it exits, which a worker's os._exit (ours, or multiprocessing's after a worker
    returns) skips: the atexit handlers. A user's script registers its own (as under torchrun); wandb's and tempfile's
    remove their temp dirs, which each DDP run with logger=wandb otherwise left behind."""
    import atexit
    import logging

    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()


def exit_now(code: int) -> None:
    """Leave without running interpreter and C++ static teardown. By now the run is complete or its error
    recorded, files closed and trackers finished, and the process group destroyed; what is left to tear down
    is gloo's threads, whose destructors at exit can abort a process whose peer left first ("terminate called
    without an active exception"), turning a finished job into a failed one."""
    _flush()
    os._exit(code)
