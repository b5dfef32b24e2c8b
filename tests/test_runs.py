"""A run dir through interruptions, reruns and mistakes: what continues it, what it keeps, what it refuses.

Each case reproduces a way work was lost or silently changed (issues 16, 18, 19) and checks the fix."""

from __future__ import annotations

import contextlib
import json
import shlex
from pathlib import Path

import pytest
import torch
from conftest import (
    FAULTY_ENV,
    SHARED,
    assert_identical,
    checkpoints,
    compose_cfg,
    faulty,
    load_weights,
    read_metrics,
    run_cli,
    run_here,
    series,
    tiny_overrides,
    train_in_process,
)
from test_errors import assert_clean_error

pytestmark = pytest.mark.slow

SINGLE = ("data.batch_size=8", *SHARED)  # the `reference` fixture's settings


def test_a_second_job_in_a_locked_run_dir_is_refused_naming_the_holder(corpus, tmp_path):
    from trainer.runlock import RunDirLock

    run_dir = tmp_path / "run"
    lock = RunDirLock(run_dir).acquire()  # this test process holds it, as a running job would
    try:
        r = run_cli(*tiny_overrides(corpus), f"hydra.run.dir={run_dir}")
    finally:
        lock.release()
    import os

    assert_clean_error(r, "is in use by process", str(os.getpid()))
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()


def test_preempted_run_prints_the_command_that_continues_it_and_that_command_does(corpus, tmp_path, reference):
    """The default run dir is a new timestamp at every start: the printed command pins it."""
    marker = tmp_path / "fired"
    args = [*tiny_overrides(corpus, *SINGLE), *faulty("sigterm", 6), f"+task.once={marker}"]
    r = run_cli(*args, cwd=tmp_path, env=FAULTY_ENV)
    assert r.returncode == 75, r.stderr
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("to continue this run: "))
    command = shlex.split(line.removeprefix("to continue this run: "))
    assert command[:3] == ["python", "-m", "trainer"] and command[-1] == "resume=auto"
    run_dir = Path(next(a for a in command if a.startswith("hydra.run.dir=")).split("=", 1)[1])
    assert f"run dir: {run_dir}" in r.stdout
    r = run_here(*command[3:], cwd=tmp_path, env=FAULTY_ENV)
    assert r.returncode == 0, r.stderr
    assert f"done: {run_dir}" in r.stdout
    assert_identical(run_dir, reference)


def test_resume_auto_without_a_run_dir_continues_the_newest_unfinished_run_with_this_config(corpus, tmp_path, reference):
    marker = tmp_path / "fired"
    args = [*tiny_overrides(corpus, *SINGLE), "checkpoint.async_save=false", *faulty("sigkill", 11),
            f"+task.once={marker}"]
    assert run_cli(*args, cwd=tmp_path, env=FAULTY_ENV).returncode == -9
    other = run_here(*tiny_overrides(corpus, *SINGLE, "trainer.max_steps=4"), cwd=tmp_path)  # another config
    assert other.returncode == 0
    killed = next(p.parent for p in (tmp_path / "outputs").glob("*/*/checkpoints") if not (p.parent / "export.json").exists())
    # A resume started in the same second as the killed job gets the killed job's timestamped dir as its own
    # default: that run is still the one to continue (it was once skipped as "this job's dir", and trained anew).
    from trainer.entry.rundir import find_run_to_continue, read_config

    assert find_run_to_continue(killed, read_config(killed / "config.yaml")) == killed
    r = run_here(*args, "resume=auto", cwd=tmp_path, env=FAULTY_ENV)
    assert r.returncode == 0, r.stderr
    assert f"resume=auto: continuing {killed}" in r.stdout
    assert len(list((tmp_path / "outputs").glob("*/*"))) == 2  # no third run dir left behind
    assert_identical(killed, reference)


def test_resume_auto_without_a_run_dir_extends_a_finished_run_to_a_larger_max_steps(corpus, tmp_path):
    """A finished run's command rerun with a larger trainer.max_steps and resume=auto, as the README's way to train
    on, made a new timestamped run from step 0 ("no complete checkpoint in <new dir>; starting fresh") and said
    nothing of the finished one. It continues that run; the same length again is a new run."""
    args = tiny_overrides(corpus, "trainer.max_steps=4", "trainer.log_every=1")
    assert run_here(*args, cwd=tmp_path).returncode == 0
    (first,) = (tmp_path / "outputs").glob("*/*")
    r = run_here(*args, "trainer.max_steps=6", "resume=auto", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"resume=auto: continuing {first}, the newest run under {tmp_path / 'outputs'} with this config, which " \
           "finished short of this job's trainer.max_steps" in r.stdout, r.stdout
    assert list((tmp_path / "outputs").glob("*/*")) == [first]
    assert [e["step"] for e in read_metrics(first) if "train/loss" in e] == [1, 2, 3, 4, 5, 6]
    assert json.loads((first / "export.json").read_text())["step"] == 6
    r = run_here(*args, "trainer.max_steps=6", "resume=auto", cwd=tmp_path)  # (finished at 6: nothing to extend)
    assert r.returncode == 0 and "continuing" not in r.stdout, r.stdout
    assert len(list((tmp_path / "outputs").glob("*/*"))) == 2
    r = run_here(*args, "trainer.max_steps=8", "trainer.seed=1", "resume=auto", cwd=tmp_path)  # (it said "unfinished")
    assert f"resume=auto: the newest run this job could extend under {tmp_path / 'outputs'}, " in r.stdout, r.stdout
    assert "has other settings (trainer.seed: 0 -> 1)" in r.stdout


def test_resume_auto_that_finds_no_run_of_this_config_names_the_newest_unfinished_one_and_what_differs(corpus,
                                                                                                        tmp_path):
    """resume=auto with a changed seed started a new timestamped run with only "no complete checkpoint in <new
    dir>": the run it passed over, and why, went unsaid."""
    args = tiny_overrides(corpus, "trainer.max_steps=4", "checkpoint.every_n_steps=2")
    unfinished = tmp_path / "outputs" / "2026-01-01" / "00-00-00"
    assert run_here(*args, f"hydra.run.dir={unfinished}", cwd=tmp_path).returncode == 0
    (unfinished / "export.json").unlink()  # (as a run stopped after its step-2 checkpoint leaves it)
    r = run_here(*args, "resume=auto", "trainer.seed=1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (f"resume=auto: the newest unfinished run under {tmp_path / 'outputs'}, {unfinished}, has other settings "
            "(trainer.seed: 0 -> 1), so this starts a new run.") in r.stdout, r.stdout
    assert f"hydra.run.dir={unfinished}" in r.stdout
    r = run_here(*args, "resume=auto", cwd=tmp_path)  # its own config: continued, no such note
    assert f"resume=auto: continuing {unfinished}" in r.stdout and "other settings" not in r.stdout, r.stdout


def test_a_fresh_restart_sets_the_earlier_events_aside_instead_of_appending(corpus, tmp_path):
    args = [*tiny_overrides(corpus, "checkpoint.every_n_steps=8"), f"hydra.run.dir={tmp_path}"]
    assert run_cli(*args, *faulty("sigkill", 5), f"+task.once={tmp_path / 'fired'}", env=FAULTY_ENV).returncode == -9
    assert [e["step"] for e in read_metrics(tmp_path)] == [1, 2, 3, 4]
    r = run_here(*args, *faulty("sigkill", 5), f"+task.once={tmp_path / 'fired'}", "resume=auto", env=FAULTY_ENV)
    assert r.returncode == 0 and "starting fresh" in r.stdout
    assert [e["step"] for e in read_metrics(tmp_path) if "train/loss" in e] == list(range(1, 21))
    prev = [json.loads(line)["step"] for line in (tmp_path / "metrics.prev.jsonl").read_text().splitlines()]
    assert prev == [1, 2, 3, 4]
    assert (tmp_path / "config.prev.yaml").is_file()  # (the earlier attempt's records too: its command)
    assert "resume=auto" not in json.loads((tmp_path / "run_info.prev.json").read_text())["command"]
    assert "resume=auto" in json.loads((tmp_path / "run_info.json").read_text())["command"]


def test_a_stop_signal_during_the_final_export_ends_a_finished_run_as_finished(corpus, tmp_path, monkeypatch, capsys):
    """A SIGTERM while the export was written (the export goes on to the end) exited 75, "preempted ... rerun to
    finish", and a scheduler requeued a finished job."""
    import signal

    import trainer.entry.run as run

    def export_then_signalled(trainer, cfg, run_dir):
        exporting(trainer, cfg, run_dir)
        trainer.preemption.requested, trainer.preemption.signum = True, signal.SIGTERM  # (as its handler records)

    exporting = run.export
    monkeypatch.setattr(run, "export", export_then_signalled)
    final = train_in_process(corpus, tmp_path, "trainer.max_steps=2")
    assert final[-1]["step"] == 2 and json.loads((tmp_path / "export.json").read_text())["step"] == 2
    assert "note: SIGTERM came while the weights were exported; the export was completed" in capsys.readouterr().out


def test_a_fresh_start_keeps_an_export_json_it_cannot_read_with_the_weights_beside_it(corpus, tmp_path):
    """An export.json that lists no files (damaged, or a file of the user's own) was overwritten by the new run's,
    while the weights beside it were kept in export.prev/."""
    (tmp_path / "model.safetensors").write_text("mine")
    (tmp_path / "export.json").write_text('{"mine": 1}')
    train_in_process(corpus, tmp_path, "trainer.max_steps=1")
    assert (tmp_path / "export.prev" / "export.json").read_text() == '{"mine": 1}'
    assert (tmp_path / "export.prev" / "model.safetensors").read_text() == "mine"
    assert json.loads((tmp_path / "export.json").read_text())["step"] == 1


def test_a_fresh_start_in_a_dir_with_a_config_yaml_of_the_users_keeps_it(corpus, tmp_path):
    """hydra.run.dir at a project dir of one's own: its metrics and weights were set aside, its config.yaml
    overwritten."""
    (tmp_path / "config.yaml").write_text("my: important\n")
    train_in_process(corpus, tmp_path, "trainer.max_steps=1")
    assert (tmp_path / "config.prev.yaml").read_text() == "my: important\n"
    assert "trainer:" in (tmp_path / "config.yaml").read_text()


def test_resume_auto_follows_a_rollback_not_the_highest_step(corpus, tmp_path, reference):
    r = run_cli(*tiny_overrides(corpus, *SINGLE, "checkpoint.keep_last=3", "checkpoint.async_save=false"),
                f"hydra.run.dir={tmp_path}", *faulty("sigkill", 9), env=FAULTY_ENV)
    assert r.returncode == -9 and checkpoints(tmp_path) == ["step_00000004", "step_00000008"]
    branch = (tmp_path / "metrics.jsonl").read_text()
    # Roll back to step 4 and get preempted at step 6 (the newer step 8 is still on disk).
    r = run_cli(*tiny_overrides(corpus, *SINGLE, "checkpoint.keep_last=3"), f"hydra.run.dir={tmp_path}",
                f"resume={tmp_path}/checkpoints/step_00000004", *faulty("sigterm", 2), env=FAULTY_ENV)
    assert r.returncode == 75, r.stderr
    assert f"step_00000004 is older than step_00000008, written before this rollback: they are kept in {tmp_path}/" \
        "checkpoints.prev" in r.stdout, r.stdout
    # (the abandoned branch: its step 8 moved aside whole, its events kept beside this run's, which were cut at 4)
    # (and where it left the run's line, for a later resume of it: branch.json)
    assert sorted(p.name for p in (tmp_path / "checkpoints.prev").iterdir()) == ["branch.json", "step_00000008"]
    assert json.loads((tmp_path / "checkpoints.prev" / "branch.json").read_text()) == {"after": 4}
    assert (tmp_path / "metrics.prev.jsonl").read_text() == branch and "step_00000008" not in checkpoints(tmp_path)
    train_in_process(corpus, tmp_path, *SINGLE, "checkpoint.keep_last=3", "resume=auto")
    events = read_metrics(tmp_path)
    assert [e["step"] for e in events if "train/loss" in e] == list(range(1, 13))  # 7-12 continue from 6
    assert_identical(tmp_path, reference)


def test_the_best_checkpoint_survives_a_kill_before_the_first_prune(corpus, tmp_path):
    best = ("checkpoint.best_metric=val/loss", "checkpoint.best_mode=max", "checkpoint.keep_last=1",
            "trainer.eval_every=2", "checkpoint.every_n_steps=2", "trainer.max_steps=10", "checkpoint.async_save=false")
    args = [*tiny_overrides(corpus, *best), f"hydra.run.dir={tmp_path}"]
    assert run_cli(*args, *faulty("sigkill", 5), f"+task.once={tmp_path / 'fired'}", env=FAULTY_ENV).returncode == -9
    assert run_here(*args, *faulty("sigkill", 5), f"+task.once={tmp_path / 'fired'}", "resume=auto",
                   env=FAULTY_ENV).returncode == 0
    val = {e["step"]: e["val/loss"] for e in read_metrics(tmp_path) if "val/loss" in e and e["step"] < 10}
    want = max(val, key=val.get)  # best_mode=max: the worst loss is "best", so it is an early one
    named = json.loads((tmp_path / "checkpoints" / "best.json").read_text())
    assert named["checkpoint"] == f"step_{want:08d}" and named["value"] == val[want]
    assert named["checkpoint"] in checkpoints(tmp_path)


def test_a_finished_run_whose_export_is_missing_writes_it_on_resume(corpus, tmp_path, capsys):
    train_in_process(corpus, tmp_path, "trainer.max_steps=4")
    weights = load_weights(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()  # killed between the final checkpoint and the export
    (tmp_path / "export.json").unlink()
    # ... while it wrote the weights: their temp file, a whole copy, was kept for good.
    (tmp_path / ".model.safetensors.k1ll3d.tmp").write_bytes(b"\0" * 4096)
    capsys.readouterr()
    train_in_process(corpus, tmp_path, "trainer.max_steps=4", "resume=auto")
    out = capsys.readouterr().out
    assert "export is missing" in out and "already finished" in out
    again = load_weights(tmp_path / "model.safetensors")
    assert all(torch.equal(again[k], weights[k]) for k in weights)
    assert list(tmp_path.glob(".*.tmp")) == []


def test_a_failed_export_is_one_paragraph_with_its_own_exit_code_and_resume_finishes_it(corpus, tmp_path):
    (tmp_path / "model.safetensors").mkdir(parents=True)  # the export cannot be written there
    args = [*tiny_overrides(corpus, "trainer.max_steps=4"), f"hydra.run.dir={tmp_path}"]
    r = run_here(*args)
    assert_clean_error(r, "could not write the exported weights", "resume=auto", code=74)
    (tmp_path / "model.safetensors").rmdir()
    train_in_process(corpus, tmp_path, "trainer.max_steps=4", "resume=auto")
    assert json.loads((tmp_path / "export.json").read_text())["step"] == 4 and (tmp_path / "model.safetensors").is_file()


def test_raising_max_steps_on_resume_stretches_the_schedule_and_says_so(corpus, tmp_path):
    train_in_process(corpus, tmp_path, "trainer.max_steps=8", "scheduler.warmup_steps=0")
    r = run_here(*tiny_overrides(corpus, "trainer.max_steps=12", "scheduler.warmup_steps=0", "optim.lr=0.002"),
                f"hydra.run.dir={tmp_path}", "resume=auto")  # the CLI: it rewrites the run's config.yaml
    assert r.returncode == 0, r.stderr
    assert "trainer.max_steps: 8 -> 12" in r.stdout and "optim.lr: 0.005 -> 0.002" in r.stdout
    from trainer.loop.schedule import WarmupCosine

    f = WarmupCosine(total_steps=12, warmup_steps=0, min_lr_ratio=0.1)
    lrs = series(read_metrics(tmp_path), "train/lr")
    assert lrs[8:] == pytest.approx([0.002 * f(s) for s in range(8, 12)])  # the 12-step schedule, the new lr
    import yaml

    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["trainer"]["max_steps"] == 12  # truthful


def test_what_one_fresh_start_sets_aside_takes_one_number(corpus, tmp_path):
    """Each kind of file was numbered on its own: an attempt whose config.yaml was not set aside (the same as the
    next one's) shifted every later config.prev-N.yaml by one against metrics.prev-N.jsonl and export.prev-N/."""
    import yaml

    args = [*tiny_overrides(corpus, "checkpoint.save_final=false", "trainer.max_steps=2"), f"hydra.run.dir={tmp_path}"]
    events = []
    for seed in (0, 0, 1, 2):  # (the second attempt's config.yaml is the first's: replaced, not set aside)
        assert run_here(*args, f"trainer.seed={seed}", "resume=null").returncode == 0
        events.append((tmp_path / "metrics.jsonl").read_text())
    for n, seed in ((2, 0), (3, 1)):
        assert (tmp_path / f"metrics.prev-{n}.jsonl").read_text() == events[n - 1]
        assert yaml.safe_load((tmp_path / f"config.prev-{n}.yaml").read_text())["trainer"]["seed"] == seed
        assert (tmp_path / f"export.prev-{n}" / "export.json").is_file()
    assert not (tmp_path / "config.prev.yaml").exists() and not (tmp_path / "config.prev-4.yaml").exists()


def test_an_attempt_without_tensorboard_sets_the_earlier_ones_events_aside_under_its_number(corpus, tmp_path):
    """TensorBoard on, off, on: the second start left tensorboard/ in place (no TensorBoard logger set it aside), so
    the run showed the first attempt's curves as its own, and the third start set them aside as tensorboard.prev-2,
    beside metrics.prev-2.jsonl, the second attempt's."""
    args = [*tiny_overrides(corpus, "trainer.max_steps=2"), f"hydra.run.dir={tmp_path}", "resume=null"]
    assert run_here(*args, "logger=tensorboard", "trainer.seed=0").returncode == 0
    first = sorted(p.name for p in (tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert run_here(*args, "trainer.seed=1").returncode == 0
    assert not (tmp_path / "tensorboard").exists()
    assert sorted(p.name for p in (tmp_path / "tensorboard.prev").glob("events.out.tfevents.*")) == first
    assert run_here(*args, "logger=tensorboard", "trainer.seed=2").returncode == 0
    assert not (tmp_path / "tensorboard.prev-2").exists() and (tmp_path / "metrics.prev-2.jsonl").is_file()


def test_every_earlier_attempt_keeps_its_events_and_its_only_copy_of_the_weights(corpus, tmp_path):
    """Three fresh starts in one run dir without final checkpoints: the first attempt's events were overwritten by
    the second's in metrics.prev.jsonl, and each rerun replaced model.safetensors, the only copy of the weights."""
    args = [*tiny_overrides(corpus, "checkpoint.save_final=false", "trainer.max_steps=3"), f"hydra.run.dir={tmp_path}"]
    weights, events = [], []
    for seed in (0, 1, 2):
        r = run_here(*args, f"trainer.seed={seed}", "resume=null")
        assert r.returncode == 0, r.stderr
        weights.append((tmp_path / "model.safetensors").read_bytes())
        events.append((tmp_path / "metrics.jsonl").read_text())
    assert len(set(weights)) == 3
    assert (tmp_path / "metrics.prev.jsonl").read_text() == events[0]
    assert (tmp_path / "metrics.prev-2.jsonl").read_text() == events[1]
    assert (tmp_path / "export.prev" / "model.safetensors").read_bytes() == weights[0]
    assert (tmp_path / "export.prev-2" / "model.safetensors").read_bytes() == weights[1]
    assert (tmp_path / "model.safetensors").read_bytes() == weights[2]
    assert sorted(p.name for p in (tmp_path / "export.prev").iterdir()) == ["export.json", "model.safetensors",
                                                                            "model_config.json"]
    # and loads as an export (it was "not a run dir (no config.yaml)"), the first attempt's weights
    from safetensors.torch import load as load_bytes

    import trainer

    kept = trainer.load(tmp_path / "export.prev").state_dict()
    assert all(torch.equal(kept[k], v) for k, v in load_bytes(weights[0]).items())


def test_a_resume_with_ema_turned_off_leaves_no_earlier_ema_export_to_load(corpus, tmp_path):
    """The step-4 export's model_ema.safetensors stayed beside the step-6 export, and trainer.load(ema=True) and
    `sample` (EMA weights by default) read it as the run's."""
    import trainer
    from trainer.errors import ConfigError

    train_in_process(corpus, tmp_path, "trainer.max_steps=4", "ema.enabled=true")
    assert (tmp_path / "model_ema.safetensors").is_file()
    train_in_process(corpus, tmp_path, "trainer.max_steps=6", "ema.enabled=false", "resume=auto")
    assert not list(tmp_path.glob("model_ema*"))
    with pytest.raises(ConfigError, match="has no EMA weights in its final export"):
        trainer.load(tmp_path, ema=True)


def test_a_checkpoint_dir_that_cannot_be_written_stops_the_run_before_it_trains(corpus, tmp_path):
    """A file where checkpoints/ goes was found at the first save, after every step before it had been trained,
    and the message said to free disk space."""
    (tmp_path / "checkpoints").write_text("not a directory")
    r = run_here(*tiny_overrides(corpus, "trainer.max_steps=6"), f"hydra.run.dir={tmp_path}")
    assert_clean_error(r, f"checkpoints cannot be written to {tmp_path / 'checkpoints'}", "is not a directory",
                       "nothing was trained", code=74)
    assert not [e for e in read_metrics(tmp_path) if "train/loss" in e]
    assert (tmp_path / "checkpoints").read_text() == "not a directory"


def test_a_sweep_rerun_with_its_values_in_another_order_continues_each_points_own_run(corpus, tmp_path):
    """resume=auto on a sweep whose values came in another order continued job 0's dir (trained at lr 1e-3) at
    lr 3e-4, and rewrote its records: each point's results were another point's."""
    sweep = tmp_path / "sweep"
    args = (*tiny_overrides(corpus, "checkpoint.every_n_steps=2"), f"hydra.sweep.dir={sweep}", "resume=auto")
    r = run_here("-m", *args, "trainer.max_steps=4", "optim.lr=0.001,0.0003,0.002")
    assert r.returncode == 0, r.stderr
    before = {d.name: (d / ".hydra" / "overrides.yaml").read_text() for d in sweep.iterdir() if d.is_dir()}
    r = run_here("-m", *args, "trainer.max_steps=6", "optim.lr=0.0003,0.005,0.001")
    assert r.returncode == 0, r.stderr
    lr_of = {d.name: next(line for line in (d / ".hydra" / "overrides.yaml").read_text().splitlines() if "optim.lr" in line)
             for d in sweep.iterdir() if d.is_dir()}
    # Each old point continued in its own dir, the new one got a dir of its own.
    assert lr_of == {"0": "- optim.lr=0.001", "1": "- optim.lr=0.0003", "2": "- optim.lr=0.002", "1-2": "- optim.lr=0.005"}
    assert "optim.lr=0.002" in before["2"] and [e["step"] for e in read_metrics(sweep / "2")][-1] == 4  # not run
    for point in ("0", "1"):
        assert [e["step"] for e in read_metrics(sweep / point) if "train/loss" in e] == list(range(1, 7)), point
    assert f"resumed from {sweep / '1' / 'checkpoints' / 'step_00000004'}" in r.stdout


def test_a_failed_sweep_point_names_the_points_after_it_that_never_ran(corpus, tmp_path):
    """Hydra's launcher ends a sweep at a failed point (here a NaN at lr 1e9); the point after it never ran, and
    nothing said so."""
    r = run_here("-m", *tiny_overrides(corpus, "trainer.max_steps=3"), f"hydra.sweep.dir={tmp_path / 'sweep'}",
                 "optim.lr=0.001,1e9,0.003", "optim.weight_decay=0.0,0.1")
    assert r.returncode == 3, r.stderr  # (NonFiniteError's)
    note = next(line for line in r.stderr.splitlines() if line.startswith("note: the sweep ends at this point"))
    # Points in Hydra's order: lr x wd, so the failed one is (1e9, 0.0), then (1e9, 0.1), (0.003, 0.0), (0.003, 0.1).
    assert "the 3 after it did not run" in note
    after = note.split("did not run: ", 1)[1].rstrip(".").split("; ")
    assert [[o for o in p.split() if o.startswith("optim.")] for p in after] == [
        ["optim.lr=1000000000.0", "optim.weight_decay=0.1"], ["optim.lr=0.003", "optim.weight_decay=0.0"],
        ["optim.lr=0.003", "optim.weight_decay=0.1"]]
    assert sorted(d.name for d in (tmp_path / "sweep").iterdir() if d.is_dir()) == ["0", "1", "2"]


def test_a_crashed_sweep_point_does_not_claim_the_sweep_ends_there(corpus, tmp_path):
    """A crash (an exception, not a refusal or a NaN) is one Hydra records and goes on from: the note said the points
    after it did not run, and they then ran."""
    r = run_here("-m", *tiny_overrides(corpus, "trainer.max_steps=3", *faulty("raise", 2),
                                       f"+task.once={tmp_path / 'fired'}"),
                 f"hydra.sweep.dir={tmp_path / 'sweep'}", "optim.lr=0.001,0.003")
    assert r.returncode == 1
    assert "sweep ends at this point" not in r.stderr
    assert [e["step"] for e in read_metrics(tmp_path / "sweep" / "1") if "train/loss" in e] == [1, 2, 3]


def test_a_sweep_point_of_a_choice_without_settings_is_read_from_the_runs_own_record(tmp_path):
    """Under submitit, Hydra writes each job's .hydra/ records into its numbered dir before it runs: the records of
    dir 0 name the job's point whatever run dir 0 holds. A choice with no settings of its own in config.yaml (a
    _global_ package: recipe=, +experiment=) showed only there. run_info.json, which only the run writes, says."""
    import json

    import yaml

    from trainer.entry.rundir import sweep_point_dir

    for name, recipe in (("0", "lm"), ("1", "diffusion")):
        (tmp_path / name / ".hydra").mkdir(parents=True)
        (tmp_path / name / "run_info.json").write_text(json.dumps({"overrides": [f"recipe={recipe}", "resume=auto"]}))
        (tmp_path / name / "config.yaml").write_text(yaml.safe_dump({"optim": {"lr": 0.001}}))
        # (as submitit's second job left them, rerun with the values in the other order)
        (tmp_path / name / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(
            [f"recipe={'diffusion' if name == '0' else 'lm'}", "resume=auto"]))
    argv = ["-u", "-m", "submitit.core._submit", str(tmp_path / ".submitit")]  # (the job's: the sweep's is unseen)
    config = {"optim": {"lr": 0.001}}
    assert sweep_point_dir(tmp_path / "0", ["recipe=diffusion", "resume=auto"], argv, config) == tmp_path / "1"
    assert sweep_point_dir(tmp_path / "1", ["recipe=lm", "resume=auto"], argv, config) == tmp_path / "0"
    # A value config.yaml shows is compared there, not as written: 0.001 is the run's 1e-3.
    (tmp_path / "1" / "run_info.json").write_text(json.dumps({"overrides": ["recipe=diffusion", "optim.lr=1e-3"]}))
    assert sweep_point_dir(tmp_path / "1", ["recipe=diffusion", "optim.lr=0.001"], argv, config) == tmp_path / "1"
    (tmp_path / "0" / "run_info.json").unlink()  # (a run from before the record: .hydra/ and config.yaml decide)
    assert sweep_point_dir(tmp_path / "1", ["recipe=lm", "resume=auto"], argv, config) == tmp_path / "1-2"


def test_a_sweep_point_is_all_its_overrides_not_only_the_swept_ones(tmp_path):
    """A rerun sweeping lr at a weight decay the first sweep swept too continued the wd=0.0 run at wd=0.1 (only the
    swept lr was compared), and a sweep defined in a config file (no swept key on the command line) continued by
    job number. Its length (trainer.max_steps) and resume are not the point: a rerun may change them."""
    import yaml

    from trainer.entry.rundir import sweep_point_dir

    for name, lr, wd in (("0", "1e-3", "0.0"), ("1", "1e-3", "0.1"), ("2", "3e-4", "0.0"), ("3", "3e-4", "0.1")):
        (tmp_path / name / ".hydra").mkdir(parents=True)
        (tmp_path / name / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(
            [f"optim.lr={lr}", f"optim.weight_decay={wd}", "resume=auto", "trainer.max_steps=4"]))
    argv = ["-m", "optim.lr=1e-3,3e-4", "optim.weight_decay=0.1", "resume=auto", "trainer.max_steps=25"]
    for job, (lr, want) in enumerate((("1e-3", "1"), ("3e-4", "3"))):
        overrides = [f"optim.lr={lr}", "optim.weight_decay=0.1", "resume=auto", "trainer.max_steps=25"]
        assert sweep_point_dir(tmp_path / str(job), overrides, argv) == tmp_path / want
    # The sweep in a config file: its values are in the job's overrides, not on the command line.
    in_file = ["optim.lr=3e-4", "optim.weight_decay=0.0", "resume=auto"]
    assert sweep_point_dir(tmp_path / "0", in_file, ["-m", "resume=auto"]) == tmp_path / "2"
    # A swept key is the point even where a rerun may change it otherwise (a sweep of the run's length).
    for name, steps in (("a/0", "4"), ("a/1", "8")):
        (tmp_path / name / ".hydra").mkdir(parents=True)
        (tmp_path / name / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"trainer.max_steps={steps}"]))
    lengths = ["-m", "trainer.max_steps=8,4"]
    assert sweep_point_dir(tmp_path / "a" / "0", ["trainer.max_steps=8"], lengths) == tmp_path / "a" / "1"
    # A logger or world chosen on a rerun, and a secret (.hydra/ holds it redacted), leave the point as it was.
    rerun = ["optim.lr=3e-4", "optim.weight_decay=0.1", "logger=wandb", "world=fsdp", "hydra/launcher=basic",
             "+model.hf_token=abcdefgh"]
    assert sweep_point_dir(tmp_path / "0", rerun, argv) == tmp_path / "3"


def test_a_sweep_point_is_found_by_its_config_where_hydra_kept_no_records(tmp_path):
    """Under hydra.output_subdir=null a sweep's dirs have no .hydra/overrides.yaml: each point is then read from
    its config.yaml (a swept key's value, or the settings a swept choice put under its group), so a rerun with the
    values in another order still continues each point's own run instead of the one its job number had."""
    import yaml

    from trainer.entry.rundir import sweep_point_dir

    def config(lr, model):
        return {"optim": {"lr": lr, "betas": [0.9, 0.95]}, "model": {"n_layer": model, "d_model": 32}, "seed": 0}

    for name, lr, model in (("0", 0.001, 2), ("1", 0.0003, 2), ("2", 0.001, 4)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.yaml").write_text(yaml.safe_dump(config(lr, model)))
    argv = ["-m", "optim.lr=0.0003,0.001", "model=a,b", "resume=auto"]
    # model=b is recorded by what it put under model: n_layer 4
    assert sweep_point_dir(tmp_path / "0", ["optim.lr=0.0003", "model=a"], argv, config(0.0003, 2)) == tmp_path / "1"
    assert sweep_point_dir(tmp_path / "1", ["optim.lr=1e-3", "model=b"], argv, config(0.001, 4)) == tmp_path / "2"
    assert sweep_point_dir(tmp_path / "0", ["optim.lr=0.001", "model=a"], argv, config(0.001, 2)) == tmp_path / "0"
    # a new point: not another point's dir (a new <N>-2), and a fresh numbered dir is its own
    assert sweep_point_dir(tmp_path / "0", ["optim.lr=0.005", "model=a"], argv, config(0.005, 2)) == tmp_path / "0-2"
    assert sweep_point_dir(tmp_path / "3", ["optim.lr=0.005", "model=a"], argv, config(0.005, 2)) == tmp_path / "3"


def test_the_forkserver_guard_takes_the_process_that_imports_it_when_its_parent_dies(tmp_path):
    """The launcher's forkserver imports trainer.entry.forkserver_guard first, so that a SIGKILLed launcher takes it,
    and through it the workers, at once (they trained on for 2-4 s while the forkserver shut down by itself)."""
    import os
    import select
    import signal
    import subprocess
    import sys

    from conftest import ROOT

    parent = tmp_path / "parent.py"
    parent.write_text(
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time, trainer.entry.forkserver_guard; "
        "print(1, flush=True); time.sleep(300)'], stdout=subprocess.PIPE, text=True)\n"
        "assert child.stdout.readline().strip() == '1'\n"
        "print(child.pid, flush=True)\n")  # and ends, its child left behind
    r = subprocess.run([sys.executable, str(parent)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    pid = int(r.stdout.strip())
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # gone already
    try:
        assert select.select([fd], [], [], 60)[0], "the child outlived its parent"
    finally:
        os.close(fd)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_a_killed_runs_data_loader_workers_die_with_it_and_leave_its_resume_free(corpus, tmp_path):
    """With data.num_workers=1 a resume=auto right after a SIGKILL was refused ("in use by process ...") until the
    loader's worker noticed its parent gone, seconds later."""
    args = [*tiny_overrides(corpus, "checkpoint.every_n_steps=2", "data.num_workers=1"), f"hydra.run.dir={tmp_path}"]
    once = f"+task.once={tmp_path / 'fired'}"
    assert run_cli(*args, *faulty("sigkill", 5), once, env=FAULTY_ENV).returncode == -9
    r = run_here(*args, *faulty("sigkill", 5), once, "resume=auto", env=FAULTY_ENV)
    assert r.returncode == 0, r.stderr
    assert f"resumed from {tmp_path / 'checkpoints'}" in r.stdout


class _DeathSignal(__import__("torch").utils.data.Dataset):
    """Each sample: the signal the kernel sends the process reading it when that process's parent dies (0: none)."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        import ctypes

        import torch

        sig = ctypes.c_int(-1)
        ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(sig))  # PR_GET_PDEATHSIG
        return torch.tensor([sig.value, __import__("os").getpid()])


def test_the_framework_s_data_loader_workers_are_set_to_die_with_their_rank():
    """The deterministic half of the test above: every DataLoader the framework starts (training batches, eval
    batches) has its workers ask the kernel for SIGKILL when the rank that started them dies, where torch's own
    check notices a dead parent only within 5 s."""
    import os
    import signal

    import torch

    from trainer.data.sampling import eval_loader, train_loader

    cpu = torch.device("cpu")
    for loader in (train_loader(_DeathSignal(), [[0, 1], [2, 3]], 1, cpu, 0),
                   eval_loader(_DeathSignal(), 2, 0, 1, None, 1, cpu)):
        rows = torch.cat(list(loader))
        assert rows[:, 0].tolist() == [int(signal.SIGKILL)] * 4  # read in a worker that dies with its rank
        assert os.getpid() not in rows[:, 1].tolist()  # (in a worker, not this process)



def test_a_finished_run_without_a_final_checkpoint_is_not_retrained_over_its_export(corpus, tmp_path):
    """checkpoint.save_final=false: the newest checkpoint (step 4) is older than the export (step 6). resume=auto
    retrained steps 5-6 from it and replaced the export, the only copy of those weights; with trainer.max_steps
    raised, it retrained them on the stretched schedule. Now the run is finished, the raise is refused with
    nothing changed, and a rollback named on purpose keeps the export in export.prev/."""
    args = [*tiny_overrides(corpus, "checkpoint.save_final=false", "checkpoint.every_n_steps=4"),
            f"hydra.run.dir={tmp_path}"]
    assert run_here(*args, "trainer.max_steps=6").returncode == 0
    before = {n: (tmp_path / n).read_bytes() for n in ("model.safetensors", "metrics.jsonl", "export.json")}

    def unchanged() -> bool:
        return all((tmp_path / n).read_bytes() == b for n, b in before.items())

    r = run_here(*args, "trainer.max_steps=6", "resume=auto")
    assert r.returncode == 0, r.stderr
    assert "the run is already finished: its export is of step 6" in r.stdout and unchanged()
    r = run_here(*args, "trainer.max_steps=8", "resume=auto")
    assert_clean_error(r, "exported weights", "are of step 6", "step_00000004", "train steps 5-6 again",
                       "Nothing was changed", code=2)
    assert unchanged() and not (tmp_path / "export.prev").exists()
    r = run_here(*args, "trainer.max_steps=8", f"resume={tmp_path}/checkpoints/step_00000004")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "export.prev" / "model.safetensors").read_bytes() == before["model.safetensors"]
    assert json.loads((tmp_path / "export.json").read_text())["step"] == 8
    assert [e["step"] for e in read_metrics(tmp_path) if "train/loss" in e] == list(range(1, 9))


def test_an_early_stopped_run_without_a_final_checkpoint_is_finished_on_resume(corpus, tmp_path):
    """Early stopping at step 4 with checkpoint.save_final=false: the export (step 4) is later than the newest
    checkpoint (step 3) but below trainer.max_steps; the run stopped itself, so resume=auto says it is finished."""
    args = [*tiny_overrides(corpus, "trainer.max_steps=40", "trainer.eval_every=2", "callbacks=early_stopping",
                            "callbacks.early_stopping.patience=1", "callbacks.early_stopping.min_delta=100",
                            "checkpoint.save_final=false", "checkpoint.every_n_steps=3"), f"hydra.run.dir={tmp_path}"]
    assert run_here(*args).returncode == 0
    assert json.loads((tmp_path / "export.json").read_text())["step"] == 4 and checkpoints(tmp_path) == ["step_00000003"]
    export = (tmp_path / "model.safetensors").read_bytes()
    r = run_here(*args, "resume=auto")
    assert r.returncode == 0, r.stderr
    assert "the run is already finished: " in r.stdout and ", at step 4 (" in r.stdout, r.stdout
    assert (tmp_path / "model.safetensors").read_bytes() == export


def test_a_resume_from_another_runs_checkpoint_keeps_this_run_dirs_own_attempt(corpus, tmp_path):
    """resume=<run A's checkpoint> with hydra.run.dir at run B: B's metrics.jsonl went on with A's steps after its
    own, its export and config.yaml were replaced without a copy, and its checkpoints were pruned among A's."""
    a, b = tmp_path / "a", tmp_path / "b"
    train_in_process(corpus, a, "trainer.max_steps=8", "checkpoint.every_n_steps=4")
    train_in_process(corpus, b, "trainer.max_steps=4", "trainer.seed=5")
    own = {n: (b / n).read_bytes() for n in ("metrics.jsonl", "model.safetensors", "config.yaml")}
    train_in_process(corpus, b, "trainer.max_steps=8", f"resume={a}/checkpoints/step_00000004")
    assert (b / "metrics.prev.jsonl").read_bytes() == own["metrics.jsonl"]
    assert (b / "export.prev" / "model.safetensors").read_bytes() == own["model.safetensors"]
    assert (b / "config.prev.yaml").read_bytes() == own["config.yaml"]
    assert sorted(p.name for p in (b / "checkpoints.prev").glob("step_*")) == ["step_00000004"]  # B's own final checkpoint
    assert [e["step"] for e in read_metrics(b) if "train/loss" in e] == [5, 6, 7, 8]
    theirs, ours = load_weights(a / "model.safetensors"), load_weights(b / "model.safetensors")
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)  # A's run, continued exactly


BRANCHING = ("trainer.max_steps=12", "checkpoint.every_n_steps=2", "checkpoint.keep_last=10")


def curve(events: list[dict]) -> list[tuple]:
    """A run's (step, loss, lr) of each training step: what two histories of one run must agree on."""
    return [(e["step"], e["train/loss"], e["train/lr"]) for e in events if "train/loss" in e]


def test_going_back_to_a_branch_set_aside_takes_that_branchs_history_not_the_one_it_leaves(corpus, tmp_path):
    """Branch 1 to step 12, a rollback to step 4 with another lr (branch 2, to 12), then resume=checkpoints.prev/step_8
    (branch 1's): metrics.jsonl kept branch 2's steps 5-8 before branch 1's continuation, and checkpoints/ kept branch
    2's steps 6 and 8 beside it. Now the history is branch 1's, as if it had never been left, branch 2 is set
    aside whole, and branch 1's steps 6 and 8 are back in checkpoints/ (its 10 and 12 stay aside, parted at 8)."""
    args, ck = BRANCHING, tmp_path / "checkpoints"
    first = curve(train_in_process(corpus, tmp_path, *args))
    own = {n: (ck / n / "model.safetensors").read_bytes() for n in ("step_00000006", "step_00000008")}
    train_in_process(corpus, tmp_path, *args, "optim.lr=1e-2", f"resume={ck}/step_00000004")
    second = {p.name: (p / "model.safetensors").read_bytes() for p in ck.glob("step_*") if int(p.name[5:]) > 4}
    assert curve(train_in_process(corpus, tmp_path, *args, f"resume={ck}.prev/step_00000008")) == first
    assert sorted(p.name for p in ck.glob("step_*")) == [f"step_{n:08d}" for n in (2, 4, 6, 8, 10, 12)]
    assert {n: (ck / n / "model.safetensors").read_bytes() for n in own} == own
    assert json.loads((tmp_path / "checkpoints.prev" / "branch.json").read_text()) == {"after": 8}
    assert {p.name: (p / "model.safetensors").read_bytes() for p in (tmp_path / "checkpoints.prev-2").glob("step_*")} \
        == second
    assert [e["train/lr"] for e in read_metrics(tmp_path) if "train/lr" in e] == [e[2] for e in first]


def test_going_back_to_a_branch_left_before_an_earlier_parting_takes_only_the_steps_the_lines_share(corpus, tmp_path):
    """A to 12, back to 6 (B), back to 2 (C), then back to A's step 10: the history was C's steps 3-6 and A's 7-10,
    and C's steps 4 and 6 stayed in checkpoints/ (C and A share only up to step 2, which the branch A left at 6
    did not record). A's 8 and 10 come back from where they were set aside; its 4 and 6 are with B's steps."""
    args, ck = BRANCHING, tmp_path / "checkpoints"
    first = curve(train_in_process(corpus, tmp_path, *args))
    train_in_process(corpus, tmp_path, *args, "optim.lr=1e-2", f"resume={ck}/step_00000006")
    train_in_process(corpus, tmp_path, *args, "optim.lr=2e-3", f"resume={ck}/step_00000002")
    assert curve(train_in_process(corpus, tmp_path, *args, f"resume={ck}.prev/step_00000010")) == first
    assert sorted(p.name for p in ck.glob("step_*")) == [f"step_{n:08d}" for n in (2, 8, 10, 12)]


def test_switching_branches_twice_keeps_each_line_whole_and_resume_auto_follows_the_one_chosen(corpus, tmp_path,
                                                                                              capsys):
    """A to 12, B from A's step 4 (another lr) to 12, back to A's step 8 (killed in step 10, before it saves), then
    resume=auto, then back to B's final step. The second switch recorded its branch as parting at step 0 (the dir it
    was creating counted as a later fresh start), so the third moved the shared steps aside too and resume=auto
    started over; a job killed after a switch resumed from the step the branches share, not the branch chosen; and
    back at a finished branch, the other branch's export and no config.yaml were left. Now each line is whole: A's
    continuation equals A, and B's end is B's export and settings."""
    from trainer import train

    args, ck = BRANCHING, tmp_path / "checkpoints"
    a = curve(train_in_process(corpus, tmp_path, *args))
    a_export = (tmp_path / "model.safetensors").read_bytes()
    b = curve(train_in_process(corpus, tmp_path, *args, "optim.lr=1e-2", f"resume={ck}/step_00000004"))
    b_export = (tmp_path / "model.safetensors").read_bytes()
    back_to_a = tiny_overrides(corpus, *args, *faulty("raise", at_call=2))  # dies in step 10
    with pytest.raises(RuntimeError, match="boom"):
        train(compose_cfg([*back_to_a, f"resume={ck}.prev/step_00000008"]), tmp_path)
    assert sorted(p.name for p in ck.glob("step_*"))[-2:] == ["step_00000006", "step_00000008"]  # A's, back in line
    capsys.readouterr()
    # The same command again (a requeued job): the checkpoint it names is back in checkpoints/, and found there.
    train(compose_cfg([*tiny_overrides(corpus, *args, *faulty("raise", at_call=99)), f"resume={ck}.prev/step_00000008"]),
          tmp_path)
    assert f"resumed from {ck}/step_00000008 at step 8" in capsys.readouterr().out
    assert curve(read_metrics(tmp_path)) == a and (tmp_path / "model.safetensors").read_bytes() == a_export
    b_dir = next(d for d in tmp_path.glob("checkpoints.prev*") if (d / "step_00000012").is_dir()
                 and (d / "step_00000006").is_dir())  # B's later steps, set aside
    train(compose_cfg([*tiny_overrides(corpus, *args, "optim.lr=1e-2"), f"resume={b_dir}/step_00000012"]), tmp_path)
    assert "the run is already finished" in capsys.readouterr().out
    assert curve(read_metrics(tmp_path)) == b and (tmp_path / "model.safetensors").read_bytes() == b_export
    assert "lr: 0.01" in (tmp_path / "config.yaml").read_text()
    assert [int(p.name[5:]) for p in sorted(ck.glob("step_*"))] == [2, 4, 6, 8, 10, 12]  # B's line, whole


def test_a_rollback_keeps_the_branch_it_abandons_whole(corpus, tmp_path):
    """A rollback (resume=PATH to step 4 of 12) with a new lr: the new branch's saves of steps 8 and 12 replaced the
    abandoned branch's (rmtree), its metrics after step 4 were cut, and its config.yaml was replaced, though the
    rollback said the newer checkpoints stay on disk. Now that branch is set aside whole, with one attempt number;
    best.json names a checkpoint that is there; and going back to the branch set aside keeps the newer one's too."""
    args = ("trainer.max_steps=12", "checkpoint.every_n_steps=4", "checkpoint.keep_last=5", "trainer.eval_every=4",
            "checkpoint.best_metric=val/loss")
    ck = tmp_path / "checkpoints"

    def weights(d: Path) -> bytes:
        return (d / "model.safetensors").read_bytes()

    train_in_process(corpus, tmp_path, *args)
    old = {n: (tmp_path / n).read_bytes() for n in ("metrics.jsonl", "config.yaml")}
    old_8, old_12 = weights(ck / "step_00000008"), weights(ck / "step_00000012")
    train_in_process(corpus, tmp_path, *args, "optim.lr=1e-2", f"resume={ck}/step_00000004")
    assert weights(tmp_path / "checkpoints.prev" / "step_00000008") == old_8 != weights(ck / "step_00000008")
    assert weights(tmp_path / "checkpoints.prev" / "step_00000012") == old_12
    assert (tmp_path / "metrics.prev.jsonl").read_bytes() == old["metrics.jsonl"]
    assert (tmp_path / "config.prev.yaml").read_bytes() == old["config.yaml"]
    assert (tmp_path / "export.prev" / "model.safetensors").exists()
    assert [e["step"] for e in read_metrics(tmp_path) if "train/loss" in e] == list(range(1, 13))
    assert (ck / json.loads((ck / "best.json").read_text())["checkpoint"]).is_dir()
    # Back to the first branch's step 8 (set aside): the second branch's step 12 would be replaced by its save.
    new_12 = weights(ck / "step_00000012")
    train_in_process(corpus, tmp_path, *args, f"resume={tmp_path}/checkpoints.prev/step_00000008")
    assert weights(tmp_path / "checkpoints.prev-2" / "step_00000012") == new_12
    assert (tmp_path / "metrics.prev-2.jsonl").exists() and (tmp_path / "export.prev-2").is_dir()


def test_a_whole_number_learning_rate_resumes_a_run_of_float_rates(corpus, tmp_path):
    """optim.lr=1 on resume: the optimizer's groups (and the schedule's base_lrs) held an int, and the checkpoint's
    float rates were refused ("'/scheduler/base_lrs/0' is 0.005 in the checkpoint; expected an integer")."""
    train_in_process(corpus, tmp_path, "trainer.max_steps=2", "checkpoint.every_n_steps=2")
    train_in_process(corpus, tmp_path, "trainer.max_steps=4", "checkpoint.every_n_steps=2", "optim.lr=1", "resume=auto")
    assert [e["step"] for e in read_metrics(tmp_path) if "train/loss" in e] == [1, 2, 3, 4]


def test_a_resume_with_the_ema_turned_off_says_where_its_ema_stays(corpus, tmp_path, reference, capsys):
    """Only the settings' diff said ema.enabled: True -> False; the run's export then had no model_ema.safetensors,
    and the checkpoint holding the EMA was pruned later, without a word about it."""
    import shutil

    from conftest import SHARED

    shutil.copytree(reference, tmp_path, dirs_exist_ok=True)
    overrides = [a for a in SHARED if not a.startswith("ema.")]
    capsys.readouterr()
    train_in_process(corpus, tmp_path, "data.batch_size=8", *overrides, "ema.enabled=false",
                     f"resume={tmp_path}/checkpoints/step_00000008")
    assert "step_00000008 holds an EMA of the weights, which this run does not continue (ema.enabled=false)" in \
        capsys.readouterr().out


def test_an_elastic_restart_of_a_rollback_resumes_from_the_runs_newest_checkpoint_not_the_path_again(tmp_path):
    """A job started with resume=PATH and restarted after its first checkpoint went back to PATH: it retrained what
    the first attempt had done (and a rollback set that aside as an abandoned branch)."""
    from trainer.checkpoint.manager import resume_candidates
    from trainer.checkpoint.store import Checkpointer

    other = tmp_path / "other" / "step_00000004"
    ck = Checkpointer(tmp_path / "checkpoints")
    assert resume_candidates(str(other), ck, restarted=True) == ([other], False)  # (nothing of its own yet)
    for step, written in ((4, 1), (8, 2)):
        (ck.dir / f"step_{step:08d}").mkdir(parents=True)
        (ck.dir / f"step_{step:08d}" / "manifest.json").write_text(json.dumps({"written": written}))
    assert resume_candidates(str(ck.dir / "step_00000004"), ck, restarted=True) == (
        [ck.dir / "step_00000008", ck.dir / "step_00000004"], True)
    assert resume_candidates(str(ck.dir / "step_00000004"), ck, restarted=False) == ([ck.dir / "step_00000004"], False)


def test_a_rollback_holds_when_the_job_stops_before_its_first_checkpoint(corpus, tmp_path, capsys):
    """A rollback to step 4 killed before the new branch wrote a checkpoint: resume=auto went back to the abandoned
    step 8 (the most recently written), though the rollback had said resume=auto now follows the new branch."""
    args = ("trainer.max_steps=8", "checkpoint.every_n_steps=4", "checkpoint.keep_last=3")
    train_in_process(corpus, tmp_path, *args)
    first = load_weights(tmp_path / "model.safetensors")
    r = run_cli(*tiny_overrides(corpus, *args), f"hydra.run.dir={tmp_path}",
                f"resume={tmp_path}/checkpoints/step_00000004", *faulty("sigkill", 2), env=FAULTY_ENV)
    assert r.returncode == -9 and "older than step_00000008, written before this rollback" in r.stdout, r.stdout + r.stderr
    capsys.readouterr()
    train_in_process(corpus, tmp_path, *args, "resume=auto")
    assert f"resumed from {tmp_path}/checkpoints/step_00000004 at step 4" in capsys.readouterr().out
    again = load_weights(tmp_path / "model.safetensors")
    assert all(torch.equal(again[k], first[k]) for k in first)  # steps 5-8 once more, as the first time


def test_a_full_disk_under_metrics_jsonl_stops_with_exit_74_and_the_command_that_continues(corpus, tmp_path):
    """A metrics line that cannot be written (a full disk: /dev/full answers every write with ENOSPC) stopped the
    run with exit 1 and two chained tracebacks, and no continue command. Now it is one paragraph, exit 74, the
    command; once there is room again the run continues from its checkpoint as if it had never stopped."""
    args = [*tiny_overrides(corpus, "trainer.max_steps=8", "trainer.log_every=4", "checkpoint.every_n_steps=2",
                            "checkpoint.async_save=false"), f"hydra.run.dir={tmp_path}"]
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")
    r = run_here(*args)
    assert_clean_error(r, f"could not write {tmp_path / 'metrics.jsonl'} at step 4 (No space left on device)",
                       "resume=auto", code=74)
    assert "to continue this run: python -m trainer " in r.stderr and checkpoints(tmp_path) == ["step_00000002"]
    (tmp_path / "metrics.jsonl").unlink()
    assert run_here(*args, "resume=auto").returncode == 0
    assert [e["step"] for e in read_metrics(tmp_path) if "train/loss" in e] == [4, 8]
    ref = tmp_path.parent / "uninterrupted"
    assert run_here(*[a for a in args if not a.startswith("hydra.run.dir")], f"hydra.run.dir={ref}").returncode == 0
    for key in ("train/loss", "train/grad_norm", "val/loss"):  # (not the timings)
        assert series(read_metrics(tmp_path), key) == series(read_metrics(ref), key), key
    ours, theirs = load_weights(tmp_path / "model.safetensors"), load_weights(ref / "model.safetensors")
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_a_metrics_line_the_disk_fills_up_under_is_cut_back_not_left_torn(tmp_path):
    """A full disk that took half a line (the file's last line ended mid-number) left metrics.jsonl unreadable
    line by line until a resume cut it off: a run not resumed, a dashboard or pandas met a torn line."""
    import errno

    from trainer.errors import StorageError
    from trainer.tracking.loggers import JsonlLogger

    logger = JsonlLogger(tmp_path)
    logger.log_metrics({"train/loss": 2.5}, 1)
    before = (tmp_path / "metrics.jsonl").read_bytes()
    real = logger._file

    class HalfThenFull:  # what a filling disk does: a short write, then ENOSPC
        fileno = real.fileno

        def flush(self):
            pass

        def write(self, data):
            if getattr(self, "wrote", False):
                raise OSError(errno.ENOSPC, "No space left on device")
            self.wrote = True
            return real.write(data[:len(data) // 2])

    logger._file = HalfThenFull()
    with pytest.raises(StorageError, match="at step 2 .No space left on device"):
        logger.log_metrics({"train/loss": 2.25, "train/step_time_ms": 3.139}, 2)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
    logger._file = real
    logger.log_metrics({"train/loss": 2.0}, 3)  # (room again: the next line lands whole after the last good one)
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 3]
    logger.finish({})


def test_a_metrics_logger_never_finished_closes_its_file_when_dropped(tmp_path):
    """A run refused after its loggers were made (a resume onto changed data) never finishes them: trainer.train in
    a notebook held metrics.jsonl open until the collector closed it, with a ResourceWarning (an error under -W
    error; it failed an unrelated test that collected it)."""
    import gc
    import warnings

    from trainer.tracking.loggers import JsonlLogger

    gc.collect()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        logger = JsonlLogger(tmp_path)
        logger.log_metrics({"train/loss": 2.5}, 1)
        del logger
        gc.collect()
    assert not [str(w.message) for w in seen if issubclass(w.category, ResourceWarning)]
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["step"] == 1


def test_a_preempted_sweep_says_the_command_that_continues_the_whole_sweep(corpus, tmp_path):
    """A sweep (-m) without hydra.sweep.dir preempted in its first point: its message said to rerun the same
    command with resume=auto, which starts every point anew in a new timestamped sweep dir (and the command for the
    point alone never runs the points after it). Now it prints the sweep's command pinned to its sweep dir."""
    import shlex

    args = [*tiny_overrides(corpus, "checkpoint.every_n_steps=2", "trainer.max_steps=8"), "trainer.seed=0,1",
            *faulty("sigterm", 5), f"+task.once={tmp_path / 'fired'}"]
    r = run_cli("-m", *args, cwd=tmp_path, env=FAULTY_ENV)
    assert r.returncode == 75, r.stderr
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("to continue this sweep"))
    words = shlex.split(line.split("): ", 1)[1])
    (sweep,) = [w.split("=", 1)[1] for w in words if w.startswith("hydra.sweep.dir=")]
    assert words[:4] == ["python", "-m", "trainer", "-m"] and "trainer.seed=0,1" in words and words[-1] == "resume=auto"
    assert Path(sweep).parent.parent == tmp_path / "multirun" and not (Path(sweep) / "1").exists()
    r = run_here(*words[3:], cwd=tmp_path, env=FAULTY_ENV)
    assert r.returncode == 0, r.stderr
    assert f"resumed from {sweep}/0/checkpoints/step_00000005 at step 5" in r.stdout
    for point in ("0", "1"):
        assert [e["step"] for e in read_metrics(Path(sweep) / point) if "train/loss" in e] == list(range(1, 9)), point
    assert len(list((tmp_path / "multirun").glob("*/*"))) == 1  # no second sweep dir


def test_a_resume_from_another_runs_checkpoint_into_the_dir_of_a_run_with_other_settings_keeps_that_run(corpus,
                                                                                                      tmp_path):
    """Run X (optim.lr=1e-3) in its dir, then resume=REF/checkpoints/step_4 hydra.run.dir=X: X differed from REF only in
    a setting a resume may change, so it counted as REF's run. Its metrics were spliced with REF's (X's steps 1-8, then
    5-8 of the new run), its checkpoints pruned among the new run's, its export and config.yaml replaced."""
    ref, x = tmp_path / "ref", tmp_path / "x"
    args = ("trainer.max_steps=8", "checkpoint.every_n_steps=2", "checkpoint.keep_last=2")
    assert run_here(*tiny_overrides(corpus, *args, "checkpoint.keep_last=4"), f"hydra.run.dir={ref}").returncode == 0
    assert run_here(*tiny_overrides(corpus, *args, "optim.lr=1e-3"), f"hydra.run.dir={x}").returncode == 0
    before = {name: (x / name).read_bytes() for name in ("metrics.jsonl", "config.yaml", "model.safetensors")}
    ckpts = {p.name: (p / "model.safetensors").read_bytes() for p in (x / "checkpoints").glob("step_*")}
    r = run_here(*tiny_overrides(corpus, *args), f"resume={ref}/checkpoints/step_00000004", f"hydra.run.dir={x}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert [e["step"] for e in read_metrics(x) if "train/loss" in e] == [5, 6, 7, 8]
    assert (x / "metrics.prev.jsonl").read_bytes() == before["metrics.jsonl"]
    assert (x / "config.prev.yaml").read_bytes() == before["config.yaml"]
    assert (x / "export.prev" / "model.safetensors").read_bytes() == before["model.safetensors"]
    assert {p.name: (p / "model.safetensors").read_bytes() for p in (x / "checkpoints.prev").glob("step_*")} == ckpts


def test_a_copied_run_dir_continues_the_run_it_is_a_copy_of(corpus, tmp_path):
    """cp -r RUN COPY, then resume=RUN/checkpoints/step_4 hydra.run.dir=COPY: the copy is the same run (it holds the
    same checkpoint), so it continues there, its history cut at step 4, nothing set aside."""
    import shutil

    args = ("trainer.max_steps=8", "checkpoint.every_n_steps=4", "checkpoint.keep_last=3")
    assert run_here(*tiny_overrides(corpus, *args), f"hydra.run.dir={tmp_path / 'run'}").returncode == 0
    shutil.copytree(tmp_path / "run", tmp_path / "copy")
    r = run_here(*tiny_overrides(corpus, *args, "trainer.max_steps=12"), "resume=" + str(tmp_path / "run" / "checkpoints"
                 / "step_00000008"), f"hydra.run.dir={tmp_path / 'copy'}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert [e["step"] for e in read_metrics(tmp_path / "copy") if "train/loss" in e] == list(range(1, 13))
    assert not list((tmp_path / "copy").glob("*.prev*"))


def test_a_resumed_runs_summary_counts_the_whole_run(corpus, tmp_path):
    """The summary (printed, returned, and the wandb run's) counted the last attempt only: a run killed at step 7 and
    resumed from step 4 said steps=4 of its 8. It counts every attempt's training up to the checkpoint each resumed
    from (the checkpoint holds it); a run started from another run's checkpoint counts its own."""
    from trainer import train

    overrides = tiny_overrides(corpus, "trainer.max_steps=8", "checkpoint.every_n_steps=4", "trainer.log_every=1",
                               *faulty("raise", at_call=7, rank=0))
    with pytest.raises(RuntimeError, match="boom"):
        train(compose_cfg(overrides), tmp_path / "a")
    saved = json.loads((tmp_path / "a" / "checkpoints" / "step_00000004" / "state.json").read_text())["trainer"]
    assert saved["trained"]["steps"] == 4 and saved["trained"]["seconds"] > 0 and saved["trained"]["targets"] > 0
    out = train(compose_cfg([*overrides, "resume=auto"]), tmp_path / "a")
    assert out["summary/steps"] == 8 and out["summary/train_time_s"] > saved["trained"]["seconds"]
    # Another run started from a's step 4 trains 4 steps of its own.
    other = train(compose_cfg([*overrides, f"resume={tmp_path}/a/checkpoints/step_00000004"]), tmp_path / "b")
    assert other["summary/steps"] == 4


def test_evaluating_leaves_the_training_numbers_alone(corpus, tmp_path):
    """Each eval drew from the process's RNG (its samples' tokens, its loader's seed), so with dropout the losses
    after the first eval depended on eval_every, and a finished run extended with resume=auto (its final eval
    came before its final checkpoint) was not the run trained that far at once."""
    drop = ("model.dropout=0.2", "trainer.log_every=1", "trainer.max_steps=8", "scheduler=constant")  # (max_steps-free)
    never = series(train_in_process(corpus, tmp_path / "never", *drop, "trainer.eval_every=0"), "train/loss")
    often = train_in_process(corpus, tmp_path / "often", *drop, "trainer.eval_every=2")
    assert "val/loss" in {k for e in often for k in e} and series(often, "train/loss") == never
    train_in_process(corpus, tmp_path / "ext", *drop, "trainer.eval_every=0", "trainer.max_steps=5")
    extended = train_in_process(corpus, tmp_path / "ext", *drop, "trainer.eval_every=0", "resume=auto")
    assert series(extended, "train/loss") == never
