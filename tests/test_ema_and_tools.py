"""EMA against a closed-form reference, and the `env` / `check` commands."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import (
    compose_cfg,
    load_weights,
    read_metrics,
    run_here,
    series,
    tiny_overrides,
    train_in_process,
)


def _ema_reference(weights: list[dict], decay: float, warmup: bool, update_every: int) -> dict:
    """e_0 = w_0; after optimizer step s (if s % update_every == 0): e <- d_t e + (1 - d_t) w_s, float64."""
    ema = {k: v.double() for k, v in weights[0].items()}
    t = 0
    for step, w in enumerate(weights[1:], start=1):
        if step % update_every:
            continue
        d = min(decay, (1 + t) / (10 + t)) if warmup else decay
        ema = {k: d * ema[k] + (1 - d) * w[k].double() for k in ema}
        t += 1
    return ema


@pytest.mark.parametrize(("warmup", "update_every"), [(True, 1), (False, 2)])
def test_ema_equals_the_closed_form_over_the_raw_weights(corpus, tmp_path, warmup, update_every):
    from trainer import build

    overrides = ("trainer.max_steps=6", "trainer.grad_accum_steps=2", "checkpoint.every_n_steps=1",
                 "checkpoint.keep_last=10", "ema.enabled=true", "ema.decay=0.8", f"ema.warmup={warmup}",
                 f"ema.update_every={update_every}")
    train_in_process(corpus, tmp_path, *overrides)
    # The initial weights: those of the Trainer a run builds, before its first step.
    built = build(compose_cfg(tiny_overrides(corpus, *overrides)), tmp_path / "built")
    init = {k: v.clone() for k, v in built.raw_model.state_dict().items()}
    raw = [init] + [load_weights(tmp_path / "checkpoints" / f"step_{s:08d}" / "model.safetensors") for s in range(1, 7)]
    expected = _ema_reference(raw, 0.8, warmup, update_every)
    got = load_weights(tmp_path / "model_ema.safetensors")
    assert got.keys() == init.keys()
    for k in expected:
        # The fp32 EMA against fp64: each of <= 6 updates (a lerp) rounds <= 4 times (the fp32 weight
        # 1 - d too), u = 6e-8 each: <= 24u = 1.4e-6 of the larger of ema and weight, on every CPU.
        torch.testing.assert_close(got[k].double(), expected[k], rtol=2e-6, atol=1e-7)
    events = read_metrics(tmp_path)
    assert series(events, "val_ema/loss") and series(events, "val/loss")


def test_the_ema_eval_under_fsdp_keeping_gathered_weights_evaluates_the_ema(corpus, tmp_path):
    """world.reshard_after_forward=false (ZeRO-2) keeps the weights an eval's forward gathered; the EMA's eval,
    right after the raw one, ran on them: val_ema/* was val/*. Its numbers are now those of the default reshard
    (the same arithmetic: equal), and not the raw weights' (the EMA lags them)."""
    ema = ("ema.enabled=true", "ema.decay=0.9", "trainer.eval_every=10", "world=fsdp", "world.nproc_per_node=1")
    evals = {}
    for keep in (False, True):
        events = train_in_process(corpus, tmp_path / str(keep), *ema, f"world.reshard_after_forward={not keep}")
        evals[keep] = [(e["step"], e["val/loss"], e["val_ema/loss"]) for e in events if "val_ema/loss" in e]
    assert [s for s, _, _ in evals[True]] == [10, 20]
    assert evals[True] == evals[False]
    assert all(raw != averaged for _, raw, averaged in evals[True])


def test_ema_skips_steps_the_scaler_skipped(corpus, tmp_path, capsys):
    """...and the summary line counts them (they were only in metrics.jsonl)."""
    train_in_process(corpus, tmp_path, "precision=fp16", "precision.init_scale=1e30", "trainer.max_steps=12",
                     "ema.enabled=true")
    skipped = int(series(read_metrics(tmp_path), "train/skipped_steps")[-1])
    state = json.loads((tmp_path / "checkpoints" / "step_00000012" / "state.json").read_text())
    assert skipped >= 3 and state["ema"]["num_updates"] == 12 - skipped
    assert f" skipped_steps={skipped}" in next(ln for ln in capsys.readouterr().out.splitlines()
                                               if ln.startswith("summary: "))


def test_env_prints_versions_devices_and_the_default_config(tmp_path):
    import torch

    r = run_here("env", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for needle in ("torch", torch.__version__.split("+")[0], "hydra-core", "omegaconf", "wandb", "safetensors", "CUDA available",
                   "gloo / nccl", "torch threads", "max_steps:"):
        assert needle in r.stdout, needle
    # Its mistakes, and check's, are one paragraph (were an OverrideParseException or ConfigError traceback).
    from test_errors import assert_clean_error

    assert_clean_error(run_here("env", "foo=1", cwd=tmp_path), "unknown config key 'foo'")
    assert_clean_error(run_here("check", "trainer.max_stepz=3", cwd=tmp_path), "Did you mean trainer.max_steps=3?")
    assert run_here("env", "--help", cwd=tmp_path).stdout.startswith("usage: python -m trainer env")


def test_check_reports_each_equivalence(capsys):
    from trainer.entry.commands import check

    assert check([]) == 0
    out = capsys.readouterr().out
    assert out.count("OK  ") == 6 and "6 passed, 0 failed" in out
    for line in ("accumulation 2 x 4", "2 ranks (gloo, ddp) x batch 4", "2 ranks (gloo, fsdp) x batch 4",
                 "tensor parallel 2 (gloo) equals 1 rank", "pipeline 2 stages (gloo, 1F1B, 2 microbatches) equals 1 rank",
                 "save at step 6, resume"):
        assert f"OK    {line}" in out, line
    assert "summary:" not in out  # the inner runs' own lines stay inside


def test_check_refuses_a_precision_its_tolerances_are_not_for(tmp_path):
    """`check precision=bf16` reported 5 failures (bf16's 1e-2 rounding against fp32's 1e-5 tolerance), exit 1:
    a working machine called broken."""
    from test_errors import assert_clean_error

    assert_clean_error(run_here("check", "precision=bf16", cwd=tmp_path), "check compares its runs to fp32's rounding",
                       "without precision=")
    # A recipe: "model.n_layer is a setting of model=gpt_medium", check's own setting, as if the user had given it.
    assert_clean_error(run_here("check", "recipe=gan", cwd=tmp_path), "check recipe=gan: check trains its own tiny GPT",
                       "python -m trainer recipe=gan debug=smoke")
    # A setting of the run's own: five checks ran, then "resume='/tmp/trainer-check-.../step_00000006' does not
    # exist", a path the user never gave.
    assert_clean_error(run_here("check", "trainer.max_steps=1", cwd=tmp_path), "check trainer.max_steps=1: check "
                       "trains its own tiny GPT with its own schedule", "its overrides are the world's")


def test_check_fails_loudly_when_an_equivalence_breaks(capsys, monkeypatch):
    """Break accumulation on purpose (later micro-batches dropped): check must say FAIL and exit 1. The launched
    items run in processes of their own, out of the patch's reach: their launch fails at once, as a worker's
    failure does, and each is reported as failed with the worker's message."""
    import contextlib

    from trainer.entry import commands, launcher
    from trainer.loop.trainer import Trainer

    original = Trainer.train_step
    monkeypatch.setattr(Trainer, "train_step", lambda self, batches, n: original(self, batches[:1], n))

    def failed(cfg, run_dir, *args, **kwargs):
        raise launcher.WorkerFailed(1, 3, f"stubbed failure of {cfg.world.nproc_per_node} processes")

    monkeypatch.setattr(launcher, "run", failed)
    monkeypatch.setattr(launcher, "one_forkserver", lambda output: contextlib.nullcontext())
    assert commands.check([]) == 1
    out = capsys.readouterr().out
    assert "FAIL  accumulation 2 x 4 equals batch 8" in out
    assert out.count("the run failed:\nworker rank 1 failed (exit code 3):\nstubbed failure of 2 processes") == 4
    assert "OK    save at step 6, resume" in out  # the other items are still judged on their own


def test_check_stopped_by_sigterm_or_ctrl_c_says_so_and_judges_nothing_failed(capsys, monkeypatch):
    """SIGTERM during a launched item was reported as that item's FAIL (FSDP "broken" on this machine) and the
    other items still ran; Ctrl-C was a KeyboardInterrupt traceback."""
    import contextlib

    from trainer.entry import commands, launcher
    from trainer.errors import Preempted

    for stop, code, how in ((Preempted("stopped by SIGTERM"), 75, "SIGTERM"), (KeyboardInterrupt(), 130, "Ctrl-C")):
        def stopped(cfg, run_dir, *args, stop=stop, **kwargs):
            raise stop

        monkeypatch.setattr(launcher, "run", stopped)
        monkeypatch.setattr(launcher, "one_forkserver", lambda output: contextlib.nullcontext())
        assert commands.check([]) == code
        out, err = capsys.readouterr()
        assert "FAIL" not in out and "passed" not in out and "save at step 6" not in out
        assert f"trainer check: stopped by {how} before every check ran" in err
