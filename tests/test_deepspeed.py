"""world=deepspeed (issue 30): DeepSpeed's ZeRO engine as a strategy, on the CPU with gloo. ZeRO 1, 2 and 3 on 2
processes train what one process trains (fp32, with accumulation and optimizer offload), the engine's checkpoints
are the framework's pickle-free ones (resumed under any strategy and world size, and bitwise after a SIGKILL),
and a ds_config.json that contradicts the run's config, or a missing DeepSpeed, is one paragraph.

The tests that start DeepSpeed are marked `deepspeed`: `make test` leaves them out (pyproject's addopts), `make
test-deepspeed` installs the extra and runs them (`pytest -m deepspeed tests/test_deepspeed.py`). Each 2-process
start takes a few seconds, and the first one on a machine compiles DeepSpeed's shared-memory op (~1 min, cached
in ~/.cache/torch_extensions). The config tests need no engine, nor DeepSpeed: they run in `make test`."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    FAULTY_ENV,
    ROOT,
    SHARED,
    assert_identical,
    assert_same_run,
    faulty,
    load_weights,
    once_per_run,
    read_metrics,
    run_cli,
    run_here,
    series,
    tiny_overrides,
    train_in_process,
)

from trainer.errors import ConfigError
from trainer.parallel import ds_config
from trainer.parallel.ds_config import RunValues

DS2 = ("world=deepspeed", "world.nproc_per_node=2")
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="DeepSpeed is not installed (pip install --no-build-isolation "
                                            "'trainer[deepspeed]')")


def cli_run(corpus: Path, run_dir: Path, *extra: str, env: dict | None = None) -> None:
    r = run_cli(*tiny_overrides(corpus, *SHARED, *extra), f"hydra.run.dir={run_dir}", env=env)
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="session")
def zero2(corpus, tmp_path_factory) -> Path:
    """ZeRO-2 on 2 processes x batch 4: the shared schedule (EMA on, a checkpoint every 4 steps, in the background)."""
    return once_per_run(tmp_path_factory, "ds_zero2", lambda d: cli_run(corpus, d, *DS2, "world.stage=2",
                                                                          "data.batch_size=4"))


def assert_same_weights(run_dir: Path, ref_dir: Path, name: str = "model.safetensors") -> None:
    got, want = load_weights(run_dir / name), load_weights(ref_dir / name)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype == torch.float32, k
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5)


# -- the engine --------------------------------------------------------------------------------------------
@pytest.mark.deepspeed
@needs_deepspeed
def test_zero2_on_2_processes_equals_one_and_its_checkpoints_are_whole_tensors_from_the_main_rank(zero2, reference):
    assert_same_run(zero2, reference)
    ckpt = zero2 / "checkpoints" / "step_00000012"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert set(manifest["files"]) == {"model.safetensors", "state.safetensors", "state.json", "config.yaml"}
    # The fp32 master weights, whole, under the plain module's keys; the optimizer's moments likewise.
    model = load_weights(ckpt / "model.safetensors")
    assert model.keys() == load_weights(reference / "checkpoints" / "step_00000012" / "model.safetensors").keys()
    assert model["tok_emb.weight"].shape == (256, 64) and model["tok_emb.weight"].dtype == torch.float32
    state = json.loads((ckpt / "state.json").read_text())
    assert set(state["optimizer"]["state"]["tok_emb.weight"]) >= {"step", "exp_avg", "exp_avg_sq"}
    assert load_weights(zero2 / "model.safetensors")["tok_emb.weight"].shape == (256, 64)  # the export is whole


@pytest.mark.deepspeed
@needs_deepspeed
def test_zero2_checkpoint_resumes_on_one_process_and_on_fsdp(zero2, reference, corpus, tmp_path):
    one = tmp_path / "one"
    shutil.copytree(zero2, one)
    train_in_process(corpus, one, "data.batch_size=8", *SHARED, f"resume={zero2}/checkpoints/step_00000008")
    assert_same_run(one, reference)
    fsdp = tmp_path / "fsdp"
    shutil.copytree(zero2, fsdp)
    cli_run(corpus, fsdp, "world=fsdp", "world.nproc_per_node=2", "data.batch_size=4",
            f"resume={zero2}/checkpoints/step_00000008")
    assert_same_run(fsdp, reference)


@pytest.mark.deepspeed
@needs_deepspeed
def test_a_one_process_checkpoint_resumes_on_zero3_with_accumulation(reference, corpus, tmp_path):
    """1 process x batch 8 -> ZeRO-3 on 2 processes x 2 micro-batches of 2 (each rank holds half of every
    parameter, and its half of every EMA average: ema.py's Partitions). The losses, the EMA's val loss, the
    weights and the EMA's weights are one process's."""
    shutil.copytree(reference, tmp_path, dirs_exist_ok=True)
    cli_run(corpus, tmp_path, *DS2, "world.stage=3", "data.batch_size=2", "trainer.grad_accum_steps=2",
            f"resume={reference}/checkpoints/step_00000008")
    got, want = read_metrics(tmp_path), read_metrics(reference)
    for key in ("train/loss", "val/loss", "val_ema/loss"):
        assert series(want, key) and series(got, key) == pytest.approx(series(want, key), rel=1e-5, abs=1e-5), key
    assert_same_weights(tmp_path, reference)
    assert_same_weights(tmp_path, reference, "model_ema.safetensors")


@pytest.mark.deepspeed
@needs_deepspeed
def test_sgd_on_zero2_equals_one_process(corpus, tmp_path):
    """optim=sgd was DeepSpeed's AssertionError ("an untested ZeRO Optimizer") in a worker: element-wise, it steps
    the flat partitions as it steps the whole tensors."""
    cli_run(corpus, tmp_path / "zero2", *DS2, "world.stage=2", "data.batch_size=4", "optim=sgd", "optim.lr=0.1")
    train_in_process(corpus, tmp_path / "one", *SHARED, "data.batch_size=8", "optim=sgd", "optim.lr=0.1")
    assert_same_run(tmp_path / "zero2", tmp_path / "one")


@pytest.mark.deepspeed
@needs_deepspeed
def test_a_lora_checkpoint_resumes_and_evaluates_on_zero3(corpus, tmp_path):
    """ZeRO-3 partitions LoRA's frozen base too, which no optimizer holds: building the live model state to check a
    checkpoint against read each rank's empty partition, and eval and resume failed with a reshape traceback. Now
    a one-process LoRA checkpoint resumes on ZeRO-3 to the one-process run's merged weights, EMA and adapter (the
    EMA's export read the empty partitions too), and eval on ZeRO-3 gives one process's val loss."""
    base, single, zero3 = tmp_path / "base", tmp_path / "single", tmp_path / "zero3"
    train_in_process(corpus, base, "trainer.max_steps=2")
    lora = (f"finetune.weights={base}", "finetune.lora.rank=4", "finetune.lora.targets=[qkv]", "trainer.max_steps=4",
            "checkpoint.every_n_steps=2", "data.batch_size=4")
    train_in_process(corpus, single, *SHARED, *lora)  # (EMA on, as cli_run's runs: its export gathers the base too)
    shutil.copytree(single, zero3)
    cli_run(corpus, zero3, *lora, *DS2, "world.stage=3", "data.batch_size=2",
            f"resume={single}/checkpoints/step_00000002")
    for name in ("model.safetensors", "model_ema.safetensors", "adapter/adapter_model.safetensors"):
        assert_same_weights(zero3, single, name)
    r = run_cli("eval", str(zero3))  # (its config: ZeRO-3 on 2 processes)
    assert r.returncode == 0, r.stderr
    want = [e for e in read_metrics(single) if "val/loss" in e][-1]["val/loss"]
    assert json.loads(r.stdout.strip().splitlines()[-1])["val/loss"] == pytest.approx(want, rel=1e-5)


@pytest.mark.deepspeed
@needs_deepspeed
def test_zero1_offloaded_with_accumulation_and_a_skipped_nan_step_equals_ddp(corpus, tmp_path):
    """ZeRO-1 with its optimizer state on the CPU, 2 micro-batches per step, and a NaN loss on rank 1 in step 5
    under trainer.nonfinite=skip: the same weights and losses as DDP with the same NaN (the step is skipped on
    both: DeepSpeed discards the step's reduced gradients, as DDP's zero_grad does)."""
    nan = ("trainer.nonfinite=skip", *faulty("nan_once", 9, rank=1))
    common = ("world.nproc_per_node=2", "data.batch_size=2", "trainer.grad_accum_steps=2", *nan)
    cli_run(corpus, tmp_path / "ds", "world=deepspeed", "world.stage=1", "world.offload_optimizer=true", *common,
            env=FAULTY_ENV)
    cli_run(corpus, tmp_path / "ddp", "world=ddp", *common, env=FAULTY_ENV)
    got, want = read_metrics(tmp_path / "ds"), read_metrics(tmp_path / "ddp")
    assert series(got, "train/skipped_steps")[-1] == series(want, "train/skipped_steps")[-1] == 1
    losses, ref = series(got, "train/loss"), series(want, "train/loss")
    assert [math.isnan(x) for x in losses] == [math.isnan(x) for x in ref] and any(math.isnan(x) for x in ref)
    assert [x for x in losses if not math.isnan(x)] == pytest.approx([x for x in ref if not math.isnan(x)], rel=1e-5)
    for name in ("model.safetensors", "model_ema.safetensors"):
        assert_same_weights(tmp_path / "ds", tmp_path / "ddp", name)


@pytest.mark.deepspeed
@needs_deepspeed
def test_zero2_rank_killed_mid_run_restarts_and_ends_bit_identical(zero2, corpus, tmp_path):
    # Synchronous saves, so step 8's is complete when rank 1 dies in step 11; the elastic agent restarts both
    # ranks, which resume from it (resume=auto on a restart).
    cli_run(corpus, tmp_path, *DS2, "world.stage=2", "data.batch_size=4", "world.max_restarts=1",
            "checkpoint.async_save=false", *faulty("sigkill", 11, rank=1, first_attempt_only=True), env=FAULTY_ENV)
    assert_identical(tmp_path, zero2)


@pytest.mark.deepspeed
@needs_deepspeed
def test_zero2_preempted_exits_75_with_a_checkpoint_and_resume_auto_ends_bit_identical(zero2, corpus, tmp_path):
    # SIGTERM to rank 0 in step 6: the ranks agree on the stop at step 7's count, after its samples are drawn, take
    # that step (a stop before it would checkpoint generators past its draws), save, and exit 75. The rerun
    # continues without the faulty task (it only wraps the same loss).
    run = [*tiny_overrides(corpus, *SHARED, *DS2, "world.stage=2", "data.batch_size=4"), f"hydra.run.dir={tmp_path}"]
    r = run_cli(*run, *faulty("sigterm", 6, rank=0), env=FAULTY_ENV)
    assert r.returncode == 75, r.stderr
    assert "checkpoint saved to" in r.stderr and (tmp_path / "checkpoints" / "step_00000007").is_dir(), r.stderr
    r = run_cli(*run, "resume=auto")
    assert r.returncode == 0, r.stderr
    assert_identical(tmp_path, zero2)


@pytest.mark.deepspeed
@needs_deepspeed
@pytest.mark.parametrize("zero", [("world.stage=3",), ("world.stage=2", "world.offload_optimizer=true")],
                         ids=["zero3", "zero2_offload"])
def test_your_own_loop_on_zero3_with_accumulation_trains_what_the_trainer_trains(reference, corpus, tmp_path, zero):
    """trainer.Runtime under `python -m trainer launch world=deepspeed`: setup returns the engine, rt.backward /
    clip_grad_norm_ / step drive it, save_model gathers the whole model. With the optimizer offloaded, rt.step must
    zero through DeepSpeed's own zero_grad (its CPU gradient buffers stay): the class's failed at step 2."""
    # precision=fp32 as the reference's (debug=smoke): a launched job otherwise takes the lm recipe's `auto`, bf16
    # where the CPU computes it natively.
    r = run_cli("launch", "precision=fp32", *DS2, *zero, "trainer.grad_accum_steps=2", str(ROOT / "recipes" / "lm" /
                "own_loop.py"), "--data", str(corpus), "--out", str(tmp_path), "--steps", "12", "--lr", "5e-3",
                "--warmup", "2", "--seq-len", "32", "--batch-size", "2")
    assert r.returncode == 0, r.stderr
    assert_same_weights(tmp_path, reference)
    assert series(read_metrics(tmp_path), "train/loss") == pytest.approx(series(read_metrics(reference),
                                                                                "train/loss"), rel=1e-5)


@pytest.mark.deepspeed
@needs_deepspeed
def test_bf16_on_one_process_is_deepspeeds_and_learns_what_the_plain_process_learns(corpus, tmp_path):
    """`world=deepspeed` as it comes (one process on a CPU: DeepSpeed's place in the world from the framework),
    ZeRO-3 in precision=bf16: 16-bit weights with fp32 master weights in ZeRO's partitions, under the framework's
    autocast. It follows world=single's bf16 run to bf16's resolution, and its export holds the fp32 master
    weights."""
    run = ("precision=bf16", "trainer.max_steps=20", "trainer.eval_every=0", "ema.enabled=false", "data.batch_size=8",
           "trainer.peak_tflops=1")
    ref = tmp_path / "one"
    train_in_process(corpus, ref, *run)
    r = run_cli(*tiny_overrides(corpus, *run, "world=deepspeed", "world.stage=3"), f"hydra.run.dir={tmp_path / 'ds'}")
    assert r.returncode == 0, r.stderr
    got, want = series(read_metrics(tmp_path / "ds"), "train/loss"), series(read_metrics(ref), "train/loss")
    # bf16 holds 8 significant bits: the losses agree to two of its ulps (2^-7 relative).
    assert got == pytest.approx(want, rel=2**-7) and got[-1] < got[0] - 1.0
    weights = load_weights(tmp_path / "ds" / "model.safetensors")
    assert {w.dtype for w in weights.values()} == {torch.float32}
    # MFU counts the same FLOPs a token (ZeRO-3's partitioned parameters read as 0 elements: 17x low).
    flops = [[e["train/mfu"] / e["train/tokens_per_s"] for e in read_metrics(d) if "train/mfu" in e][-1]
             for d in (tmp_path / "ds", ref)]
    assert flops[0] == pytest.approx(flops[1], rel=1e-9)
    # DeepSpeed's gradients are bf16 (its weights are), the plain run's fp32 (autocast keeps fp32 weights): where
    # a gradient element is near 0 the two AdamW updates may differ by up to 2 x lr per step (Adam's steps are at
    # most ~lr per element), so the weights agree to 2 x the sum of the learning rates.
    bound = 2 * sum(series(read_metrics(ref), "train/lr"))
    for k, w in load_weights(ref / "model.safetensors").items():
        torch.testing.assert_close(weights[k], w, rtol=0, atol=bound)


# -- the config -------------------------------------------------------------------------------------------
RUN = RunValues(batch_size=4, grad_accum_steps=2, grad_clip=1.0, clip_known=True, dp_size=2, precision="bf16",
                optimizer="AdamW", lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, schedule="cosine",
                warmup_steps=100, min_lr_ratio=0.1, max_steps=1000)
WORLD = {"stage": None, "offload_optimizer": None, "offload_param": None}


def test_auto_entries_take_the_runs_values_and_the_engine_gets_the_frameworks_step():
    file = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                  "stage3_prefetch_bucket_size": "auto", "overlap_comm": True},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                      "weight_decay": "auto", "torch_adam": True}},
            "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": "auto", "total_num_steps": "auto",
                                                               "cos_min_ratio": "auto"}}}
    cfg = ds_config.resolve(file, RUN, **WORLD)
    # One engine step is one framework step: DeepSpeed never divides the loss by the accumulation again.
    assert cfg["gradient_accumulation_steps"] == 1 and cfg["train_micro_batch_size_per_gpu"] == 8
    assert "train_batch_size" not in cfg  # (DeepSpeed derives it: 8 x 1 x 2 ranks = the global batch)
    assert cfg["gradient_clipping"] == 1.0 and cfg["bf16"] == {"enabled": True, "check_grad_overflow": True}
    assert "fp16" not in cfg and "optimizer" not in cfg and "scheduler" not in cfg
    assert cfg["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu"}, "overlap_comm": True}
    assert cfg["zero_force_ds_cpu_optimizer"] is False
    assert file["gradient_clipping"] == "auto"  # the user's dict is left as it was


def test_a_contradicting_entry_is_one_paragraph_naming_both_and_equal_values_pass():
    file = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
            "train_batch_size": 16, "fp16": {"enabled": True}, "zero_optimization": {"stage": 3},
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95]}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100, "warmup_type": "log"}}}
    with pytest.raises(ConfigError) as e:
        ds_config.resolve(file, RUN, **{**WORLD, "stage": 2}, source="world.config=ds.json")
    message = str(e.value)
    assert "\n" not in message and message.startswith("world.config=ds.json contradicts this run's config: ")
    for needle in ("train_micro_batch_size_per_gpu is 8 there but data.batch_size=4",
                   "gradient_clipping is 0.5 there but trainer.grad_clip=1.0",
                   "zero_optimization.stage is 3 there but world.stage=2", "fp16.enabled is true there but precision=bf16",
                   "optimizer.params.lr is 0.0003 there but optim.lr=0.001",
                   'scheduler.type is "WarmupLR" there but scheduler=cosine', "warmup_type", 'write "auto"'):
        assert needle in message, needle
    for ok in ("gradient_accumulation_steps", "train_batch_size", "betas", "warmup_num_steps"):  # equal: no complaint
        assert f"{ok} is" not in message, ok


@pytest.mark.parametrize(("world", "file", "zero"), [
    ({}, {}, {"stage": 2}),  # nothing said: ZeRO-2
    ({}, {"zero_optimization": {"stage": 1}}, {"stage": 1}),  # null options leave it to the file
    ({"stage": 3, "offload_param": True}, {}, {"stage": 3, "offload_param": {"device": "cpu"}}),
    ({"offload_optimizer": True}, {"zero_optimization": {"offload_optimizer": {"device": "auto", "pin_memory": True}}},
     {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}),
])
def test_world_options_are_the_zero_entries(world, file, zero):
    assert ds_config.resolve(file, RunValues(), **{**WORLD, **world})["zero_optimization"] == zero


def test_zero_takes_an_element_wise_optimizer_and_refuses_muon_unless_the_file_allows_it():
    assert ds_config.resolve({}, RunValues(optimizer="SGD"), **WORLD)["zero_allow_untested_optimizer"] is True
    assert "zero_allow_untested_optimizer" not in ds_config.resolve({}, RunValues(), **WORLD)
    with pytest.raises(ConfigError, match="optim=muon orthogonalises each 2-D weight matrix as a whole. Use world=ddp"):
        ds_config.resolve({}, RunValues(optimizer="MuonAdamW"), **WORLD)
    with pytest.raises(ConfigError, match="Adafactor factors each matrix's second moment"):
        ds_config.resolve({}, RunValues(optimizer="Adafactor"), **WORLD)
    ds_config.resolve({"zero_allow_untested_optimizer": True}, RunValues(optimizer="MuonAdamW"), **WORLD)  # (the file's)
    # DeepSpeed's own (and a factory function's name, which says nothing of the class): DeepSpeed's to decide.
    for name in ("FusedAdam", "DeepSpeedCPUAdam", "make_adamw"):
        assert "zero_allow_untested_optimizer" not in ds_config.resolve({}, RunValues(optimizer=name), **WORLD)


def test_an_unknown_run_value_checks_nothing_and_an_unknown_auto_is_dropped():
    """A hand-written loop's Runtime knows no batch size: DeepSpeed's batch entries are its bookkeeping only."""
    cfg = ds_config.resolve({"train_micro_batch_size_per_gpu": 16, "gradient_clipping": 2.0, "wall_clock_breakdown":
                             "auto"}, RunValues(), **WORLD)
    assert cfg["train_micro_batch_size_per_gpu"] == 1 and cfg["gradient_clipping"] == 2.0
    assert "wall_clock_breakdown" not in cfg


def test_the_run_values_come_from_the_config_as_the_world_yaml_wires_them(corpus):
    from omegaconf import OmegaConf

    from trainer import compose

    cfg = compose(tiny_overrides(corpus, "world=deepspeed", "precision=bf16", "trainer.grad_accum_steps=3"))
    run = RunValues.from_auto(OmegaConf.to_container(cfg.world.auto, resolve=True))
    assert (run.batch_size, run.grad_accum_steps, run.precision, run.optimizer) == (
        cfg.data.batch_size, 3, "bf16", "AdamW")
    assert (run.lr, run.betas, run.schedule, run.max_steps) == (cfg.optim.lr, tuple(cfg.optim.betas), "cosine",
                                                                 cfg.trainer.max_steps)
    assert run.clip_known and run.grad_clip == cfg.trainer.grad_clip


@pytest.mark.parametrize(("args", "needles"), [
    (["world.config=ds.json", "world.stage=2"], ["world.config=ds.json contradicts this run's config",
                                                 "zero_optimization.stage is 3 there but world.stage=2",
                                                 "gradient_clipping is 0.25 there but trainer.grad_clip=1.0"]),
    # train_batch_size needs the number of ranks: named with the rest, before any process (it came from the
    # workers, alone, after the others were fixed, and left the run dir behind)
    (["world.config=batch.json"], ["train_batch_size is 16 there but data.batch_size x trainer.grad_accum_steps x "
                                   "data-parallel ranks", "gradient_clipping is 0.25 there"]),
    # ... and in a run of one process, which has no preflight: before the model is built
    (["world.nproc_per_node=1", "world.config=batch.json"], ["data-parallel ranks = 4 x 1 x 1 = 4",
                                                             "gradient_clipping is 0.25 there"]),
    # the world options' stage where given: the contradiction is named, not "needs stage 3" after world.stage=3
    (["world.config=stage2.json", "world.stage=3", "world.offload_param=true"],
     ["zero_optimization.stage is 2 there but world.stage=3"]),
    (["world.offload_param=true"], ["world.offload_param needs ZeRO stage 3"]),
    (["world.stage=4"], ["world.stage=4 is invalid", "1, 2 or 3"]),
    (["optim=muon"], ["optim=muon orthogonalises each 2-D weight matrix"]),  # (DeepSpeed's assertion, in a worker)
    (["world.config=missing.json"], ["world.config='missing.json' cannot be read"]),
    (["world.config=ds.json", "world.stag=3"], ["unknown config key 'world.stag'", "world.stage=3"]),
])
def test_deepspeed_config_mistakes_are_one_paragraph_before_any_process(tmp_path, corpus, args, needles):
    from test_errors import assert_clean_error

    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3}, "gradient_clipping": 0.25}))
    (tmp_path / "batch.json").write_text(json.dumps({"train_batch_size": 16, "gradient_clipping": 0.25}))
    (tmp_path / "stage2.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    r = run_here(*tiny_overrides(corpus, *DS2), *args, "hydra.run.dir=run", cwd=tmp_path)
    assert_clean_error(r, *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["batch.json", "ds.json", "stage2.json"]


def test_without_deepspeed_world_deepspeed_is_the_install_paragraph(tmp_path, corpus, monkeypatch):
    from test_errors import assert_clean_error

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # as if it were not installed
    r = run_here(*tiny_overrides(corpus, *DS2), "hydra.run.dir=run", cwd=tmp_path)
    assert_clean_error(r, "world=deepspeed needs DeepSpeed, which is not installed",
                       "pip install --no-build-isolation 'trainer[deepspeed]'", "world=fsdp")
    assert list(tmp_path.iterdir()) == []


def test_fp16s_loss_scale_is_deepspeeds_in_gradscalers_format():
    """precision=fp16's scaler under DeepSpeed reads and sets DeepSpeed's dynamic loss scaler, and saves its state
    as torch's GradScaler does (so the scale resumes under another strategy)."""
    from types import SimpleNamespace

    from trainer.parallel.deepspeed import _EngineLossScale

    strategy = SimpleNamespace(engine=None)
    scale = _EngineLossScale(strategy, torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=100))
    assert scale.get_scale() == 2.0**10
    scale.load_state_dict({"scale": 512.0, "_growth_tracker": 7})  # loaded before the engine exists
    ds_scaler = SimpleNamespace(cur_scale=2.0**16, cur_iter=50, last_overflow_iter=-1, scale_window=100, scale_factor=2.0)
    strategy.engine = SimpleNamespace(optimizer=SimpleNamespace(loss_scaler=ds_scaler))
    scale.attached()
    assert ds_scaler.cur_scale == 512.0 and scale.get_scale() == 512.0
    state = scale.state_dict()
    assert state == {"scale": 512.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 100,
                     "_growth_tracker": 7}
    assert set(state) == set(torch.amp.GradScaler("cpu").state_dict())
    scale.update()  # the non-finite guard's close_skipped_step: DeepSpeed's step updates the scale itself
    assert ds_scaler.cur_scale == 512.0
