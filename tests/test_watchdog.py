"""The hang watchdog (trainer/loop/watchdog.py): when no rank makes progress for world.hang_timeout seconds, every
rank's stack is collected, one paragraph names the rank that is missing and where each rank waits, and the
job exits with HangDetected.exit_code (70)."""

from __future__ import annotations

import io
import json
import sysconfig
import threading
import time
from pathlib import Path

import pytest
from conftest import FAULTY_ENV, ROOT, compose_cfg, faulty, run_cli, run_main, tiny_overrides

from trainer.errors import HangDetected
from trainer.loop import watchdog
from trainer.loop.watchdog import Frame

SITE = sysconfig.get_paths()["purelib"]
STDLIB = sysconfig.get_paths()["stdlib"]


def _hang_line() -> int:
    """The line of tests/helpers/faulty.py where the "hang" action sleeps forever."""
    lines = (ROOT / "tests" / "helpers" / "faulty.py").read_text().splitlines()
    return next(n for n, line in enumerate(lines, 1) if "time.sleep(3600)" in line)


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


# -- a job that hangs ---------------------------------------------------------------------------------------
def test_a_rank_that_hangs_is_named_and_the_job_exits_with_its_own_code(corpus, tmp_path):
    """Rank 1 sleeps forever at its 3rd loss call; rank 0 waits for it in a collective. After
    world.hang_timeout=3 s the launcher prints one paragraph naming both, and the job exits 70."""
    run_dir = tmp_path / "run"
    started = time.monotonic()
    r = run_cli(*tiny_overrides(corpus, "world=ddp", "world.nproc_per_node=2", "data.batch_size=4",
                                "world.hang_timeout=3"), *faulty("hang", 3, rank=1),
                f"hydra.run.dir={run_dir}", env=FAULTY_ENV, timeout=150)
    elapsed = time.monotonic() - started
    assert r.returncode == HangDetected.exit_code, r.stdout + r.stderr
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    errors = _errors(r.stderr)
    assert len(errors) == 1, r.stderr
    error = errors[0]
    assert f"rank 1 is stuck in tests/helpers/faulty.py:{_hang_line()} in _fault (not in a collective;" in error, error
    assert "rank 0 waits in " in error, error
    assert "world.hang_timeout=3" in error, error
    stacks = (run_dir / watchdog.STACKS_FILE).read_text()
    assert "rank 0" in stacks and "rank 1" in stacks and "faulty.py" in stacks, stacks
    assert elapsed < 60, f"{elapsed:.0f} s"


def test_a_single_process_that_hangs_reports_its_own_stack(corpus, tmp_path):
    run_dir = tmp_path / "run"
    r = run_cli(*tiny_overrides(corpus, "world.hang_timeout=2"), *faulty("hang", 3, rank=0),
                f"hydra.run.dir={run_dir}", env=FAULTY_ENV, timeout=120)
    assert r.returncode == HangDetected.exit_code, r.stdout + r.stderr
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    errors = _errors(r.stderr)
    assert len(errors) == 1, r.stderr
    assert f"the process is stuck in tests/helpers/faulty.py:{_hang_line()} in _fault" in errors[0], errors[0]
    assert "world.hang_timeout=2" in errors[0]
    assert "faulty.py" in (run_dir / watchdog.STACKS_FILE).read_text()


# -- the configuration ---------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["0", "null"])
def test_zero_or_null_switches_the_watch_off(value, corpus):
    from trainer.config.schema import launch_config

    cfg = compose_cfg(tiny_overrides(corpus, "world=ddp", f"world.hang_timeout={value}"))
    timeout = launch_config(cfg.world).hang_timeout
    assert not timeout
    watch = watchdog.start(timeout, None)
    try:
        assert not watch.running
    finally:
        watch.stop()


def test_the_default_is_on():
    from trainer.config.schema import LaunchConfig

    assert LaunchConfig().hang_timeout == 600
    watch = watchdog.start(600, None)
    try:
        assert watch.running
    finally:
        watch.stop()
    assert not watch.running


@pytest.mark.parametrize("value", ["-1", "abc"])
def test_a_bad_hang_timeout_is_refused_before_the_run_dir_exists(value, corpus, tmp_path):
    run_dir = tmp_path / "x"
    r = run_main(*tiny_overrides(corpus, "world=ddp", "world.nproc_per_node=2", f"world.hang_timeout={value}"),
                 f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "world.hang_timeout" in r.stderr
    assert not run_dir.exists()


# -- where a rank waits: the classification of its stack -------------------------------------------------
def _user(path: str, line: int, func: str, module: str) -> Frame:
    return Frame(str(Path.cwd() / path), line, func, module)


def _torch(path: str, line: int, func: str) -> Frame:
    return Frame(f"{SITE}/torch/{path}", line, func, "torch." + path[:-3].replace("/", "."))


def _std(path: str, line: int, func: str) -> Frame:
    return Frame(f"{STDLIB}/{path}", line, func, path[:-3].replace("/", "."))


OUTER = [_std("runpy.py", 198, "_run_module_as_main"), _user("trainer/entry/worker.py", 80, "<module>", "__main__"),
         _user("trainer/entry/run.py", 480, "train", "trainer.entry.run"), _user("trainer/loop/trainer.py", 290, "fit", "trainer.loop.trainer")]
IN_ALL_REDUCE = [*OUTER, _user("trainer/loop/trainer.py", 98, "sync_counts", "trainer.loop.trainer"),
                 _user("trainer/parallel/backend.py", 150, "all_reduce", "trainer.parallel.backend"),
                 _torch("distributed/c10d_logger.py", 81, "wrapper"),
                 _torch("distributed/distributed_c10d.py", 2806, "all_reduce")]
IN_BACKWARD = [*OUTER, _user("trainer/loop/trainer.py", 130, "train_step", "trainer.loop.trainer"),
               _user("trainer/parallel/precision.py", 45, "backward", "trainer.parallel.precision"),
               _torch("_tensor.py", 626, "backward"), _torch("autograd/__init__.py", 347, "backward"),
               _torch("autograd/graph.py", 823, "_engine_run_backward")]
IN_LOADER = [*OUTER, _torch("utils/data/dataloader.py", 701, "__next__"),
             _torch("utils/data/dataloader.py", 1448, "_next_data"), _std("multiprocessing/queues.py", 113, "get"),
             _std("threading.py", 331, "wait")]
IN_USER_CODE = [*OUTER, _user("trainer/loop/trainer.py", 118, "train_step", "trainer.loop.trainer"),
                _user("tests/helpers/faulty.py", 62, "loss", "faulty")]


def test_a_rank_in_a_torch_distributed_call_waits_in_that_collective():
    place = watchdog.where(IN_ALL_REDUCE)
    assert place.collective and place.what == "torch.distributed all_reduce", place
    assert place.caller == "trainer/parallel/backend.py:150 in all_reduce, from trainer/loop/trainer.py:98 in sync_counts", place


def test_a_loop_of_ones_own_waiting_inside_the_runtime_is_named_by_the_scripts_line_too():
    """A launched script's rank waiting in rt.step's all-reduce was named by two framework frames alone
    (parallel/precision.py, parallel/strategy.py): the script's line, which says which call, is added."""
    script = [_std("runpy.py", 198, "_run_module_as_main"), _user("trainer/entry/worker.py", 80, "<module>", "__main__"),
              _user("trainer/entry/run.py", 900, "script", "trainer.entry.run"), _std("runpy.py", 290, "run_path"),
              _user("train.py", 41, "<module>", "__main__"),
              _user("trainer/loop/runtime.py", 1000, "step", "trainer.loop.runtime"),
              _user("trainer/parallel/strategy.py", 287, "clip", "trainer.parallel.strategy"),
              _user("trainer/parallel/precision.py", 48, "unscale", "trainer.parallel.precision"),
              _torch("distributed/distributed_c10d.py", 2806, "all_reduce")]
    place = watchdog.where(script)
    assert place.caller == ("trainer/parallel/precision.py:48 in unscale, from trainer/parallel/strategy.py:287 in clip, "
                            "from train.py:41 in <module>"), place
    # (the Trainer's own loop has no such line: its worker's __main__ is the framework's entry/worker.py)
    assert "worker.py" not in watchdog.where(IN_ALL_REDUCE).caller


def test_a_distributed_rank_in_backward_waits_in_the_gradient_all_reduce():
    place = watchdog.where(IN_BACKWARD, distributed=True)
    assert place.collective and "backward" in place.what, place
    assert "trainer/loop/trainer.py:130 in train_step" in place.caller, place
    assert not watchdog.where(IN_BACKWARD, distributed=False).collective  # one process: backward is just slow


def test_a_rank_elsewhere_is_stuck_at_its_innermost_frame_outside_libraries():
    place = watchdog.where(IN_USER_CODE)
    assert not place.collective
    assert place.what == "tests/helpers/faulty.py:62 in loss" and place.caller == "trainer/loop/trainer.py:118 in train_step", place
    place = watchdog.where(IN_LOADER)
    assert not place.collective
    assert place.what == "trainer/loop/trainer.py:290 in fit, calling torch/utils/data/dataloader.py:701 in __next__", place


def _record(rank: int, frames: list[Frame], world_size: int = 2) -> dict:
    return {"rank": rank, "world_size": world_size, "frames": [list(f) for f in frames]}


def test_the_paragraph_names_the_missing_rank_and_where_the_others_wait():
    text = watchdog.paragraph([_record(0, IN_ALL_REDUCE), _record(1, IN_USER_CODE)], ranks=[0, 1], timeout=3,
                              stacks="RUN/hang_stacks.txt")
    assert text.startswith("error: ") and "\n" not in text
    assert ("rank 1 is stuck in tests/helpers/faulty.py:62 in loss (not in a collective; called from trainer/loop/trainer.py:118 "
            "in train_step)") in text, text
    assert "rank 0 waits in torch.distributed all_reduce called from trainer/parallel/backend.py:150" in text
    assert "world.hang_timeout=3" in text and "RUN/hang_stacks.txt" in text


def test_the_paragraph_groups_ranks_and_names_those_that_left_no_stack():
    records = [_record(r, IN_ALL_REDUCE, 4) for r in (0, 2)] + [_record(1, IN_USER_CODE, 4)]
    text = watchdog.paragraph(records, ranks=[0, 1, 2, 3], timeout=600, stacks="S")
    assert "ranks 0, 2 wait in torch.distributed all_reduce" in text, text
    assert "rank 3 left no stack" in text, text


def test_ranks_in_different_collectives_are_said_to_be_so():
    other = [*OUTER, _user("trainer/parallel/backend.py", 160, "broadcast_object", "trainer.parallel.backend"),
             _torch("distributed/distributed_c10d.py", 3300, "broadcast_object_list"),
             _torch("distributed/distributed_c10d.py", 2700, "broadcast")]
    text = watchdog.paragraph([_record(0, IN_ALL_REDUCE), _record(1, other)], ranks=[0, 1], timeout=3, stacks="S")
    assert "different collectives" in text, text
    assert "rank 1 waits in torch.distributed broadcast_object_list" in text, text


def test_a_rank_that_ended_its_loop_early_is_named_not_sought_on_another_machine(tmp_path, monkeypatch):
    """Rank 0 left its loop a step early (a `break` on one rank) and waited in rt.end, its watch stopped, while rank 1
    waited for it in the gradient all-reduce: the paragraph sent the user to look for rank 0 on another machine (of a
    one-machine job) or, where torch found rank 0's lost connection first, was not given (rank 0's traceback was)."""
    from types import SimpleNamespace

    (tmp_path / "A0.stack.1.json").write_text(json.dumps(_record(1, IN_BACKWARD)))
    lost = SimpleNamespace(exitcode=1, local_rank=0)  # rank 0 failed on the connection rank 1's exit closed
    # (no rank's loop ended: a lost connection alone is no hang, whatever stacks an attempt left)
    assert watchdog.report(tmp_path, {0: lost}, 2, tmp_path, lost_connection=True) is None
    watch = watchdog.Watchdog(600, directory=tmp_path, rank=0, world_size=2, local_world_size=2, attempt=0).start()
    monkeypatch.setattr(watchdog, "_current", watch)
    watchdog.disarm()  # (what rt.end does: the watch stops, and says the loop ended)
    assert not watch.running and (tmp_path / "A0.ended.0").exists()
    assert watchdog.report(tmp_path, {0: lost}, 2, tmp_path) is None  # (a crash of its own: not a hang)
    text = watchdog.report(tmp_path, {0: lost}, 2, tmp_path, lost_connection=True)
    assert "rank 0 of this machine ended its loop while the others wait for it in a collective" in text, text
    assert "rank 1 waits in backward's gradient all-reduce" in text and "another machine" not in text, text
    assert "left no stack" not in text, text


def test_a_firing_watch_waits_for_the_stacks_of_the_ranks_still_in_their_loop_only(tmp_path, monkeypatch):
    """A rank whose loop ended writes no stack: the watch that fires does not wait for it (the whole bound, 5 s,
    at every such hang), and does wait for a rank still in its loop."""
    exits, waits = [], []
    monkeypatch.setattr(watchdog.time, "sleep", lambda s: waits.append(s) or (tmp_path / "A0.stack.2.json").touch())
    (tmp_path / "A0.ended.1").touch()
    watch = watchdog.Watchdog(600, directory=tmp_path, rank=0, world_size=2, local_world_size=2, exit=exits.append)
    watch._watched = threading.get_ident()
    watch._fire(700.0)
    assert exits == [HangDetected.exit_code] and waits == []  # (rank 1 ended: nobody to wait for)
    watch.local_world_size = 3  # rank 2 still in its loop: waited for until its stack is there
    watch._fire(700.0)
    assert len(waits) == 1 and exits == [HangDetected.exit_code] * 2


def test_a_rank_of_a_one_machine_job_that_left_no_stack_is_named_not_sought_on_another_machine(tmp_path):
    """Rank 1 stopped (kill -STOP) or in native code holding the GIL: rank 0's watch fired, torch listed rank 0 alone,
    and the paragraph said the rank rank 0 waits for "is on another machine"."""
    from types import SimpleNamespace

    (tmp_path / "A0.stack.0.json").write_text(json.dumps(_record(0, IN_BACKWARD)))
    fired = {0: SimpleNamespace(exitcode=watchdog.HangDetected.exit_code, local_rank=0)}
    text = watchdog.report(tmp_path, fired, 2, tmp_path, ranks=[0, 1])
    assert "rank 1 left no stack" in text and "another machine" not in text, text
    assert "another machine" in watchdog.report(tmp_path, fired, 2, tmp_path)  # (ranks unknown: several machines)


# -- the watch thread itself (in this process; its exit is recorded instead of taken) -----------------------
class _Exit:
    def __init__(self):
        self.codes, self.done = [], threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.done.set()


def _sit_still(seconds: float) -> None:
    time.sleep(seconds)


def test_no_beat_for_the_timeout_fires_with_the_watched_threads_stack(tmp_path):
    exit, err = _Exit(), io.StringIO()
    watch = watchdog.Watchdog(0.5, run_dir=tmp_path, exit=exit, err=err).start()
    try:
        _sit_still(3)
    finally:
        watch.stop()
    assert exit.codes == [HangDetected.exit_code]
    assert "_sit_still" in err.getvalue() and "test_watchdog.py" in err.getvalue(), err.getvalue()
    assert "_sit_still" in (tmp_path / watchdog.STACKS_FILE).read_text()


def test_beats_keep_it_quiet(tmp_path):
    exit = _Exit()
    watch = watchdog.Watchdog(1.0, run_dir=tmp_path, exit=exit, err=io.StringIO()).start()
    try:
        for _ in range(30):
            time.sleep(0.05)
            watchdog.beat()
    finally:
        watch.stop()
    assert exit.codes == []


def test_a_peers_progress_keeps_it_quiet_and_a_peers_stack_makes_it_write_its_own(tmp_path):
    """Ranks of one node share the launcher's directory: a rank that waits while another works (rank 0 exporting
    the weights) does not fire, and once one rank fires every other writes its stack at once."""
    exit = _Exit()
    peer_beat = tmp_path / "A0.beat.1"
    watch = watchdog.Watchdog(1.0, run_dir=None, directory=tmp_path, rank=0, world_size=2, local_world_size=2,
                              exit=exit, err=io.StringIO()).start()
    try:
        for _ in range(30):  # rank 1 progresses for 1.5 s; this rank does not
            peer_beat.touch()
            time.sleep(0.05)
        assert exit.codes == []
        (tmp_path / "A0.stack.1.json").write_text(json.dumps(_record(1, IN_USER_CODE)))
        assert exit.done.wait(10)
    finally:
        watch.stop()
    assert exit.codes == [HangDetected.exit_code]
    mine = json.loads((tmp_path / "A0.stack.0.json").read_text())
    assert mine["rank"] == 0 and any(f[2] == "test_a_peers_progress_keeps_it_quiet_and_a_peers_stack_makes_it_write_"
                                     "its_own" for f in mine["frames"])


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the report reads /proc (Linux)")
def test_the_suites_report_on_a_hung_process_names_every_process_and_its_python_stack(tmp_path):
    """The suite's own harness, not the trainer: a process a test gives up waiting for (start_cli.wait) is stopped
    with a report of each process of its tree and each one's Python stack (tests/helpers/hung.py). A hang seen
    once on CI said only "timed out after 180 seconds"."""
    from conftest import Hung, start_cli

    ready = tmp_path / "child.pid"
    with start_cli(str(ready), module="hang_forever", env=FAULTY_ENV) as cli:
        deadline = time.monotonic() + 60
        while not ready.exists() and cli.child.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.05)  # (waiting for the program to reach its hang, bounded)
        assert ready.exists(), cli.err.read_text()
        child = int(ready.read_text())
        with pytest.raises(Hung) as raised:
            cli.wait(0.01)
    report = str(raised.value)
    assert f"pid {cli.pid} " in report and f"pid {child} ppid {cli.pid} " in report
    # Both processes of the program wrote their Python stacks, one after the other, each ending in its wait_forever.
    assert report.count("in wait_forever") == 2 and "Aborted\nFatal" not in report
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split(") ")[1][:1]
