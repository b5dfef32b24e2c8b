"""DDP on CPU with gloo: world size is a pure performance knob, and only rank 0 writes."""

from __future__ import annotations

import multiprocessing
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml
from conftest import (
    DDP2,
    FAULTY_ENV,
    ROOT,
    SHARED,
    assert_same_run,
    faulty,
    read_metrics,
    run_cli,
    series,
    tiny_overrides,
    train_in_process,
)

pytestmark = pytest.mark.slow


def test_two_ranks_equal_one_rank_with_accumulation_and_big_batch(corpus, tmp_path, reference, ddp_reference):
    acc = tmp_path / "acc"
    train_in_process(corpus, acc, "data.batch_size=4", "trainer.grad_accum_steps=2", *SHARED)
    assert_same_run(acc, reference)

    run_dir, stdout = ddp_reference
    assert_same_run(run_dir, reference)
    # One run dir, written by rank 0 only: no per-rank files, each event once, printed once.
    assert {p.name for p in run_dir.iterdir()} == {".hydra", ".lock", "config.yaml", "metrics.jsonl", "checkpoints",
                                                   "model.safetensors", "model_ema.safetensors", "model_config.json",
                                                   "run_info.json", "export.json", "tensorboard"}
    assert stdout.count("step 6: val/loss") == 1 and stdout.count("step 12/12 loss=") == 1


def test_the_python_api_starts_the_processes_the_config_asks_for(corpus, tmp_path, reference):
    """trainer.train(cfg) with world.nproc_per_node=2 trained one process (half the global batch) without a word.
    The caller's environment is as it was: the launcher left TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 set, so a torchrun
    this process started later chose its workers' port by binding and closing it (another process took it in
    between: EADDRINUSE). So are its signal handlers: torch's agent left its own, which raised SignalException at a
    later SIGTERM or Ctrl-C (a notebook's interrupt)."""
    import json
    import os
    import signal

    stops = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)
    api, before, handlers = tmp_path / "api", dict(os.environ), [signal.getsignal(s) for s in stops]
    train_in_process(corpus, api, *SHARED, *DDP2)
    assert dict(os.environ) == before
    assert [signal.getsignal(s) for s in stops] == handlers
    assert json.loads((api / "run_info.json").read_text())["world_size"] == 2
    assert_same_run(api, reference)


def test_the_python_api_launches_from_a_thread_other_than_the_main_one(corpus, tmp_path):
    """A tuner's trial thread (Ray Tune's function trainables, Optuna's n_jobs) calls trainer.train: the launcher's
    signal handling (main thread only) raised ValueError there after the workers had trained."""
    import threading

    out = {}

    def trial():
        try:
            train_in_process(corpus, tmp_path / "run", "trainer.max_steps=2", *DDP2)
            out["done"] = True
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            out["error"] = repr(e)

    thread = threading.Thread(target=trial)
    thread.start()
    thread.join()
    assert out == {"done": True}, out
    assert (tmp_path / "run" / "export.json").is_file()


def test_torchrun_launch_matches_self_launch(corpus, tmp_path, reference):
    """And a world.nproc_per_node torchrun overrules is said (it trained on torchrun's 2 without a word)."""
    r = run_cli("--standalone", "--nproc_per_node=2", "-m", "trainer",
                *tiny_overrides(corpus, *SHARED, "world=ddp", "world.nproc_per_node=3", "data.batch_size=4"),
                f"hydra.run.dir={tmp_path}", module="torch.distributed.run", env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    assert_same_run(tmp_path, reference)
    assert r.stdout.count("note: world.nproc_per_node=3 did not decide this job's processes: torchrun started it, "
                          "2 process(es) per node and 2 in all") == 1, r.stdout


def test_world_single_under_torchrun_is_one_paragraph_in_the_clis_terms(corpus, tmp_path):
    """It was the Python API's paragraph (Runtime(<SingleDevice object at 0x...>), use Runtime('ddp'))."""
    r = run_cli("--standalone", "--nproc_per_node=2", "-m", "trainer", *tiny_overrides(corpus, "world=single"),
                f"hydra.run.dir={tmp_path / 'run'}", module="torch.distributed.run", env={"OMP_NUM_THREADS": "1"})
    assert r.returncode != 0
    assert "world=single was started on 2 processes" in r.stderr and "Use world=ddp" in r.stderr, r.stderr
    assert "Runtime(" not in r.stderr and " object at 0x" not in r.stderr
    assert "did not decide this job's processes" not in r.stdout  # (world=single's own 1, never given: no note)


def test_a_model_world_tp_cannot_split_under_torchrun_is_rank_0s_paragraph_before_training(corpus, tmp_path):
    """The launcher's checks before its workers start (the model against world.tp) never ran under torchrun: a split
    that did not divide the heads trained into torch's reshape error in the first forward, a traceback on each rank."""
    r = run_cli("--standalone", "--nproc_per_node=2", "-m", "trainer",
                *tiny_overrides(corpus, "world=ddp", "world.tp=2", "model.n_head=1"), f"hydra.run.dir={tmp_path / 'run'}",
                module="torch.distributed.run", env={"OMP_NUM_THREADS": "1"})
    assert r.returncode != 0  # (torchrun's own: 1 whatever its ranks' codes)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "world.tp=2" in errors[0] and "n_head" in errors[0], r.stderr
    assert "is invalid for input of size" not in r.stderr and "recipes/lm/model.py" not in r.stderr  # (torchrun's own
    # ChildFailedError block follows, as for any rank that exits non-zero)
    assert not (tmp_path / "run").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_multirun_sweeps_ddp_jobs_into_separate_run_dirs_each_with_its_own_port(corpus, tmp_path):
    r = run_cli("-m", *tiny_overrides(corpus, *DDP2, "trainer.max_steps=3"), "optim.lr=1e-3,3e-3",
                f"hydra.sweep.dir={tmp_path}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lrs = {yaml.safe_load((tmp_path / str(i) / "config.yaml").read_text())["optim"]["lr"] for i in (0, 1)}
    assert lrs == {1e-3, 3e-3}
    assert all(len(series(read_metrics(tmp_path / str(i)), "train/loss")) == 3 for i in (0, 1))
    first_lr = [series(read_metrics(tmp_path / str(i)), "train/lr")[0] for i in (0, 1)]
    assert first_lr[1] == pytest.approx(3 * first_lr[0])


def _processes_with_marker(marker: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker.encode() in (d / "environ").read_bytes():
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


def test_a_crashing_rank_fails_the_job_once_and_leaves_no_process(corpus, tmp_path, scratch_tmpdir):
    """...and nothing in the temp dir: the workers' error files (torchelastic's per-launch directory, which torch
    never removes) and the hang watchdog's files go with the launch."""
    key, value = "TRAINER_TEST_MARKER", uuid.uuid4().hex
    scratch = scratch_tmpdir
    r = run_cli(*tiny_overrides(corpus, *DDP2, "task._target_=faulty.Faulty"), "+task.rank=1", "+task.at_call=3",
                f"hydra.run.dir={tmp_path / 'run'}", env={**FAULTY_ENV, key: value, "TMPDIR": str(scratch),
                                                          "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    assert r.returncode == 1
    output = r.stdout + r.stderr
    assert output.count("boom from the faulty task on rank 1") == 1, output
    assert "worker rank 1 failed" in r.stderr
    assert _processes_with_marker(f"{key}={value}") == []
    assert not (tmp_path / "run" / "model.safetensors").exists()
    assert sorted(p.name for p in scratch.iterdir()) == []


def test_a_mistake_only_the_workers_find_exits_2_and_leaves_no_run_dir(corpus, tmp_path):
    """A ConfigError raised in the launched workers (after the run dir was made, before any step) is a user mistake
    like one the launcher finds: exit 2, its paragraph, and the run dir, holding only this job's records, removed."""
    r = run_cli(*tiny_overrides(corpus, *DDP2, "task._target_=faulty.Faulty"), "+task.action=refuse_in_workers",
                f"hydra.run.dir={tmp_path / 'run'}", env=FAULTY_ENV)
    assert r.returncode == 2, r.stderr
    assert "task.action=refuse_in_workers: a mistake that only the workers find" in r.stderr
    assert not (tmp_path / "run").exists()
    # One found after a checkpoint: the run dir and what it holds stay (only a dir of records goes).
    r = run_cli(*tiny_overrides(corpus, *DDP2, "checkpoint.every_n_steps=2", *faulty("refuse", at_call=5)),
                f"hydra.run.dir={tmp_path / 'trained'}", env=FAULTY_ENV)
    assert r.returncode == 2 and "a mistake found at training call 5" in r.stderr, r.stderr
    assert (tmp_path / "trained" / "checkpoints" / "step_00000004" / "manifest.json").exists()
    assert (tmp_path / "trained" / "config.yaml").exists()


def test_a_nan_on_one_rank_stops_every_rank_at_the_next_read_with_nonfinite_check_log(corpus, tmp_path):
    """Gradients are averaged before the norm, so rank 1's NaN latches the skip on both ranks alike; both
    read the latch at the checkpoint due at step 8 and stop there, with nothing saved after step 4."""
    r = run_cli(*tiny_overrides(corpus, *DDP2, "trainer.log_every=5", "checkpoint.every_n_steps=4",
                                "trainer.nonfinite_check=log", "task._target_=faulty.Faulty"),
                "+task.action=nan_once", "+task.at_call=6", "+task.rank=1", f"hydra.run.dir={tmp_path}", env=FAULTY_ENV)
    assert r.returncode == 3, r.stderr
    # The worker's message, not also the elastic agent's log line about the failed worker.
    assert "failed (exitcode" not in r.stderr, r.stderr
    message = r.stderr.strip().splitlines()[-1]
    assert "non-finite gradient norm (nan) at step 6" in message and "the 2 after it" in message, message
    assert [p.name for p in sorted((tmp_path / "checkpoints").glob("step_*"))] == ["step_00000004"]
    assert [e["step"] for e in read_metrics(tmp_path)] == [5]


def test_the_failure_reported_is_the_cause_not_a_consequence(tmp_path):
    """Rank 1 fails first; rank 0 then fails on the closed connection a moment later in the same second, or
    is stopped by the agent (SIGTERM) after recording the same error. Either way the job reports rank 1's
    error and exit code; a rank killed without a record (OOM: SIGKILL) earlier in the second is the cause."""
    import json

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from trainer.entry.launcher import root_failure

    def failure(rank: int, exitcode: int, ms: int | None) -> ProcessFailure:
        path = tmp_path / f"error_{rank}_{exitcode}_{ms}.json"
        if ms is not None:  # what trainer.entry.worker records
            info = {"py_callstack": "", "timestamp": "50", "time_ns": 50 * 10**9 + ms * 10**6}
            path.write_text(json.dumps({"message": {"message": f"error: rank {rank}", "extraInfo": info}}))
        f = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(path))
        if ms is None:
            f.timestamp = 50  # found dead during second 50
        return f

    for failures in ({0: failure(0, 1, 700), 1: failure(1, 1, 300)},
                     {0: failure(0, -15, 100), 1: failure(1, 3, 300)},
                     {1: failure(1, 3, 300), 0: failure(0, -15, None)}):
        assert root_failure(failures)[0] == 1, failures
    assert root_failure({0: failure(0, -9, None), 1: failure(1, 1, 300)})[0] == 0
    late = failure(0, -9, None)
    late.timestamp = 51  # found dead only in the next second, after its peer's error on the closed connection
    assert root_failure({0: late, 1: failure(1, 1, 300)})[0] == 0


def test_the_cause_is_found_when_torch_reports_only_the_consequence(tmp_path):
    """Workers forked from the forkserver are reported one at a time: torch.multiprocessing names the first dead
    worker it looks at, here rank 0 on node 1 (global ranks 2, 3), which failed on the closed connection after
    rank 1 had recorded the real error. Rank 1's record (beside rank 0's, in torchelastic's attempt directory)
    is read back, with the exit code it recorded, and is the one reported."""
    import json

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from trainer.entry.launcher import every_failure, root_failure

    def record(local: int, ms: int, exitcode: int) -> str:
        path = tmp_path / "attempt_0" / str(local) / "error.json"
        path.parent.mkdir(parents=True)
        info = {"py_callstack": "", "timestamp": "50", "time_ns": 50 * 10**9 + ms * 10**6, "exitcode": exitcode}
        path.write_text(json.dumps({"message": {"message": f"error: rank {local}", "extraInfo": info}}))
        return str(path)

    reported = {2: ProcessFailure(local_rank=0, pid=100, exitcode=1, error_file=record(0, 700, 1))}
    record(1, 300, 2)
    (tmp_path / "attempt_0" / "2").mkdir()  # a rank that left no record (stopped by the agent)
    failures = every_failure(reported, nproc=3)
    assert sorted(failures) == [2, 3]
    rank, failure = root_failure(failures)
    assert (rank, failure.exitcode, failure.message["message"]) == (3, 2, "error: rank 1")


def _inherited(queue) -> None:
    from multiprocessing import forkserver

    from trainer.entry.worker import _let_go_of_forkserver

    before = multiprocessing.get_start_method()
    _let_go_of_forkserver()
    queue.put((before, multiprocessing.get_start_method(), forkserver._forkserver._forkserver_alive_fd))


def test_a_forked_worker_keeps_nothing_of_the_forkserver_a_fresh_interpreter_lacks():
    """A worker forked from the launcher's forkserver inherits "forkserver" as the default start method (its
    DataLoader's workers would start through a forkserver of their own, importing torch again) and the pipe
    that keeps the forkserver alive (a SIGKILLed launcher's forkserver would live on, and its workers with it).
    After `_let_go_of_forkserver` it has neither: the start method is a fresh interpreter's."""
    fresh = subprocess.run([sys.executable, "-c", "import multiprocessing; print(multiprocessing.get_start_method())"],
                           capture_output=True, text=True, check=True).stdout.strip()
    context = multiprocessing.get_context("forkserver")
    queue = context.SimpleQueue()
    child = context.Process(target=_inherited, args=(queue,))
    child.start()
    inherited, after, alive_fd = queue.get()
    child.join()
    assert inherited == "forkserver" and (after, alive_fd) == (fresh, None)


STOP_WITH_A_FORKED_CHILD = """
import os, signal, sys
from trainer.entry.launcher import _start_forkserver, _stop_forkserver
server = _start_forkserver()
pid = server._forkserver_pid
r, w = os.pipe()
child = os.fork()  # holds a copy of the launcher's end of the forkserver's pipe, as a DataLoader worker would
if child == 0:
    os.read(r, 1)
    os._exit(0)
_stop_forkserver(server)
gone = not os.path.exists(f"/proc/{pid}")
os.kill(child, signal.SIGKILL)
print(gone, server._forkserver_pid)
"""


def test_the_launcher_ends_its_forkserver_even_while_a_process_it_forked_holds_the_pipe():
    """multiprocessing's own stop waits for the server to read end-of-file, which a forked child's copy of the
    pipe withholds: the job would never end. The launcher kills its forkserver instead, once its workers are gone."""
    r = subprocess.run([sys.executable, "-c", STOP_WITH_A_FORKED_CHILD], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "None"]


def test_workers_write_where_their_launcher_writes_at_the_launch_not_where_the_forkserver_did(corpus, tmp_path):
    """A worker forked from a forkserver started earlier (by another launch, or with other files open) takes
    the launcher's stdout and stderr of this launch (worker.Streams): `trainer check` sends them to its log
    for its launches, and its report must not fill with the workers' lines."""
    out = tmp_path / "launch.log"
    r = run_cli(str(tmp_path / "run"), str(out), *tiny_overrides(corpus, *DDP2, "trainer.max_steps=2"),
                module="launch_elsewhere", env={"PYTHONPATH": f"{ROOT}:{ROOT / 'tests' / 'helpers'}"})
    assert r.returncode == 0, r.stderr
    assert r.stdout == "launched\n" and "summary: steps=2" in out.read_text()  # (rank 0's last line)


def test_a_forked_worker_takes_this_launchs_environment_not_the_forkservers():
    """The forkserver keeps the environment of the launch that started it; a later launch from the same process
    (a sweep, the Python API called twice) hands its own. What torchelastic set for the rank stays."""
    from trainer.entry.worker import worker_environment

    boot = {"PATH": "/bin", "TRAINER_CONFIG": "first job", "STALE": "1"}
    current = {**boot, "RANK": "1", "MASTER_PORT": "29500"}  # forked, then torchelastic's rank variables
    launcher = {"PATH": "/bin", "TRAINER_CONFIG": "second job", "NEW": "2"}
    assert worker_environment(launcher, boot, current) == {
        "PATH": "/bin", "TRAINER_CONFIG": "second job", "NEW": "2", "RANK": "1", "MASTER_PORT": "29500"}


def test_rendezvous_events_keep_the_names_torch_gives_them_without_reading_the_stacks_source():
    """The launcher names the c10d rendezvous's events with sys._getframe instead of torch's inspect.stack()
    (which reads the source of every frame, twice per event: 0.2 s of CPU a launch). Same names, at any depth."""
    import inspect

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from trainer.entry import launcher

    def torchs(depth=2):  # torch's get_method_name, as written in dynamic_rendezvous.py
        if len(inspect.stack()) > depth:
            return inspect.stack()[depth].function
        return "no_method_name"

    def _record(name_of, depth=2):
        return name_of(depth)

    def next_rendezvous():
        names = []
        for d in (1, 2, 3, 400):
            names.append((_record(torchs, d), _record(launcher._caller_name, d)))
        return names

    names = next_rendezvous()
    this_test = test_rendezvous_events_keep_the_names_torch_gives_them_without_reading_the_stacks_source.__name__
    assert [t for t, _ in names] == ["_record", "next_rendezvous", this_test, "no_method_name"]
    assert [ours for _, ours in names] == [t for t, _ in names]
    launcher._name_rendezvous_events_cheaply()  # (what every launch does before the agent starts)
    assert dynamic_rendezvous.get_method_name is launcher._caller_name


def test_a_worker_killed_without_a_record_is_named_when_torch_reports_the_peer_it_cut_off(tmp_path):
    """kill -9 of rank 1 was reported as "worker rank 0 failed" with rank 0's gloo error: torch names the one
    worker it found dead, which was the peer failing on the closed connection."""
    import json

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from trainer.entry.launcher import lost_node_message, lost_peer_message, silent_peers

    attempt = tmp_path / "attempt_0"
    for local in (0, 1, 2):
        (attempt / str(local)).mkdir(parents=True)
    gloo = "RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer."
    record = {"message": {"message": gloo, "extraInfo": {"py_callstack": gloo, "timestamp": "1", "time_ns": 1}}}
    (attempt / "0" / "error.json").write_text(json.dumps(record))
    (attempt / "2" / "error.json").write_text(json.dumps(record))  # rank 2 recorded the same consequence
    survivor = ProcessFailure(local_rank=0, pid=100, exitcode=1, error_file=str(attempt / "0" / "error.json"))
    assert silent_peers({0: survivor}, 0, survivor, nproc=3) == [1]
    said = lost_peer_message([1], 0, f"Traceback (most recent call last):\n  File ...\n{gloo}")
    assert said.startswith("error: worker rank 1 ended without a word") and "\n" not in said  # no traceback of rank 0's
    assert "rank 0 then failed on the connection it lost (gloo: Connection reset by peer)" in said
    # A node lost (its job killed): every rank here failed on the connection, none was killed here.
    said = lost_node_message(0, f"Traceback (most recent call last):\n  File ...\n{gloo}")
    assert said.startswith("error: rank 0 lost its connection to a rank of another node (gloo: Connection reset by "
                           "peer)") and "\n" not in said, said
    (attempt / "1" / "error.json").write_text(json.dumps({"message": {"message": "error: a user error",
                                                                       "extraInfo": {"timestamp": "0", "time_ns": 0}}}))
    assert silent_peers({0: survivor}, 0, survivor, nproc=3) == []  # rank 1 said why: every_failure finds it
    crash = {"message": {"message": "ValueError: bad batch", "extraInfo": {"py_callstack": "ValueError", "timestamp": "1",
                                                                            "time_ns": 1}}}
    (attempt / "0" / "error.json").write_text(json.dumps(crash))
    (attempt / "1" / "error.json").unlink()
    crashed = ProcessFailure(local_rank=0, pid=100, exitcode=1, error_file=str(attempt / "0" / "error.json"))
    assert silent_peers({0: crashed}, 0, crashed, nproc=3) == []  # not a lost connection: its own error
