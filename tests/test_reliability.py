"""One job per run dir for real, and resumes that never start over silently (issue 25).

Each test reproduces a way an adversarial sweep lost work, and fails without its fix."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    FAULTY_ENV,
    ROOT,
    SHARED,
    checkpoints,
    faulty,
    read_metrics,
    run_cli,
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
    from trainer.runlock import RunDirLock

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
        workers = [w for child in _children(launcher.pid) for w in _children(child)]  # (its forkserver's children)
        assert blocked in workers and len(workers) == 2
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        assert _gone_within(workers, 30) == [], "workers outlived their SIGKILLed launcher"
        RunDirLock(run_dir).acquire().release()  # the next job may start
    finally:
        for pid in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def held_elsewhere(run_dir: Path, hold: str = "RunDirLock(sys.argv[1]).acquire()"):
    """Another process holding `run_dir` (`hold`: a trainer.runlock call) until the block ends; yields its PID."""
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import sys; from trainer.runlock import *; {hold}; print('held', flush=True); "
         "sys.stdin.read()", str(run_dir)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        yield holder.pid
    finally:
        holder.stdin.close()
        holder.wait()


def test_a_run_dir_whose_workers_outlived_their_launcher_is_refused(tmp_path):
    """The lock is held for as long as any process of the job can write: a worker's hold on the run dir
    (taken by every worker) keeps a new job out even when the launcher's lock is free."""
    from trainer.errors import ConfigError
    from trainer.runlock import RunDirLock

    with held_elsewhere(tmp_path, "hold_as_worker(sys.argv[1])") as pid:
        with pytest.raises(ConfigError, match=f"processes of another job .*PID {pid}"):
            RunDirLock(tmp_path).acquire()
    RunDirLock(tmp_path).acquire().release()  # once it is gone, the run dir is free


def test_a_link_in_the_locks_place_is_replaced_never_written_through(tmp_path):
    """`RUN/.lock` a symbolic link (planted, or left by a copy of links): the job's record (PID and host) was written
    over the file it named, truncating it."""
    from trainer.runlock import RunDirLock

    precious = tmp_path / "precious.txt"
    precious.write_text("precious data")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / ".lock").symlink_to(precious)
    assert RunDirLock(tmp_path / "run").holder() is None
    lock = RunDirLock(tmp_path / "run").acquire()
    try:
        assert precious.read_text() == "precious data"
        assert not (tmp_path / "run" / ".lock").is_symlink() and str(os.getpid()) in (tmp_path / "run" / ".lock").read_text()
    finally:
        lock.release()


def test_two_run_dirs_whose_checkpoints_link_to_one_directory_cannot_train_at_once_or_in_turn(corpus, tmp_path):
    """`RUN/checkpoints` linked to a big scratch disk, by two run dirs to the same directory: each job held its own
    run dir's lock, and each pruned and replaced the other's checkpoints (both runs' work lost). The directory a
    linked checkpoints/ resolves to is held with the run dir; the second job is refused, changing nothing. In turn
    too (`cp -r RUN COPY` copies the link): the copy's run pruned the original's checkpoints, and the original's
    resume then took the copy's newest as its own and replaced its export with the copy's weights."""
    from trainer.errors import ConfigError
    from trainer.runlock import RunDirLock

    shared = tmp_path / "scratch"
    shared.mkdir()
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "checkpoints").symlink_to(shared)
    lock = RunDirLock(tmp_path / "a").acquire()
    try:
        r = run_here(*tiny_overrides(corpus, "trainer.max_steps=2"), f"hydra.run.dir={tmp_path / 'b'}")
        assert_clean_error(r, f"{tmp_path / 'b' / 'checkpoints'} leads to {shared}, whose checkpoints another job is "
                              "writing now", "Nothing in the run dir was changed.")
        assert sorted(p.name for p in (tmp_path / "b").iterdir()) == [".lock", "checkpoints"]  # (the refused job's)
        assert (tmp_path / "b" / ".lock").read_text() == "" and [p.name for p in shared.iterdir()] == ["linked_by.json"]
    finally:
        lock.release()
    with pytest.raises(ConfigError, match=f"leads to {shared}, which holds the checkpoints of the run dir "
                                          f"{tmp_path / 'a'} too .*cp -rL"):  # (in turn: a is not running)
        RunDirLock(tmp_path / "b").acquire()
    RunDirLock(tmp_path / "a").acquire().release()  # (a, whose it is, goes on)
    (tmp_path / "a").rename(tmp_path / "a_moved")  # a run dir moved or renamed: its links no longer lead there
    RunDirLock(tmp_path / "b").acquire().release()  # (b's now)
    with pytest.raises(ConfigError, match="which holds the checkpoints of the run dir"):
        RunDirLock(tmp_path / "a_moved").acquire()
    # A link to a running job's own (real) checkpoints/ (found by a review: only links were held); in turn, to a run
    # dir's own checkpoints/ at all.
    (tmp_path / "c" / "checkpoints").mkdir(parents=True)
    (tmp_path / "c" / "config.yaml").write_text("trainer: {}\n")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "checkpoints").symlink_to(tmp_path / "c" / "checkpoints")
    lock = RunDirLock(tmp_path / "c").acquire()
    try:
        with pytest.raises(ConfigError, match="whose checkpoints another job is writing now"):
            RunDirLock(tmp_path / "d").acquire()
    finally:
        lock.release()
    with pytest.raises(ConfigError, match=f"which holds the checkpoints of the run dir {tmp_path / 'c'} too"):
        RunDirLock(tmp_path / "d").acquire()


def test_a_data_cache_that_cannot_be_written_is_exit_74_naming_it_and_leaves_no_run_dir(corpus, tmp_path, monkeypatch):
    """A full disk (or a read-only HOME) under the data cache was exit 2, "could not build 'data': ...text_file
    raised OSError", pointing at the recipe's code, where the README's 74 is "could not write (disk full)"."""
    import errno

    import trainer.recipes.lm.data as lm_data

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(lm_data, "atomic_write_bytes", full)
    r = run_here(*tiny_overrides(corpus), f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'run'}")
    assert_clean_error(r, f"could not write the data cache {tmp_path / 'cache'}", "(No space left on device)",
                       "data.cache_dir=DIR (or TRAINER_CACHE_DIR=DIR for every run)", code=74)
    assert not (tmp_path / "run").exists()
    monkeypatch.undo()  # a file where the cache goes: "could not build 'data' ... NotADirectoryError" named no setting
    (tmp_path / "afile").write_text("x")
    r = run_here(*tiny_overrides(corpus), f"data.cache_dir={tmp_path / 'afile'}", f"hydra.run.dir={tmp_path / 'run'}")
    assert_clean_error(r, f"could not write the data cache {tmp_path / 'afile'}", "(Not a directory)",
                       "data.cache_dir=DIR", code=74)
    assert not (tmp_path / "run").exists()


def test_a_deleted_lock_file_does_not_let_a_second_job_into_a_live_run_dir(corpus, tmp_path):
    """A single-process job held .lock alone (only workers also held the run dir): `rm RUN/.lock`, as a cleanup of
    "stale" locks does, let a second job in; it moved the live job's checkpoints aside and trained in its place."""
    run_dir = tmp_path / "run"
    with held_elsewhere(run_dir) as pid:
        (run_dir / ".lock").unlink()
        r = run_here(*tiny_overrides(corpus), f"hydra.run.dir={run_dir}")
        assert_clean_error(r, "is still written by the processes of another job", f"PID {pid}",
                           ".lock is free (their launcher is gone, or the file was deleted)")
        assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]  # (the refused job's own, empty)


def test_a_refused_second_job_leaves_the_running_jobs_run_dir_alone(corpus, tmp_path):
    """The refused job's cleanup used to delete the running job's run dir, .lock and .hydra included."""
    from trainer.runlock import RunDirLock

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


OWN_RUNTIME = """
import sys, trainer
rt = trainer.Runtime(run_dir=sys.argv[1])
rt.log({"loss": 2.0}, 1)
rt.end()
"""


def test_a_scripts_own_runtime_takes_the_run_dir_lock_and_shares_it_within_its_process(corpus, tmp_path):
    """Only the CLI locked its run dir: two scripts with trainer.Runtime(run_dir=X) running at once (a rerun while
    the first still trained) wrote one metrics.jsonl and one checkpoints/ together. Now the main rank holds the lock
    until rt.end(); a second Runtime of the same process (a notebook's rerun of a cell) shares it."""
    import trainer

    (tmp_path / "own_runtime.py").write_text(OWN_RUNTIME)
    run_dir = tmp_path / "run"

    def another_script(fresh: bool = False):  # (fresh: an interpreter of its own, whose excepthook says the error)
        return run_cli(str(run_dir), module="own_runtime", env={"PYTHONPATH": f"{ROOT}:{tmp_path}"}, fresh=fresh)

    first = trainer.Runtime(run_dir=run_dir)
    first.log({"loss": 1.0}, 1)
    before = sorted((p.name, p.read_bytes()) for p in run_dir.iterdir() if p.is_file())
    r = another_script(fresh=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert f"run dir {run_dir} is in use by process {os.getpid()}" in r.stderr and \
        "give this job its own Runtime(run_dir=...). Nothing in the run dir was changed." in r.stderr, r.stderr
    assert sorted((p.name, p.read_bytes()) for p in run_dir.iterdir() if p.is_file()) == before
    assert_clean_error(run_here(*tiny_overrides(corpus), f"hydra.run.dir={run_dir}"), "is in use by process")
    second = trainer.Runtime(run_dir=run_dir)  # this process again: shared
    first.end()
    assert "is in use by process" in another_script().stderr  # (still the second's)
    second.end()
    r = another_script()
    assert r.returncode == 0, r.stderr
    assert [e["loss"] for e in read_metrics(run_dir)] == [2.0]  # (a new run: the earlier metrics set aside)


def test_trainer_train_from_python_takes_the_run_dir_lock_the_cli_takes(corpus, tmp_path):
    """`trainer.train(cfg, run_dir)` took no lock: two notebooks training into one dir interleaved their steps.
    Another process's job is refused before anything is written; the CLI's job, which holds the lock in the
    process that calls train, is not; the lock is free once train returns."""
    from trainer import compose, train
    from trainer.errors import ConfigError
    from trainer.runlock import RunDirLock

    run_dir = tmp_path / "run"
    cfg = compose(tiny_overrides(corpus, "trainer.max_steps=2"))
    with held_elsewhere(run_dir) as pid:
        with pytest.raises(ConfigError, match=f"in use by process {pid}.*its own run_dir \\(trainer.train's"):
            train(cfg, run_dir)
        assert [p.name for p in run_dir.iterdir()] == [".lock"]
    (tmp_path / "a_file").write_text("x")  # (the lock's mkdir raised FileExistsError, a traceback)
    with pytest.raises(ConfigError, match="a_file is a file, not a directory.* as run_dir \\(trainer.train's"):
        train(cfg, tmp_path / "a_file")
    assert (tmp_path / "a_file").read_text() == "x"
    lock = RunDirLock(run_dir).acquire()  # this process's job (as the CLI holds it) trains there
    try:
        train(cfg, run_dir)
        assert lock.held and [e["step"] for e in read_metrics(run_dir) if "train/loss" in e][-1] == 2
    finally:
        lock.release()
    train(cfg, tmp_path / "other")
    RunDirLock(tmp_path / "other").acquire().release()  # released when train returned


def test_two_jobs_of_the_same_second_get_two_run_dirs(corpus, tmp_path):
    """The default run dir is a timestamp: a second job of the same second moves to `<dir>-2` instead of
    being refused (and never removes the first one's)."""
    from trainer import compose
    from trainer.entry.cli import _own_run_dir
    from trainer.entry.launcher import launch_topology
    from trainer.runlock import RunDirLock

    first = tmp_path / "outputs" / "2026-01-01" / "12-00-00"
    (first / ".hydra").mkdir(parents=True)
    lock = RunDirLock(first).acquire()
    topology = launch_topology(compose(tiny_overrides(corpus)).world)
    try:
        other, other_lock = _own_run_dir(first, topology, chosen=False)
        assert other == first.with_name("12-00-00-2") and other_lock.held and (other / ".hydra").is_dir()
        other_lock.release()
        from trainer.errors import ConfigError

        with pytest.raises(ConfigError, match="in use"):  # a dir the user chose is never swapped
            _own_run_dir(first, topology, chosen=True)
    finally:
        lock.release()
    assert (first / ".hydra").is_dir()


def test_a_job_of_the_same_second_as_a_killed_one_leaves_its_run_dir_alone(corpus, tmp_path):
    """A killed job's default run dir holds no lock, but holds its checkpoints: a job of the same second (another
    config) used to take the dir over, train in it and finish it, and resume=auto then never found the killed
    run. It moves to `<dir>-2`; a run that resume=auto continues, or a dir the user chose, stays where it is."""
    from trainer import compose
    from trainer.entry.cli import _own_run_dir
    from trainer.entry.launcher import launch_topology

    killed = tmp_path / "outputs" / "2026-01-01" / "12-00-00"
    (killed / "checkpoints" / "step_00000008").mkdir(parents=True)
    (killed / "config.yaml").write_text("the killed job's\n")
    topology = launch_topology(compose(tiny_overrides(corpus)).world)
    other, lock = _own_run_dir(killed, topology, chosen=False)
    lock.release()
    assert other == killed.with_name("12-00-00-2")
    assert (killed / "config.yaml").read_text() == "the killed job's\n"
    same, lock = _own_run_dir(killed, topology, chosen=True)
    lock.release()
    assert same == killed


def test_a_node_refuses_a_run_dir_another_job_holds(corpus, tmp_path):
    from trainer.runlock import RunDirLock

    lock = RunDirLock(tmp_path, job="rdzv=10.0.0.1:29500").acquire()
    try:
        r = run_here(*tiny_overrides(corpus, "world=ddp", "world.nnodes=2", "world.node_rank=1",
                                     "world.rdzv_endpoint=127.0.0.1:29999"), f"hydra.run.dir={tmp_path}")
    finally:
        lock.release()
    assert_clean_error(r, "is in use by process", str(os.getpid()))


# -- a resume with changed settings continues or refuses; it never starts over (item 1) -----------------------
BASE = ("data.batch_size=8", "trainer.max_steps=8", "trainer.eval_every=4", "checkpoint.every_n_steps=4",
        "checkpoint.keep_last=2", "trainer.eval_samples=16")


@pytest.fixture(scope="module")
def stopped(corpus, tmp_path_factory) -> Path:
    """A run that stopped at step 8 (checkpoints 4 and 8), to be continued to step 12 with a changed setting."""
    from conftest import train_in_process

    run_dir = tmp_path_factory.mktemp("stopped")
    train_in_process(corpus, run_dir, *BASE)
    return run_dir


def _copy(run: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(run, to)
    return to


def _digests(run_dir: Path) -> dict[str, str]:
    from trainer.checkpoint.store import sha256

    return {str(p.relative_to(run_dir)): sha256(p) for p in sorted((run_dir / "checkpoints").rglob("*")) if p.is_file()}


@pytest.mark.parametrize(("change", "note"), [
    (("data.batch_size=4",), "the global batch changes from 8 to 4 samples"),
    (("ema.enabled=true",), "has no EMA state (ema.enabled was off): the EMA starts from its weights now"),
    (("callbacks=early_stopping",), "has no state for callbacks.early_stopping"),
], ids=["batch_size", "ema", "callback"])
def test_resume_auto_with_a_changed_setting_continues_and_says_so(change, note, corpus, stopped, tmp_path):
    """It used to skip every checkpoint as unreadable, train from step 1 and prune the old checkpoints."""
    run_dir = _copy(stopped, tmp_path / "run")
    r = run_here(*tiny_overrides(corpus, *BASE, "trainer.max_steps=12", *change), f"hydra.run.dir={run_dir}",
                 "resume=auto")
    assert r.returncode == 0, r.stderr
    assert "starting fresh" not in r.stdout and "skipping" not in r.stdout
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000008'} at step 8" in r.stdout
    assert note in r.stdout
    steps = [e["step"] for e in read_metrics(run_dir) if "train/loss" in e]
    assert steps == list(range(1, 13))  # steps 1-8 from the first attempt, 9-12 continue them
    if "ema" in change[0]:
        assert "val_ema/loss" in read_metrics(run_dir)[-1]


def test_resume_auto_finds_a_run_saved_before_a_setting_was_added_and_names_no_change(corpus, stopped, tmp_path):
    """A config.yaml written before trainer.compile_mode/compile_options existed lacks them: compared key by key,
    resume=auto never matched that run and started a new one beside it. Read, it holds their old-behaviour values."""
    import json

    import yaml

    from trainer.checkpoint.settings import ADDED
    from trainer.checkpoint.store import sha256

    run_dir = _copy(stopped, tmp_path / "outputs" / "2000-01-01" / "00-00-00")
    for name in ("export.json", "model.safetensors", "model_config.json"):  # stopped before its end, not finished
        (run_dir / name).unlink()
    for path in [run_dir / "config.yaml", *(run_dir / "checkpoints").glob("step_*/config.yaml")]:
        saved = yaml.safe_load(path.read_text())
        for section, keys in ADDED.items():
            for key in keys:
                del saved[section][key]
        assert "compile_options" not in saved["trainer"]  # (what this run's version of the schema added)
        path.write_text(yaml.safe_dump(saved))
        if path.parent.name.startswith("step_"):  # (a checkpoint's manifest holds each file's sha256)
            manifest = json.loads((path.parent / "manifest.json").read_text())
            manifest["files"]["config.yaml"] = sha256(path)
            (path.parent / "manifest.json").write_text(json.dumps(manifest))
    r = run_here(*tiny_overrides(corpus, *BASE, "trainer.max_steps=12"), "resume=auto", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000008'} at step 8" in r.stdout
    assert "compile" not in r.stdout.replace("compiling", "")  # no setting named as changed
    assert [e["step"] for e in read_metrics(run_dir) if "train/loss" in e] == list(range(1, 13))


def test_resume_auto_refuses_a_change_it_cannot_continue_and_changes_nothing(corpus, stopped, tmp_path):
    """A new seed changes the sample stream: the run stops (exit 2) naming the setting and the two ways out, and
    leaves every checkpoint as it was."""
    run_dir = _copy(stopped, tmp_path / "run")
    before = _digests(run_dir)
    r = run_here(*tiny_overrides(corpus, *BASE, "trainer.max_steps=12", "trainer.seed=5"), f"hydra.run.dir={run_dir}",
                 "resume=auto")
    assert_clean_error(r, "none of the 2 checkpoints", "trainer.seed: 0 -> 5", "rerun with trainer.seed=0",
                       "start a new run in a directory of its own", "Nothing in the run dir was changed")
    assert _digests(run_dir) == before
    assert [e["step"] for e in read_metrics(run_dir) if "train/loss" in e] == list(range(1, 9))


def test_a_changed_model_is_refused_once_with_its_list_of_tensors_not_once_per_checkpoint(corpus, stopped, tmp_path,
                                                                                          capsys):
    """Every checkpoint of a run refuses a changed model for the same reason. The list of tensors used to be said
    three times (a warning per checkpoint, then the error) and in full, a wall of text for a real model; now the
    error gives the first few once, the older checkpoint in a clause, and nothing is said before it."""
    from conftest import train_in_process

    from trainer.errors import CheckpointError

    run_dir = _copy(stopped, tmp_path / "run")
    before = _digests(run_dir)
    capsys.readouterr()
    with pytest.raises(CheckpointError) as e:
        train_in_process(corpus, run_dir, *BASE, "trainer.max_steps=12", "model.d_model=32", "resume=auto")
    message = str(e.value)
    assert message.count("tok_emb.weight") == 1 and "more. Use the model config it was trained with" in message
    assert "The older one, step_00000004, fails the same way." in message and "model.d_model: " in message
    assert "skipping checkpoint" not in capsys.readouterr().out
    assert _digests(run_dir) == before


def test_checkpoints_skipped_for_one_reason_are_warned_of_in_full_once():
    from trainer.checkpoint.manager import _skipped_lines
    from trainer.errors import CheckpointError

    ckpts = [Path(f"/run/checkpoints/step_0000000{n}") for n in (9, 6, 3)]
    errors = [CheckpointError(f"checkpoint {ckpts[0]} does not match the model: w"),
              CheckpointError(f"file {ckpts[1]}/state.safetensors is truncated"),
              CheckpointError(f"checkpoint {ckpts[2]} does not match the model: w")]
    assert _skipped_lines(list(zip(ckpts, errors))) == [
        f"warning: skipping checkpoint {ckpts[0]}: {errors[0]} It stays on disk.",
        f"warning: skipping checkpoint {ckpts[1]}: {errors[1]} It stays on disk.",
        f"warning: skipping checkpoint {ckpts[2]} too, for the same reason as step_00000009. It stays on disk."]


def test_resume_auto_never_prunes_what_it_could_not_read_and_resume_null_sets_it_aside(corpus, stopped, tmp_path):
    """Every checkpoint damaged: resume=auto stops instead of starting over (it used to train from step 1 and
    prune them); resume=null then starts fresh with the damaged ones kept in checkpoints.prev/."""
    run_dir = _copy(stopped, tmp_path / "run")
    for ckpt in checkpoints(run_dir):
        f = run_dir / "checkpoints" / ckpt / "state.safetensors"
        f.write_bytes(f.read_bytes()[:-10])
    damaged = _digests(run_dir)
    args = [*tiny_overrides(corpus, *BASE), f"hydra.run.dir={run_dir}"]
    r = run_here(*args, "resume=auto")
    assert_clean_error(r, "none of the 2 checkpoints", "it is truncated", "resume=null")
    assert _digests(run_dir) == damaged
    r = run_here(*args, "resume=null")
    assert r.returncode == 0, r.stderr
    assert f"kept in {run_dir / 'checkpoints.prev'}" in r.stdout
    assert sorted(p.name for p in (run_dir / "checkpoints.prev").iterdir()) == ["step_00000004", "step_00000008"]
    assert checkpoints(run_dir) == ["step_00000004", "step_00000008"]  # the new run's own


@pytest.mark.parametrize("damage", ["state", "manifest", "no_manifest"])
def test_a_damaged_newer_checkpoint_survives_the_fallback_and_the_pruning_after_it(corpus, stopped, tmp_path, damage):
    """resume=auto falls back past a damaged step 8 to step 4 and renames the damaged one step_00000008.unreadable,
    out of reach of this and every later run's pruning. A manifest cut short (a copy stopped half-way) is damage
    too: it was once sorted as the oldest checkpoint, never tried, never named, and pruned. So is a manifest that
    never arrived: such a dir was passed over without a word, and deleted (a user's file in it too) when the run
    saved step 8 again."""
    run_dir = _copy(stopped, tmp_path / "run")
    f = run_dir / "checkpoints" / "step_00000008" / ("state.safetensors" if damage == "state" else "manifest.json")
    if damage == "no_manifest":
        f.unlink()
        f = f.parent / "NOTES.txt"
        f.write_text("mine")
    else:
        f.write_bytes(f.read_bytes()[:-10] if damage == "state" else f.read_bytes()[:50])
    damaged = f.read_bytes()
    r = run_here(*tiny_overrides(corpus, *BASE, "trainer.max_steps=12"), f"hydra.run.dir={run_dir}", "resume=auto")
    assert r.returncode == 0, r.stderr
    assert f"skipping checkpoint {run_dir / 'checkpoints' / 'step_00000008'}" in r.stdout
    assert "resumed from" in r.stdout and "step_00000004" in r.stdout
    assert "the skipped step_00000008 is kept as step_00000008.unreadable" in r.stdout
    assert (run_dir / "checkpoints" / "step_00000008.unreadable" / f.name).read_bytes() == damaged
    from trainer.checkpoint.store import Checkpointer

    assert [p.name for p in Checkpointer(run_dir / "checkpoints").complete()] == ["step_00000008", "step_00000012"]


def test_a_step_dir_without_a_manifest_is_never_deleted_by_a_save_of_its_step_nor_left_by_a_fresh_start(tmp_path):
    """A copy that stopped before its manifest arrived, alone in checkpoints/: resume=auto said "no complete
    checkpoint; starting fresh" and left it in place, and the fresh run's save of that step deleted it."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from trainer.checkpoint.manager import resume
    from trainer.checkpoint.store import MANIFEST, Checkpointer
    from trainer.parallel.backend import Backend

    c = Checkpointer(tmp_path / "checkpoints", keep_last=1)
    half = tmp_path / "checkpoints" / "step_00000002"
    half.mkdir(parents=True)
    (half / "model.safetensors").write_bytes(b"copied so far")
    assert c.complete() == [] and c.unreadable() == [half]
    c.save(2, {"w": torch.zeros(2)}, {"trainer": {"step": 2}})
    assert (tmp_path / "checkpoints" / "step_00000002.unreadable" / "model.safetensors").read_bytes() == b"copied so far"
    assert [p.name for p in c.complete()] == ["step_00000002"]
    (tmp_path / "checkpoints" / "step_00000002" / MANIFEST).unlink()  # (a manifest-less one again, alone)
    said = []
    trainer = SimpleNamespace(checkpointer=c, backend=Backend(device="cpu"))
    assert resume(trainer, OmegaConf.create({"resume": None}), said.append) is None
    assert said == [f"starting fresh (resume=None): the earlier checkpoints of this run dir are kept in "
                    f"{tmp_path / 'checkpoints.prev'}."]
    assert sorted(p.name for p in (tmp_path / "checkpoints.prev").iterdir()) == ["step_00000002",
                                                                                 "step_00000002.unreadable"]


def test_a_pruned_checkpoint_leaves_its_name_whole_before_its_files_go(tmp_path, monkeypatch):
    """`eval RUN` of a run training with keep_last=1 read its newest checkpoint while the next save's pruning deleted
    it file by file: 2 reads in 90 failed with "state.safetensors listed in the manifest is missing" (a damaged
    checkpoint, as said) where the checkpoint had merely been pruned, which eval retries. Now it is renamed out of
    sight first: under its name, a checkpoint is whole or absent. A pruned dir left by a killed process goes too."""
    from trainer.checkpoint import store

    c = store.Checkpointer(tmp_path / "checkpoints", keep_last=1)
    left = tmp_path / "checkpoints" / ".pruned-step_00000000-oldnonce-"
    left.mkdir(parents=True)
    seen = []
    real = store.shutil.rmtree

    def rmtree(path, *args, **kwargs):
        seen.append((Path(path).name, sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(store.shutil, "rmtree", rmtree)
    c.save(1, {"w": torch.zeros(2)}, {"trainer": {"step": 1}})
    c.save(2, {"w": torch.ones(2)}, {"trainer": {"step": 2}})
    pruned = [(name, visible) for name, visible in seen if "step_00000001" in name]
    assert pruned and all(name.startswith(".pruned-") and "step_00000001" not in visible for name, visible in pruned)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(("step_", ".pruned"))) == \
        ["step_00000002"]


def test_a_checkpoint_whose_manifest_cannot_be_read_is_tried_first_and_never_pruned(tmp_path):
    from trainer.checkpoint.store import Checkpointer

    c = Checkpointer(tmp_path / "checkpoints", keep_last=1)
    state = {"trainer": {"step": 0}}
    c.save(1, {"w": torch.zeros(2)}, state)
    c.save(2, {"w": torch.ones(2)}, state)
    (tmp_path / "checkpoints" / "step_00000002" / "manifest.json").write_text("{")
    c.save(3, {"w": torch.ones(2)}, state)
    c.save(4, {"w": torch.ones(2)}, state)
    from trainer.checkpoint.manager import resume_candidates

    assert [p.name for p in c.complete()] == ["step_00000004"]  # what loads without a fallback: the newest readable
    assert [p.name for p in c.unreadable()] == ["step_00000002"]  # never pruned
    tried, fallback = resume_candidates("auto", c, restarted=False)
    assert [p.name for p in tried] == ["step_00000002", "step_00000004"] and fallback  # tried first, then the rest
    assert resume_candidates(str(tmp_path), c, restarted=False)[0] == [tmp_path / "checkpoints" / "step_00000004"]


# -- finding the run to continue (item 5) -------------------------------------------------------------------
def test_resume_auto_finds_its_run_whatever_precision_auto_measured_and_after_raising_max_steps(tmp_path):
    """precision=auto records its probe's timing text, which differs at every start; a preempted run whose
    max_steps is raised on resume is still the same run. One of another learning rate is another experiment to
    the search (a run named by hydra.run.dir takes it changed): it continued the other's run as its own."""
    import yaml

    from trainer.entry.rundir import find_run_to_continue

    config = {"trainer": {"max_steps": 60, "seed": 0}, "optim": {"_target_": "torch.optim.AdamW", "lr": 1e-3},
              "precision": {"_target_": "trainer.parallel.precision.FP32", "reason": "precision=auto: bf16 ran 0.01x as fast"},
              "model": {"n_layer": 2}, "resume": None}
    run = tmp_path / "outputs" / "2026-01-01" / "12-00-00"
    (run / "checkpoints" / "step_00000005").mkdir(parents=True)
    (run / "checkpoints" / "step_00000005" / "manifest.json").write_text("{}")
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    here = tmp_path / "outputs" / "2026-01-01" / "13-00-00"
    now = {**config, "resume": "auto", "trainer": {"max_steps": 90, "seed": 0},
           "precision": {**config["precision"], "reason": "precision=auto: bf16 ran 0.02x as fast"}}
    assert find_run_to_continue(here, now) == run
    assert find_run_to_continue(here, {**now, "optim": {**now["optim"], "lr": 2e-3}}) is None
    assert find_run_to_continue(here, {**now, "model": {"n_layer": 3}}) is None  # another experiment
    assert find_run_to_continue(here, {**now, "optim": {**now["optim"], "_target_": "torch.optim.SGD"}}) is None


def test_resume_auto_of_two_runs_that_differ_in_the_learning_rate_continues_each_its_own(tmp_path):
    """Two preempted jobs of one command but for optim.lr: resume=auto continued the newest for both, swapping their
    learning rates from then on. Each continues its own; a third rate continues neither (it continued the newest,
    its steps at another rate, and that run's own job then began again from step 0)."""
    import os

    import yaml

    from trainer.entry.rundir import find_run_to_continue

    def run(time: str, lr: float, mtime: int) -> tuple[Path, dict]:
        config = {"trainer": {"max_steps": 60}, "optim": {"lr": lr}, "model": {"n_layer": 2}, "resume": None,
                  "precision": {"reason": f"measured at {time}"}, "logger": {"wandb": {"name": time}}}
        d = tmp_path / "outputs" / "2026-01-01" / time
        (d / "checkpoints" / "step_00000005").mkdir(parents=True)
        (d / "checkpoints" / "step_00000005" / "manifest.json").write_text("{}")
        (d / "config.yaml").write_text(yaml.safe_dump(config))
        os.utime(d, (mtime, mtime))
        return d, config

    (a, a_cfg), (b, b_cfg) = run("11-00-00", 1e-3, 1000), run("11-00-05", 3e-4, 2000)
    here = tmp_path / "outputs" / "2026-01-01" / "12-00-00"
    for cfg, want in ((a_cfg, a), (b_cfg, b)):
        job = {**cfg, "resume": "auto", "precision": {"reason": "measured now"}, "logger": {"wandb": {"name": "x"}}}
        assert find_run_to_continue(here, job) == want
    assert find_run_to_continue(here, {**a_cfg, "optim": {"lr": 5e-4}}) is None  # neither: a new run


def test_resume_notes_do_not_report_precision_autos_timing_text(tmp_path):
    from omegaconf import OmegaConf

    from trainer.checkpoint.settings import changed_settings

    (tmp_path / "config.yaml").write_text("precision:\n  reason: 'bf16 ran 0.01x'\ntrainer:\n  max_steps: 10\n")
    now = OmegaConf.create({"precision": {"reason": "bf16 ran 0.02x"}, "trainer": {"max_steps": 20}})
    assert changed_settings(tmp_path, now) == [("trainer.max_steps", 10, 20)]


def test_a_resume_into_another_world_counts_the_keys_only_one_option_has(tmp_path):
    """world=single resumed on world=ddp listed every DDP key as `world.bucket_cap_mb: None -> 25`, keys the single
    run never had; a changed key both have is still named."""
    from omegaconf import OmegaConf

    from trainer.checkpoint.manager import resume_notes
    from trainer.checkpoint.store import Checkpointer

    (tmp_path / "config.yaml").write_text("world:\n  _target_: trainer.parallel.SingleDevice\n  threads: auto\n")
    now = OmegaConf.create({"world": {"_target_": "trainer.parallel.DDP", "threads": 2, "bucket_cap_mb": 25,
                                      "static_graph": False}})
    (note,) = resume_notes(tmp_path, now, Checkpointer(tmp_path / "checkpoints"))
    assert note.endswith("world._target_: 'trainer.parallel.SingleDevice' -> 'trainer.parallel.DDP'; world.threads: "
                         "'auto' -> 2; world: 2 settings only one of the two options has"), note


# -- what a run reads must be its own (item 6) --------------------------------------------------------------
def test_a_symlinked_checkpoint_from_another_run_is_not_one_of_this_runs(stopped, tmp_path):
    from trainer.checkpoint.store import Checkpointer

    run_dir = _copy(stopped, tmp_path / "run")
    (run_dir / "checkpoints" / "step_00000099").symlink_to(stopped / "checkpoints" / "step_00000008")
    assert [p.name for p in Checkpointer(run_dir / "checkpoints").complete()] == ["step_00000004", "step_00000008"]


# -- hostile values with rewritten hashes (item 14) ---------------------------------------------------------
def _edit_state(ckpt: Path, change) -> None:
    import json

    from trainer.checkpoint.store import sha256

    tree = json.loads((ckpt / "state.json").read_text())
    change(tree)
    (ckpt / "state.json").write_text(json.dumps(tree))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["state.json"] = sha256(ckpt / "state.json")
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(("change", "needle"), [
    (lambda t: t["callbacks"]["early_stopping"].update(best="abc"), "callbacks.early_stopping.best='abc' is not a metric"),
    (lambda t: t["checkpointer"].update(best=["x", "y"]), "checkpointer.best=['x', 'y'] is not a (metric value"),
], ids=["early-stopping-best-a-string", "checkpointer-best-a-list-of-strings"])
def test_hostile_component_state_is_refused_before_anything_is_applied(change, needle, corpus, tmp_path):
    from conftest import train_in_process

    run_dir = tmp_path / "run"
    train_in_process(corpus, run_dir, *BASE, "callbacks=early_stopping", "checkpoint.best_metric=val/loss")
    ckpt = run_dir / "checkpoints" / "step_00000008"
    _edit_state(ckpt, change)
    r = run_here(*tiny_overrides(corpus, *BASE, "callbacks=early_stopping", "checkpoint.best_metric=val/loss",
                                 "trainer.max_steps=12"), f"hydra.run.dir={run_dir}", f"resume={ckpt}")
    assert_clean_error(r, str(ckpt), needle)


# -- every rank agrees on every load decision (item 8) -----------------------------------------------------
def test_a_checkpoint_one_rank_cannot_load_is_skipped_by_every_rank(ddp_reference, corpus, tmp_path):
    """Rank 1's RNG state in step 12 is invalid (hashes rewritten): rank 0 used to load step 12 while rank 1 fell
    back to step 8, and the job hung in its first collective until gloo's 30-minute timeout. Now both skip it,
    continue from step 8, and end exactly where the uninterrupted run did."""
    from conftest import DDP2, assert_identical, run_cli

    reference, _ = ddp_reference
    run_dir = _copy(reference, tmp_path / "run")
    _edit_state(run_dir / "checkpoints" / "step_00000012",
                lambda t: t["rng"][1]["python"]["__tuple__"][1]["__tuple__"].__setitem__(624, 700))
    r = run_cli(*tiny_overrides(corpus, *SHARED, *DDP2, "logger=tensorboard"), "trainer.progress=lines",
                f"hydra.run.dir={run_dir}", "resume=auto", timeout=120)
    assert r.returncode == 0, r.stderr
    skipped = [ln for ln in r.stdout.splitlines() if ln.startswith("warning: skipping checkpoint")]
    assert len(skipped) == 1 and "step_00000012" in skipped[0] and "RNG state" in skipped[0] and "(rank 1)" in skipped[0]
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000008'} at step 8" in r.stdout
    assert_identical(run_dir, reference)


@pytest.mark.parametrize("damage", ["deleted", "same-size-garbage"])
def test_resume_auto_repairs_an_export_whose_files_changed(damage, corpus, stopped, tmp_path):
    """export.json lists every file of the export with its size and sha256: a finished run whose model.safetensors
    was deleted (or overwritten) afterwards is re-exported by resume=auto, bit for bit."""
    import json

    run_dir = _copy(stopped, tmp_path / "run")
    weights = run_dir / "model.safetensors"
    good = weights.read_bytes()
    assert set(json.loads((run_dir / "export.json").read_text())["files"]) == {"model.safetensors", "model_config.json"}
    if damage == "deleted":
        weights.unlink()
    else:
        weights.write_bytes(good[:-8] + b"\0" * 8)
    r = run_here(*tiny_overrides(corpus, *BASE), f"hydra.run.dir={run_dir}", "resume=auto")
    assert r.returncode == 0, r.stderr
    assert "its export is missing or incomplete: writing it" in r.stdout
    assert weights.read_bytes() == good


def test_after_a_stop_signal_the_launcher_says_what_the_workers_really_saved(stopped, tmp_path):
    """It used to say "workers saved a checkpoint" whatever happened (a hung rank saves nothing), and then whenever a
    checkpoint was newer than the launch's, a periodic save of steps before the stop too."""
    import json

    from trainer.checkpoint.store import newest_complete, step_of
    from trainer.entry.launcher import _what_was_saved

    run_dir = _copy(stopped, tmp_path / "run")
    newest = newest_complete(run_dir)
    assert _what_was_saved(run_dir, newest) == f"the workers saved no checkpoint where they stopped; the newest is {newest}."
    assert _what_was_saved(run_dir, run_dir / "checkpoints" / "step_00000004") == \
        f"the workers saved a checkpoint ({newest})."
    assert _what_was_saved(tmp_path / "empty", None) == "the workers saved no checkpoint (none was due yet)."
    with open(run_dir / "metrics.jsonl", "a") as f:  # (steps logged past it: the stop's own save never came)
        f.write(json.dumps({"step": step_of(newest) + 3, "train/loss": 1.0}) + "\n")
    assert _what_was_saved(run_dir, run_dir / "checkpoints" / "step_00000004") == (
        f"the workers saved no checkpoint where they stopped; the newest is {newest} (they had logged step "
        f"{step_of(newest) + 3}: the steps after it are trained again).")


def test_a_preemption_right_after_a_periodic_save_does_not_save_that_step_again(corpus, tmp_path):
    """A stop signal seen at the boundary after step 4's periodic (async) save used to save step 4 a second time
    into the same temp directory, which the main rank was renaming into place: a rank's write then failed and
    the job exited 74 ("free disk space") instead of 75, about one time in four under FSDP."""
    from conftest import compose_cfg

    from trainer.entry.run import build
    from trainer.errors import Preempted

    trainer = build(compose_cfg(tiny_overrides(corpus, *BASE)), tmp_path)
    try:
        trainer.step = 4
        trainer.save_checkpoint()  # the periodic save of step 4, in flight
        saves = []
        trainer.checkpointer.save = lambda *a, **k: saves.append(a)
        trainer.preemption.requested = True
        with pytest.raises(Preempted, match="checkpoint saved to .*step_00000004"):
            trainer._preempted(first_step=0)
        assert saves == []
        assert [p.name for p in trainer.checkpointer.complete()] == ["step_00000004"]
    finally:
        trainer.backend.teardown()


def test_a_second_stop_signal_does_not_rename_the_first():
    """SLURM sends SIGUSR1 as its notice, then SIGTERM at the deadline: the run said it was stopped by SIGTERM."""
    import signal

    from trainer.loop.preemption import PreemptionFlag

    flag = PreemptionFlag()
    flag._handler(signal.SIGUSR1, None)
    flag._handler(signal.SIGTERM, None)
    assert (flag.requested, flag.signum) == (True, signal.SIGUSR1)


def test_a_checkpoint_file_truncated_while_it_is_read_is_an_error_not_sigbus(tmp_path):
    """Checkpoint files used to be mapped: a shard truncated after its checks and before its tensors were copied
    out killed the process with SIGBUS. Now each rank reads the byte ranges it uses, and a short read is one
    CheckpointError. (In a process of its own: before the fix the signal would have killed pytest.)"""
    script = """
import os, sys, torch
from trainer.checkpoint.store import Checkpointer, read
from trainer.errors import CheckpointError
from trainer.checkpoint.snapshot import assemble
path = Checkpointer(sys.argv[1]).save(1, {"w": torch.arange(1 << 20, dtype=torch.float32)}, {"step": 1})
loaded = read(path)
os.truncate(path / "model.safetensors", 4096)  # after every check passed
try:
    assemble("w", loaded.model["w"], torch.empty(1 << 20), "checkpoint")
except CheckpointError as e:
    print("refused:", e)
"""
    (tmp_path / "truncated_read.py").write_text(script)
    r = run_cli(str(tmp_path / "ckpt"), module="truncated_read", cwd=tmp_path, timeout=60)  # (python -m truncated_read)
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert "refused:" in r.stdout and "shorter than when it was opened" in r.stdout


def test_resume_auto_leaves_the_same_seconds_other_job_alone(tmp_path):
    """resume=auto without a run dir drops its own fresh timestamped dir when it continues an older run; a job
    started in the same second shares that dir, and its records must stay while it holds the lock."""
    from trainer.entry.cli import _remove_if_free
    from trainer.runlock import RunDirLock

    run_dir = tmp_path / "12-00-00"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("other: job\n")
    lock = RunDirLock(run_dir).acquire()
    try:
        _remove_if_free(run_dir)
        assert (run_dir / "config.yaml").read_text() == "other: job\n"
    finally:
        lock.release()
    _remove_if_free(run_dir)  # nobody holds it: only start records, so it goes
    assert not run_dir.exists()


def test_a_refused_rerun_leaves_the_run_dirs_records_and_an_accepted_one_updates_them(corpus, tmp_path):
    """A job refused in an existing run dir (a changed model under resume=auto) used to rewrite config.yaml and
    .hydra/ with its own settings while saying nothing was changed: the record of what ran was lost, and
    `trainer eval` of the run then built the wrong model. A resumed job still records its own settings."""
    run_dir = tmp_path / "run"
    args = (*tiny_overrides(corpus, *BASE), f"hydra.run.dir={run_dir}")
    assert run_here(*args).returncode == 0
    files = ["config.yaml", ".hydra/config.yaml", ".hydra/overrides.yaml", ".hydra/hydra.yaml"]
    before = {f: (run_dir / f).read_bytes() for f in files}
    refused = run_here(*args, "model.d_model=48", "trainer.max_steps=12", "resume=auto")
    assert refused.returncode == 2 and "Nothing in the run dir was changed" in refused.stderr + refused.stdout
    assert {f: (run_dir / f).read_bytes() for f in files} == before
    resumed = run_here(*args, "optim.lr=0.002", "trainer.max_steps=12", "resume=auto")
    assert resumed.returncode == 0, resumed.stderr
    assert "optim.lr=0.002" in (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert "lr: 0.002" in (run_dir / "config.yaml").read_text()


def test_a_resume_onto_other_bytes_at_data_path_is_refused_and_onto_the_same_bytes_elsewhere_is_not(corpus, tmp_path):
    """The order's fingerprint covers only the corpus's length: a file edited in place (same size, other text)
    resumed without a word."""
    data = tmp_path / "data.txt"
    data.write_bytes(corpus.read_bytes())
    run_dir = tmp_path / "run"
    args = ("debug=smoke", "data=text", f"data.cache_dir={tmp_path / 'cache'}", *BASE, f"hydra.run.dir={run_dir}")
    assert run_here(*args, f"data.path={data}").returncode == 0
    data.write_bytes(bytes(b ^ 1 for b in corpus.read_bytes()))  # every byte changed, the size kept
    r = run_here(*args, f"data.path={data}", "trainer.max_steps=12", "resume=auto")
    assert r.returncode == 2
    assert "trained on other data than this run's" in r.stderr, r.stderr
    moved = tmp_path / "elsewhere.txt"
    moved.write_bytes(corpus.read_bytes())
    r = run_here(*args, f"data.path={moved}", "trainer.max_steps=12", "resume=auto")
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stdout


def test_a_checkpoint_from_before_the_data_identity_was_recorded_still_resumes(corpus, stopped, tmp_path):
    import hashlib
    import json

    run_dir = _copy(stopped, tmp_path / "run")
    ckpt = run_dir / "checkpoints" / "step_00000008"
    state = json.loads((ckpt / "state.json").read_text())
    assert state["trainer"].pop("data_identity")  # (the lm recipe's text corpus records one)
    (ckpt / "state.json").write_text(json.dumps(state))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["state.json"] = hashlib.sha256((ckpt / "state.json").read_bytes()).hexdigest()
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    r = run_here(*tiny_overrides(corpus, *BASE, "trainer.max_steps=12"), f"hydra.run.dir={run_dir}", "resume=auto")
    assert r.returncode == 0, r.stderr
    assert f"resumed from {ckpt} at step 8" in r.stdout


def test_a_checkpoint_that_could_not_be_read_for_a_passing_reason_stays_for_the_next_run(corpus, stopped, tmp_path,
                                                                                          monkeypatch):
    """One skipped for its contents is set aside as step_N.unreadable; one that could not be read just now (an I/O
    error, a file shrinking under the reader) stays where it is, for the next resume=auto to try again."""
    from trainer.checkpoint import store
    from trainer.errors import CheckpointError

    run_dir = _copy(stopped, tmp_path / "run")
    checked = store._map_all

    def busy(path, files):
        if path.name == "step_00000008":
            raise CheckpointError(f"file {path / 'state.safetensors'} listed in the manifest cannot be read "
                                  f"(Input/output error); {store.AGAIN}")
        return checked(path, files)

    monkeypatch.setattr(store, "_map_all", busy)
    r = run_here(*tiny_overrides(corpus, *BASE, "trainer.max_steps=6", "checkpoint.every_n_steps=0"),
                 f"hydra.run.dir={run_dir}", "resume=auto")
    assert r.returncode == 0, r.stderr
    assert "skipping checkpoint" in r.stdout and "is kept as" not in r.stdout
    assert (run_dir / "checkpoints" / "step_00000008" / "manifest.json").is_file()
    # And it stays ahead of the one this run fell back to (which is not made the newest, as a rollback is).
    order = [p.name for p in store.Checkpointer(run_dir / "checkpoints").complete()]
    used = r.stdout.split("resumed from ")[1].split(" at step")[0].rsplit("/", 1)[1]
    assert order.index(used) < order.index("step_00000008"), (used, order)


def test_a_fresh_start_sets_checkpoints_aside_in_the_same_collectives_on_every_rank(tmp_path, monkeypatch):
    """A fresh start in a run dir with checkpoints: rank 0 moves them to checkpoints.prev. A rank that looked for
    them after that move took no part in rank 0's broadcast, and the run hung until world.hang_timeout (found under
    world.tp=2, whose other rank comes later). Every rank now makes the same calls, whatever it sees on disk."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from trainer.checkpoint import manager, store

    monkeypatch.setattr(store, "set_aside", lambda directory: tmp_path / "checkpoints.prev")

    sent = []  # what rank 0 broadcast, in order: what rank 1 receives

    def calls(rank: int, sees: list[Path]) -> tuple[list, list[str]]:
        made, said = [], []

        def broadcast_object(obj):
            made.append("broadcast_object")
            if rank == 0:
                sent.append(obj)
                return obj
            return sent[len(made) - 1] if len(made) <= len(sent) else None  # (a call rank 0 never made)

        backend = SimpleNamespace(info=SimpleNamespace(restart_count=0), is_main=rank == 0,
                                  broadcast_object=broadcast_object)
        checkpointer = SimpleNamespace(complete=lambda: sees, unreadable=lambda: [], dir=tmp_path / "checkpoints")
        trainer = SimpleNamespace(backend=backend, checkpointer=checkpointer)
        assert manager.resume(trainer, OmegaConf.create({"resume": None}), said.append) is None
        return made, said

    rank0, rank1 = calls(0, [tmp_path / "checkpoints" / "step_00000003"]), calls(1, [])  # (rank 1: after the move)
    assert rank0[0] == rank1[0], (rank0, rank1)
    assert rank0[1] == [f"starting fresh (resume=None): the earlier checkpoints of this run dir are kept in "
                        f"{tmp_path / 'checkpoints.prev'}."]


def test_a_fresh_start_over_a_linked_checkpoints_dir_says_where_its_checkpoints_now_go(corpus, tmp_path):
    """resume=null in a run dir whose checkpoints/ links to another disk: the link is set aside with the earlier
    checkpoints, and the new run's went to a new checkpoints/ on the run dir's disk, without a word."""
    scratch, run = tmp_path / "scratch", tmp_path / "run"
    scratch.mkdir()
    run.mkdir()
    (run / "checkpoints").symlink_to(scratch)
    args = (*tiny_overrides(corpus, "trainer.max_steps=2"), f"hydra.run.dir={run}")
    assert run_here(*args).returncode == 0
    r = run_here(*args, "resume=null")
    assert r.returncode == 0, r.stderr
    assert f"note: {run / 'checkpoints'} was a link to {scratch}, set aside with those checkpoints" in r.stdout + r.stderr
    assert (run / "checkpoints.prev").is_symlink()
    assert sorted(p.name for p in scratch.iterdir()) == ["linked_by.json", "step_00000002"]  # (and which run dir links it)
    assert not (run / "checkpoints").is_symlink() and (run / "checkpoints" / "step_00000002").is_dir()


def test_trainer_train_refuses_what_the_cli_refuses_a_run_dir_and_a_config_changed_after_compose(corpus, stopped,
                                                                                                 tmp_path, monkeypatch):
    """trainer.train(cfg, RUN/checkpoints/step_N) trained inside the checkpoint (its config.yaml rewritten, its
    weights moved: the checkpoint no longer loaded), `RUN/checkpoints` wrote a run among them, "" into the current
    directory; and a config changed after compose (max_steps = -3) trained. The CLI refuses each."""
    import shutil

    from trainer import compose, train
    from trainer.errors import ConfigError, DataError

    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    step = sorted((run / "checkpoints").glob("step_*"))[-1]
    before = {p: p.read_bytes() for p in step.iterdir()}
    cfg = compose(tiny_overrides(corpus, "trainer.max_steps=2"))
    for where, needle in ((step, "is a checkpoint of the run"), (run / "checkpoints", "is inside the checkpoints of"),
                          ("", "is empty: it would be the current directory")):
        monkeypatch.chdir(tmp_path)
        with pytest.raises(ConfigError, match=needle):
            train(cfg, where)
    assert {p: p.read_bytes() for p in step.iterdir()} == before and sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    cfg.trainer.max_steps = -3
    with pytest.raises(ConfigError, match="trainer.max_steps=-3 is invalid"):
        train(cfg, tmp_path / "new")
    assert not (tmp_path / "new").exists()
    cfg.trainer.max_steps, cfg.data.batch_size = 2, 100_000  # (refused once the data is read: the new dir goes too)
    with pytest.raises(DataError, match="data.batch_size=100000 is more than the"):
        train(cfg, tmp_path / "new")
    assert not (tmp_path / "new").exists()


def test_a_linked_checkpoints_dir_on_a_disk_without_directory_locks_does_not_stop_the_run(tmp_path, monkeypatch):
    """NFS refuses an exclusive flock of a directory opened read-only (EBADF), Lustre without -o flock gives ENOSYS:
    the lock of a linked checkpoints/ made every run with one there fail to start. It goes on without that lock."""
    import errno
    import fcntl

    from trainer import runlock

    scratch = tmp_path / "nfs"
    scratch.mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").symlink_to(scratch)
    real_flock = fcntl.flock

    def no_directory_locks(fd, op):
        if os.fstat(fd).st_ino == scratch.stat().st_ino:
            raise OSError(errno.EBADF, "Bad file descriptor")
        return real_flock(fd, op)

    monkeypatch.setattr(runlock.fcntl, "flock", no_directory_locks)
    lock = runlock.RunDirLock(tmp_path / "run").acquire()
    assert lock.held
    lock.release()
