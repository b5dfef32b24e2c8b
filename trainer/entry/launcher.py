"""Starting the processes of a run: in-process, via torch's elastic launcher, or under torchrun.

`python -m trainer world=ddp world.nproc_per_node=2` composes and resolves the config once, here in
the parent, then starts the workers with `torch.distributed.launcher.api.elastic_launch`. Workers
(`trainer.entry.worker`) receive the resolved config through the environment and never re-parse argv.
They are forked from a forkserver that imported torch once (start_method="forkserver"), not each started
as a fresh interpreter: a fork of a process that only imported torch is safe, where a fork of one that
ran torch ops (OpenMP's threads) or holds threads (the agent's store) is not.
Under `torchrun ... -m trainer`, rank 0 composes the config with Hydra and broadcasts it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from multiprocessing import forkserver
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from trainer.entry import worker
from trainer.entry.worker import CONFIG_ENV, ENTRY_ENV, LAUNCHER_ENV, PRELOAD, RUN_DIR_ENV, forked, run_worker
from trainer.errors import TrainerExit
from trainer.loop import watchdog


def in_torchrun() -> bool:
    """True in a worker started by torchrun (or our launcher)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def is_torchrun_follower() -> bool:
    """A torchrun worker other than rank 0: it waits for rank 0's config instead of parsing argv."""
    return in_torchrun() and int(os.environ["RANK"]) != 0


def _share_config(payload: list) -> list:
    from trainer.parallel.backend import share_before_setup

    return share_before_setup(payload)


def follow_torchrun_rank0() -> int:
    """Entry of torchrun ranks > 0: receive rank 0's resolved config and train."""
    from trainer.entry.run import ENTRY_POINTS

    container, run_dir, entry, refused = _share_config([None, None, None, None])
    if refused is not None:  # (rank 0 refused the config before training, and says why)
        return refused
    return run_worker(OmegaConf.create(container), Path(run_dir), ENTRY_POINTS[entry])


def run(cfg: DictConfig, run_dir: Path, entry: Callable | None = None, topology=None) -> dict | None:
    """Run the entry point `entry` (one of trainer.entry.run.ENTRY_POINTS: train, the default, evaluate, ...) according
    to `cfg.world`: here, or on every rank of workers started by the elastic launcher (which get its name).
    `topology`: world's launch keys as `launch_topology` typed them, when the caller has them already."""
    from trainer.entry.run import train

    entry = entry or train
    if in_torchrun():  # we are torchrun's rank 0: hand the config to the other ranks
        # What the launcher checks before its workers start (the model against world.tp and world.pp, the task, the
        # data), checked here once: under torchrun, where no launcher of ours runs, a tensor-parallel split that did
        # not divide the heads was torch's reshape error in the first forward. The others stop with rank 0's code.
        refused = None
        if entry.__name__ != "script":
            from trainer.config.schema import launch_config
            from trainer.entry.run import preflight

            try:  # (torchrun's process count, not world's, which it overrules)
                preflight(cfg, run_dir, launch_config(cfg.world).device, world_size=int(os.environ["WORLD_SIZE"]))
            except Exception as e:  # noqa: BLE001 - whatever stops rank 0 stops the others, which wait for its word
                refused = e
        _share_config([OmegaConf.to_container(cfg), str(run_dir), entry.__name__,
                       None if refused is None else getattr(refused, "exit_code", 1)])
        if refused is not None:
            raise refused
        note = torchrun_decides(cfg.world)
        if note:
            print(note, flush=True)
    else:
        w = topology or launch_topology(cfg.world, say=print)
        if starts_workers(cfg, w):
            return launch(cfg, run_dir, entry, w)
    return entry(cfg, run_dir)


def torchrun_decides(world: DictConfig) -> str | None:
    """A note for world's process counts that torchrun, which started this job, overrules: a user who gave
    world.nproc_per_node=4 to a job torchrun started on 2 processes per node trained on 2 without a word."""
    from trainer.config.schema import launch_config
    from trainer.config.targets import locate

    if not locate("world", world._target_).distributed:  # (world=single on several processes is refused next)
        return None
    w = launch_config(world)
    local, size = int(os.environ.get("LOCAL_WORLD_SIZE", 1)), int(os.environ.get("WORLD_SIZE", 1))
    said = []
    if w.nproc_per_node not in ("auto", local):
        said.append(f"world.nproc_per_node={w.nproc_per_node}")
    if w.nnodes != 1 and w.nnodes * local != size:
        said.append(f"world.nnodes={w.nnodes}")
    if not said:
        return None
    return (f"note: {' and '.join(said)} did not decide this job's processes: torchrun started it, {local} process(es) "
            f"per node and {size} in all (its --nproc_per_node and --nnodes), and the run uses those. Give torchrun "
            "the counts, or start the run with python -m trainer, which starts what world asks for.")


def starts_workers(cfg: DictConfig, w=None) -> bool:
    """Whether `cfg.world` asks for worker processes (several, of a distributed strategy) that this process, not
    itself a worker, must start."""
    from trainer.config.schema import nproc_per_node
    from trainer.config.targets import locate

    if in_torchrun():
        return False
    w = w or launch_topology(cfg.world)
    return nproc_per_node(w.nproc_per_node) * w.nnodes > 1 and locate("world", cfg.world._target_).distributed


# -- SLURM: the multi-node topology from the job's environment (trainer/config/slurm.py) ---------------------
def launch_topology(world: DictConfig, say=None):
    """The launch keys of `world` (a LaunchConfig). Under SLURM (SLURM_JOB_ID set) on several nodes, when
    world.nnodes, world.node_rank and world.rdzv_endpoint are all left at their defaults (1, 0, null), the
    three come from SLURM_NNODES, SLURM_NODEID and the first host of SLURM_JOB_NODELIST (port MASTER_PORT,
    default 29500). Setting any one of them yourself turns this off: then the three are yours. Variables that
    make no sense raise a ConfigError naming the variable (config.validate checked them already, before the
    run dir was made)."""
    from trainer.config import slurm
    from trainer.config.schema import launch_config

    w = launch_config(world)
    if not slurm.leaves_topology_to_slurm(w.nnodes, w.node_rank, w.rdzv_endpoint):
        return w
    found = slurm.topology(os.environ)
    if found is not None:
        w.nnodes, w.node_rank, w.rdzv_endpoint = found
        if say is not None:
            say(f"world.nnodes={w.nnodes} world.node_rank={w.node_rank} world.rdzv_endpoint={w.rdzv_endpoint} "
                f"(from SLURM job {os.environ['SLURM_JOB_ID']})", flush=True)
    return w


class RendezvousFailed(TrainerExit):
    """The nodes of a multi-node run did not all meet: one never came, or node 0's endpoint could not be
    opened or reached. Nothing was trained."""

    exit_code = 69  # EX_UNAVAILABLE


def wait_for_node0(w) -> None:
    """On nodes other than 0: wait up to world.rdzv_timeout until node 0's rendezvous endpoint accepts a
    connection. torch's store client would wait too, but logs a C++ stack trace at every retry, then raises."""
    import socket
    import time

    from trainer.config.slurm import split_endpoint

    host, port = split_endpoint(w.rdzv_endpoint)
    deadline, last = time.monotonic() + w.rdzv_timeout, None
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(5.0, w.rdzv_timeout)):
                return
        except OSError as e:  # refused (node 0 not up yet), unreachable, unknown host: all may pass
            last = e
        if time.monotonic() >= deadline:
            raise RendezvousFailed(f"nothing answered at the rendezvous endpoint {w.rdzv_endpoint} (node 0) within "
                                   f"world.rdzv_timeout={w.rdzv_timeout} s ({_first_line(last)}); "
                                   f"{_rendezvous_checklist(w)}")
        time.sleep(0.5)


def resolve_on_node0(w) -> None:
    """On node 0: its rendezvous host must resolve (it is node 0's own address). torch's store would otherwise
    try to reach it as a client for about two minutes, whatever world.rdzv_timeout says, logging a line per try."""
    import socket

    from trainer.config.slurm import split_endpoint

    host, port = split_endpoint(w.rdzv_endpoint)
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise RendezvousFailed(f"the rendezvous host {host!r} (world.rdzv_endpoint={w.rdzv_endpoint}) cannot be "
                               f"resolved on node 0 ({_first_line(e)}); it must be this node's own host name or "
                               f"address. {_rendezvous_checklist(w)}") from None


def rendezvous_failed(w, error: Exception) -> RendezvousFailed:
    """The one paragraph for torch's rendezvous giving up: RendezvousTimeoutError (not every node joined within
    the join timeout) or RendezvousConnectionError (node 0's store could not be opened, e.g. its port is taken,
    or reached)."""
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    if isinstance(error, RendezvousTimeoutError):
        what = (f"not all {w.nnodes} nodes joined the rendezvous at {w.rdzv_endpoint} within "
                f"world.rdzv_timeout={w.rdzv_timeout} s")
    else:
        what = (f"the rendezvous at {w.rdzv_endpoint} failed on node {w.node_rank} "
                f"({_first_line(error.__cause__ or error)})")
    return RendezvousFailed(f"{what}; {_rendezvous_checklist(w)}")


def _rendezvous_checklist(w) -> str:
    return (f"this is node {w.node_rank} of {w.nnodes} nodes. Check that all {w.nnodes} nodes run the same command "
            f"with world.nnodes={w.nnodes}, each its own world.node_rank in 0..{w.nnodes - 1}, and "
            f"world.rdzv_endpoint={w.rdzv_endpoint}: node 0's address, reachable from every node, its port free "
            "on node 0 (under SLURM: run it with srun, one task per node, not in the batch script alone). "
            "Raise world.rdzv_timeout if some nodes start late.")


def _first_line(error: BaseException | None) -> str:
    text = str(error).strip().splitlines()[0] if error is not None and str(error).strip() else type(error).__name__
    return text[:200]
# -- end SLURM -------------------------------------------------------------------------------------------


# The signals torch's agent takes over for a launch (it forwards them to the workers, and raises SignalException
# here). A scheduler's preemption notice, SIGUSR1, too: not in torch's default list, it would kill this process and
# orphan the workers.
HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)


def launch(cfg: DictConfig, run_dir: Path, entry: Callable, w) -> dict | None:
    """Start the workers of this node, each running `entry`; `w` is world's launch keys (a LaunchConfig)."""
    # torch never gives the signals back: its handler raised SignalException at any later one, a traceback for a
    # second SIGTERM while this process reported the first, and in a notebook that trained through trainer.train.
    # (Handlers live in the main thread alone: a launch from another, a tuner's trial thread, changes none.)
    handlers = {s: signal.getsignal(s) for s in HANDLED_SIGNALS} if _main_thread() else {}
    server = _start_forkserver()
    try:
        return _launch(cfg, run_dir, entry, w)
    finally:
        try:
            _stop_forkserver(server)
        finally:
            for s, handler in handlers.items():
                signal.signal(s, _live(handler))


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _live(handler):
    """`handler`, or the default where it is a stop flag's that a run has taken over (the command's early flag: put
    back, it would set a flag nobody reads any more)."""
    from trainer.loop.preemption import PreemptionFlag

    owner = getattr(handler, "__self__", None)
    return signal.SIG_DFL if isinstance(owner, PreemptionFlag) and not owner.installed else handler


@contextlib.contextmanager
def _first_stop_signal_only() -> Iterator[None]:
    """torch's agent turns a stop signal into SignalException, forwards it to the workers and waits for them (then
    SIGKILLs them). Another signal during that wait raised SignalException out of it: the workers were neither
    joined nor killed, and this process hung at its exit joining them (a second Ctrl-C, a SIGTERM sent twice).
    The first signal goes to the agent as before; the later ones are dropped: the agent has forwarded one already,
    and a signal to the whole job reaches the workers itself. (torch installs its handler by this module global's
    name at each start of the workers; tests/test_checkpoint.py sends SIGTERM again and again.)"""
    from torch.distributed.elastic.multiprocessing import api

    torchs, caught = api._terminate_process_handler, []

    def first_only(signum, frame):
        if not caught:
            caught.append(signum)
            torchs(signum, frame)

    api._terminate_process_handler = first_only
    try:
        yield
    finally:
        api._terminate_process_handler = torchs


def _workers_gone() -> None:
    """The agent is done (its workers finished or stopped): a stop signal has nothing left to stop while this
    process reports and cleans up (`launch` puts the caller's handlers back after)."""
    for s in HANDLED_SIGNALS if _main_thread() else ():
        signal.signal(s, signal.SIG_IGN)


def _launch(cfg: DictConfig, run_dir: Path, entry: Callable, w) -> dict | None:
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from trainer.entry.run import preflight, script
    from trainer.loop.preemption import PreemptionFlag

    # A stop signal before the workers exist (while the datasets are built): nothing to save, exit 75.
    early = PreemptionFlag().install()
    try:
        if entry is not script and not early.requested:  # (a user's script builds what it builds itself)
            preflight(cfg, run_dir, w.device)
    finally:
        early.uninstall()
    if early.requested:
        from trainer.errors import Preempted

        raise Preempted(f"stopped by {signal.Signals(early.signum).name} before training started; nothing to save. "
                        "Rerun the same command with resume=auto to continue.")
    from trainer.config.schema import nproc_per_node

    nproc = nproc_per_node(w.nproc_per_node)
    if w.nnodes > 1:
        endpoint, run_id = w.rdzv_endpoint, f"trainer-{w.rdzv_endpoint}"
        # Node 0 hosts the rendezvous store; the others connect to it. Every node waits world.rdzv_timeout.
        rdzv_configs = {"is_host": w.node_rank == 0, "join_timeout": w.rdzv_timeout}
        if w.node_rank:
            wait_for_node0(w)
        else:
            resolve_on_node0(w)
    else:
        # Port 0: the rendezvous picks a free port, so concurrent jobs (multirun) never collide.
        endpoint, run_id, rdzv_configs = "127.0.0.1:0", f"trainer-{uuid.uuid4().hex[:8]}", {}
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    # (torch's elastic loggers set their own level, WARNING: the parent's does not reach the agent's "Received 2
    # death signal, shutting down workers" at Ctrl-C, which came before the framework's own paragraph)
    logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.ERROR)
    # (and torch.multiprocessing's "Terminating process N via signal SIGTERM" as the agent stops the workers left
    # after one failed: the failure is reported once, by us)
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    _name_rendezvous_events_cheaply()
    # The agent logs every failed worker ("failed (exitcode: 3) local_rank: ..."); we report the failure
    # ourselves, once, as the worker's own message (or its traceback), so drop that line.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_drop_worker_failed_line)
    # Where the workers' hang watchdogs share their progress and, after a hang, their stacks (trainer/loop/watchdog.py).
    hang_dir = tempfile.mkdtemp(prefix="trainer-hang-")
    config = LaunchConfig(
        min_nodes=w.nnodes, max_nodes=w.nnodes, nproc_per_node=nproc, run_id=run_id,
        rdzv_backend="c10d", rdzv_endpoint=endpoint, rdzv_configs=rdzv_configs,
        max_restarts=w.max_restarts, monitor_interval=0.1,
        signals_to_handle=",".join(s.name for s in HANDLED_SIGNALS),
        start_method="forkserver",
        # The workers' error files, which the failure report reads. Left to torch, each launch would leave a
        # torchelastic_* directory in the temp dir for good (torchrun's does); this one goes with hang_dir.
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(hang_dir, "elastic")),
    )
    # Workers of each restart get a fresh rendezvous store. The agent's shared store outlives restarts
    # and keeps the previous attempt's gloo addresses, which restarted workers then fail to reach.
    environment = dict(os.environ)  # (put back after the launch: a torchrun this process starts later would take
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # the setting, and choose its ports racily)
    os.environ[CONFIG_ENV] = json.dumps(OmegaConf.to_container(cfg))
    os.environ[RUN_DIR_ENV] = str(run_dir)
    os.environ[ENTRY_ENV] = entry.__name__  # (the worker finds it in trainer.entry.run.ENTRY_POINTS)
    os.environ[LAUNCHER_ENV] = str(os.getpid())
    os.environ[watchdog.HANG_DIR_ENV] = hang_dir
    from trainer.checkpoint.store import newest_complete

    before, export_before = newest_complete(run_dir), _export_record(run_dir)
    try:
        try:
            with _first_stop_signal_only():
                elastic_launch(config, entrypoint=forked)(dict(os.environ), worker.Streams())  # (its stdout, stderr)
        finally:
            _workers_gone()
    except ChildFailedError as e:
        failures = every_failure(e.failures, nproc)
        rank, failure = root_failure(failures)
        lost = all(any(s in _failure_text(f) for s in LOST_CONNECTION) for f in failures.values())
        hang = watchdog.report(hang_dir, failures, w.hang_timeout, run_dir, lost,  # no progress: every rank's stack
                               list(range(nproc)) if w.nnodes == 1 else ())
        if hang is not None:
            raise WorkerFailed(rank, watchdog.HangDetected.exit_code, hang) from None
        text, silent = _failure_text(failure), silent_peers(failures, rank, failure, nproc)
        if silent:  # (torch names one dead worker: here the one that failed on the connection the killed one closed)
            text = lost_peer_message(silent, rank, text)
        elif w.nnodes > 1 and lost:  # every local failure a lost connection: the cause is on another node
            text = lost_node_message(rank, text)
        raise WorkerFailed(rank, failure.exitcode, text) from None
    except (RendezvousTimeoutError, RendezvousConnectionError) as e:  # a node never came, or node 0 unreachable
        raise rendezvous_failed(w, e) from None
    except SignalException as e:
        # The agent forwarded the signal to the workers and waited for them: a SIGTERM/SIGUSR1 made
        # them save a checkpoint; Ctrl-C stopped them.
        if e.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        from trainer.errors import Preempted

        if entry is script:  # (a loop of one's own saves what it saves, where it says)
            raise Preempted(f"stopped by {signal.Signals(e.sigval).name}: the script's processes were stopped. "
                            "What it saved with rt.save_state is what there is; rerun it to continue from its "
                            "rt.load_state.") from None
        if _export_record(run_dir) not in (None, export_before):  # the signal came in the last step or the export:
            return None  # the workers completed the export, and said so (exit 0: there is nothing to continue)
        raise Preempted(f"stopped by {signal.Signals(e.sigval).name}; {_what_was_saved(run_dir, before)} "
                        "Rerun the same command with resume=auto to continue.") from None
    finally:
        for name in set(os.environ) - set(environment):  # (torch's elastic launch sets variables of its own too)
            os.environ.pop(name, None)
        os.environ.update(environment)
        shutil.rmtree(hang_dir, ignore_errors=True)
    return None


def _caller_name(depth: int = 2) -> str:
    """The name of the function `depth` frames up, as torch's `get_method_name` returns it."""
    try:
        return sys._getframe(depth).f_code.co_name  # (frame 0 is this one, as inspect.stack()[0] is its caller's)
    except ValueError:  # a shorter stack
        return "no_method_name"


def _name_rendezvous_events_cheaply() -> None:
    """The c10d rendezvous names each event it records by its caller, through `inspect.stack()`, twice a call:
    that reads the source line of every frame on the stack, ~20 ms a call and 0.2 s of the launcher's CPU a
    launch (9 calls; 5% of the test suite's CPU, where stacks are deeper). `sys._getframe` gives the same
    name without reading anything. Only the name in torch's rendezvous event log depends on it."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    if callable(getattr(dynamic_rendezvous, "get_method_name", None)):
        dynamic_rendezvous.get_method_name = _caller_name


def _start_forkserver():
    """Start the workers' forkserver, which imports torch (PRELOAD) while the datasets are built; returns it
    when this launch started it (None when one was running already, started by someone else)."""
    server = getattr(forkserver, "_forkserver", None)
    if server is None or getattr(server, "_forkserver_pid", None) is not None:
        return None
    multiprocessing.set_forkserver_preload(list(PRELOAD))
    forkserver.ensure_running()
    return server


@contextlib.contextmanager
def one_forkserver(output: Path) -> Iterator[None]:
    """Launches inside share one forkserver (the imports of PRELOAD paid once, not at every launch), and this
    process's stdout and stderr go to `output` meanwhile, so the workers' (which take the launcher's: worker.Streams)
    and the launches' own lines go there too (`trainer check`: its report keeps only its own lines)."""
    saved = [os.dup(1), os.dup(2)]
    server = None
    try:
        with open(output, "ab") as f:
            for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
                stream.flush()
                os.dup2(f.fileno(), fd)
        server = _start_forkserver()
        yield
    finally:
        _stop_forkserver(server)
        for stream, copy, fd in zip((sys.stdout, sys.stderr), saved, (1, 2)):
            stream.flush()
            os.dup2(copy, fd)
            os.close(copy)


def _stop_forkserver(server) -> None:
    """End the forkserver this launch started, now that its workers are gone: it would otherwise outlive the job
    by a moment (it exits when it notices its launcher gone), and a later launch from this process gets a fresh
    one. Killed, not asked: multiprocessing's own stop waits for the server to read end-of-file on a pipe, which
    never comes while any process forked from this one (a DataLoader's worker) holds a copy."""
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None or not hasattr(server, "_stop"):
        return
    try:
        os.kill(pid, signal.SIGKILL)
        server._stop()  # (closes our end, reaps it, removes its socket)
    except OSError:
        pass  # (it is gone already)


def _export_record(run_dir: Path) -> str | None:
    """The run's export.json (written last, once the export is complete), or None: whether a launch finished it."""
    try:
        return (Path(run_dir) / "export.json").read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _what_was_saved(run_dir: Path, before: Path | None) -> str:
    """What the workers left after a forwarded stop signal, read from the run dir (not assumed: a worker may have
    died before it could save)."""
    from trainer.checkpoint.store import newest_complete, step_of
    from trainer.tracking.loggers import last_step

    newest = newest_complete(run_dir)
    try:  # (a periodic save of an earlier step was called the stop's own: the steps after it were said saved)
        logged = last_step(Path(run_dir) / "metrics.jsonl")
    except OSError:
        logged = None
    if newest is not None and newest != before and (logged is None or step_of(newest) >= logged):
        return f"the workers saved a checkpoint ({newest})."
    if newest is not None:
        past = f" (they had logged step {logged}: the steps after it are trained again)" if logged is not None and \
            step_of(newest) < logged else ""
        return f"the workers saved no checkpoint where they stopped; the newest is {newest}{past}."
    return "the workers saved no checkpoint (none was due yet)."


def every_failure(failures: dict, nproc: int) -> dict:
    """`failures` and every other worker of this node that recorded an error. torch.multiprocessing reports one
    dead worker, the first it looks at among those found dead, then stops the rest; the one that failed first
    may be another, whose error file (beside the reported one's: attempt_N/LOCAL_RANK/error.json) says so."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    found = dict(failures)
    for rank, failure in failures.items():
        base = rank - failure.local_rank
        for local in range(nproc):
            path = Path(failure.error_file).parent.parent / str(local) / "error.json"
            if base + local not in found and path.is_file():
                try:
                    data = json.loads(path.read_text())
                    exitcode = int(data["message"]["extraInfo"]["exitcode"])
                except (OSError, ValueError, KeyError, TypeError):
                    continue  # (not one of our records: the reported failure stands)
                found[base + local] = ProcessFailure(local, 0, exitcode, str(path))
    return found


LOST_CONNECTION = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused")


def silent_peers(failures: dict, rank: int, failure, nproc: int) -> list[int]:
    """The ranks of this node that left no record, when the reported failure (`rank`'s) is a lost connection:
    a worker killed outright (SIGKILL) records nothing, and torch then names the peer that failed on the closed
    connection. Empty otherwise."""
    if not any(s in _failure_text(failure) for s in LOST_CONNECTION):
        return []
    base, attempt = rank - failure.local_rank, Path(failure.error_file).parent.parent
    return [base + local for local in range(nproc)
            if base + local not in failures and not (attempt / str(local) / "error.json").is_file()]


def lost_peer_message(silent: list[int], rank: int, text: str) -> str:
    """The paragraph for workers killed without a record (`silent_peers`) and the peer that failed after them. The
    peer's traceback says only where it was waiting when the connection closed (gloo's read in the next
    collective): the cause is the killed worker, which had nothing to say, so the traceback is left out."""
    return (f"error: worker rank {', '.join(map(str, silent))} ended without a word (killed: out of memory, or "
            f"kill -9?), and rank {rank} then failed on the connection it lost ({_lost_how(text)}). The kernel log "
            "(dmesg) or the scheduler's record of the job says what killed it.")


def lost_node_message(rank: int, text: str) -> str:
    """The paragraph for a node's workers that all failed on lost connections: a rank of another node went away
    (its job killed, its machine down). Their tracebacks say where they waited, not why; that node's log does."""
    return (f"error: rank {rank} lost its connection to a rank of another node ({_lost_how(text)}), as did this "
            "node's other ranks: that node's job stopped or its machine went away. Its own output (or the scheduler's "
            "record of its job) says why.")


def _lost_how(text: str) -> str:
    """How a traceback says its connection was lost, in a few words: "gloo: Connection reset by peer"."""
    how = next(s for s in LOST_CONNECTION if s in text)
    library = next((name for name in ("gloo", "nccl") if name in text.lower()), "")
    return f"{library}: {how}" if library else how


def root_failure(failures: dict) -> tuple:
    """The (rank, ProcessFailure) to report: the earliest failure that is not the agent's SIGTERM. Once one
    worker fails the agent SIGTERMs the others (possibly after they recorded the same error): consequences.
    Times: our workers record theirs to the nanosecond (torchelastic's `timestamp` is whole seconds, which
    cannot tell a crash from the peer's 'connection closed' a millisecond later); a worker killed by a signal
    without a record (SIGKILL, SIGSEGV: not the agent's SIGTERM) comes before every recorded error."""
    def key(rank_failure: tuple) -> tuple:
        f = rank_failure[1]
        message = f.error_file_data.get("message") if isinstance(f.error_file_data, dict) else None
        info = message.get("extraInfo", {}) if isinstance(message, dict) else {}
        # A worker killed by another signal (SIGKILL: the OOM killer, someone's kill -9; SIGSEGV) is a cause,
        # never a peer's consequence, whenever it was found dead: its peers then fail on the closed connection.
        killed = f.exitcode < 0 and f.exitcode != -signal.SIGTERM and not info
        return f.exitcode == -signal.SIGTERM, not killed, int(info.get("time_ns", f.timestamp * 10**9))
    return min(failures.items(), key=key)


def _drop_worker_failed_line(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("failed (exitcode")


def _failure_text(failure) -> str:
    msg = failure.message
    if isinstance(msg, dict):
        text = msg.get("message", "")
        stack = msg.get("extraInfo", {}).get("py_callstack", "")
        return stack if stack and not text.startswith("error:") else text
    if failure.exitcode > 0 and str(msg).startswith("To enable traceback see"):  # (torch's text: no error record)
        return (f"error: a worker (local rank {failure.local_rank}) exited with code {failure.exitcode} and no error record: "
                "the script's own exit (sys.exit; its output is above), or a crash that left none.")
    return str(msg)


class WorkerFailed(Exception):
    def __init__(self, rank: int, exitcode: int, text: str):
        super().__init__(text)
        self.rank, self.exitcode, self.text = rank, exitcode, text

    def report(self) -> int:
        """Print the root cause once (a worker's own user error, or its traceback), secrets taken out;
        returns the exit code to leave with."""
        from trainer.redaction import scrub, secret_values

        text = self.text if self.text.startswith("error:") else f"error: worker rank {self.rank} failed:\n{self.text}"
        print(scrub(text.rstrip(), secret_values()), file=sys.stderr, flush=True)
        return self.exitcode if self.exitcode > 0 else 1
