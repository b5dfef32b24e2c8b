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
import tempfile

from trainer.entry.worker import PRELOAD as WORKER_PRELOAD

# What `python -m trainer` imports on its way to a run or a launch: what a worker needs, and the CLI's side.
# (Not the launcher's forkserver guard: this forkserver is the suite's, and lives as long as the pytest worker does.)
PRELOAD = [*(m for m in WORKER_PRELOAD if m != "trainer.entry.forkserver_guard"), "torch.distributed.launcher.api",
           "hydra", "safetensors.torch",
           "trainer.entry.cli", "trainer.entry.commands", "trainer.entry.launcher"]


def main(module: str, args: list[str], cwd: str, env: dict, path: list[str], out: str, err: str,
         preexec=None) -> None:
    """The child: become `python -m MODULE ARGS` (run from `cwd` with `env`; `path`: the sys.path such an
    interpreter has) writing to the files `out` and `err`, then leave with its exit code. `preexec` is called
    first, as subprocess calls its preexec_fn before the command starts (the processes it starts inherit it)."""
    # A fresh interpreter's default start method (a forkserver's child inherits "forkserver": the DataLoader's
    # workers would start through a forkserver of their own, and outlive this process).
    multiprocessing.set_start_method(None, force=True)
    os.chdir(cwd)
    if preexec is not None:
        preexec()
    sys.path[:] = path
    for fd, name in ((1, out), (2, err)):
        target = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    server = _own_forkserver()
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # (read from this environment's TMPDIR at its first use, as a fresh interpreter does)
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
    _without_torchs_operator_teardown()
    atexit._run_exitfuncs()  # (what the interpreter runs at exit; C++ teardown it skips, as worker.exit_now does)
    from trainer.entry.launcher import _stop_forkserver

    _stop_forkserver(server)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _without_torchs_operator_teardown() -> None:
    """torch unregisters every operator library it defined, at exit (weakref finalizers): a set difference per
    library, ~60 ms of CPU a process, ~25 s of the suite's. It changes nothing but this process's own registries,
    which os._exit ends next, so it is left out here as the C++ teardown is; every other exit function runs."""
    import weakref

    registry = getattr(weakref.finalize, "_registry", {})
    for finalizer, info in list(registry.items()):
        if getattr(getattr(info, "func", None), "__name__", "") == "_del_library":
            finalizer.atexit = False


def _own_forkserver():
    """The forkserver this process's launches fork their workers from, started now as a fork of this process,
    which is the suite's forkserver's fork and has imported what a worker needs (PRELOAD), and no more than the
    launcher's forkserver (`python -c 'from multiprocessing.forkserver import main; ...'`) would import: its
    ~3 s of CPU a launch saved. Otherwise it is what the launcher starts: this process's child, running
    multiprocessing's server loop, exiting when this process does (the pipe only this process holds), with
    this run's cwd, sys.path and output files. Its environment is the one the worker module was imported in,
    as the launcher's has, so a worker's is the launch's (trainer.entry.worker.worker_environment). The launcher
    finds it running, uses it, and leaves it to `_stop_forkserver` here."""
    import socket
    from multiprocessing import connection, forkserver, util

    address = connection.arbitrary_address("AF_UNIX")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    if not util.is_abstract_socket_namespace(address):
        os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the forkserver
        code = 1
        try:
            os.close(alive_w)
            # What the launcher's own forkserver imports first: it dies with this process (the launcher) and ignores
            # the stop signals a whole process group gets, which the workers take (trainer/entry/forkserver_guard.py).
            import trainer.entry.forkserver_guard  # noqa: F401
            forkserver.main(listener.fileno(), alive_r, [])
        except SystemExit as e:  # (the server loop ends so, at end-of-file on its pipe)
            code = e.code if isinstance(e.code, int) else 0
        finally:
            os._exit(code)
    listener.close()
    os.close(alive_r)
    server = forkserver._forkserver
    if server._forkserver_alive_fd is not None:  # (this process's copy of the suite's forkserver's pipe)
        os.close(server._forkserver_alive_fd)
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    return server
