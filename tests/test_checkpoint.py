"""Checkpoints with real processes and real signals: exact resume, corruption, pickle, preemption, elastic.

Runs that must die (SIGKILL, SIGTERM, a crashed rank) are real subprocesses; resumes that need no
signal run in-process to keep the suite fast. Every resumed run is compared bit for bit with an
uninterrupted one.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from conftest import (
    DDP2,
    FAULTY_ENV,
    SHARED,
    assert_identical,
    checkpoints,
    faulty,
    load_weights,
    read_metrics,
    run_cli,
    run_here,
    series,
    tiny_overrides,
    train_in_process,
)

from trainer.errors import CheckpointError

pytestmark = pytest.mark.slow

SINGLE = ("data.batch_size=8", *SHARED)  # the `reference` fixture's settings


@pytest.mark.parametrize(("kill_call", "workers", "async_save"), [(7, 0, False), (11, 2, True)])
def test_sigkill_then_resume_auto_is_bit_identical(corpus, tmp_path, reference, kill_call, workers, async_save):
    extra = (f"data.num_workers={workers}", f"checkpoint.async_save={async_save}")
    r = run_cli(*tiny_overrides(corpus, *SINGLE, *extra), f"hydra.run.dir={tmp_path}",
                *faulty("sigkill", kill_call), env=FAULTY_ENV)
    assert r.returncode == -9  # really killed mid-step, no chance to clean up
    newest = 4 * ((kill_call - 1) // 4)
    # A background save may still be writing when the kill lands; then the one before it is the newest.
    expected = [f"step_{newest:08d}", f"step_{newest - 4:08d}"] if async_save else [f"step_{newest:08d}"]
    assert checkpoints(tmp_path)[-1] in expected
    train_in_process(corpus, tmp_path, *SINGLE, *extra, "resume=auto")
    assert_identical(tmp_path, reference)


def test_keep_last_and_resuming_a_finished_run(corpus, tmp_path, reference):
    assert checkpoints(reference) == ["step_00000008", "step_00000012"]
    manifest = json.loads((reference / "checkpoints" / "step_00000012" / "manifest.json").read_text())
    assert set(manifest["files"]) == {"model.safetensors", "state.safetensors", "state.json", "config.yaml"}
    shutil.copytree(reference, tmp_path, dirs_exist_ok=True)
    r = run_here(*tiny_overrides(corpus, *SINGLE), f"hydra.run.dir={tmp_path}", "resume=auto")
    assert r.returncode == 0 and "already finished" in r.stdout
    # keep_last=null (Accelerate's total_limit=None, Lightning's save_top_k=-1) deletes none.
    events = train_in_process(corpus, tmp_path, *SINGLE, "resume=auto", "trainer.max_steps=16", "checkpoint.keep_last=null")
    assert [e["step"] for e in events if "train/loss" in e] == list(range(1, 17))
    assert checkpoints(tmp_path) == ["step_00000008", "step_00000012", "step_00000016"]


def test_corrupt_newest_checkpoint_falls_back_on_auto_and_fails_on_path(corpus, tmp_path, reference, capsys):
    args = [*tiny_overrides(corpus, *SINGLE), f"hydra.run.dir={tmp_path}"]
    # Synchronous saves, so step 8's is complete when the kill lands (a background one may not be).
    r = run_cli(*args, "checkpoint.async_save=false", *faulty("sigkill", 11), env=FAULTY_ENV)
    assert r.returncode == -9  # died in step 11: checkpoints 4 and 8 exist
    bad = tmp_path / "checkpoints" / "step_00000008" / "state.safetensors"
    bad.write_bytes(bad.read_bytes()[:-100])  # truncated
    with pytest.raises(CheckpointError, match=str(bad)):  # an explicit path must load: no fallback
        train_in_process(corpus, tmp_path / "explicit", *SINGLE, f"resume={bad.parent}")
    capsys.readouterr()
    train_in_process(corpus, tmp_path, *SINGLE, "resume=auto")
    out = capsys.readouterr().out
    assert str(bad) in out and "resumed from" in out and "step_00000004" in out  # what it skipped and used
    assert_identical(tmp_path, reference)


def test_a_pickle_payload_in_a_checkpoint_never_runs(corpus, tmp_path, reference):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference / "checkpoints" / "step_00000008", ckpt)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    from trainer.checkpoint.store import sha256

    for name in ("model.safetensors", "state.safetensors"):  # the attacker also rewrites the checksums
        (ckpt / name).write_bytes(pickle.dumps({"x": Payload()}))
        manifest["files"][name] = sha256(ckpt / name)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    r = run_here(*tiny_overrides(corpus, *SINGLE), f"hydra.run.dir={tmp_path / 'run'}", f"resume={ckpt}")
    assert r.returncode == 2 and "not a valid trainer checkpoint" in r.stderr
    assert not marker.exists()
    pickle.loads((ckpt / "model.safetensors").read_bytes())  # the payload was live: unpickling runs it
    assert marker.exists()


def test_resume_refuses_a_different_model_or_data_order(corpus, tmp_path, reference):
    ckpt = reference / "checkpoints" / "step_00000008"
    r = run_here(*tiny_overrides(corpus, *SINGLE, "model.d_model=32"), f"hydra.run.dir={tmp_path}", f"resume={ckpt}")
    assert r.returncode == 2
    assert "tok_emb.weight: checkpoint (256, 64) vs model (256, 32)" in r.stderr
    assert "does not match the model (10 tensors)" in r.stderr and "; and 6 more." in r.stderr  # (the first 4 named)
    with pytest.raises(CheckpointError, match=r"sample stream .* trainer\.seed: 0 -> 5"):
        train_in_process(corpus, tmp_path / "seed", *SINGLE, "trainer.seed=5", f"resume={ckpt}")


def test_sigterm_saves_a_checkpoint_and_resume_continues_exactly(corpus, tmp_path, reference):
    r = run_cli(*tiny_overrides(corpus, *SINGLE), f"hydra.run.dir={tmp_path}", *faulty("sigterm", 6), env=FAULTY_ENV)
    assert r.returncode == 75, r.stderr
    assert "preempted by SIGTERM at step 6" in r.stderr and "resume=auto" in r.stderr
    assert checkpoints(tmp_path)[-1] == "step_00000006"  # step 6 finished, then it stopped
    train_in_process(corpus, tmp_path, *SINGLE, "resume=auto")
    assert_identical(tmp_path, reference)


NOISY_RECIPE = """# @package _global_
defaults:
  - override /precision: fp32
model: {_target_: torch.nn.Linear, in_features: 4, out_features: 1}
data: {_target_: noisy_samples.regression, batch_size: 8, shuffle: true, num_workers: 0}
task: {_target_: trainer.task.SupervisedTask, loss: torch.nn.MSELoss}
trainer: {max_steps: 10, eval_every: 0, log_every: 1, progress: "off"}
scheduler: {warmup_steps: 2}
optim: {lr: 0.05, weight_decay: 0.0}
world: {threads: 1}
"""


@pytest.mark.parametrize(("world", "read"), [((), 37), (("world=ddp", "world.nproc_per_node=2", "data.batch_size=4"), 19)],
                         ids=["single", "ddp2"])  # (the read of step 5's samples, 8 a step, or 4 a rank on 2 ranks)
def test_a_sigterm_while_a_steps_samples_draw_random_numbers_resumes_exactly(tmp_path, world, read):
    """A dataset drawing noise in __getitem__, in the rank's process (data.num_workers=0), SIGTERMed while it read
    step 5's samples: the run stopped at step 4 after those draws, and its checkpoint kept generators past them, so
    the resumed run drew other noise from step 5 on (its loss 0.614 against 0.475). It now stops at a step boundary
    before the draws (the ranks, which agree on a stop at the step's count, take that step first). And numpy's
    generator was never seeded: two runs of one config drew other noise from the first step."""
    conf = tmp_path / "conf" / "recipe"
    conf.mkdir(parents=True)
    (conf / "noisy.yaml").write_text(NOISY_RECIPE)
    args = ("--config-dir", str(tmp_path / "conf"), "recipe=noisy", *world)
    cut = (f"+data.sigterm_at={read}", f"+data.once={tmp_path / 'signalled'}")
    run = run_cli if world else run_here  # (workers: from run_cli's forkserver)
    assert run(*args, "hydra.run.dir=whole", cwd=tmp_path, env=FAULTY_ENV).returncode == 0
    r = run_cli(*args, *cut, "hydra.run.dir=cut", cwd=tmp_path, env=FAULTY_ENV)
    assert r.returncode == 75 and "error: preempted by" in r.stderr, r.stdout + r.stderr
    assert (tmp_path / "signalled").exists()
    r = run(*args, *cut, "hydra.run.dir=cut", "resume=auto", cwd=tmp_path, env=FAULTY_ENV)
    assert r.returncode == 0, r.stderr
    whole, resumed = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "cut")
    assert series(resumed, "train/loss") == series(whole, "train/loss")  # (bit for bit: the same draws, in order)
    assert len(series(whole, "train/loss")) == 10
    weights = [load_weights(tmp_path / d / "model.safetensors") for d in ("whole", "cut")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_ddp_preemption_of_one_rank_then_resume_is_exact(corpus, tmp_path, ddp_reference):
    args = [*tiny_overrides(corpus, *SHARED, *DDP2), f"hydra.run.dir={tmp_path}"]
    r = run_cli(*args, *faulty("sigusr1", 10, rank=1), env=FAULTY_ENV)  # only rank 1 gets the signal
    assert r.returncode == 75, r.stderr
    # Both ranks stopped after the same step: the signal came in step 10's loss, the ranks agreed on the stop at step
    # 11's count, after its samples were drawn, and took that step first (test_a_sigterm_while_a_steps_samples_...)
    assert checkpoints(tmp_path)[-1] == "step_00000011"
    r = run_cli(*args, "resume=auto")
    assert r.returncode == 0, r.stderr
    assert_identical(tmp_path, ddp_reference[0])


def test_export_shards_above_the_size_limit(corpus, tmp_path):
    train_in_process(corpus, tmp_path, "trainer.max_steps=2", "checkpoint.max_shard_mb=0.1")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    merged = {}
    for s in shards:
        merged.update(load_weights(tmp_path / s))
    assert set(merged) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in merged.values())
    assert not (tmp_path / "model.safetensors").exists()


@pytest.mark.parametrize(("mode", "save_final"), [("min", True), ("max", True), ("min", False)])
def test_best_checkpoint_by_metric_is_the_best_eval_and_survives_pruning(corpus, tmp_path, mode, save_final):
    """Every eval is compared, and one that beats the best is saved whether or not a checkpoint was due (evals at
    3 and 6, checkpoints every 2 steps: best.json named only evals that fell on a checkpoint step, the worst under
    max). The best survives pruning to keep_last=1. With checkpoint.save_final=false the final eval was never
    ranked: the checkpoint due at the last step was saved before it, and best.json named step 6's, a worse one."""
    events = train_in_process(corpus, tmp_path, "trainer.max_steps=8", "trainer.eval_every=3", "optim.lr=3e-2",
                              "checkpoint.every_n_steps=2", "checkpoint.keep_last=1", "checkpoint.best_metric=val/loss",
                              f"checkpoint.best_mode={mode}", f"checkpoint.save_final={save_final}")
    best = json.loads((tmp_path / "checkpoints" / "best.json").read_text())
    val = {e["step"]: e["val/loss"] for e in events if "val/loss" in e}
    assert sorted(val) == [3, 6, 8]
    best_step = (min if mode == "min" else max)(val, key=val.get)
    assert best == {"metric": "val/loss", "value": val[best_step], "checkpoint": f"step_{best_step:08d}"}
    kept = checkpoints(tmp_path)
    assert f"step_{best_step:08d}" in kept and "step_00000008" in kept and len(kept) <= 2


def test_a_nan_best_metric_is_said_once_not_ranked_in_silence(tmp_path, capsys):
    """A best_metric NaN at every eval (diffusion's diversity on too few samples) kept no best.json, exit 0, without a
    word; `eval checkpoint=best` then blamed a run without evals."""
    from trainer.checkpoint.store import Checkpointer

    ck = Checkpointer(tmp_path, best_metric="val/diversity", best_mode="max")
    assert not ck.improves({"val/diversity": float("nan")}) and not ck.improves({"val/diversity": float("nan")})
    assert capsys.readouterr().out.count("checkpoint.best_metric=val/diversity is NaN in this eval") == 1
    assert ck.improves({"val/diversity": 0.5})


def test_a_best_ranked_by_another_metric_is_ranked_anew_after_a_resume(tmp_path):
    """Resumed with checkpoint.best_metric=val/bpb after val/loss: the val/loss best (3.55) was compared with val/bpb's
    values (~5), never beaten, and `eval checkpoint=best` kept naming the worst checkpoint by val/bpb. Checkpoints
    written before the metric was in their state are read by best.json's."""
    import json

    from omegaconf import OmegaConf

    from trainer.checkpoint.manager import resume_notes
    from trainer.checkpoint.store import Checkpointer

    old = Checkpointer(tmp_path, best_metric="val/loss")
    old.consider({"val/loss": 3.55}, 30)
    state = old.state_dict()
    for metric, mode, reranked in (("val/loss", "min", None), ("val/bpb", "min", ("val/loss", "min", "step_00000030")),
                                   ("val/loss", "max", ("val/loss", "min", "step_00000030"))):
        new = Checkpointer(tmp_path, best_metric=metric, best_mode=mode)
        new.load_state_dict(state)
        assert new.reranked == reranked
        assert new.improves({metric: 4.8}) is (reranked is not None or mode == "max")
    (tmp_path / "best.json").write_text(json.dumps({"metric": "val/loss", "value": 3.55, "checkpoint": "step_00000030"}))
    new = Checkpointer(tmp_path, best_metric="val/bpb")
    new.load_state_dict({"best": [3.55, "step_00000030"]})  # (a checkpoint of before: best.json says by what)
    assert new.reranked == ("val/loss", "min", "step_00000030") and new.improves({"val/bpb": 4.8})
    (notes,) = [n for n in resume_notes(tmp_path / "step_00000030", OmegaConf.create({}), new) if "ranked" in n]
    assert "ranked by val/loss (min) and this run ranks by checkpoint.best_metric=val/bpb (min)" in notes


def test_without_a_final_save_the_periodic_checkpoint_of_the_last_step_is_still_written(corpus, tmp_path):
    """The last step's periodic save was left to the final one, which checkpoint.save_final=false does not make."""
    train_in_process(corpus, tmp_path, "trainer.max_steps=4", "checkpoint.every_n_steps=2",
                     "checkpoint.save_final=false", "checkpoint.keep_last=5")
    assert checkpoints(tmp_path) == ["step_00000002", "step_00000004"]


def test_a_best_metric_the_evals_lack_keeps_the_training_in_a_checkpoint(corpus, tmp_path):
    """Found at the first eval (with eval_every=0, the run's end), the mistake stopped the run with nothing saved."""
    from test_errors import assert_clean_error

    r = run_here(*tiny_overrides(corpus, "trainer.max_steps=4", "checkpoint.best_metric=val/nosuch"),
                 f"hydra.run.dir={tmp_path}")
    assert_clean_error(r, "checkpoint.best_metric='val/nosuch' is not among the metrics", "The checkpoint of step 4 is "
                       "saved", "resume=auto")
    assert checkpoints(tmp_path) == ["step_00000004"]
    # Fixed as the message says: the run is finished, and no eval ranks its checkpoint by the fixed metric, which
    # `eval checkpoint=best` says instead of "trained without checkpoint.best_metric".
    train_in_process(corpus, tmp_path, "trainer.max_steps=4", "checkpoint.best_metric=val/loss", "resume=auto")
    from trainer.errors import ConfigError
    from trainer.inference.finished import checkpoint_of

    with pytest.raises(ConfigError, match="no eval has ranked a checkpoint by checkpoint.best_metric=val/"):
        checkpoint_of(tmp_path, "best")
    # An eval on a checkpoint step (the usual eval_every == every_n_steps): its save raised before it wrote.
    again = tmp_path / "again"
    r = run_here(*tiny_overrides(corpus, "trainer.max_steps=4", "trainer.eval_every=2", "checkpoint.every_n_steps=2",
                                 "checkpoint.best_metric=val/nosuch"), f"hydra.run.dir={again}")
    assert_clean_error(r, "The checkpoint of step 2 is saved")
    assert checkpoints(again) == ["step_00000002"]


def test_sigusr1_to_the_launcher_stops_every_worker_with_a_checkpoint_that_resumes_on_one_process(
        corpus, tmp_path, ddp_reference):
    """SLURM's preemption notice goes to the job's main process: the launcher forwards it to the workers (as
    torch's agent does SIGTERM), which save and exit 75. The 2-process checkpoint then resumes on 1 process
    with the same global batch."""
    import uuid

    from test_distributed import _processes_with_marker

    key, value = "TRAINER_TEST_MARKER", uuid.uuid4().hex
    r = run_cli(*tiny_overrides(corpus, *SHARED, *DDP2), f"hydra.run.dir={tmp_path}",
                *faulty("sigusr1_parent", 9, rank=0), env={**FAULTY_ENV, key: value})
    assert r.returncode == 75, r.stderr
    assert "SIGUSR1" in r.stderr and checkpoints(tmp_path)
    assert f"the workers saved a checkpoint ({tmp_path / 'checkpoints' / checkpoints(tmp_path)[-1]})" in r.stderr
    assert _processes_with_marker(f"{key}={value}") == []  # no orphaned worker trains on
    train_in_process(corpus, tmp_path, *SINGLE, "resume=auto")
    got, ref = read_metrics(tmp_path), read_metrics(ddp_reference[0])
    assert [e["step"] for e in got] == [e["step"] for e in ref]
    assert series(got, "train/loss") == pytest.approx(series(ref, "train/loss"), rel=1e-5, abs=1e-5)


def test_a_sigterm_to_every_process_of_the_job_saves_a_checkpoint_that_resumes_exactly(corpus, tmp_path, ddp_reference):
    """timeout, `kill -- -PGID` and SLURM's --signal=TERM@120 signal every process of the job: the workers' forkserver
    died of it at once and took every worker with it (their parent-death signal) before they saved, "the workers saved
    no checkpoint", the steps since the last periodic one lost (the README's sbatch example lost up to 500). And sent
    again while the job stops (at every call from then on): the launcher's second SignalException broke torch's wait
    for the workers, a traceback, and the launcher hung at its exit joining them."""
    import os

    args = [*tiny_overrides(corpus, *SHARED, *DDP2), f"hydra.run.dir={tmp_path}"]
    r = run_cli(*args, *faulty("sigterm_group_repeated", 9, rank=0), env=FAULTY_ENV, preexec=os.setsid)  # (a group
    assert r.returncode == 75, r.stdout + r.stderr  # of its own)
    assert "Traceback" not in r.stderr and "SignalException" not in r.stderr, r.stderr
    # (the signal came in step 9; the ranks agreed on it at step 10's count and took that step first)
    assert checkpoints(tmp_path)[-1] == "step_00000010", r.stderr
    assert f"the workers saved a checkpoint ({tmp_path / 'checkpoints' / 'step_00000010'})" in r.stderr, r.stderr
    r = run_cli(*args, "resume=auto")
    assert r.returncode == 0, r.stderr
    assert_identical(tmp_path, ddp_reference[0])


def test_sigterms_to_the_job_in_its_last_step_leave_it_finished_as_if_none_came(corpus, tmp_path, ddp_reference):
    """The workers complete the last step and the export, and say so; the launcher called the run stopped (exit 75,
    "the workers saved no checkpoint where they stopped ... rerun"), or with the signal again, a traceback and a hang."""
    import os

    r = run_cli(*tiny_overrides(corpus, *SHARED, *DDP2), f"hydra.run.dir={tmp_path}",
                *faulty("sigterm_group_repeated", 12, rank=0), env=FAULTY_ENV, preexec=os.setsid)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "the export was completed, so the run is finished" in r.stdout and f"done: {tmp_path}" in r.stdout
    assert "error:" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert_identical(tmp_path, ddp_reference[0])


@pytest.mark.parametrize("world", [(), DDP2])
def test_a_stop_signal_before_the_first_step_exits_75(corpus, tmp_path, world):
    r = run_cli(*tiny_overrides(corpus, *world), f"hydra.run.dir={tmp_path}", *faulty("sigterm_at_build", 1),
                env=FAULTY_ENV)
    assert r.returncode == 75, r.stderr
    assert "SIGTERM" in r.stderr and "nothing" in r.stderr and "resume=auto" in r.stderr
    assert not checkpoints(tmp_path) if (tmp_path / "checkpoints").exists() else True


def _sigterm_as_the_command_starts() -> None:
    """(run_cli's preexec) A SIGTERM to the command as soon as it holds its early flag: while it imports and composes."""
    import os
    import signal

    from trainer.loop import preemption

    hold = preemption.hold_early

    def holding():
        flag = hold()
        os.kill(os.getpid(), signal.SIGTERM)  # (handled before kill returns to Python: the main thread's own signal)
        return flag

    preemption.hold_early = holding


@pytest.mark.parametrize("command", ["run", "sweep"])
def test_a_stop_signal_while_the_command_starts_exits_75_not_143(corpus, tmp_path, command):
    """A SIGTERM in the command's first second (Python's imports, Hydra's composition) killed it with 143, where the
    README promises 75 for any signal before the first step (the sbatch example requeues on 75 only)."""
    where = [f"hydra.run.dir={tmp_path / 'run'}"] if command == "run" else \
        ["-m", "trainer.seed=0,1", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    r = run_cli(*tiny_overrides(corpus), *where, preexec=_sigterm_as_the_command_starts)
    assert r.returncode == 75, r.stderr
    assert "stopped by SIGTERM before" in r.stderr and "Traceback" not in r.stderr
    if command == "run":  # the run stops before its first step, as a signal while it builds does
        assert "before the first step" in r.stderr and not (tmp_path / "run" / "checkpoints").exists()
    else:  # no point of the sweep starts
        assert "before training started" in r.stderr and not (tmp_path / "sweep").exists()


@pytest.mark.parametrize("mode", ["min", "max"])
def test_a_nan_eval_is_never_the_best_and_any_number_beats_a_nan_best(tmp_path, mode):
    """A metric that is NaN at the first eval (val_ema/diversity with too few samples) became the best, and every
    later comparison with it was false: the first checkpoint stayed "best" for the rest of the run."""
    from trainer.checkpoint.store import Checkpointer

    ckpt = Checkpointer(tmp_path, best_metric="val/x", best_mode=mode)
    nan = float("nan")
    assert not ckpt.improves({"val/x": nan})
    ckpt.consider({"val/x": nan}, 1)
    assert ckpt.best is None
    ckpt.consider({"val/x": 2.0}, 2)
    assert ckpt.best == (2.0, "step_00000002")
    assert not ckpt.improves({"val/x": nan})
    ckpt.best = (nan, "step_00000001")  # (recorded by a run before this rule)
    assert ckpt.improves({"val/x": 5.0})


def test_repair_best_file_rewrites_a_damaged_best_json_from_the_state_and_leaves_a_readable_one(tmp_path):
    """best.json (eval checkpoint=best's pointer) was rewritten only at the next new best: damaged, it stayed so for
    the rest of a resumed run. (The checkpoint manager calls this on a resume.)"""
    import json

    from trainer.checkpoint.store import Checkpointer

    ckpt = Checkpointer(tmp_path, best_metric="val/loss")
    (tmp_path / "step_00000004").mkdir()
    (tmp_path / "step_00000004" / "manifest.json").write_text("{}")
    ckpt.load_state_dict({"best": [1.5, "step_00000004"]})
    (tmp_path / "best.json").write_text("{")
    ckpt.repair_best_file()
    assert json.loads((tmp_path / "best.json").read_text()) == {"metric": "val/loss", "value": 1.5,
                                                                 "checkpoint": "step_00000004"}
    mine = json.dumps({"metric": "val/loss", "value": 1.2, "checkpoint": "step_00000004"})
    (tmp_path / "best.json").write_text(mine)  # one that reads: left as it is
    ckpt.repair_best_file()
    assert (tmp_path / "best.json").read_text() == mine


def test_a_resume_rewrites_a_damaged_best_json(corpus, tmp_path):
    """best_mode=max on val/loss keeps step 1's (the loss falls), so the resumed run finds no new best: only the
    resume's repair makes best.json readable again."""
    import json

    from conftest import run_here, tiny_overrides

    args = (*tiny_overrides(corpus, "trainer.eval_every=1", "checkpoint.every_n_steps=1", "checkpoint.keep_last=1",
                            "checkpoint.best_metric=val/loss", "checkpoint.best_mode=max"), f"hydra.run.dir={tmp_path}")
    assert run_here(*args, "trainer.max_steps=2").returncode == 0
    best = tmp_path / "checkpoints" / "best.json"
    assert json.loads(best.read_text())["checkpoint"] == "step_00000001"
    best.write_text("{")
    r = run_here(*args, "trainer.max_steps=3", "resume=auto")
    assert r.returncode == 0, r.stderr
    assert json.loads(best.read_text())["checkpoint"] == "step_00000001"


def test_going_back_to_the_same_branch_twice_keeps_what_the_line_took_back_from_it(tmp_path):
    """Line 10-60, back to 20 (30-60 set aside), the new line writes 30 and 40, back to the aside's 40 (its 30 and 40
    return), the line writes 50 and 60, then back to the aside's 60: the aside set aside by the first return (parted
    at 20) bounded the second's parting to 20, so the branch's own 30 and 40, now the line's, were set aside as the
    branch this job leaves. The parting is 40."""
    from trainer.checkpoint.store import Checkpointer

    ck = tmp_path / "checkpoints"
    counter = iter(range(1, 100))

    def write(*steps):
        for s in steps:
            d = ck / f"step_{s:08d}"
            d.mkdir(parents=True)
            (d / "manifest.json").write_text(json.dumps({"written": next(counter)}))

    def names(d):
        return sorted(int(p.name[5:]) for p in d.glob("step_*"))

    write(10, 20, 30, 40, 50, 60)
    Checkpointer(ck).branch_from(ck / "step_00000020")  # a rollback to 20
    write(30, 40)
    aside = tmp_path / "checkpoints.prev"
    c = Checkpointer(ck)
    c.branch_from(aside / "step_00000040")  # back to the branch set aside, at 40
    assert names(ck) == [10, 20, 30, 40] and names(aside) == [50, 60] and c.taken_back == ["step_00000030",
                                                                                              "step_00000040"]
    write(50, 60)
    c = Checkpointer(ck)
    assert c.branch_point(aside / "step_00000060") == 40
    c.branch_from(aside / "step_00000060")
    assert names(ck) == [10, 20, 30, 40, 50, 60] and not names(aside)
    assert names(tmp_path / "checkpoints.prev-3") == [50, 60]  # the line's own 50 and 60, left
