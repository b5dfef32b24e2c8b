"""Bad input through the real CLI: one paragraph naming the key or path, exit 2, nothing left behind.

Each case asserts the exit code, the key content of the message, the absence of a traceback, and
that nothing was written (or that earlier results survived).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import uuid
from pathlib import Path

import pytest
from conftest import (
    DDP2,
    FAULTY_ENV,
    SHARED,
    read_metrics,
    run_cli,
    run_here,
    run_main,
    series,
    tiny_overrides,
    train_in_process,
)

from trainer.checkpoint.store import verify


def assert_clean_error(r: subprocess.CompletedProcess, *needles: str, code: int = 2) -> None:
    """One paragraph ("error: ..."), maybe followed by the command that continues the run; no traceback."""
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout
    lines = r.stderr.strip().splitlines()
    errors = [i for i, line in enumerate(lines) if line.startswith("error: ")]
    assert len(errors) == 1, r.stderr
    assert all(line.startswith("to continue this run: ") for line in lines[errors[0] + 1:]), r.stderr
    message = lines[errors[0]]
    for needle in needles:
        assert needle in message, message


def test_a_number_as_text_and_resolve_without_cfg_are_one_paragraph_saying_the_fix(tmp_path):
    """${oc.env:LR} gives text, which an untyped section keeps: "optim.lr='1e-3' is invalid: expected a finite number
    > 0" said the number was wrong. And Hydra's --resolve without --cfg was a ValueError traceback, exit 1."""
    r = run_main("debug=smoke", "optim.lr=${oc.env:LR}", "hydra.run.dir=run", cwd=tmp_path, env={"LR": "1e-3"})
    assert_clean_error(r, "optim.lr='1e-3' is invalid", "It is text", """'optim.lr="${oc.decode:${oc.env:VAR}}"'""")
    r = run_main("debug=smoke", "--resolve", cwd=tmp_path)
    assert_clean_error(r, "--resolve resolves the interpolations of the config that --cfg prints",
                       "python -m trainer --cfg job --resolve debug=smoke")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("args", "needles"), [
    (["trainer.max_stps=3"], ["unknown config key 'trainer.max_stps'", "Did you mean trainer.max_steps=3?"]),
    (["+trainer.foo=1"], ["trainer.foo is not a setting of `trainer`", "Remove +trainer.foo"]),  # (a traceback, run dir)
    (["data.nosuch=1"], ["unknown config key 'data.nosuch'", "write +data.nosuch=VALUE"]),  # (a section of one's own)
    (["model.foo=1", "model.bar=2"], ["unknown config key 'model.foo'", "Valid keys under 'model': _target_, d_model"]),
    # (two unknown keys: "'model' has no keys yet", composing without the first failed on the second)
    (["model.n_layr=3"], ["'model.n_layr'", "Did you mean model.n_layer=3?"]),
    (["model.d_model=0"], ["model.d_model=0", "positive integers"]),  # (was a reshape traceback in the first step)
    (["model.n_layer=-1"], ["model.n_layer=-1", "n_layer may be 0"]),
    (["model=gpt_tny"], ["model=gpt_tny", "Available: gan, gpt_medium, gpt_small, gpt_tiny", "Did you mean gpt_tiny?"]),
    (["precision=bf61"], ["precision=bf61", "bf16, fp16, fp32"]),
    (["trainer.max_steps=abc"], ["trainer.max_steps", "'abc'"]),
    (["trainer.max_steps=0"], ["trainer.max_steps=0", ">= 1"]),
    (["data.batch_size=0"], ["data.batch_size=0", ">= 1"]),
    (["trainer.grad_accum_steps=0"], ["trainer.grad_accum_steps=0"]),
    (["world=ddp", "world.nproc_per_node=0"], ["world.nproc_per_node=0"]),
    (["optim.lr=0"], ["optim.lr=0", "> 0"]),
    (["optim.lr=-1e-3"], ["optim.lr=-0.001"]),
    (["optim.lr=inf"], ["optim.lr=inf is invalid: expected a finite number > 0"]),  # (trained, then exit 3)
    (["world.nproc_per_node=2"], ["world=ddp"]),  # an incompatible combination: several processes, world=single
    (["logger=[wandb,tensorbord]"], ["logger=tensorbord is not an option", "Available: none, tensorboard, wandb",
                                     "Did you mean tensorboard?"]),  # (a list's typo listed "(none)")
    # The strategies' own flags (a string was truthy: cpu_offload=maybe offloaded; others were a traceback per rank).
    # A task's, model's or data function's own typed keys: task.num_samples=abc trained the whole run, then crashed
    # at the first eval with a traceback and a run dir left behind.
    (["recipe=diffusion", "debug=smoke", "task.num_samples=abc"], ["task.num_samples='abc' is invalid: expected an "
                                                                   "integer"]),
    (["world=fsdp", "world.cpu_offload=maybe"], ["world.cpu_offload='maybe' is invalid: expected a bool (true or false)"]),
    (["world=ddp", "world.static_graph=maybe"], ["world.static_graph='maybe' is invalid: expected a bool"]),
    (["world=ddp", "world.bucket_cap_mb=-1"], ["world.bucket_cap_mb=-1 is invalid: expected a number of megabytes > 0"]),
    (["world=deepspeed", "world.offload_param=yes"], ["world.offload_param='yes' is invalid: expected a bool (true or false) "
                                                      "or null"]),
    (["data=text"], ["data.path is required"]),
    (["model._target_=os.system"], ["model._target_='os.system' is refused", "blocklist"]),
    (["model._target_=trainer.recipes.lm.model.GTP"], ["cannot be imported"]),
    # (a module that exists and raised while importing: the reason was "Are you sure that module is installed?")
    (["model._target_=broken_module.Linear"], ["its module raised while being imported (RuntimeError('a bug at the "
                                               "top of the module'))"]),
    (["+model.n_layr=2"], ["model.n_layr is not an option of model._target_=GPT", "Did you mean n_layer?"]),
    # Values that used to crash mid-run or pass silently (issues 16 and 18): one paragraph before anything runs.
    (["optim.betas=0.9"], ["optim.betas=0.9", "two numbers in [0, 1)"]),
    (["recipe=gan", "optim.discriminator._target_=torch.optim.SGD"], ["write +optim.discriminator._target_=VALUE"]),
    # Settings of pipeline stages on a run without them (world.pp forgotten: a plain DDP run, microbatches=3 not
    # dividing the batch and all), and a compile the pipeline's schedule never reaches (compile: true on record).
    (["world=ddp", "world.microbatches=3"], ["world.microbatches=3 is invalid: expected null with world.pp=1",
                                             "Add world.pp=N"]),
    (["world=ddp", "world.pp_schedule=GPipe"], ["world.pp_schedule='GPipe' is invalid: expected 1F1B (the default)"]),
    (["world=ddp", "world.nproc_per_node=2", "world.pp=2", "model.n_layer=2", "trainer.compile=true"],
     ["trainer.compile=True is invalid: expected false with world.pp=2", "would compile nothing"]),
    # (read by no part, each setting its own: the run trained at the recipe's rates, optim.lr=-1 too)
    (["recipe=gan", "optim.lr=0.1"], ["every part of optim sets its own lr",
                                      "optim.generator.lr=0.1 optim.discriminator.lr=0.1"]),
    (["finetune.lora.rank=4", "finetune.lora.targets=qkv"], ["finetune.lora.targets=qkv is not a list",
                                                            "finetune.lora.targets=[qkv]"]),
    (["optim.betas=[0.9,1.5]"], ["optim.betas=[0.9, 1.5]"]),
    # (a count meant for a switch: OmegaConf took any number but 0 as true, and checkpointed every block)
    (["trainer.activation_checkpointing=2"], ["trainer.activation_checkpointing=2: trainer.activation_checkpointing "
                                              "is a switch, not a number", "trainer.activation_checkpointing=true"]),
    (["trainer.activation_checkpointing='2'"], ["is a switch, not a number"]),  # (quoted: taken as true as well)
    # (optim's and scheduler's were an OmegaConf traceback: a check of the sections' parts resolved every value)
    (["optim.lr=${nope}"], ["optim.lr: Interpolation key 'nope' not found"]),
    # (Hydra's node is composed apart from the job's: "The config has no 'hydra.run'" was false)
    (["hydra.run.nope=1"], ["unknown config key 'hydra.run.nope'", "--cfg hydra", "lists the keys of 'hydra.run'"]),
    (["scheduler.warmup_steps=${oc.env:TRAINER_NO_SUCH_VAR}"], ["scheduler.warmup_steps: ", "TRAINER_NO_SUCH_VAR"]),
    (["optim.eps=-1"], ["optim.eps=-1", ">= 0"]),
    (["optim.weight_decay=-1"], ["optim.weight_decay=-1"]),
    (["optim._target_=torch.optim.SGD"], ["optim.betas, optim.eps are not options of optim._target_=SGD", "momentum"]),
    (["optim._target_=torch.optim.RMSprop"], ["optim.betas, optim.fused are not options of optim._target_=RMSprop",
                                              "~optim.betas ~optim.fused"]),  # (all at once, not one per rerun)
    (["data.batch_size=-1"], ["data.batch_size=-1"]),
    (["trainer.eval_batch_size=0"], ["trainer.eval_batch_size=0"]),
    (["scheduler.warmup_steps=-1"], ["scheduler.warmup_steps=-1"]),
    (["scheduler.min_lr_ratio=abc"], ["scheduler.min_lr_ratio='abc'"]),
    (["trainer.max_nonfinite_skips=0"], ["trainer.max_nonfinite_skips=0"]),
    (["checkpoint.keep_last=0"], ["checkpoint.keep_last=0 is invalid", "Or null to keep every one."]),
    (["model.vocab_size=100"], ["model.vocab_size=100", "256"]),
    (["model.seq_len=16"], ["model.seq_len=16 is shorter than data.seq_len=256"]),
    (["logger=wandb", "logger.wandb.tags=baseline"], ["logger.wandb.tags='baseline'", "a list"]),
    (["trainer.compile=true", "trainer.compile_backend=nosuch"], ["trainer.compile_backend='nosuch'", "inductor"]),
    # torch.compile's mode and inductor's options: only with compile on and inductor, one or the other, names torch has.
    (["trainer.compile_mode=max-autotune"], ["trainer.compile_mode='max-autotune'", "Add trainer.compile=true"]),
    (["trainer.compile=true", "trainer.compile_mode=fast"], ["trainer.compile_mode='fast'", "max-autotune"]),
    (["trainer.compile=true", "+trainer.compile_options.coordinate_decent_tuning=true"],
     ["trainer.compile_options.coordinate_decent_tuning is not an option of inductor",
      "Did you mean coordinate_descent_tuning?"]),
    (["trainer.compile=true", "trainer.compile_mode=max-autotune", "+trainer.compile_options.max_autotune=true"],
     ["not both"]),
    (["trainer.compile=true", "trainer.compile_backend=eager", "trainer.compile_mode=max-autotune"],
     ["unset with trainer.compile_backend=eager"]),
    (["trainer.compile=true", "+trainer.compile_options.max_autotune=notabool"],
     ["trainer.compile_options.max_autotune='notabool' is invalid: expected a bool"]),
    (["trainer.compile=true", "trainer.compile_options.max_autotune=true"],
     ["'trainer.compile_options' has no keys yet", "+trainer.compile_options.max_autotune=VALUE"]),
    (["checkpoint.best_metric=loss"], ["checkpoint.best_metric='loss'", "val/"]),
    (["checkpoint.best_metric=val_ema/loss"], ["checkpoint.best_metric='val_ema/loss'", "ema.enabled=true"]),
    (["world.device=cuda"], ["world.device='cuda'", "no CUDA device"]),
    (["world.device=cpu:3"], ["world.device='cpu:3' is invalid: expected auto, cpu, cuda, cuda:N or mps"]),  # (was
    # taken without a word: a CPU has no index)
    (["trainer.nonfinite_check=log", "trainer.nonfinite=skip"], ["trainer.nonfinite_check='log'", "nonfinite=skip"]),
    (["trainer.nonfinite_check=sometimes"], ["trainer.nonfinite_check='sometimes'", "auto, step or log"]),
    (["--config-dir", "nosuch"], ["--config-dir nosuch: there is no such directory"]),  # (was Hydra's, and a warning)
    # A logger's or callback's setting without choosing it: the generic "+KEY" advice led to a traceback.
    (["logger.wandb.project=p"], ["logger.wandb.project is a setting of logger=wandb", "add logger=wandb"]),
    (["+logger.wandb.project=p"], ["logger.wandb={'project': 'p'} is invalid", "Choose it: logger=wandb"]),
    (["+logger.tensorboard.dir=tb"], ["logger.tensorboard=", "Choose it: logger=tensorboard"]),
    (["callbacks.early_stopping.patience=3"], ["add callbacks=early_stopping"]),
    # ... and a typo in the setting of one chosen was told to choose it (it is)
    (["logger=wandb", "logger.wandb.projct=p"], ["unknown config key 'logger.wandb.projct'",
                                                 "Did you mean logger.wandb.project=p?"]),
    (["callbacks=early_stopping", "callbacks.early_stopping.patiense=2"],
     ["Did you mean callbacks.early_stopping.patience=2?"]),
    (["+callbacks.early_stopping.patience=3"], ["Choose it: callbacks=early_stopping"]),
    (["+logger.mine.x=1"], ["logger.mine=", "The options of logger are none, tensorboard, wandb"]),
    (["optim=muon", "optim.adamw_lr=abc"], ["optim.adamw_lr='abc' is invalid: expected a finite number > 0"]),  # (a traceback,
    (["optim=muon", "optim.ns_steps=abc"], ["optim.ns_steps='abc' is invalid: expected an integer"]),  # a run dir left)
    (["world=deepspeed", "world.stage=7", "--cfg", "job"], ["world.stage=7 is invalid: expected 1, 2 or 3"]),
    (["ema.decay=0.99", "ema.warmup=true"], ["ema.decay, ema.warmup: the EMA is off", "Add ema.enabled=true"]),
    (["finetune.weights=nosuch", "world=ddp", "world.nproc_per_node=2", "world.pp=2"],
     ["world.pp=2 is invalid: expected 1 with finetune.weights=nosuch", "world=fsdp"]),  # (a worker's traceback)
    (["world=[single,ddp]"], ["world=[single,ddp] chooses several options of world, which takes one",
                               "python -m trainer -m world=single,ddp"]),  # (ran as ddp without a word)
    (["+optim.lr=1"], ["+optim.lr=1: optim.lr is already in the config", "Set it without the `+`: optim.lr=1."]),
    (["~trainer"], ["the `trainer` settings were removed (~trainer)"]),  # (omegaconf's traceback, the run dir left)
    (["~ema"], ["the `ema` settings were removed (~ema)"]),
    # LoRA under pipeline stages: a worker's AttributeError traceback (its blocks on the other stage).
    (["world=ddp", "world.nproc_per_node=2", "world.pp=2", "model.n_layer=4", "finetune.lora.rank=4",
      "finetune.lora.targets=[qkv]"], ["world.pp=2 is invalid: expected 1 with finetune.lora.rank=4"]),
    (["resume=auot"], ["resume='auot' does not exist", "Did you mean resume=auto?"]),
    (["resume=notes.txt"], ["resume='notes.txt' is a file, not a directory"]),
    (["resume="], ["resume= is empty: pass auto, null"]),  # (the current directory was searched for checkpoints)
    # eval's option given to a training run (omegaconf's "str is not a subclass of CheckpointConfig")
    (["checkpoint=best"], ["checkpoint=best: `checkpoint` is a section of settings, not one value",
                           "python -m trainer eval RUN_DIR", "checkpoint.KEY=VALUE"]),
    # Both names of a Hugging Face model's size, differing: the lm recipe's name was dropped without a word.
    (["model=llama_tiny", "debug=smoke", "model.num_hidden_layers=4", "model.n_layer=2"],
     ["model.n_layer=2 and model.num_hidden_layers=4 name one size", "with two values"]),
    (["model=llama_tiny", "model.n_layer=2"], ["unknown config key 'model.n_layer': this Hugging Face model's config "
                                               "calls it num_hidden_layers. Set model.num_hidden_layers=2"]),
    # A top-level key of one's own that nothing reads, named as a section's setting: trained at the default lr.
    (["+lr=1e-3"], ["+lr=1e-3 adds a top-level key of its own, which nothing reads", "Set it there: optim.lr=1e-3."]),
    # From a sweep of bad values for every key: each was a traceback once the run started (finetune's keys, the
    # optimizer's, integers past 64 bits: some at the last eval), trained nonsense without a word (momentum 2.5),
    # forked until the machine stopped (num_workers), or waited for the first eval (monitor).
    (["+finetune.lora.foo=1"], ["finetune.lora.foo is not a setting of `finetune.lora`", "Remove +finetune.lora.foo"]),
    (["trainer.seed=99999999999999999999"], ["trainer.seed=99999999999999999999 is invalid: expected an integer that "
                                             "fits in 64 bits"]),
    (["optim.betas=null"], ["optim.betas=null is invalid", "leave the key out: ~optim.betas"]),
    (["optim.foreach=true"], ["optim.foreach=True is invalid: expected false or null with optim.fused=true"]),
    (["optim=sgd", "optim.momentum=0"], ["optim.momentum=0 is invalid: expected a number in (0, 1) with "
                                         "optim.nesterov=true"]),
    (["optim=sgd", "optim.momentum=2.5"], ["optim.momentum=2.5 is invalid: expected a number in [0, 1)"]),
    (["optim=muon", "optim.ns_steps=0"], ["optim.ns_steps=0 is invalid: expected an integer in [1, 100)"]),
    (["optim=muon", "optim.adamw_lr=0"], ["optim.adamw_lr=0 is invalid: expected a finite number > 0"]),
    (["optim.fused=abc"], ["optim.fused='abc' is invalid: expected true or false"]),
    (["data.num_workers=99999"], ["data.num_workers=99999 is invalid: expected an integer in [0, "]),
    (["callbacks=early_stopping", "callbacks.early_stopping.monitor=loss"],
     ["callbacks.early_stopping.monitor='loss' is invalid: expected a metric logged at eval"]),
    (["callbacks=early_stopping", "callbacks.early_stopping.monitor=val_ema/loss"], ["only an EMA's evals log val_ema/"]),
    (["optim=5"], ["optim=5 is not an option of optim: choose one of adam, adamw, muon, sgd by its name"]),
    (["logger=[1,2]"], ["logger=[1,2] is not an option of logger", "(several: logger=[tensorboard,...])"]),
    # (read as a part's node: "optim.eps.a is not an option of optim.eps._target_=AdamW")
    (["optim.eps={a:1}"], ["optim.eps={'a': 1} is invalid: eps is a setting, a value (optim.eps=VALUE)"]),
])
def test_config_mistakes(tmp_path, args, needles):
    # Most mistakes end before Hydra writes anything: checked in this process (`run_main`, the same
    # output without an interpreter start-up). Those the recipe's task finds run Hydra's job (`run_here`).
    inside_the_job = any(a.startswith(("model.vocab_size", "model.seq_len", "model.d_model", "model.n_layer")) for a in args)
    if "resume=notes.txt" in args:
        (tmp_path / "notes.txt").write_text("x")
    r = (run_here if inside_the_job else run_main)(*args, "hydra.run.dir=run", cwd=tmp_path)
    assert_clean_error(r, *needles)
    assert [p.name for p in tmp_path.iterdir() if p.name != "notes.txt"] == []  # no run dir, no half-written files


@pytest.mark.parametrize("args, needle", [
    (["data.batch_size=5000"], "data.batch_size=5000 is more than the 115 samples of the training split"),
    (["recipe=diffusion", "model.in_channels=0"], "model.in_channels=0: the UNet's sizes are positive integers"),
    (["recipe=diffusion", "task.num_classes=0"], "task.num_classes=0 must be an integer >= 1"),
    (["recipe=diffusion", "model.num_classes=3"], "task.num_classes=3 (model.num_classes, which it follows) is fewer "
                                                  "than the data's labels, 0 to 9"),  # (an IndexError in a step)
    (["recipe=gan", "model.hidden=0"], "model.hidden=0: the GAN's sizes are positive integers"),
    (["data=text_stream", "data.val_path=''"], "data.val_path='' is empty"),  # (taken as none: no val, no word)
    # (an AttributeError deep in the strategy, and at the first step)
    (["model._target_=odd_callbacks.not_a_module"], "returned a value of type object, not a torch.nn.Module"),
    (["task._target_=odd_callbacks.TaskWithoutNumTargets"], "(TaskWithoutNumTargets) has no num_targets()"),
    (["task._target_=odd_callbacks.OldSetup"], "the task's setup (OldSetup.setup) must take (train, val, run_dir)"),
    # (never trained: in no optimizer; the export kept its random weights, and trainer.load blamed the files)
    (["model._target_=odd_callbacks.LazyLayer"], "the model made parameters in its forward (head.weight, head.bias)"),
    (["data=stdlib", "data.val_every=1000000000"], "data.val_every=1000000000 put none of the standard library's"),
    # (torch's stack error, a traceback through the loader at the first batch, the run dir left)
    (["data._target_=odd_callbacks.ragged"], "the samples of Ragged do not make one batch: torch's default_collate"),
])
def test_values_the_data_or_the_recipes_code_refuses_are_one_paragraph_before_the_first_step(small_corpus, tmp_path,
                                                                                            args, needle):
    """A batch larger than the training split (a list of its indices per batch: 10^20 of them filled the memory),
    an empty val path, and the diffusion and GAN recipes' sizes (0 classes or channels failed in the first step; a GAN of width 0
    trained at loss ln 2 without a word)."""
    data = [f"data.path={small_corpus}", "data=text"] if not any(a.startswith(("recipe=", "data=")) for a in args) \
        else [f"data.path={small_corpus}"] if "data=text_stream" in args else []
    r = run_here("debug=smoke", *data, *args, "hydra.run.dir=run", cwd=tmp_path)
    assert_clean_error(r, needle)
    assert not (tmp_path / "run").exists()


def test_a_top_level_key_of_ones_own_is_taken_when_something_reads_it_or_it_names_no_setting():
    from omegaconf import OmegaConf

    from trainer.config.compose import check_top_level_adds
    from trainer.errors import ConfigError

    cfg = {"optim": {"lr": 0.1}, "data": {"batch_size": 8}, "lr": 1e-3, "foo": 1}
    check_top_level_adds(OmegaConf.create(cfg), ["+foo=1"])  # (no setting of that name: a key of one's own)
    for reader in ({"hydra": {"run": {"dir": "runs/${lr}"}}}, {"data": {"batch_size": 8, "note": "${lr.x}"}},
                   {"optim": {"lr": "${..lr}"}}):  # (a relative interpolation, in a config file of one's own)
        check_top_level_adds(OmegaConf.create({**cfg, **reader}), ["+lr=1e-3"])  # (read through an interpolation)
    check_top_level_adds(OmegaConf.create(cfg), ["optim.lr=1e-3", "+data.x=1"])  # (not a top-level addition)
    with pytest.raises(ConfigError, match=r"\+\+lr=1e-3 .* is optim.lr. Set it there"):  # (Hydra's ++ adds too)
        check_top_level_adds(OmegaConf.create({**cfg, "data": {"note": "${optim.lr}"}}), ["++lr=1e-3"])
    # Hydra's records of the command line are no readers: a `${...}` given there read every +KEY.
    records = {"hydra": {"overrides": {"task": ["+lr=1e-3", "+foo=${now:%H}"]}, "job": {"override_dirname": "${x}"}}}
    with pytest.raises(ConfigError, match="is optim.lr. Set it there"):
        check_top_level_adds(OmegaConf.create({**cfg, **records}), ["+lr=1e-3", "+foo=${now:%H}"])


def test_early_stopping_and_a_best_checkpoint_without_a_val_split_are_refused(tmp_path):
    """A file too short to keep a val split trains on all of it: no eval ever ran, so early stopping and
    checkpoint.best_metric never acted, exit 0, no word."""
    (tmp_path / "notes.txt").write_text("x" * 400)
    r = run_here("debug=smoke", "data=text", f"data.path={tmp_path / 'notes.txt'}", "data.seq_len=256",
                 "data.batch_size=1", "callbacks=early_stopping", "checkpoint.best_metric=val/loss", "hydra.run.dir=run", cwd=tmp_path)
    assert_clean_error(r, "checkpoint.best_metric and callbacks=early_stopping act on the evals' metrics",
                       "built no val split", "data=text keeps the end of its text as val")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    r = run_here("debug=smoke", "data._target_=unsupported_data.no_val", "checkpoint.best_metric=val/loss",
                 "hydra.run.dir=run", cwd=tmp_path)  # (one of them, and data of one's own: no word of data=text's)
    assert_clean_error(r, "checkpoint.best_metric acts on the evals' metrics", "Have it return a val dataset")
    assert "data=text" not in r.stderr


def test_fp16_on_a_device_that_cannot_run_it():
    from trainer.errors import ConfigError
    from trainer.parallel.precision import FP16

    with pytest.raises(ConfigError, match="precision=fp16 is not supported on device type 'mps'"):
        FP16("mps")


def _data_case(tmp_path: Path, case: str) -> Path:
    p = tmp_path / "data.txt"
    if case == "missing":
        return tmp_path / "nope.txt"
    if case == "directory":
        (tmp_path / "empty_dir").mkdir()
        return tmp_path / "empty_dir"
    if case == "fifo":
        os.mkfifo(p)  # reading it would block forever
        return p
    if case == "glob":
        return tmp_path / "*.nothing"
    p.write_bytes(b"" if case == "empty" else b"x" * 20 if case == "short" else b"hello world\n" * 100)
    if case == "unreadable":
        p.chmod(0)
    return p


@pytest.mark.parametrize("override", ["data=text data.path=''", "data=text_stream data.path=''",
                                      "data=hf_text data.path=''", "hydra.run.dir=''"])
def test_an_empty_path_is_refused_not_read_as_the_current_directory(tmp_path, override):
    """`data.path=''` trained on every file under the current directory (Path("") is "."), and `hydra.run.dir=''`
    wrote the run among the user's files there, setting their own config.yaml aside as config.prev.yaml."""
    (tmp_path / "config.yaml").write_text("mine")
    args = ["debug=smoke", *override.split()]
    if "hydra.run.dir" not in override:
        args.append(f"hydra.run.dir={tmp_path / 'run'}")
    r = run_here(*args, cwd=tmp_path, env={"TRAINER_CACHE_DIR": str(tmp_path / "cache")})
    key = override.split()[-1].split("=")[0]
    assert_clean_error(r, f"{key}='' is empty")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"] and (tmp_path / "config.yaml").read_text() == "mine"


def test_a_data_path_set_to_null_is_said_to_be_unset(tmp_path):
    r = run_here("debug=smoke", "data=text", "data.path=null", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert_clean_error(r, "data.path is not set (null)")  # (it looked for a file named 'None')


@pytest.mark.parametrize("tracker", ["tensorboard", "wandb"])
def test_a_tracker_dir_that_is_a_file_is_refused_before_a_finished_run_is_touched(tmp_path, tracker):
    """A rerun in a finished run's dir with logger.X.dir naming a file moved its checkpoints and export to .prev,
    overwrote config.yaml, then crashed with a FileExistsError traceback: eval, sample and trainer.load of the dir
    then found nothing."""
    run = tmp_path / "run"
    assert run_here("debug=smoke", f"hydra.run.dir={run}", cwd=tmp_path).returncode == 0
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    (tmp_path / "notes.txt").write_text("mine")
    r = run_here("debug=smoke", f"hydra.run.dir={run}", f"logger={tracker}",
                 f"logger.{tracker}.dir={tmp_path / 'notes.txt'}", cwd=tmp_path, env={"WANDB_MODE": "offline"})
    assert_clean_error(r, f"logger.{tracker}.dir={tmp_path / 'notes.txt'} cannot be used", "is not a directory")
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_a_yaml_mistake_in_a_config_of_ones_own_names_its_file_line_and_column(tmp_path):
    """It was "error: while parsing a flow mapping", naming neither the file nor the line."""
    (tmp_path / "conf" / "recipe").mkdir(parents=True)
    bad = tmp_path / "conf" / "recipe" / "mine.yaml"
    bad.write_text("# @package _global_\ntrainer: {max_steps: ${oc.env:STEPS,3}}\n")
    r = run_main("--config-dir", str(tmp_path / "conf"), "recipe=mine", "debug=smoke", cwd=tmp_path)
    assert_clean_error(r, f"{bad}, line 2, column 23: not valid YAML (while parsing a flow mapping",
                       "(a `${...}` inside a `{...}` or `[...]` needs quotes")
    # A recipe choosing other groups' options without its `# @package _global_` line: Hydra's "Could not override
    # 'precision@recipe.precision'" did not say which line was missing.
    bad.write_text("defaults:\n  - override /precision: fp32\ntrainer:\n  max_steps: 3\n")
    r = run_main("--config-dir", str(tmp_path / "conf"), "recipe=mine", "debug=smoke", cwd=tmp_path)
    assert_clean_error(r, "recipe/mine.yaml chooses other configs' options", "needs `# @package _global_` as the "
                                                                             "file's first line")
    assert_clean_error(run_main("--config-dir", str(bad), "debug=smoke", cwd=tmp_path),
                       f"--config-dir {bad}: a file, not a directory")


def _without_root_file_access() -> None:
    """Root reads any file (CAP_DAC_OVERRIDE), so drop those capabilities: permissions then apply as
    they do for every other user."""
    if os.geteuid() == 0:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
            if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP: gone from the exec'd process
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


@pytest.mark.parametrize(("case", "needle"), [
    ("missing", "does not exist"), ("directory", "is a directory with no files"), ("empty", "is empty"),
    ("short", "has 20 bytes, fewer than data.seq_len + 1 = 33"), ("unreadable", "cannot be read"),
    ("fifo", "is not a regular file"), ("glob", "matches no file"),
])
def test_data_mistakes(tmp_path, case, needle):
    tmp_path.chmod(0o777)
    path = _data_case(tmp_path, case)
    run_dir = tmp_path / "run"
    args = (*tiny_overrides(path), f"hydra.run.dir={run_dir}")
    if case in ("unreadable", "fifo"):  # a process of its own: without root's file access (dropped for the
        # interpreter it starts: fresh); a FIFO opened by mistake would block its reader (the timeout fails the
        # test instead of hanging the suite)
        r = run_cli(*args, cwd=tmp_path, env={"TRAINER_CACHE_DIR": str(tmp_path / "cache")}, timeout=120,
                    fresh=case == "unreadable", preexec=_without_root_file_access if case == "unreadable" else None)
    else:
        r = run_here(*args, cwd=tmp_path, env={"TRAINER_CACHE_DIR": str(tmp_path / "cache")})
    assert_clean_error(r, f"data.path='{path}'", needle)
    assert not run_dir.exists() and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("case", ["missing", "directory"])
def test_a_val_path_mistake_names_data_val_path(corpus, tmp_path, case):
    """data.val_path is read like data.path; its mistakes name it (they named data.path, which was fine)."""
    path = _data_case(tmp_path, case)
    run_dir = tmp_path / "run"
    r = run_here(*tiny_overrides(corpus, "data=text_stream", f"data.val_path={path}"), f"hydra.run.dir={run_dir}",
                 cwd=tmp_path, env={"TRAINER_CACHE_DIR": str(tmp_path / "cache")})
    assert_clean_error(r, f"data.val_path='{path}'", "Point data.val_path at")
    assert "data.path=" not in r.stderr
    assert not run_dir.exists()


def test_a_directory_where_the_runs_metrics_file_belongs_is_one_paragraph(corpus, tmp_path):
    """metrics.jsonl/ (a directory) in the run dir was an IsADirectoryError traceback before the first step."""
    run_dir = tmp_path / "run"
    (run_dir / "metrics.jsonl").mkdir(parents=True)
    r = run_here(*tiny_overrides(corpus), f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert_clean_error(r, f"could not open {run_dir / 'metrics.jsonl'} to append the run's metrics", code=74)
    assert (run_dir / "metrics.jsonl").is_dir()
    # A file where the eval images go: the first eval's image stopped the run after its steps ("free disk space").
    (run_dir / "metrics.jsonl").rmdir()
    (run_dir / "samples").write_text("mine")
    r = run_here(*tiny_overrides(corpus), f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert_clean_error(r, f"{run_dir / 'samples'} is a file where the run's eval images go", "nothing was trained")
    assert (run_dir / "samples").read_text() == "mine" and not (run_dir / "metrics.jsonl").exists()  # (nothing written)


def test_resume_from_a_path_that_does_not_exist(corpus, tmp_path):
    r = run_here(*tiny_overrides(corpus), f"hydra.run.dir={tmp_path / 'run'}", f"resume={tmp_path / 'nope'}")
    assert_clean_error(r, str(tmp_path / "nope"), "does not exist")
    # A step written without its 8 digits names the checkpoint it meant; another step, those that are there.
    checkpoints = tmp_path / "checkpoints"
    for name in ("step_00000005", "step_00000010"):
        (checkpoints / name).mkdir(parents=True)
    r = run_main("debug=smoke", f"resume={checkpoints / 'step_10'}", cwd=tmp_path)
    assert_clean_error(r, f"The checkpoint of step 10 is {checkpoints / 'step_00000010'}.")
    r = run_main("debug=smoke", f"resume={checkpoints / 'step_15'}", cwd=tmp_path)
    assert_clean_error(r, f"{checkpoints} holds step_00000005, step_00000010.")


def test_checkpoint_from_a_newer_format(corpus, tmp_path, reference):
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference / "checkpoints" / "step_00000008", ckpt)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    (ckpt / "manifest.json").write_text(json.dumps({**manifest, "format": 99}))
    r = run_here(*tiny_overrides(corpus), f"hydra.run.dir={tmp_path / 'run'}", f"resume={ckpt}")
    assert_clean_error(r, "format version 99", "Upgrade")


def test_nonfinite_stop_keeps_the_last_checkpoint(corpus, tmp_path):
    r = run_here(*tiny_overrides(corpus, *SHARED, "task._target_=faulty.Faulty"), "+task.action=nan_once",
                "+task.at_call=6", "+task.rank=0", f"hydra.run.dir={tmp_path}", env=FAULTY_ENV)
    assert_clean_error(r, "non-finite loss (nan)", "at step 6 on rank 0", "trainer.nonfinite=skip", code=3)
    ckpts = sorted((tmp_path / "checkpoints").glob("step_*"))
    assert [p.name for p in ckpts] == ["step_00000004"]
    verify(ckpts[0])
    assert series(read_metrics(tmp_path), "train/loss")[-1] == pytest.approx(series(read_metrics(tmp_path), "train/loss")[-1])
    assert [e["step"] for e in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]


def test_nonfinite_skip_counts_and_gives_up_after_n_in_a_row(corpus, tmp_path):
    events = train_in_process(corpus, tmp_path / "once", "trainer.nonfinite=skip", "task._target_=faulty.Faulty",
                              "+task.action=nan_once", "+task.at_call=6", "+task.rank=0")
    assert series(events, "train/skipped_steps")[-1] == 1 and len(series(events, "train/loss")) == 20
    r = run_here(*tiny_overrides(corpus, "trainer.nonfinite=skip", "trainer.max_nonfinite_skips=3",
                                "task._target_=faulty.Faulty"),
                "+task.action=nan_always", "+task.at_call=6", "+task.rank=0", f"hydra.run.dir={tmp_path / 'many'}",
                env=FAULTY_ENV)
    assert_clean_error(r, "3 consecutive non-finite steps up to step 8", "raise trainer.max_nonfinite_skips", code=3)
    assert "set trainer.nonfinite=skip" not in r.stderr  # (it is set: the advice was to do what was done)


def test_secrets_never_reach_the_run_dir(corpus, tmp_path):
    env_secret, cli_secret = f"envsecret-{uuid.uuid4().hex}", f"clisecret-{uuid.uuid4().hex}"
    r = run_here(*tiny_overrides(corpus, "trainer.max_steps=4", "checkpoint.every_n_steps=2"),
                f"+hydra.job.env_set.WANDB_API_KEY={cli_secret}", f"hydra.run.dir={tmp_path}",
                env={"WANDB_API_KEY": env_secret, "HF_TOKEN": env_secret})
    assert r.returncode == 0, r.stderr
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) > 8
    for p in files:
        data = p.read_bytes()
        assert env_secret.encode() not in data and cli_secret.encode() not in data, p
    assert env_secret not in r.stdout + r.stderr and cli_secret not in r.stdout + r.stderr


def _limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (450_000, 450_000))  # the model (395 kB) fits, the optimizer state (540 kB) does not
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing


def test_a_checkpoint_that_does_not_fit_keeps_the_previous_one(corpus, tmp_path):
    args = [*tiny_overrides(corpus, *SHARED), f"hydra.run.dir={tmp_path}"]
    train_in_process(corpus, tmp_path, *SHARED, "trainer.max_steps=8")
    r = run_cli(*args, "resume=auto", timeout=120, preexec=_limit_file_size)
    # A full disk is not a usage error: its own exit code (74, EX_IOERR), so a scheduler can tell it from a typo.
    assert_clean_error(r, "could not write checkpoint", "step_00000008 is intact", "resume=auto", code=74)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000004", "step_00000008"]  # no temp dir
    verify(tmp_path / "checkpoints" / "step_00000008")


@pytest.mark.slow
def _as_a_background_job() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # what a non-interactive shell does to a job it starts with &


@pytest.mark.parametrize("background", [False, True])
def test_ctrl_c_stops_every_worker_promptly(corpus, tmp_path, background):
    """SIGINT to the launcher (Ctrl-C, kill -INT) stops every worker with KeyboardInterrupt, well before the
    agent's SIGKILL 30 s later (the timeout): also for a launcher started with SIGINT ignored, as a background
    job, whose workers used to inherit that."""
    key, value = "TRAINER_TEST_MARKER", uuid.uuid4().hex
    r = run_cli(*tiny_overrides(corpus, *DDP2, "task._target_=faulty.Faulty", "trainer.max_steps=1000"),
                "+task.action=sigint_parent", "+task.at_call=5", "+task.rank=0", f"hydra.run.dir={tmp_path}",
                env={**FAULTY_ENV, key: value}, timeout=25, preexec=_as_a_background_job if background else None)
    assert r.returncode == 130 and "interrupted" in r.stderr
    assert "Traceback" not in r.stderr and "death signal" not in r.stderr  # (torch's agent said so first)
    from test_distributed import _processes_with_marker

    assert _processes_with_marker(f"{key}={value}") == []


def test_a_run_dir_that_cannot_be_made_is_one_paragraph_before_hydra_makes_it(tmp_path):
    """A file where the run dir's parent should be (or a read-only place) was a traceback from Hydra's mkdir."""
    (tmp_path / "afile").write_text("x")
    r = run_main("debug=smoke", f"hydra.run.dir={tmp_path / 'afile' / 'run'}", cwd=tmp_path)
    assert_clean_error(r, f"hydra.run.dir={tmp_path / 'afile' / 'run'} cannot be made", "is not a directory")
    r = run_main("-m", "debug=smoke", f"hydra.sweep.dir={tmp_path / 'afile' / 'sw'}", "optim.lr=1e-3,1e-4", cwd=tmp_path)
    assert_clean_error(r, "hydra.sweep.dir=", "is not a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
    # Where the permission bits allow it but the place does not (/proc takes no new directory, even from root).
    r = run_main("debug=smoke", "hydra.run.dir=/proc/trainer-test/run", cwd=tmp_path)
    assert_clean_error(r, "hydra.run.dir=/proc/trainer-test/run cannot be made: no directory can be made in /proc")


def test_a_run_dir_given_to_a_sweep_is_refused_naming_the_sweep_dir(tmp_path):
    """Hydra passes hydra.run.dir over in silence under -m, and the sweep went to multirun/DATE/TIME."""
    r = run_main("-m", "debug=smoke", f"hydra.run.dir={tmp_path / 'runs'}", "optim.lr=1e-3,1e-4", cwd=tmp_path)
    assert_clean_error(r, f"hydra.run.dir={tmp_path / 'runs'} is not used by a sweep (-m)", "hydra.sweep.dir=DIR")
    assert list(tmp_path.iterdir()) == []


def test_a_comma_without_m_names_the_three_ways_out(tmp_path):
    """`optim.lr=1e-3,3e-4` without -m kept only Hydra's first line, "Ambiguous value for argument ...", and dropped
    the lines after it that say what to do."""
    r = run_main("debug=smoke", "optim.lr=1e-3,3e-4", cwd=tmp_path)
    assert_clean_error(r, "optim.lr=1e-3,3e-4: a comma makes several values", "add -m", "optim.lr=[1e-3,3e-4]",
                       "\"optim.lr='1e-3,3e-4'\"")
    assert list(tmp_path.iterdir()) == []


def test_a_logger_set_to_null_is_dropped_not_refused():
    """logger.tensorboard=null drops one logger of a list (a machine's logger=[wandb,tensorboard]), as before the
    check that a logger's settings come with its choice."""
    from trainer.config.compose import load

    cfg = load(["debug=smoke", "logger=[wandb,tensorboard]", "logger.tensorboard=null"], targets=False)
    assert cfg.logger.tensorboard is None and cfg.logger.wandb.project == "trainer"


def test_an_ema_setting_with_the_ema_off_is_a_note_in_a_sweep_comparing_both(tmp_path):
    """`-m ema.enabled=true,false ema.decay=0.9` compares a run with and without an EMA: one note for the points
    without one, not a refusal. A sweep none of whose points has an EMA is refused, as a single run is
    (test_config_mistakes)."""
    r = run_here("-m", "debug=smoke", "trainer.max_steps=1", "ema.enabled=true,false", "ema.decay=0.9",
                 f"hydra.sweep.dir={tmp_path / 'both'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("note: ema.decay does nothing in 1 of the sweep's 2 points, those with the EMA off") == 1
    r = run_main("-m", "debug=smoke", "optim.lr=1e-3,3e-4", "ema.decay=0.9", f"hydra.sweep.dir={tmp_path / 'none'}",
                 cwd=tmp_path)
    assert_clean_error(r, "ema.decay: the EMA is off (ema.enabled=false) in every point of the sweep")
    assert not (tmp_path / "none").exists()


def test_a_sweep_with_cfg_is_one_paragraph_naming_the_command_for_one_point(tmp_path):
    """`-m ... --cfg hydra` (checking a SLURM sweep's launcher without SLURM) was Hydra's ValueError traceback."""
    r = run_main("-m", "--cfg", "job", "debug=smoke", "optim.lr=1e-3,1e-4", "trainer.seed=range(1,3)", cwd=tmp_path)
    assert_clean_error(r, "--cfg job shows one job's config, so it does not go with -m",
                       "python -m trainer --cfg job debug=smoke optim.lr=0.001 trainer.seed=1)")
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_while_the_run_dir_is_set_up_is_one_paragraph(tmp_path, monkeypatch):
    """A failed write of config.yaml or Hydra's records (ENOSPC, a read-only place) before training was a
    traceback."""
    import errno

    import trainer.entry.run

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / "config.yaml"))

    monkeypatch.setattr(trainer.entry.run, "save_config", full)
    r = run_here("debug=smoke", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert_clean_error(r, f"setting the run dir {tmp_path / 'run'} up failed (No space left on device",
                       "nothing was trained", "Free disk space", code=74)


def test_a_full_disk_while_a_resume_rewinds_the_metrics_is_one_paragraph(tmp_path, monkeypatch):
    """Once the workers run, the start's own writes (metrics.jsonl rewound to the checkpoint, config.yaml, the run's
    records) failing on a full disk were a traceback with exit 1; the checkpoints and metrics stay as they were."""
    import errno

    from trainer.tracking.loggers import JsonlLogger

    run = tmp_path / "run"
    args = ("debug=smoke", "checkpoint.every_n_steps=2", f"hydra.run.dir={run}")
    assert run_here(*args, "trainer.max_steps=4", cwd=tmp_path).returncode == 0
    kept = (run / "metrics.jsonl").read_bytes()

    def full(self, step):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path))

    monkeypatch.setattr(JsonlLogger, "rewind", full)
    r = run_here(*args, "trainer.max_steps=6", "resume=auto", cwd=tmp_path)
    assert_clean_error(r, f"setting the run dir {run} up failed (No space left on device: "
                          f"{run / 'metrics.jsonl'}); nothing was trained", "Free disk space", code=74)
    assert (run / "metrics.jsonl").read_bytes() == kept
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]


def test_a_target_key_is_not_offered_a_near_spelling_of_another_key():
    """`optim.discriminator._target_` was asked "Did you mean finetune.lora.targets=...?"."""
    from trainer import compose
    from trainer.config.compose import did_you_mean

    cfg = compose(["recipe=gan"])
    assert did_you_mean("optim.discriminator._target_", "torch.optim.SGD", cfg) == ""
    assert "optim.lr" in did_you_mean("optim.lrr", "1e-3", cfg)


def test_compose_and_train_from_python_name_what_they_take(tmp_path):
    """trainer.compose("debug=smoke") read the string letter by letter ("'d' is not an override"), and
    trainer.train({...}) failed inside the launcher with an AttributeError."""
    import trainer
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError, match=r"takes a list of KEY=VALUE strings.*compose\(\['debug=smoke'\]\)"):
        trainer.compose("debug=smoke")
    with pytest.raises(ConfigError, match=r"trainer.train takes the config trainer.compose returns .* not a dict"):
        trainer.train({"trainer": {"max_steps": 1}}, tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("given", "says"), [
    (["precision=bf16", "precision.init_scale=1024"], "precision.init_scale is a setting of precision=fp16, which this "
                                                      "run does not choose: add precision=fp16"),
    (["optim.momentum=0.9"], "optim.momentum is a setting of optim=muon and optim=sgd")])
def test_a_key_of_a_group_option_not_chosen_names_the_option(given, says):
    """It said "To add a new key on purpose, write +precision.init_scale=VALUE", which bf16 then refused, offering
    its internal keys."""
    from conftest import run_here

    assert_clean_error(run_here("debug=smoke", *given, "--cfg", "job"), says)


def test_periodic_evals_without_a_val_split_are_said_once(tmp_path):
    """trainer.eval_every=N where the data built no val split: the run had no evals, without a word."""
    (tmp_path / "notes.txt").write_text("x" * 400)  # (too short to keep a val window of 257 bytes)
    r = run_here("debug=smoke", "data=text", f"data.path={tmp_path / 'notes.txt'}", "data.seq_len=256",
                 "data.batch_size=1", "trainer.max_steps=2", "trainer.eval_every=1", "hydra.run.dir=run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (r.stdout + r.stderr).count("built no val split, so this run has no evals") == 1
