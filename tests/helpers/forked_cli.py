"""`python -m trainer ARGS` in a process forked from a forkserver that has imported torch, Hydra and the
trainer once (tests/conftest.py: run_cli). The suite starts ~100 such processes; each fresh interpreter
spent ~3 s of CPU on the same imports, a third of the suite's time on 2 cores.

The forkserver is a fresh interpreter that only imported modules (no torch op ran, no thread started), so
a process forked from it is a fresh interpreter but for what is in sys.modules: `trainer/__main__.py` runs
as `__main__` with the test's argv, cwd, environment, sys.path and stdout/stderr files. What only an
interpreter's start reads (PYTHON* flags, sitecustomize) needs `run_cli(..., fresh=True)`.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import sys

from trainer.entry.worker import PRELOAD as WORKER_PRELOAD

# What `python -m trainer` imports on its way to a run or a launch: what a worker needs, and the CLI's side.
PRELOAD = [*WORKER_PRELOAD, "torch.distributed.launcher.api", "hydra", "safetensors.torch",
           "trainer.entry.cli", "trainer.entry.commands", "trainer.entry.launcher"]


def main(module: str, args: list[str], cwd: str, env: dict, path: list[str], out: str, err: str) -> None:
    """The child: become `python -m MODULE ARGS` (run from `cwd` with `env`; `path`: the sys.path such an
    interpreter has) writing to the files `out` and `err`, then leave with its exit code."""
    # A fresh interpreter's default start method (a forkserver's child inherits "forkserver": the DataLoader's
    # workers would start through a forkserver of their own, and outlive this process).
    multiprocessing.set_start_method(None, force=True)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = path
    for fd, name in ((1, out), (2, err)):
        target = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = [module, *args]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:  # as the interpreter leaves: an int is the code, anything else is printed (code 1)
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught exception
        import traceback

        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # (what the interpreter runs at exit; C++ teardown it skips, as worker.exit_now does)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
