"""A task's own training step inside the Trainer (issue 26.3): the gan recipe's discriminator and generator steps,
each with its own optimizer and schedule (optim.generator / optim.discriminator), while the Trainer keeps the data
order, accumulation, checkpoints, logging and resume. Two DDP processes equal one; a SIGKILLed run resumes
bit-identically; a checkpoint of one process resumes under FSDP."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import FAULTY_ENV, faulty, load_weights, read_metrics, run_cli, run_here

# 8 steps of 16 images (the recipe's smoke sizes), an eval with samples every 4, a checkpoint every 4.
GAN = ("recipe=gan", "debug=smoke", "trainer.max_steps=8", "trainer.eval_every=4", "checkpoint.every_n_steps=4",
       "trainer.log_every=1")


@pytest.fixture(scope="module")
def gan_reference(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("gan_reference")
    r = run_here(*GAN, f"hydra.run.dir={run_dir}")
    assert r.returncode == 0, r.stderr
    return run_dir


def assert_same(run_dir: Path, ref: Path, exact: bool = False, from_step: int = 1) -> None:
    got, want = read_metrics(run_dir), read_metrics(ref)
    for key in ("train/loss", "train/d_loss", "val/loss", "val/d_loss"):
        a = [e[key] for e in got if key in e and e["step"] >= from_step]
        b = [e[key] for e in want if key in e and e["step"] >= from_step]
        assert a and (a == b if exact else a == pytest.approx(b, rel=1e-5, abs=1e-6)), key
    wa, wb = load_weights(run_dir / "model.safetensors"), load_weights(ref / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wb:
        if exact:
            assert torch.equal(wa[k], wb[k]), k
        else:  # fp32, gradients summed in another order across ranks
            torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)


def test_the_gan_learns_its_two_steps_and_draws_grids(gan_reference):
    events = read_metrics(gan_reference)
    first = next(e for e in events if "train/d_loss" in e)
    # Both optimizers and schedules are in the checkpoint, under their part's name.
    state = (gan_reference / "checkpoints" / "step_00000008" / "state.json").read_text()
    assert '"generator"' in state and '"discriminator"' in state
    assert {"train/loss", "train/d_loss", "train/lr"} <= set(first)
    # Each part's rate (only the generator's was logged): optim.generator.lr 1e-3, discriminator 2e-4, one schedule.
    assert first["train/lr"] == first["train/lr_generator"] == pytest.approx(5 * first["train/lr_discriminator"])
    assert any("val_ema/class_match" in e for e in events)  # the sample metric (from the EMA weights)
    assert sorted(p.name for p in (gan_reference / "samples").glob("*.png")) == ["step_4.png", "step_8.png"]


def test_the_gan_on_2_ddp_processes_equals_one(gan_reference, tmp_path):
    """Early stopping and the best checkpoint watching a sample metric (val_ema/class_match, which the main rank
    alone computes): the other rank lacked it, stopped for a monitor "not among the metrics" and the job hung until
    world.hang_timeout (exit 70)."""
    import json

    r = run_cli(*GAN, "world=ddp", "world.nproc_per_node=2", "data.batch_size=8", f"hydra.run.dir={tmp_path}",
                "callbacks=early_stopping", "callbacks.early_stopping.monitor=val_ema/class_match",
                "callbacks.early_stopping.mode=max", "callbacks.early_stopping.patience=5",
                "checkpoint.best_metric=val_ema/class_match", "checkpoint.best_mode=max", "world.hang_timeout=30")
    assert r.returncode == 0, r.stderr
    assert_same(tmp_path, gan_reference)
    # (by steps, not values: class_match counts samples classified right, and the 2-rank weights equal one
    # process's to float rounding only, so a sample at a class boundary may go either way on another CPU)
    matches = {e["step"]: e["val_ema/class_match"] for e in read_metrics(tmp_path) if "val_ema/class_match" in e}
    assert sorted(matches) == [e["step"] for e in read_metrics(gan_reference) if "val_ema/class_match" in e] == [4, 8]
    best = json.loads((tmp_path / "checkpoints" / "best.json").read_text())
    assert best["value"] == max(matches.values()), best


def test_the_gan_resumes_bit_identically_after_sigkill(gan_reference, tmp_path):
    r = run_cli(*GAN, f"hydra.run.dir={tmp_path}", "checkpoint.async_save=false", "+task.base=trainer.recipes.gan.task.GANTask",
                *faulty("sigkill", 7), env=FAULTY_ENV)
    assert r.returncode == -9  # killed in step 7: the checkpoint of step 4 is the newest
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000004"]
    r = run_here(*GAN, f"hydra.run.dir={tmp_path}", "resume=auto")
    assert r.returncode == 0, r.stderr
    assert_same(tmp_path, gan_reference, exact=True)


def test_a_gan_checkpoint_of_one_process_resumes_under_fsdp(gan_reference, tmp_path):
    step4 = tmp_path / "from" / "step_00000004"
    shutil.copytree(gan_reference / "checkpoints" / "step_00000004", step4)
    r = run_cli(*GAN, "world=fsdp", "world.nproc_per_node=2", "data.batch_size=8", f"resume={step4}",
                f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr
    assert_same(tmp_path / "run", gan_reference, from_step=5)
    assert "returned a view tensor" not in r.stderr  # (FSDP2's warning of a part's view output: 4 a run, alarming)


def test_a_step_where_one_part_skipped_its_update_still_moves_the_ema_and_is_not_counted_skipped(tmp_path):
    """The discriminator's update skipped (non-finite) and the generator's applied: the step counted as skipped, the
    EMA missed the generator's update, and a run of such steps warned that its weights did not change."""
    import torch
    from conftest import load_weights, read_metrics

    from trainer import build, compose, train

    args = ["recipe=gan", "debug=smoke", "trainer.max_steps=1", "task._target_=partial_gan.DiscriminatorNaN",
            "task.num_samples=0", "trainer.nonfinite=skip", "ema.enabled=true", "ema.decay=0.5", "ema.warmup=false"]
    before = {k: v.clone() for k, v in build(compose(args), tmp_path / "built").raw_model.state_dict().items()}
    train(compose(args), tmp_path / "run")
    raw, ema = load_weights(tmp_path / "run" / "model.safetensors"), load_weights(tmp_path / "run" / "model_ema.safetensors")
    gen = [k for k in raw if k.startswith("generator.") and raw[k].is_floating_point()]
    disc = [k for k in raw if k.startswith("discriminator.") and raw[k].is_floating_point()]
    assert any(not torch.equal(raw[k], before[k]) for k in gen)  # the generator stepped
    assert all(torch.equal(raw[k], before[k]) for k in disc)  # the discriminator did not
    assert any(not torch.equal(ema[k], before[k]) for k in gen)  # and the EMA followed the generator
    assert [e["train/skipped_steps"] for e in read_metrics(tmp_path / "run") if "train/skipped_steps" in e] == [0]
