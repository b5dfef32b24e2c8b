"""What a user coming from Accelerate still trips on in the second week (issue 32): an inline config node that
hides a group option, Accelerate's and torchrun's flags, epochs and schedules, figures that cannot be, and
datasets the framework does not take yet."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import ROOT, run_main

CONF = str(ROOT / "tests" / "conf")


# -- 32.2: a group option on the command line that an inline node would hide ------------------------------
def test_the_readme_recipe_leaves_precision_to_the_command_line(tmp_path):
    from test_readme import blocks

    from trainer.config.compose import load

    (_, recipe), = blocks("yaml")
    where = tmp_path / re.search(r"^# (conf/\S+\.yaml)", recipe, re.M).group(1)
    where.parent.mkdir(parents=True)
    where.write_text(recipe)
    name = where.stem
    targets = {}
    for choice in ("fp32", "bf16", "fp16"):
        cfg = load([f"recipe={name}", f"precision={choice}"], config_dir=str(tmp_path / "conf"), targets=False)
        targets[choice] = cfg.precision._target_
    assert targets == {"fp32": "trainer.parallel.precision.FP32", "bf16": "trainer.parallel.precision.BF16",
                       "fp16": "trainer.parallel.precision.FP16"}
    assert load([f"recipe={name}"], config_dir=str(tmp_path / "conf"), targets=False).precision._target_ == \
        "trainer.parallel.precision.FP32"  # the recipe's own choice


def test_a_group_option_an_inline_node_hides_is_one_paragraph(tmp_path):
    from trainer.config.compose import load
    from trainer.errors import ConfigError

    # tests/conf/recipe/classify.yaml sets `precision: {_target_: trainer.parallel.precision.FP32}` inline.
    with pytest.raises(ConfigError, match=r"precision=bf16 .*override /precision"):
        load(["recipe=classify", "precision=bf16"], config_dir=CONF)
    r = run_main("--config-dir", CONF, "recipe=classify", "precision=fp16", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: precision=fp16"), r.stderr
    assert "init_scale" not in r.stderr and "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1
    assert not (tmp_path / "outputs").exists()
    # What the inline node says itself, and an option equal to it, are no conflict.
    assert load(["recipe=classify", "precision=fp32"], config_dir=CONF).precision._target_ == "trainer.parallel.precision.FP32"
    assert load(["debug=smoke", "precision=bf16"]).precision._target_ == "trainer.parallel.precision.BF16"
    assert load(["precision=fp16", "debug=smoke", "precision=bf16"]).precision._target_ == "trainer.parallel.precision.BF16"
    assert load(["precision=bf16", "precision._target_=trainer.parallel.precision.FP32"]).precision._target_ == \
        "trainer.parallel.precision.FP32"  # a _target_ set on purpose after the option


def test_a_model_or_data_option_an_inline_node_hides_is_refused_too(tmp_path):
    """model= and data= options interpolate keys outside themselves (`${data.seq_len}`): read unresolved, the
    check sees their `_target_` (it used to give up on them, and the inline node won without a word)."""
    from trainer.config.compose import load
    from trainer.errors import ConfigError

    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "inline_model.yaml").write_text(
        "# @package _global_\nmodel:\n  _target_: torch.nn.Linear\n  in_features: 2\n  out_features: 2\n")
    with pytest.raises(ConfigError, match=r"^model=gpt_tiny would be ignored: .* model\._target_ stays 'torch\.nn\.Linear'"):
        load(["recipe=inline_model", "model=gpt_tiny"], config_dir=str(tmp_path), targets=False)
    assert load(["debug=smoke", "model=gpt_small", "data=stdlib"]).model._target_ == "trainer.recipes.lm.model.GPT"


def test_each_option_checked_alone_is_what_hydra_composes_for_it_alone():
    """check_choices composes each chosen option alone without Hydra's own `hydra` node (a seventh of the time):
    for every option of every group, shipped and the tests' (--config-dir), the group's node is what
    `hydra.compose("GROUP/OPTION")` gives, or both fail alike."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from trainer.config.compose import CONFIG_MODULE, option_alone, search_path

    def node(compose, *args, group):
        try:
            return OmegaConf.to_container(OmegaConf.select(compose(*args), group, default=None) or {}, resolve=False)
        except Exception as exc:  # noqa: BLE001 - an option that cannot stand alone: the same failure
            return type(exc).__name__

    checked = 0
    search = search_path(CONF)  # (the shipped options and the tests' recipe/classify)
    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        for group in sorted(p.name for p in (ROOT / "conf").iterdir() if p.is_dir() and p.name != "__pycache__"):
            for option in [*loader.get_group_options(group), *(["classify"] if group == "recipe" else [])]:
                ours = node(option_alone, group, option, search, group=group)
                hydras = node(hydra_compose, f"{group}/{option}", search, group=group)
                assert ours == hydras, (group, option)
                checked += 1
    assert checked > 35


# -- 32.3: the habits people bring ---------------------------------------------------------------------------
def _suggested_command(stderr: str) -> list[str]:
    """The overrides of the `python -m trainer ...` command an error message proposes."""
    found = re.search(r"python -m trainer ((?:\S+ ?)+?)(?:\.?$|\. )", stderr.strip())
    assert found, stderr
    return found.group(1).rstrip(".").split()


@pytest.mark.parametrize("flags, says", [
    (["--num_processes", "2"], "world=ddp world.nproc_per_node=2"),
    (["--num-processes=2"], "world=ddp world.nproc_per_node=2"),
    (["--nproc_per_node=2"], "world=ddp world.nproc_per_node=2"),   # torchrun's spelling after -m trainer
    (["--multi_gpu"], "world=ddp world.nproc_per_node=auto"),
    (["--mixed_precision", "bf16"], "precision=bf16"),
    (["--mixed_precision=no"], "precision=fp32"),
    (["--use_fsdp", "--num_processes", "2"], "world=fsdp world.nproc_per_node=2"),
    # (one value a setting: the same run named world.nproc_per_node twice, auto then 2)
    (["--multi_gpu", "--num_processes", "2"], "world=ddp world.nproc_per_node=2 debug=smoke"),
    (["--gradient_accumulation_steps", "4"], "trainer.grad_accum_steps=4"),
    (["--dynamo_backend", "inductor", "--dynamo_mode", "Max-Autotune"],
     "trainer.compile=true trainer.compile_backend=inductor trainer.compile_mode=max-autotune"),
    (["--dynamo_backend", "no", "--dynamo_mode", "max-autotune"], "trainer.compile=false"),
])
def test_accelerate_and_torchrun_flags_name_the_override(tmp_path, flags, says):
    from trainer.entry.cli import precheck

    r = run_main(*flags, "debug=smoke", cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and r.stderr.startswith("error: "), r.stderr
    assert says in r.stderr and "usage:" not in r.stderr
    assert not (tmp_path / "outputs").exists()
    proposed = _suggested_command(r.stderr)
    assert "debug=smoke" in proposed and says in " ".join(proposed)
    precheck(proposed)  # the command it proposes is one the CLI takes


def test_a_dynamo_mode_without_inductor_is_said_to_do_nothing_and_left_out(tmp_path):
    r = run_main("--dynamo_backend", "no", "--dynamo_mode", "max-autotune", "debug=smoke", cwd=tmp_path)
    assert r.returncode == 2 and "--dynamo_mode max-autotune does nothing with --dynamo_backend no" in r.stderr
    proposed = _suggested_command(r.stderr)
    assert "trainer.compile=false" in proposed and not any(o.startswith("trainer.compile_mode") for o in proposed)
    assert "trainer.compile=true" not in proposed


def test_a_flag_no_launcher_has_is_answered_with_the_nested_key(tmp_path):
    r = run_main("--max_steps", "5", "debug=smoke", cwd=tmp_path)
    assert r.returncode == 2 and "trainer.max_steps=5" in r.stderr and "usage:" not in r.stderr, r.stderr


@pytest.mark.parametrize("override, says", [
    ("world.nproc-per-node=2", "world.nproc_per_node=2"),    # Accelerate treats - and _ alike
    ("lr=1e-3", "optim.lr=1e-3"),                            # a top-level key that is a nested key's last part
    ("trainer.lr=1e-3", "optim.lr=1e-3"),
    ("batch_size=4", "data.batch_size=4"),
])
def test_an_unknown_key_suggests_the_key_it_means(tmp_path, override, says):
    r = run_main("debug=smoke", override, cwd=tmp_path)
    assert r.returncode == 2 and says in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr


def test_world_wrap_advice_names_the_models_own_blocks():
    import torch.nn as nn

    from trainer.errors import ConfigError
    from trainer.parallel import FSDP

    class LlamaDecoderLayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = nn.Linear(4, 4)

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(LlamaDecoderLayer() for _ in range(2))

    with pytest.raises(ConfigError, match=r"world\.wrap=\[LlamaDecoderLayer\]") as e:
        FSDP(wrap=["Block"]).units(Llama())
    assert "[Block]" not in str(e.value)
    with pytest.raises(ConfigError, match=r"world\.wrap=\[LlamaDecoderLayer\]"):
        FSDP(wrap="LlamaDecoderLayer")  # a string where a list is wanted: the list of that string


def test_an_eval_override_mistake_names_the_override(tmp_path):
    from trainer.config.compose import load
    from trainer.entry.run import save_config

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    save_config(load(["debug=smoke"], targets=False), run_dir)
    for override, says in (("trainer.eval_samplez=5", "trainer.eval_samples=5"), ("lr=1e-3", "optim.lr=1e-3"),
                           ("world=dpp", "Did you mean ddp?")):
        r = run_main("eval", str(run_dir), override, cwd=tmp_path)
        assert r.returncode == 2 and r.stderr.startswith(f"error: the override {override}"), r.stderr
        assert says in r.stderr


def test_an_equals_sign_in_a_value_names_the_key_and_the_quoting(tmp_path):
    from trainer.entry.cli import precheck

    r = run_main("debug=smoke", "hydra.run.dir=runs/lr=1e-3", cwd=tmp_path)
    assert r.returncode == 2 and "hydra.run.dir" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    quoted = re.search(r"'(hydra\.run\.dir=[^']+)'", r.stderr).group(1)
    assert quoted == 'hydra.run.dir="runs/lr=1e-3"'
    precheck(["debug=smoke", quoted])  # the spelling it proposes parses
    r = run_main("-m", "debug=smoke", "optim.lr=1e-3,3e-3", "hydra.sweep.dir=sweeps/a=b", cwd=tmp_path)
    assert r.returncode == 2 and "hydra.sweep.dir" in r.stderr and "Traceback" not in r.stderr, r.stderr


# -- 32.5: epochs and schedules -------------------------------------------------------------------------------
def test_max_epochs_with_max_steps_null_is_max_epochs(small_corpus, tmp_path, capsys):
    from conftest import series, train_in_process

    epochs = ("trainer.max_epochs=1", "trainer.log_every=5", "data.batch_size=16")
    with_null = train_in_process(small_corpus, tmp_path / "null", *epochs, "trainer.max_steps=null")
    said = capsys.readouterr().out
    with_steps = train_in_process(small_corpus, tmp_path / "set", *epochs)  # max_epochs decides either way
    assert [e["step"] for e in with_null] == [e["step"] for e in with_steps]
    assert series(with_null, "train/loss") == series(with_steps, "train/loss")
    steps, batch, per_epoch, samples = map(int, re.search(
        r"trainer.max_epochs=1: (\d+) steps of (\d+) samples \((\d+) per epoch of (\d+)", said).groups())
    assert with_null[-1]["step"] == steps == per_epoch
    # How the last, partial global batch of an epoch is handled: completed from the next epoch's order.
    assert f"{steps * batch} samples" in said and "from the next epoch" in said, said
    from trainer.data.sampling import GlobalBatchSampler

    sampler = GlobalBatchSampler(samples, batch, seed=0)
    stream = sampler.indices(0, steps * batch)
    assert sorted(stream[:samples]) == list(range(samples))  # the epoch: every sample once, none dropped
    assert stream[samples:] == sampler._perm(1)[:steps * batch - samples].tolist()  # the rest: the next epoch's start


def test_max_steps_null_needs_max_epochs():
    from trainer.config.compose import load
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError, match=r"trainer.max_steps=None .*trainer.max_epochs"):
        load(["debug=smoke", "trainer.max_steps=null"], targets=False)


@pytest.mark.parametrize("length", [("trainer.max_steps=6",), ("trainer.max_epochs=1", "trainer.max_steps=null")])
def test_a_warmup_longer_than_the_run_is_a_one_line_warning(small_corpus, tmp_path, capsys, length):
    from conftest import train_in_process

    train_in_process(small_corpus, tmp_path, *length, "scheduler.warmup_steps=100000", "data.batch_size=16")
    warned = [line for line in capsys.readouterr().out.splitlines() if "scheduler.warmup_steps=100000" in line]
    assert len(warned) == 1 and warned[0].startswith("warning: "), warned
    train_in_process(small_corpus, tmp_path / "short", *length, "scheduler.warmup_steps=2", "data.batch_size=16")
    assert "warmup" not in capsys.readouterr().out


# -- 32.7: figures that cannot be ---------------------------------------------------------------------------
def _loaded_for_one_call(monkeypatch, slow_dtype):
    """cpu_matmul_tflops as on a machine where another process took the core during one probe call of
    `slow_dtype` (a 100x slower reading), and steady otherwise: fp32 1.0, other dtypes 2.0 TFLOP/s."""
    import torch

    import trainer.parallel.hardware

    calls = []

    def probe(dtype, size=512, seconds=0.05):
        calls.append(dtype)
        steady = 1.0 if dtype == torch.float32 else 2.0
        return steady / 100 if dtype == slow_dtype and calls.count(dtype) == 1 else steady

    monkeypatch.setattr(trainer.parallel.hardware, "cpu_matmul_tflops", probe)
    monkeypatch.setattr(trainer.parallel.hardware, "_ONE_THREAD", {})  # (what this process probed before)
    return calls


@pytest.mark.parametrize("slow", ["float32", "bfloat16"])
def test_the_precision_probe_repeats_and_keeps_its_best(monkeypatch, slow):
    import torch

    from trainer.parallel.precision import matmul_speedup

    calls = _loaded_for_one_call(monkeypatch, getattr(torch, slow))
    assert matmul_speedup(torch.bfloat16) == 2.0  # the steady ratio, whichever dtype's call was disturbed
    assert calls.count(torch.bfloat16) >= 3 and calls.count(torch.float32) >= 3


def test_the_cpu_peak_probe_repeats_and_keeps_its_best(monkeypatch):
    import torch

    from trainer.parallel.hardware import cpu_peak_tflops

    _loaded_for_one_call(monkeypatch, torch.float32)
    assert cpu_peak_tflops(torch.float32) == torch.get_num_threads() * 1.0


def test_mfu_never_exceeds_1_when_the_peak_was_measured_low(monkeypatch, capsys):
    import torch

    import trainer.loop.metrics
    from trainer.loop.metrics import Cost

    # A probe that ran while the machine was busy: a peak far below what the run then achieves.
    monkeypatch.setattr(trainer.loop.metrics, "cpu_peak_tflops", lambda dtype: 1e-6)
    cost = Cost(torch.nn.Linear(100, 100), torch.device("cpu"), torch.float32, None)
    fast = 10e12 / cost.flops_per_target  # 10 TFLOP/s worth of targets per second
    assert cost.metrics(fast)["train/mfu"] == 1.0  # the run's own throughput is a peak it has reached
    assert cost.metrics(fast / 2)["train/mfu"] == pytest.approx(0.5)
    assert cost.peak_tflops == pytest.approx(10.0)
    out = capsys.readouterr().out
    assert out.count("train/mfu") == 1, out  # said once


def test_mfu_stays_at_most_1_in_a_run_with_a_peak_set_too_low(corpus, tmp_path, capsys):
    from conftest import series, train_in_process

    events = train_in_process(corpus, tmp_path, "trainer.peak_tflops=1e-9", "trainer.log_every=2")
    mfu = series(events, "train/mfu")
    assert mfu and max(mfu) <= 1.0, mfu
    assert "trainer.peak_tflops=1e-09 is below" in capsys.readouterr().out


# -- 32.8: what the framework does not take (an IterableDataset is a stream now: tests/test_streaming.py) ------
@pytest.mark.parametrize("target, says", [
    ("loader", "training split .* is a DataLoader"),
    ("unindexable", "training split .* has no __getitem__"),
])
def test_an_unsupported_dataset_is_one_paragraph_and_leaves_no_run_dir(tmp_path, target, says):
    from conftest import run_here

    run_dir = tmp_path / "run"
    r = run_here("debug=smoke", f"data._target_=unsupported_data.{target}", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    error = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and re.search(says, error[0]) and "map-style" in error[0], r.stderr
    assert not run_dir.exists()  # no config.yaml, no .lock left behind


@pytest.mark.parametrize("mistake, says", [
    (["model._target_=own_mistakes.NoParams", "~model.out"], "has no parameters: the optimizer would have nothing"),
    (["model._target_=own_mistakes.Frozen", "~model.out"], "has 2 parameters, every one frozen"),
    (["model._target_=own_mistakes.TupleOut"], "returned a tuple where trainer.task.SupervisedTask takes its prediction"),
    (["model.out=3"], r"prediction has shape \[16, 3\] and its target \[16, 1\]: MSELoss would broadcast"),
    (["+data.flat=true"], r"prediction has shape \[16, 1\] and its target \[16\]: .* y.unsqueeze\(-1\)"),
    (["task._target_=own_mistakes.ZeroTargets", "~task.loss"], "counted 0 targets in step 1's whole batch"),
    (["task._target_=own_mistakes.PerSample", "~task.loss"], r"must be the SUM .* \[16, 1\]\. Sum it \(`.sum\(\)`, not"),
    (["task._target_=own_mistakes.Detached", "~task.loss"], r"got a tensor without a graph .*\. Compute it from the model"),
    # (a TypeError traceback; torch's `new(): invalid data type 'str'`; a stack error at the first log; and train/
    # grad_norm logged as the Trainer's, the task's dropped without a word)
    (["task._target_=own_mistakes.Summing", "~task.loss", "+task.extra=no_loss"], r"returned a dict without 'loss' \(keys"),
    (["task._target_=own_mistakes.Summing", "~task.loss", "+task.extra=string"], r"returned 'acc': a str\. Beside 'loss'"),
    (["task._target_=own_mistakes.Summing", "~task.loss", "+task.extra=per_sample"],
     r"returned 'err': a tensor of shape \[16, 1\]\. Beside 'loss', each entry is one number"),
    (["task._target_=own_mistakes.Summing", "~task.loss", "+task.extra=reserved"],
     r"a sum named 'grad_norm', which the Trainer logs itself as train/grad_norm"),
    # (CrossEntropyLoss's own tracebacks: "0D or 1D target tensor expected", "expected target dtype to be Long")
    (["model._target_=classify.MLP", "~model.out", "data._target_=own_mistakes.labels", "+data.kind=column",
      "task.loss=torch.nn.CrossEntropyLoss"], r"its target \[16, 1\] \(int64\): CrossEntropyLoss takes class indices, "
                                             r"integers of shape \[16\] \(a target of \[B, 1\] is y.squeeze\(-1\)\)"),
    (["model._target_=classify.MLP", "~model.out", "data._target_=own_mistakes.labels", "+data.kind=float",
      "task.loss=torch.nn.CrossEntropyLoss"], r"its target \[16\] \(float32\): .*\(float labels of class numbers are "
                                             r"y.long\(\)\), or class probabilities"),
])
def test_a_mistake_in_ones_own_model_or_task_is_one_paragraph_and_leaves_no_run_dir(tmp_path, mistake, says):
    """Each was a traceback (rc 1) leaving config.yaml and an empty metrics.jsonl, or, for a prediction that
    broadcasts against its target (MSE of [B, 1] and [B]), a run that trained on another loss to the end, exit 0;
    and a per-sample task loss was told to take its mean, which would shrink it by the batch size in silence."""
    from conftest import ROOT, run_here

    run_dir = tmp_path / "run"
    right = ["--config-dir", str(ROOT / "tests" / "conf"), "recipe=classify", "model._target_=own_mistakes.Linear",
             "~model.hidden", "+model.out=1", "data._target_=own_mistakes.points", "task.loss=torch.nn.MSELoss",
             "trainer.max_steps=2", f"hydra.run.dir={run_dir}"]
    r = run_here(*right, *mistake, cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    error = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and re.search(says, error[0]), r.stderr
    assert not run_dir.exists()
    assert run_here(*right, cwd=tmp_path).returncode == 0  # (the same recipe, put right, trains)


@pytest.mark.parametrize("task, says", [
    (["FloatMetrics"], r"FloatMetrics\.eval_metrics returned a float: it returns a dict of metric names to numbers"),
    (["VectorScore"], r"VectorScore\.score returned \{'error': Tensor of shape \[16\]\}: it returns a dict of metric"),
    # (it replaced val/loss, which best_metric then ranked; one sum's name replaced another's value)
    (["EvalMistake", "+task.mistake=named_loss"], r"eval_metrics returned a metric named 'loss', which is the framework"),
    (["EvalMistake", "+task.mistake=clash"], r"the val metric 'close' comes from two of its eval_metrics, its loss's sums"),
    # (an AttributeError traceback: `'list' object has no attribute 'items'`; an IndexError in the gather)
    (["EvalMistake", "+task.mistake=row_dicts"], r"EvalMistake\.predict returned a list for a batch of 16 samples: it "
                                                 r"returns a dict of names to tensors with one row per sample"),
    (["EvalMistake", "+task.mistake=short_rows"], r"predict returned \{'error': a tensor of shape \[2\]\} for a batch of 16"),
    # (a TypeError traceback from the eval's logging)
    (["EvalMistake", "+task.mistake=list_sample"], r"EvalMistake\.sample returned a list for 'sample': it returns text, "
                                                   r"or a dict of named artefacts"),
    (["EvalMistake", "+task.mistake=sample_loss"], r"EvalMistake\.sample returned a metric 'loss', which the eval logs "
                                                   r"itself as val/loss"),
    # (found by the main rank alone, which samples and scores: the others are told, not left waiting for it)
    (["EvalMistake", "+task.mistake=list_sample", "world=ddp", "world.nproc_per_node=2", "data.batch_size=8"],
     r"EvalMistake\.sample returned a list for 'sample'"),
])
def test_a_task_method_returning_what_the_eval_cannot_take_is_one_paragraph_and_the_steps_are_saved(tmp_path, task,
                                                                                                   says):
    """A task's eval_metrics returning its number bare, or a score of a tensor per sample, was a traceback inside the
    eval (`'float' object has no attribute 'update'`, `a Tensor with 16 elements cannot be converted to Scalar`), and
    the steps before that first eval were lost (no checkpoint, no way to continue): they are saved now."""
    from conftest import FAULTY_ENV, ROOT, run_cli, run_here

    run_dir = tmp_path / "run"
    run = run_cli if "world=ddp" in task else run_here  # (workers: from run_cli's forkserver)
    r = run("--config-dir", str(ROOT / "tests" / "conf"), "recipe=classify", "model._target_=own_mistakes.Linear",
            "~model.hidden", "+model.out=1", "data._target_=own_mistakes.points",
            f"task._target_=own_mistakes.{task[0]}", *task[1:], "~task.loss", "trainer.max_steps=4",
            "trainer.eval_every=2", f"hydra.run.dir={run_dir}", cwd=tmp_path, env=FAULTY_ENV)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    error = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and re.search(says, error[0]), r.stderr
    assert "The checkpoint of step 2 is saved: fix it and rerun with resume=auto" in error[0], error[0]
    assert (run_dir / "checkpoints" / "step_00000002" / "manifest.json").is_file()


@pytest.mark.parametrize("world", [(), ("world=ddp", "world.nproc_per_node=2", "data.batch_size=8")], ids=["one", "ddp"])
def test_a_crash_in_ones_own_code_before_the_first_step_shows_its_line_and_leaves_no_run_dir(tmp_path, world):
    """A forward of one's own raising at the first batch: its traceback is the user's to read, but the run dir it left
    held only the start's records (config.yaml, run_info.json, .hydra/, an empty metrics.jsonl), as a refused run's
    did before those were removed."""
    from conftest import FAULTY_ENV, ROOT, run_cli, run_here

    run_dir = tmp_path / "run"
    r = (run_cli if world else run_here)(
        "--config-dir", str(ROOT / "tests" / "conf"), "recipe=classify", "model._target_=own_mistakes.RaisesInForward",
        "~model.hidden", "+model.out=1", "data._target_=own_mistakes.points", "task.loss=torch.nn.MSELoss", *world,
        f"hydra.run.dir={run_dir}", cwd=tmp_path, env=FAULTY_ENV)
    assert r.returncode == 1, r.stderr
    assert "own_mistakes.py" in r.stderr and "ValueError: a bug in the forward of one's own model" in r.stderr, r.stderr
    assert not run_dir.exists()


def test_a_tasks_sums_and_metrics_of_tensors_and_numpy_numbers_are_logged_as_floats(tmp_path):
    """eval_metrics' 0-dim tensor and numpy float32 passed the check and then failed in the JSON logger (`Object of
    type Tensor is not JSON serializable`), a traceback at the first eval."""
    from conftest import ROOT, read_metrics, run_here

    run_dir = tmp_path / "run"
    r = run_here("--config-dir", str(ROOT / "tests" / "conf"), "recipe=classify", "model._target_=own_mistakes.Linear",
                 "~model.hidden", "+model.out=1", "data._target_=own_mistakes.points", "task._target_=own_mistakes.Summing",
                 "~task.loss", "trainer.max_steps=2", "trainer.eval_every=2", "trainer.log_every=1",
                 f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    val = [e for e in read_metrics(run_dir) if "val/rmse" in e][-1]
    assert val["val/rmse"] == pytest.approx(val["val/loss"] ** 0.5, rel=1e-5) and isinstance(val["val/rmse_np"], float)
    assert val["val/quality"] == 0.5  # (numpy's float32 from sample: sent to the image logger, a ValueError)
    assert all(isinstance(e["train/close"], float) for e in read_metrics(run_dir) if "train/loss" in e)  # (a [1]: a
    # stack error at the first log)


def test_classification_accuracy_reads_the_class_dimension_and_nll_takes_no_probabilities():
    """CrossEntropyLoss of [B, C, d] against [B, d] (a sequence labeller) passed the label check and then failed in the
    accuracy (argmax over the last dimension); NLLLoss of float probabilities passed it and failed in torch."""
    import torch

    from trainer.errors import ConfigError
    from trainer.task import SupervisedTask

    pred = torch.randn(4, 5, 7, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 5, (4, 7), generator=torch.Generator().manual_seed(1))
    out = SupervisedTask("torch.nn.CrossEntropyLoss").loss(lambda x: pred, (torch.zeros(4), y))
    assert out["accuracy"] == (pred.argmax(1) == y).sum()
    soft = torch.softmax(torch.randn(4, 5), -1)
    out = SupervisedTask("torch.nn.CrossEntropyLoss").loss(lambda x: pred[:, :, 0], (torch.zeros(4), soft))
    assert out["accuracy"] == (pred[:, :, 0].argmax(1) == soft.argmax(1)).sum()
    with pytest.raises(ConfigError, match=r"NLLLoss takes class indices, integers of shape \[4\]\. Fix"):
        SupervisedTask("torch.nn.NLLLoss").loss(lambda x: pred[:, :, 0].log_softmax(-1), (torch.zeros(4), soft))


@pytest.mark.parametrize(("loss", "pred_shape", "target"), [
    ("CrossEntropyLoss", (6, 5), "labels"),
    ("CrossEntropyLoss", (6, 5, 7), "labels"),  # a sequence labeller: 7 positions a sample
    ("CrossEntropyLoss", (6, 5, 7), "ignored"),  # some positions at ignore_index (-100)
    ("CrossEntropyLoss", (6, 5, 7), "probabilities"),
    ("NLLLoss", (6, 5, 7), "ignored"),
    ("MSELoss", (6, 3), "same"),  # 3 outputs a sample
    ("BCEWithLogitsLoss", (6, 4), "binary"),
    ("MultiLabelSoftMarginLoss", (6, 5), "binary"),  # (averages within each sample itself: 6 terms, not 30)
])
def test_the_supervised_tasks_loss_per_target_is_torchs_mean_loss(loss, pred_shape, target):
    """num_targets counted samples while the loss summed every term: a sequence labeller's loss and accuracy, a
    [B, 3] regression's loss, were 7 and 3 times what torch's own mean (a hand-written loop) gives, and so were the
    gradients grad_clip clipped; an ignored label counted as a target."""
    import torch

    from trainer.task import SupervisedTask

    g = torch.Generator().manual_seed(0)
    pred = torch.randn(*pred_shape, generator=g)
    if loss == "NLLLoss":
        pred = pred.log_softmax(1)
    classes = pred_shape[1]
    indices = (pred_shape[0], *pred_shape[2:])
    y = {"labels": lambda: torch.randint(0, classes, indices, generator=g),
         "ignored": lambda: torch.randint(0, classes, indices, generator=g).masked_fill(
             torch.rand(indices, generator=g) < 0.3, -100),
         "probabilities": lambda: torch.softmax(torch.randn(*pred_shape, generator=g), 1),
         "same": lambda: torch.randn(*pred_shape, generator=g),
         "binary": lambda: torch.randint(0, 2, pred_shape, generator=g).float()}[target]()
    task = SupervisedTask(f"torch.nn.{loss}")
    batch = (torch.zeros(pred_shape[0]), y)
    out = task.loss(lambda x: pred, batch)
    total = out["loss"] if isinstance(out, dict) else out
    n = float(task.num_targets(batch))
    want = getattr(torch.nn, loss)()(pred, y)  # torch's default: the mean over its terms
    torch.testing.assert_close(total / n, want, rtol=1e-6, atol=1e-7)  # (a sum then one division: a few ulps)
    from types import SimpleNamespace

    from trainer.loop.trainer import Trainer
    from trainer.recipes.lm.task import LanguageModeling

    # MFU counts the model's 6 x parameters per sample (one forward), not per term; an lm's per token, as before.
    assert Trainer._flops_rate.fget(SimpleNamespace(task=task)) == "samples_per_s"
    assert Trainer._flops_rate.fget(SimpleNamespace(task=LanguageModeling())) == "targets_per_s"
    if isinstance(out, dict):  # accuracy over the counted labels
        kept = y != -100 if target in ("labels", "ignored") else torch.ones(indices, dtype=torch.bool)
        labels = y.argmax(1) if target == "probabilities" else y
        assert out["accuracy"].item() == ((pred.argmax(1) == labels) & kept).sum().item()
        assert n == kept.sum().item()


def test_a_batch_whose_labels_are_all_ignored_names_the_labels_not_the_frameworks_own_task(tmp_path):
    """SupervisedTask counts the labels its loss reads: a batch of ignore_index labels alone was "Return how many terms
    task.loss sums over", advice for a task of one's own, about the framework's."""
    from conftest import run_here
    from test_errors import assert_clean_error

    conf = Path(__file__).resolve().parent / "conf"
    r = run_here("--config-dir", str(conf), "recipe=classify", "data._target_=classify.ignored",
                 f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert_clean_error(r, "counted 0 targets in step 1's whole batch", "ignore_index (-100)", "check the data's labels")
    assert "Return how many terms" not in r.stderr


@pytest.mark.slow
def test_an_unsupported_dataset_stops_a_ddp_run_before_its_workers(tmp_path):
    from conftest import FAULTY_ENV, run_cli

    run_dir = tmp_path / "run"
    r = run_cli("debug=smoke", "world=ddp", "world.nproc_per_node=2", "data._target_=unsupported_data.loader",
                f"hydra.run.dir={run_dir}", env=FAULTY_ENV, timeout=120)
    assert r.returncode == 2 and "DataLoader" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not run_dir.exists()


# -- 32.4: this machine's defaults ----------------------------------------------------------------------------
def test_machine_defaults_are_what_the_same_overrides_give(tmp_path, monkeypatch):
    from conftest import run_here

    from trainer.config.compose import load

    monkeypatch.setenv("TRAINER_CONFIG_HOME", str(tmp_path / "home"))
    saved = ("world=ddp", "world.nproc_per_node=2", "precision=bf16", "checkpoint.keep_last=1")
    plain = {o: load([*o.split()], targets=False) for o in ("", "debug=smoke", "recipe=diffusion", "precision=fp32")}
    r = run_here("config", *saved, f"outputs={tmp_path / 'runs'}", cwd=tmp_path)
    assert r.returncode == 0 and (tmp_path / "home" / "machine" / "default.yaml").is_file(), r.stderr
    for extra, before in plain.items():
        now = load([*extra.split()], targets=False)
        # As if the saved settings came first on the command line: the recipe's precision (diffusion's fp32)
        # gives way to them, the command line's does not, nor debug=smoke's fp32 (a run of seconds stays one).
        first = [o for o in saved if not (extra == "debug=smoke" and o.startswith("precision="))]
        assert now == load([*first, *extra.split()], targets=False), extra
        assert now != before
    r = run_here("--cfg", "hydra", cwd=tmp_path)
    assert f"dir: {tmp_path / 'runs'}/" in r.stdout, r.stdout
    r = run_here("env", cwd=tmp_path)
    assert "machine defaults" in r.stdout.lower() and "override /precision: bf16" in r.stdout, r.stdout
    r = run_here("config", cwd=tmp_path)
    assert "nproc_per_node: 2" in r.stdout
    r = run_here("config", "--reset", cwd=tmp_path)
    assert r.returncode == 0 and not (tmp_path / "home" / "machine" / "default.yaml").exists()
    assert load([], targets=False) == plain[""]


def test_a_run_uses_the_machine_defaults(tmp_path, monkeypatch):
    from conftest import run_here

    monkeypatch.setenv("TRAINER_CONFIG_HOME", str(tmp_path / "home"))
    assert run_here("config", "checkpoint.keep_last=1", f"outputs={tmp_path / 'runs'}", cwd=tmp_path).returncode == 0
    r = run_here("debug=smoke", "trainer.max_steps=3", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    run_dir = Path(re.search(r"^done: (.+)$", r.stdout, re.M).group(1))
    assert run_dir.parent.parent == tmp_path / "runs"
    assert "keep_last: 1" in (run_dir / "config.yaml").read_text()
    assert "machine defaults" in r.stdout
    # A launched script's Runtime() takes them too, and launch says so (it said nothing).
    from conftest import run_cli

    script = tmp_path / "script.py"
    script.write_text("import trainer\nrt = trainer.Runtime()\nprint('keep_last', rt.keep_last)\nrt.end()\n")
    r = run_cli("launch", str(script), cwd=tmp_path, env={"TRAINER_CONFIG_HOME": str(tmp_path / "home")})
    assert r.returncode == 0 and "keep_last 1" in r.stdout, r.stdout + r.stderr
    assert f"machine defaults: {tmp_path / 'home'}" in r.stdout


def test_what_only_this_machine_cannot_run_is_saved_with_a_note(tmp_path, monkeypatch):
    """The defaults file often sits in a home dir that a cluster's login and compute nodes share: an outputs dir
    not mounted here, or world.tp=2 where auto counts no GPU, run elsewhere. Saved, and said (saved without a word,
    every run here would stop; refused, no node could have them)."""
    from conftest import run_here

    monkeypatch.setenv("TRAINER_CONFIG_HOME", str(tmp_path / "home"))
    r = run_here("config", "world=ddp", "world.tp=3", "outputs=/proc/runs", cwd=tmp_path)
    assert r.returncode == 0 and (tmp_path / "home" / "machine" / "default.yaml").is_file(), r.stderr
    assert "note: runs cannot be written to outputs=/proc/runs on this machine" in r.stderr
    assert "world.tp=3 is invalid" in r.stderr and "save world.nproc_per_node=N with it to run here" in r.stderr


def test_a_machine_default_environment_variable_is_saved_and_reaches_runs(tmp_path, monkeypatch):
    """hydra.job.env_set.* (a cluster's NCCL interface, HF_HOME) is a machine's setting: saved, as before the
    refusal of hydra.run.* and hydra.sweep.* (where runs go: outputs=DIR)."""
    from conftest import run_here

    monkeypatch.setenv("TRAINER_CONFIG_HOME", str(tmp_path / "home"))
    assert run_here("config", "hydra.job.env_set.NCCL_SOCKET_IFNAME=eth0", cwd=tmp_path).returncode == 0
    r = run_here("--cfg", "hydra", "debug=smoke", cwd=tmp_path)
    assert r.returncode == 0 and "NCCL_SOCKET_IFNAME: eth0" in r.stdout, r.stdout[-2000:]


@pytest.mark.parametrize("setting, says", [
    ("precision=bf61", "precision=bf61 is not an option"),
    ("recipe=diffusion", "recipe is the recipe's to choose"),
    ("wrld=ddp", "wrld is no config group (callbacks, data, debug, logger, model, optim, precision, recipe, "
                 "scheduler, smoke, world). Nothing was saved. Did you mean world?"),  # (not "the recipe's")
    ("world.nproc_per_nod=2", "Did you mean world.nproc_per_node=2?"),
    ("hydra.run.dir=one_dir", "other hydra.* settings are not saved"),  # (every later run in one dir)
    ("hydra.mode=MULTIRUN", "other hydra.* settings are not saved"),  # (every later run a sweep)
    ("hydra.job.env_set.WANDB_API_KEY=abcdef123", "a secret is not saved in the machine's defaults"),
    # A secret's value (the environment's MY_SECRET) is not saved as a plain value either: its name is.
    ("logger=wandb logger.wandb.group=hunter2hunter2", "holds the secret in $MY_SECRET, which is not saved in the "
                                                        "machine's defaults. Save its name instead: "
                                                        "'logger.wandb.group=${oc.env:MY_SECRET}'"),
    ("outputs=FILE", "FILE is not a directory"),
    ("outputs=FILE/runs", "FILE is not a directory"),
    # What a run checks later, once it builds its trackers (every run would stop there).
    ("logger=wandb logger.wandb.mode=ofline", "logger.wandb.mode='ofline' is invalid"),
    ("callbacks=early_stopping callbacks.early_stopping.patience=-1", "patience=-1 is invalid"),  # (and callbacks')
    ("world=deepspeed world.stage=7", "world.stage=7 is invalid"),  # (the strategy's own checks too)
    # An unknown key is named as a run names it (Hydra blamed the file's `# @package _global_` header), without
    # the run's `+KEY=VALUE` way out, which `config` does not take.
    ("optim.lrr=1e-3", "unknown config key 'optim.lrr'. Did you mean optim.lr=1e-3?"),
    ("foo.bar=1", "unknown config key 'foo.bar'. The config has no 'foo'."),
])
def test_a_machine_default_mistake_writes_nothing(tmp_path, monkeypatch, setting, says):
    from conftest import run_here

    monkeypatch.setenv("TRAINER_CONFIG_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MY_SECRET", "hunter2hunter2")
    (tmp_path / "FILE").write_text("")
    setting, says = setting.replace("FILE", str(tmp_path / "FILE")), says.replace("FILE", str(tmp_path / "FILE"))
    r = run_here("config", *setting.split(), cwd=tmp_path)
    assert "abcdef123" not in r.stdout + r.stderr and "hunter2" not in r.stdout + r.stderr  # (no secret's value shown)
    assert r.returncode == 2 and says in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert "package" not in r.stderr and "on purpose" not in r.stderr
    assert not (tmp_path / "home" / "machine" / "default.yaml").exists()


def test_a_secret_in_a_machine_defaults_file_of_ones_own_is_printed_redacted(tmp_path, monkeypatch):
    """`env` (for bug reports) and `config` printed the file as it was, a secret's value written into it by hand
    (or saved before config refused one) and all."""
    from conftest import run_here

    monkeypatch.setenv("TRAINER_CONFIG_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MY_SECRET", "hunter2hunter2")
    (tmp_path / "home" / "machine").mkdir(parents=True)
    (tmp_path / "home" / "machine" / "default.yaml").write_text(
        "# @package _global_\ndefaults:\n- override /logger: wandb\nlogger:\n  wandb:\n    group: hunter2hunter2\n")
    for command in ("env", "config"):
        r = run_here(command, cwd=tmp_path)
        assert r.returncode == 0 and "group: <redacted>" in r.stdout and "hunter2" not in r.stdout + r.stderr, r.stdout


def test_a_mistake_in_a_hand_edited_machine_defaults_file_is_named_there_and_env_still_reports(tmp_path, monkeypatch):
    """A group option the file chooses that does not exist was "world=ddpp is not an option", as if the command line
    had said it; and `env`, the command a bug report pastes, stopped at it (exit 2) without reporting the machine."""
    from conftest import run_here

    monkeypatch.setenv("TRAINER_CONFIG_HOME", str(tmp_path / "home"))
    (tmp_path / "home" / "machine").mkdir(parents=True)
    (tmp_path / "home" / "machine" / "default.yaml").write_text("# @package _global_\ndefaults:\n- override /world: ddpp\n")
    r = run_here("debug=smoke", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert r.returncode == 2 and "world=ddpp is not an option of config group 'world', chosen in this machine's " \
        f"defaults ({tmp_path / 'home' / 'machine' / 'default.yaml'}" in r.stderr, r.stderr
    r = run_here("env", cwd=tmp_path)
    assert r.returncode == 0 and "- torch" in r.stdout and "(not composed: world=ddpp is not an option" in r.stdout
    # A key the config lacks was "machine/default.yaml sets ...": a path relative to nothing the user knows.
    (tmp_path / "home" / "machine" / "default.yaml").write_text("# @package _global_\ntrainer:\n  max_stepz: 3\n")
    r = run_here("debug=smoke", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert r.returncode == 2 and f"this machine's defaults file {tmp_path / 'home' / 'machine' / 'default.yaml'} " \
        "(python -m trainer config) sets trainer.max_stepz, a key the config does not have" in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()


def test_machine_defaults_hold_beside_a_config_dir(tmp_path, monkeypatch):
    from conftest import run_here

    from trainer.config.compose import load

    monkeypatch.setenv("TRAINER_CONFIG_HOME", str(tmp_path / "home"))
    assert run_here("config", "checkpoint.keep_last=1", cwd=tmp_path).returncode == 0
    assert load(["recipe=classify"], config_dir=CONF).checkpoint.keep_last == 1
    r = run_here("--config-dir", CONF, "recipe=classify", "--cfg", "job", cwd=tmp_path)
    assert r.returncode == 0 and "keep_last: 1" in r.stdout, r.stdout + r.stderr


def test_a_group_the_command_line_chooses_takes_none_of_the_machines_settings_for_another_option(tmp_path,
                                                                                                 monkeypatch):
    """The machine's logger=wandb logger.wandb.project=... under a command line's logger=none left logger.wandb
    half there (a traceback, and a run dir), and its world=ddp world.nproc_per_node=2 under world=single refused
    a key the command line never gave. The command line wins, keys and all; the machine's other settings stay."""
    from conftest import run_here

    from trainer.config.compose import load

    monkeypatch.setenv("TRAINER_CONFIG_HOME", str(tmp_path / "home"))
    assert run_here("config", "logger=wandb", "logger.wandb.project=myproj", "world=ddp", "world.nproc_per_node=2",
                    "checkpoint.keep_last=1", cwd=tmp_path).returncode == 0
    machine = load(["debug=smoke"])
    assert machine.logger.wandb.project == "myproj" and machine.world.nproc_per_node == 2
    mine = load(["debug=smoke", "logger=none", "world=single"])
    assert dict(mine.logger) == {} and mine.world.nproc_per_node == 1 and mine.checkpoint.keep_last == 1
    r = run_here("debug=smoke", "logger=tensorboard", "world=single", "--cfg", "job", cwd=tmp_path)
    assert r.returncode == 0 and "myproj" not in r.stdout and "tensorboard" in r.stdout, r.stderr
    assert "choice of logger, world is left out" in r.stderr
    # Several loggers, the machine's among them (logger=[wandb,tensorboard]): its settings for wandb stay, as with
    # logger=wandb (they fell back to the option's project=trainer).
    for choice in ("logger=[wandb]", "logger=[wandb,tensorboard]"):
        assert load(["debug=smoke", choice]).logger.wandb.project == "myproj", choice
    assert "tensorboard" in load(["debug=smoke", "logger=[wandb,tensorboard]"]).logger


# -- 32.6: finders that agree across ranks ----------------------------------------------------------------------
def _finder_lines(stdout: str, key: str) -> dict[int, str]:
    """{size: 'fits (peak ...)' or 'does not fit (...)'} of each trial the finder printed."""
    found = re.finditer(rf"^{re.escape(key)}=(\d+): ((?:fits|does not fit).*)$", stdout, re.M)
    return {int(m.group(1)): m.group(2) for m in found}


def test_the_batch_size_finder_stops_at_the_budget_and_says_the_override(tmp_path):
    from conftest import run_here

    r = run_here("tune", "batch_size", "debug=smoke", "tune.memory_mb=100000", "tune.max_batch_size=16",
                 f"save={tmp_path / 'bs.txt'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert sorted(_finder_lines(r.stdout, "data.batch_size")) == [1, 2, 4, 8, 16]
    assert "Run with: python -m trainer debug=smoke data.batch_size=16" in r.stdout
    assert (tmp_path / "bs.txt").read_text() == "data.batch_size=16\n"
    # A budget below what torch itself takes: nothing fits, and it says so.
    r = run_here("tune", "batch_size", "debug=smoke", "tune.memory_mb=10", cwd=tmp_path)
    assert r.returncode == 2 and "not even data.batch_size=1 fits" in r.stderr and "tune.memory_mb=10" in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("sized", [True, False])
def test_the_batch_size_finder_tries_a_stream_s_first_samples(tmp_path, sized):
    """data=text_stream (or an IterableDataset of one's own, with or without a length) was a NotImplementedError
    traceback from Dataset.__getitem__, or a TypeError from len(): the finder took samples by index."""
    from conftest import FAULTY_ENV, run_here

    (tmp_path / "book.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    data = (["data=text_stream", f"data.path={tmp_path / 'book.txt'}"] if sized else
            ["data._target_=stream_data.unsized", "data.shuffle=false"])  # (tests/helpers/stream_data.py)
    r = run_here("tune", "batch_size", "debug=smoke", *data, "tune.memory_mb=100000", "tune.max_batch_size=4",
                 cwd=tmp_path, env=FAULTY_ENV)
    assert r.returncode == 0, r.stderr
    assert sorted(_finder_lines(r.stdout, "data.batch_size")) == [1, 2, 4]


def test_the_batch_size_finder_agrees_across_ranks(tmp_path):
    """Rank 1 needs 24 MB more per sample (tests/helpers/memory_hog.py): every rank stops at rank 1's limit, where
    one process alone (rank 0's memory) goes on to the largest size tried."""
    from conftest import FAULTY_ENV, run_cli

    args = ("tune", "batch_size", "debug=smoke", "model._target_=memory_hog.HogGPT", "tune.memory_mb=1000",
            "tune.max_batch_size=64")
    alone = run_cli(*args, env=FAULTY_ENV, timeout=180)
    assert alone.returncode == 0 and "data.batch_size=64: the largest" in alone.stdout, alone.stdout + alone.stderr
    both = run_cli(*args, "world=ddp", "world.nproc_per_node=2", env=FAULTY_ENV, timeout=300)
    assert both.returncode == 0, both.stdout + both.stderr
    tried = _finder_lines(both.stdout, "data.batch_size")
    last_fit = max(b for b, said in tried.items() if said.startswith("fits"))
    assert last_fit < 64 and tried[2 * last_fit].startswith("does not fit (rank 1: peak"), both.stdout
    assert f"data.batch_size={last_fit}: the largest micro-batch that fits on every rank" in both.stdout
    assert both.stdout.count("the largest micro-batch") == 1  # said once, by rank 0


def test_the_lr_range_test_suggests_an_lr_in_its_range(tmp_path):
    from conftest import run_here

    r = run_here("tune", "lr", "debug=smoke", "tune.steps=40", "tune.min_lr=1e-5", "tune.max_lr=10",
                 f"save={tmp_path / 'lr.txt'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    suggested = float(re.search(r"^optim.lr=(\S+): where the loss fell fastest", r.stdout, re.M).group(1))
    assert 1e-5 < suggested < 10
    assert (tmp_path / "lr.txt").read_text() == f"optim.lr={suggested:.3g}\n"
    losses = [float(x) for x in re.findall(r"^lr=\S+  loss=(\S+)$", r.stdout, re.M)]
    assert len(losses) >= 4 and min(losses) < losses[0]  # it learned somewhere in the sweep


def test_the_lr_range_test_picks_from_the_fall_not_from_a_wiggle_of_the_flat_start():
    """The steepest fall of the smoothed loss was looked for everywhere past the first steps: on little or noisy
    data a dip in the flat start (two low losses while the average holds few) was steeper than the real fall, and
    was suggested. Only a fall beyond the curve's own noise counts now; with none, the test says so."""
    import math
    import random

    from trainer.entry.tuning import BETA, suggest

    def smoothed(raw):  # (find_lr's smoothing)
        avg, out = 0.0, []
        for i, loss in enumerate(raw):
            avg = BETA * avg + (1 - BETA) * loss
            out.append(avg / (1 - BETA ** (i + 1)))
        return out

    n, rng = 40, random.Random(1)
    lrs = [1e-5 * (10 / 1e-5) ** (i / (n - 1)) for i in range(n)]
    raw = [5 + rng.gauss(0, 0.3) for _ in range(n)]  # flat at 5, noise 0.3
    raw[5], raw[6] = 3.0, 2.5  # the dip
    for i in range(22, n):  # the fall: from step 22, to 2 at step 34
        raw[i] = max(2.0, 5 - 3 * (i - 22) / 12) + rng.gauss(0, 0.3)
    smooth = smoothed(raw)

    def slope(j):
        return (smooth[j + 1] - smooth[j - 1]) / math.log(lrs[j + 1] / lrs[j - 1])

    assert min(range(4, n - 1), key=slope) in (5, 6)  # (the dip is the steepest point of the curve)
    pick, lowest, fell = suggest(lrs, raw, smooth)
    assert fell and 22 <= pick <= lowest
    flat = [5 + rng.gauss(0, 0.3) for _ in range(n)]  # no fall at all: said
    assert suggest(lrs, flat, smoothed(flat))[2] is False


def test_an_lr_range_test_that_never_left_its_noise_suggests_nothing(tmp_path):
    """tune.max_lr=1e-6: the loss never moved, yet the test suggested its steepest wiggle (1.5e-7), exit 0, and wrote
    it to save=lr.txt, from where a script trained at a rate that does nothing."""
    from conftest import run_here

    (tmp_path / "lr.txt").write_text("optim.lr=0.003\n")  # (an earlier test's: kept)
    r = run_here("tune", "lr", "debug=smoke", "tune.steps=20", "tune.max_lr=1e-6", f"save={tmp_path / 'lr.txt'}",
                 cwd=tmp_path)
    assert r.returncode == 2
    assert "never fell by more than its own noise" in r.stderr and "nothing is suggested" in r.stderr
    assert "Traceback" not in r.stderr and not re.search(r"^optim.lr=", r.stdout, re.M)
    assert (tmp_path / "lr.txt").read_text() == "optim.lr=0.003\n"


def test_the_lr_range_test_scales_an_optimizers_other_rates_as_it_tested_them(tmp_path):
    """optim=muon's AdamW group (optim.adamw_lr) rose with optim.lr during the test, but only optim.lr was
    suggested: the run then paired the picked Muon rate with the old AdamW rate, a point the test never tried."""
    from conftest import run_here

    r = run_here("tune", "lr", "debug=smoke", "optim=muon", "optim.lr=0.005", "optim.adamw_lr=1e-3",
                 "tune.steps=20", f"save={tmp_path / 'lr.txt'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lr, adamw_lr = re.search(r"^optim.lr=(\S+) optim.adamw_lr=(\S+): where", r.stdout, re.M).groups()
    assert adamw_lr == f"{float(lr) * 1e-3 / 0.005:.3g}"  # (their ratio in the test: 1e-3 / 0.005)
    assert (tmp_path / "lr.txt").read_text() == f"optim.lr={lr} optim.adamw_lr={adamw_lr}\n"
    # (each key once in the command to run)
    assert f"Run with: python -m trainer debug=smoke optim=muon optim.lr={lr} optim.adamw_lr={adamw_lr}\n" in r.stdout


@pytest.mark.slow
def test_the_lr_range_test_is_the_same_on_two_ranks(corpus, tmp_path):
    """World size is a performance knob here too: 2 ranks x batch 4 see the curve 1 rank x batch 8 sees."""
    from conftest import run_cli, run_here, tiny_overrides

    args = ("tune", "lr", *tiny_overrides(corpus), "tune.steps=30", "tune.min_lr=1e-4", "tune.max_lr=1")
    one = run_here(*args, "data.batch_size=8")  # (one process: no need for one of its own)
    two = run_cli(*args, "data.batch_size=4", "world=ddp", "world.nproc_per_node=2", timeout=300)
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr

    def curve(out: str):
        return [(float(a), float(b)) for a, b in re.findall(r"^lr=(\S+)  loss=(\S+)$", out, re.M)]

    assert [lr for lr, _ in curve(two.stdout)] == [lr for lr, _ in curve(one.stdout)]
    # (the same arithmetic in another order: float differences, grown by the last, largest learning rates)
    assert [loss for _, loss in curve(two.stdout)] == pytest.approx([loss for _, loss in curve(one.stdout)], rel=1e-3)
    pick = re.compile(r"^(optim.lr=\S+): where", re.M)
    assert pick.search(two.stdout).group(1) == pick.search(one.stdout).group(1)


def test_the_finders_take_your_own_config_dir_and_say_it_in_the_command_they_suggest(tmp_path):
    """`tune lr --config-dir DIR recipe=mine` was refused ('--config-dir' is not an override), and the command
    `python -m trainer --config-dir DIR tune ...` too: a recipe of one's own could not be tuned."""
    from conftest import run_here

    r = run_here("tune", "lr", "--config-dir", str(CONF), "recipe=classify", "tune.steps=30", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"Run with: python -m trainer --config-dir {CONF} recipe=classify optim.lr=" in r.stdout


@pytest.mark.parametrize("args, says", [
    ([], "say what to find: batch_size or lr"),
    (["batch", "debug=smoke"], "Did you mean batch_size?"),
    (["batch_size", "debug=smoke"], "tune.memory_mb=4000"),
    (["batch_size", "debug=smoke", "world=fsdp", "world.nproc_per_node=2", "tune.memory_mb=1000"], "world=fsdp"),
    # (the run's own setting named: under world=ddp with world.pp=2 it read as if world=ddp were refused)
    (["batch_size", "debug=smoke", "world=ddp", "world.nproc_per_node=2", "world.pp=2", "tune.memory_mb=1000"],
     "as under world._target_=trainer.parallel.DDP with world.pp=2 (world=fsdp, world.tp > 1, world.pp > 1"),
    (["lr", "debug=smoke", "tune.max_lr=1e-9"], "must be above tune.min_lr"),
    (["lr", "debug=smoke", "save=."], "is a directory; give a file name in it"),  # (before the sweep, not after)
    (["lr", "debug=smoke", "tune.stepz=5"], "Did you mean steps?"),
    (["lr", "debug=smoke", "optim.lrr=1"], "optim.lr=1"),
    # A task that steps its own optimizers: the sweep never reached them, and its suggestion changed nothing.
    (["lr", "recipe=gan", "debug=smoke"], "steps optimizers of its own (optim.generator, optim.discriminator)"),
])
def test_a_finder_mistake_is_one_paragraph(tmp_path, args, says):
    from conftest import run_here

    r = run_here("tune", *args, cwd=tmp_path)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_the_batch_size_finder_takes_a_config_whose_batch_is_larger_than_the_data(tmp_path):
    """A batch larger than the training split is refused for training; the finder, which builds the run (as here)
    and chooses the batch itself up to the split, was refused with it (a recipe's default of 128 on a small file)."""
    from trainer import build, compose
    from trainer.errors import DataError

    (tmp_path / "small.txt").write_bytes(b"abcdefgh" * 16)  # (3 samples of 32 bytes for training)
    trainer = build(compose(["debug=smoke", "data=text", f"data.path={tmp_path / 'small.txt'}", "data.seq_len=32",
                             "data.batch_size=64"]), tmp_path / "run")
    try:
        with pytest.raises(DataError, match="data.batch_size=64 is more than the 3 samples of the training split"):
            trainer.data.check_batch()  # (where a training run starts, and the LR range test)
    finally:
        trainer.backend.teardown()


def test_a_finders_save_replaces_only_a_file_a_finder_wrote(tmp_path):
    """`tune lr save=RUN/config.yaml` (or a script) replaced that file with `optim.lr=...`: the run no longer
    evaluated. A file of one line of overrides (an earlier finder's) is still replaced; anything else is refused
    before the sweep, unchanged."""
    from conftest import run_here

    from trainer.entry.tuning import _not_a_tune_file

    (tmp_path / "config.yaml").write_text("trainer:\n  max_steps: 3\n")
    r = run_here("tune", "lr", "debug=smoke", f"save={tmp_path / 'config.yaml'}", cwd=tmp_path)
    assert r.returncode == 2 and "that file exists and is not one a finder wrote" in r.stderr, r.stderr
    assert (tmp_path / "config.yaml").read_text() == "trainer:\n  max_steps: 3\n"
    (tmp_path / "lr.txt").write_text("optim.lr=0.0119\n")
    (tmp_path / "both.txt").write_text("data.batch_size=16 trainer.grad_accum_steps=2\n")
    assert _not_a_tune_file(tmp_path / "lr.txt") is None and _not_a_tune_file(tmp_path / "both.txt") is None
    assert _not_a_tune_file(tmp_path / "new.txt") is None
    (tmp_path / "empty.txt").write_text("")  # (mktemp's: found by a review)
    (tmp_path / "spaced.txt").write_text("optim.lr=0.0119 \n")
    assert _not_a_tune_file(tmp_path / "empty.txt") is None and _not_a_tune_file(tmp_path / "spaced.txt") is None


def test_data_drawn_from_torchs_generator_is_the_same_at_every_build(tmp_path):
    """A data factory that calls torch.randn (the README's regress recipe) drew from an unseeded generator: two
    runs of one config trained on different data, and so did the ranks of one run."""
    import torch

    from trainer import build
    from trainer.config.compose import load

    cfg = load(["recipe=classify", "data._target_=classify.global_blobs", "checkpoint.save_final=false"],
               config_dir=CONF)
    drawn = []
    for run in ("a", "b"):
        torch.manual_seed(len(drawn) + 123)  # whatever the process drew before
        trainer = build(cfg, tmp_path / run)
        try:
            drawn.append(trainer.data.train.tensors[0].clone())
        finally:
            trainer.backend.teardown()
    assert torch.equal(drawn[0], drawn[1])
    other = load(["recipe=classify", "data._target_=classify.global_blobs", "trainer.seed=1"], config_dir=CONF)
    trainer = build(other, tmp_path / "c")
    try:
        assert not torch.equal(trainer.data.train.tensors[0], drawn[0])  # the seed decides it
    finally:
        trainer.backend.teardown()
