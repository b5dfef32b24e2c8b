"""One job per run dir for real, and resumes that never start over silently (issue 25).

Each test reproduces a way an adversarial sweep lost work, and fails without its fix."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    FAULTY_ENV,
    ROOT,
    SHARED,
    assert_same_run,
    faulty,
    run_here,
    tiny_overrides,
)
from test_errors import assert_clean_error

pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    """Whether any thread of process `pid` still runs (a zombie leader whose other threads are still exiting
    holds its files, and so its locks, until the last one is gone)."""
    try:
        states = [(t / "status").read_text() for t in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        return False
    return any("State:\tZ" not in s and "State:\tX" not in s for s in states)


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    """The PIDs still alive after waiting up to `seconds` for them to end (processes that are not our
    children cannot be waited for: their state is read from /proc until they are gone or time is up)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def test_a_sigkilled_launcher_takes_its_workers_with_it_and_frees_the_run_dir(corpus, tmp_path):
    """kill -9 of the launcher used to leave its workers training (re-parented to PID 1) while the printed
    resume command took the lock beside them."""
    from trainer.rundir import RunDirLock

    hold = tmp_path / "hold"
    os.mkfifo(hold)
    os.mkfifo(f"{hold}.release")
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "trainer", *tiny_overrides(corpus, "world=ddp", "world.nproc_per_node=2"),
         *faulty("block", 3, rank=1), f"+task.hold={hold}", f"hydra.run.dir={run_dir}"],
        cwd=ROOT, env={**os.environ, **FAULTY_ENV}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers = []
    try:
        with open(hold) as f:  # rank 1 is at its third loss call: the job is training
            blocked = int(f.read())
        workers = _children(launcher.pid)
        assert blocked in workers and len(workers) == 2
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        assert _gone_within(workers, 30) == [], "workers outlived their SIGKILLed launcher"
        RunDirLock(run_dir).acquire().release()  # the next job may start
    finally:
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_run_dir_whose_workers_outlived_their_launcher_is_refused(tmp_path):
    """The lock is held for as long as any process of the job can write: a worker's hold on the run dir
    (taken by every worker) keeps a new job out even when the launcher's lock is free."""
    from trainer.errors import ConfigError
    from trainer.rundir import RunDirLock

    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from trainer.rundir import hold_as_worker; hold_as_worker(sys.argv[1]); "
         "print('held', flush=True); sys.stdin.read()", str(tmp_path)],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(ConfigError, match=f"worker processes of an earlier job .*PID {holder.pid}"):
            RunDirLock(tmp_path).acquire()
    finally:
        holder.stdin.close()
        holder.wait()
    RunDirLock(tmp_path).acquire().release()  # once it is gone, the run dir is free


def test_a_refused_second_job_leaves_the_running_jobs_run_dir_alone(corpus, tmp_path):
    """The refused job's cleanup used to delete the running job's run dir, .lock and .hydra included."""
    from trainer.rundir import RunDirLock

    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)  # a job that has just started: only the records of its start
    (run_dir / ".hydra" / "overrides.yaml").write_text("- first job\n")
    (run_dir / "config.yaml").write_text("first: job\n")
    lock = RunDirLock(run_dir).acquire()
    try:
        r = run_here(*tiny_overrides(corpus), f"hydra.run.dir={run_dir}")
        assert_clean_error(r, "is in use by process", str(os.getpid()))
        assert (run_dir / ".lock").is_file() and (run_dir / "config.yaml").read_text() == "first: job\n"
        assert (run_dir / ".hydra").is_dir()
    finally:
        lock.release()


def test_two_jobs_of_the_same_second_get_two_run_dirs(corpus, tmp_path):
    """The default run dir is a timestamp: a second job of the same second moves to `<dir>-2` instead of
    being refused (and never removes the first one's)."""
    from trainer import compose
    from trainer.cli import _own_run_dir
    from trainer.rundir import RunDirLock

    first = tmp_path / "outputs" / "2026-01-01" / "12-00-00"
    (first / ".hydra").mkdir(parents=True)
    lock = RunDirLock(first).acquire()
    cfg = compose(tiny_overrides(corpus))
    try:
        other, other_lock = _own_run_dir(first, cfg, chosen=False)
        assert other == first.with_name("12-00-00-2") and other_lock.held and (other / ".hydra").is_dir()
        other_lock.release()
        from trainer.errors import ConfigError

        with pytest.raises(ConfigError, match="in use"):  # a dir the user chose is never swapped
            _own_run_dir(first, cfg, chosen=True)
    finally:
        lock.release()
    assert (first / ".hydra").is_dir()


def test_two_nodes_share_one_run_dir_as_the_readme_says(corpus, tmp_path, reference):
    """Multi-node used to be refused by the run dir lock: node 1 found node 0's lock. The lock is one per job:
    node 0's launcher takes it naming the job's rendezvous endpoint, and node 1 checks that it is its job's."""
    from test_slurm import _free_port

    port = _free_port()
    run_dir = tmp_path / "shared"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "trainer",
             *tiny_overrides(corpus, *SHARED, "world=ddp", "world.nproc_per_node=1", "data.batch_size=4"),
             "world.nnodes=2", f"world.node_rank={rank}", f"world.rdzv_endpoint=127.0.0.1:{port}",
             f"hydra.run.dir={run_dir}"],
            cwd=ROOT, env={**base, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in (0, 1)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert_same_run(run_dir, reference)


def test_a_node_refuses_a_run_dir_another_job_holds(corpus, tmp_path):
    from trainer.rundir import RunDirLock

    lock = RunDirLock(tmp_path, job="rdzv=10.0.0.1:29500").acquire()
    try:
        r = run_here(*tiny_overrides(corpus, "world=ddp", "world.nnodes=2", "world.node_rank=1",
                                     "world.rdzv_endpoint=127.0.0.1:29999"), f"hydra.run.dir={tmp_path}")
    finally:
        lock.release()
    assert_clean_error(r, "is in use by process", str(os.getpid()))
