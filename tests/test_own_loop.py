"""trainer.Runtime: a loop of your own (issue 26). The lm recipe's hand-written loop (recipes/lm/own_loop.py) must
train what the declarative Trainer trains, on one process, on 2 DDP and on 2 FSDP processes; a step with two
models and two optimizers must give on 2 processes what it gives on one; save_state/load_state resume bitwise and
across strategies; eval outputs are gathered with each sample once; misuse is one paragraph."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import ROOT, load_weights, read_metrics, run_cli, run_here, series, tiny_overrides

from trainer.errors import CheckpointError, UserError

OWN_LOOP = str(ROOT / "recipes" / "lm" / "own_loop.py")
SCRIPT = str(ROOT / "tests" / "helpers" / "runtime_script.py")
# The reference run's settings (tests/conftest.py: debug=smoke + SHARED, batch 8): 12 steps, lr 5e-3, warmup 2.
LIKE_REFERENCE = ("--steps", "12", "--lr", "5e-3", "--warmup", "2", "--seq-len", "32")
TWO_PROCS = {"PYTHONPATH": f"{ROOT}:{ROOT / 'tests' / 'helpers'}"}


# The references train in fp32 (debug=smoke). A launched job's precision is otherwise its config's, the lm
# recipe's `auto`: bf16 where the CPU computes it natively and measured it faster (so on some machines only).
FP32 = "precision=fp32"


def launch(*args: str, env: dict | None = None, timeout: float = 180):
    return run_cli("launch", FP32, *args, env={**TWO_PROCS, **(env or {})}, timeout=timeout)


def assert_close_weights(got: Path, want: Path, exact: bool = False, atol: float = 1e-5) -> None:
    a, b = load_weights(got), load_weights(want)
    assert a.keys() == b.keys()
    for k in b:
        if exact:
            assert torch.equal(a[k], b[k]), k
        else:  # fp32; the ranks sum gradients in another order than one process does
            torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=atol)


@pytest.mark.parametrize("world", [
    ("--batch-size", "8"),
    ("torchrun", "--world", "ddp", "--batch-size", "4"),
    ("world=fsdp", "world.nproc_per_node=2", "trainer.grad_accum_steps=2", "--batch-size", "2"),
    ("world=ddp", "world.nproc_per_node=2", "world.tp=2", "--batch-size", "8"),
], ids=["single", "ddp2_torchrun", "fsdp2_accum2", "tp2"])
def test_your_own_loop_trains_what_the_trainer_trains(world, reference, corpus, tmp_path):
    """One process, FSDP and tensor parallelism through `python -m trainer launch`, DDP under torchrun."""
    overrides = [a for a in world if "=" in a]
    script_args = [a for a in world if "=" not in a and a != "torchrun"]
    args = [*overrides, OWN_LOOP, "--data", str(corpus), "--out", str(tmp_path), *LIKE_REFERENCE, *script_args]
    if "torchrun" in world:
        r = run_cli("--standalone", "--nproc_per_node=2", *args, module="torch.distributed.run",
                    env={**TWO_PROCS, "OMP_NUM_THREADS": "1"})
    else:
        r = run_here("launch", FP32, *args, cwd=tmp_path) if not overrides else launch(*args)
    assert r.returncode == 0, r.stderr
    # Tensor parallelism splits each matmul's sum in two: the same 1e-4 as the Trainer's own tp test (test_parallel).
    assert_close_weights(tmp_path / "model.safetensors", reference / "model.safetensors",
                         atol=1e-4 if "world.tp=2" in world else 1e-5)
    # rt.log: each step's loss once, from the main process, as the Trainer logged it (the mean over the global batch).
    logged = read_metrics(tmp_path)
    assert [e["step"] for e in logged] == list(range(1, 13))
    assert series(logged, "train/loss") == pytest.approx(series(read_metrics(reference), "train/loss"), rel=1e-5)


@pytest.fixture(scope="module")
def two_models_single(tmp_path_factory) -> Path:
    """Two models, two optimizers (Adam and SGD), a schedule on one: 6 steps on one process, saving at step 3."""
    out = tmp_path_factory.mktemp("two_single")
    r = run_here("launch", FP32, SCRIPT, "two", str(out), "6", "3", cwd=out)
    assert r.returncode == 0, r.stderr
    return out


def test_two_models_and_optimizers_on_2_ddp_processes_equal_one(two_models_single, tmp_path):
    r = launch("world=ddp", "world.nproc_per_node=2", SCRIPT, "two", str(tmp_path), "6")
    assert r.returncode == 0, r.stderr
    for name in ("gen", "disc"):
        assert_close_weights(tmp_path / f"{name}.safetensors", two_models_single / f"{name}.safetensors")


def resumed_from_step_3(source: Path, out: Path) -> None:
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(source / "checkpoints" / "step_00000003", out / "checkpoints" / "step_00000003")


def test_save_state_load_state_resumes_bitwise(two_models_single, tmp_path):
    resumed_from_step_3(two_models_single, tmp_path)
    r = run_here("launch", FP32, SCRIPT, "two", str(tmp_path), "6", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for name in ("gen", "disc"):
        assert_close_weights(tmp_path / f"{name}.safetensors", two_models_single / f"{name}.safetensors", exact=True)


def test_a_checkpoint_of_one_process_resumes_on_2_fsdp_processes(two_models_single, tmp_path):
    """Models, optimizers (moments, momentum), the schedule and the loader's position, resharded."""
    resumed_from_step_3(two_models_single, tmp_path)
    r = launch("world=fsdp", "world.nproc_per_node=2", SCRIPT, "two", str(tmp_path), "6")
    assert r.returncode == 0, r.stderr
    for name in ("gen", "disc"):
        assert_close_weights(tmp_path / f"{name}.safetensors", two_models_single / f"{name}.safetensors")


def test_eval_outputs_are_gathered_with_every_sample_once(tmp_path):
    """Under FSDP a forward is a collective: of 5 samples in batches of 2, rank 0 has 2 batches and rank 1 one, which
    it runs twice to keep in step. The gathered rows are each sample once, in order; a median over them (a metric no
    sum over ranks gives) is the one-process median."""
    r = launch("world=fsdp", "world.nproc_per_node=2", SCRIPT, "gather", "5", "2")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["indices"] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert out["median"] == pytest.approx((torch.linspace(-1, 1, 5) ** 3).median().item(), abs=0)
    assert "rt.gather needs the same shape and dtype on every rank, and got rank 0: [3, 2]" in out["gather_refused"]
    assert out["scalars"] == [0.0, 1.0]  # (a 0-dim tensor per rank: torch.cat refused them, a traceback on each rank)
    assert out["summed"] == ["int", 3]


def test_save_state_on_one_rank_only_is_an_error_not_a_hang(tmp_path):
    """rt.save_state under `if rt.is_main_process`, and before it an rt.register there (saved from rank 0, then
    refused at the load by rank 1): each refused on every rank it concerns, before anything is written."""
    r = launch("world=ddp", "world.nproc_per_node=2", SCRIPT, "save_on_main_only", str(tmp_path),
               env={"TRAINER_COLLECTIVE_TIMEOUT": "5"})
    assert r.returncode == 2, r.stderr
    for rank in (0, 1):
        assert (f"rank {rank} refused: rt.save_state: the ranks set up different things to checkpoint ('counter' on "
                "rank 0 only)") in r.stdout, r.stdout
    assert "Nothing was written" in r.stdout
    assert "rt.save_state was called on rank 0 but not on every rank" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints").iterdir())


def test_ranks_in_different_save_and_load_calls_are_an_error_not_a_hang(tmp_path):
    """Rank 0 in rt.save_state, rank 1 in rt.save_model: both passed the same barrier, then waited forever in each
    other's collectives. Now each names what every rank called."""
    r = launch("world=ddp", "world.nproc_per_node=2", SCRIPT, "diverge", str(tmp_path), timeout=120)
    assert r.returncode == 2, r.stderr
    assert "the ranks called different Runtime methods at the same point (rank 0: rt.save_state, rank 1: " \
           "rt.save_model)" in r.stderr
    assert "Traceback" not in r.stderr
    assert not list(tmp_path.glob("*.safetensors")) and not list(tmp_path.glob("checkpoints/step_*"))


def test_a_frozen_teacher_set_up_under_ddp_is_left_unwrapped_with_rank_0s_weights():
    """DistributedDataParallel refuses a module with nothing to train: a distillation script's frozen teacher, set
    up beside its student, ended in torch's traceback. It is left unwrapped (as Accelerate's prepare leaves it),
    with rank 0's weights on every rank, as DDP would have broadcast them; the student trains as under DDP."""
    r = launch("world=ddp", "world.nproc_per_node=2", SCRIPT, "teacher")
    assert r.returncode == 0, r.stderr
    lines = sorted(line.split(" ", 2)[2] for line in r.stdout.splitlines() if line.startswith("rank "))
    assert len(lines) == 2 and lines[0] == lines[1], r.stdout  # (teacher and student: equal on both ranks)


@pytest.mark.parametrize("world", ["ddp", "fsdp"])
def test_ranks_that_set_up_models_of_other_shapes_are_told_which_tensor_differs(world):
    """A model whose shape depends on the rank: DDP's check failed in a torch traceback, and FSDP broadcast rank 0's
    tensors into other shapes until gloo aborted the process (SIGABRT, a C++ dump)."""
    r = launch(f"world={world}", "world.nproc_per_node=2", SCRIPT, "rank_shaped")
    assert r.returncode == 2, r.stderr
    assert "Runtime.setup: the ranks set up different models (weight is [4, 4] torch.float32 on rank 0 and weight " \
           "[5, 4] torch.float32 on rank 1)" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "Fatal Python error" not in r.stderr


def test_accelerators_keywords_and_a_misspelt_one_are_told_the_runtimes_names():
    """Runtime(mixed_precision="bf16", gradient_accumulation_steps=2), an Accelerator's spelling, was a bare TypeError."""
    import trainer

    with pytest.raises(UserError, match="mixed_precision is Accelerate's: here precision='bf16' .*; "
                                        "gradient_accumulation_steps is Accelerate's: here grad_accum_steps=N"):
        trainer.Runtime(mixed_precision="bf16", gradient_accumulation_steps=2)
    with pytest.raises(UserError, match=r"grad_acum_steps is not one of its keywords \(Did you mean grad_accum_steps"):
        trainer.Runtime(grad_acum_steps=2)
    with pytest.raises(UserError, match=r"expected one of auto, fp32, bf16, fp16 \('no' is Accelerate's name for fp32"):
        trainer.Runtime("single", "no")  # (Accelerate's mixed_precision="no")
    rt = trainer.Runtime("single", "fp32")  # names= counts the optimizers too, which the message said nothing of
    gen, disc = nn.Linear(2, 2), nn.Linear(2, 2)
    with pytest.raises(UserError, match=r"2 names for 4 objects: one name per object, models and optimizers alike"):
        rt.setup(gen, disc, torch.optim.SGD(gen.parameters(), lr=0.1), torch.optim.SGD(disc.parameters(), lr=0.1),
                 names=["gen", "disc"])
    # Their attributes and methods under other names here were AttributeErrors: each names the Runtime's.
    rt = trainer.Runtime("single", "fp32")
    for name, ours in (("num_processes", "rt.world_size"), ("process_index", "rt.rank"),
                       ("local_process_index", "rt.local_rank"), ("prepare", "rt.setup(model, optimizer)"),
                       ("all_gather", "rt.gather(tensor)"), ("is_global_zero", "rt.is_main_process")):
        with pytest.raises(UserError, match=rf"rt.{name} is (Accelerate|Fabric)'s: here .*{re.escape(ours)}"):
            getattr(rt, name)
    assert (rt.local_rank, rt.is_local_main_process, hasattr(rt, "no_such_name")) == (0, True, False)


def test_a_file_as_run_dir_and_an_eval_loader_over_an_endless_stream_are_refused_in_a_paragraph(tmp_path):
    import trainer

    (tmp_path / "notadir").write_text("x")
    with pytest.raises(UserError, match="notadir is a file, not a directory.* as Runtime\\(run_dir=...\\)"):
        trainer.Runtime(run_dir=tmp_path / "notadir")
    assert (tmp_path / "notadir").read_text() == "x"

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from (torch.tensor([float(i)]) for i in range(5))

    rt = trainer.Runtime()
    with pytest.raises(UserError, match="rt.eval_loader\\(Stream, ...\\): a stream without __len__"):
        rt.eval_loader(Stream(), batch_size=2)


def test_load_state_drops_the_events_logged_after_the_checkpoint(tmp_path):
    """A loop resumed from step 2 after logging steps 3-4 logged them again: metrics.jsonl held steps 3 and 4 twice.
    Only a load before this process logged anything rewinds: a later one keeps the events."""
    import json

    import trainer

    def run(steps: range) -> None:
        rt = trainer.Runtime(run_dir=tmp_path)
        model = rt.setup(nn.Linear(2, 2))
        del model
        start = rt.load_state(tmp_path / "checkpoints") or 0
        for step in steps:
            if step > start:
                rt.log({"loss": float(step)}, step)
                if step == 2:
                    rt.save_state(tmp_path / "checkpoints", step)
        rt.end()

    run(range(1, 5))  # killed after step 4's log, say
    run(range(1, 7))
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == \
        [1, 2, 3, 4, 5, 6]
    # A load later in a run (the best checkpoint, for a last eval) keeps what this process logged.
    rt = trainer.Runtime(run_dir=tmp_path / "late")
    rt.setup(nn.Linear(2, 2))
    for step in (1, 2, 3):
        rt.log({"loss": float(step)}, step)
        if step == 2:
            rt.save_state(tmp_path / "late" / "checkpoints", step)
    assert rt.load_state(tmp_path / "late" / "checkpoints" / "step_00000002") == 2
    rt.end()
    assert [json.loads(line)["step"] for line in (tmp_path / "late" / "metrics.jsonl").read_text().splitlines()] == \
        [1, 2, 3]


def test_a_new_run_in_a_used_run_dir_sets_the_earlier_metrics_aside_instead_of_appending(tmp_path, capsys):
    """The same script run twice appended a second copy of every step to metrics.jsonl (the Trainer sets an
    earlier attempt aside). A process whose first rt.log, with no checkpoint loaded, logs a step the file has is a
    new run: the earlier metrics become metrics.prev.jsonl, and its trackers start anew too (rt.init_trackers'
    config included, written only then). A later step (an evaluation logged after the run) is appended; a run that
    logs first and loads after is told where its history went."""
    import json

    import trainer

    def steps(name: str) -> list[int]:
        return [json.loads(line)["step"] for line in (tmp_path / name).read_text().splitlines()]

    def run(first: int, last: int, load: str = "first", save: bool = False) -> None:
        rt = trainer.Runtime(run_dir=tmp_path, log_with="tensorboard")
        rt.setup(nn.Linear(2, 2))
        rt.init_trackers({"first": first})
        start = (rt.load_state(tmp_path / "checkpoints") or 0) if load == "first" else 0
        for step in range(max(first, start + 1), last + 1):
            rt.log({"loss": float(step)}, step)
            if load == "after" and step == first:
                assert rt.load_state(tmp_path / "checkpoints") == 2
        if save:
            rt.save_state(tmp_path / "checkpoints", last)
        rt.end()

    run(1, 3, load="none")
    run(1, 2, load="none", save=True)  # the same script again, from scratch
    assert steps("metrics.prev.jsonl") == [1, 2, 3] and steps("metrics.jsonl") == [1, 2]
    assert "kept as metrics.prev.jsonl" in capsys.readouterr().err
    pytest.importorskip("tensorboard")
    from test_tensorboard import scalars, texts

    assert [s for s, _ in scalars(tmp_path / "tensorboard")["loss"]] == [1, 2]  # (this run's alone, config and all)
    assert [s for s, _ in scalars(tmp_path / "tensorboard.prev")["loss"]] == [1, 2, 3]
    assert [t for _, t in texts(tmp_path / "tensorboard", "config")] == ["first: 1"]
    run(1, 4)  # a resume from step 2: the history goes on in one file
    assert steps("metrics.jsonl") == [1, 2, 3, 4] and not (tmp_path / "metrics.prev-2.jsonl").exists()
    assert capsys.readouterr().err == ""
    run(7, 7, load="none")  # an evaluation after the run, at a later step: appended, in TensorBoard too
    assert steps("metrics.jsonl") == [1, 2, 3, 4, 7] and capsys.readouterr().err == ""
    assert [s for s, _ in scalars(tmp_path / "tensorboard")["loss"]] == [1, 2, 3, 4, 7]
    run(1, 2, load="after")  # logs first, loads after: set aside, and said so at the load
    err = capsys.readouterr().err
    assert steps("metrics.prev-2.jsonl") == [1, 2, 3, 4, 7] and steps("metrics.jsonl") == [1, 2]
    assert [s for s, _ in scalars(tmp_path / "tensorboard.prev-2")["loss"]] == [1, 2, 3, 4, 7]  # (one number)
    assert "rt.load_state after rt.log: the run's metrics up to this checkpoint are in" in err and \
        "metrics.prev-2.jsonl" in err, err

def test_backward_outside_accumulate_with_accumulation_on_ranks_is_an_error(tmp_path):
    r = launch("world=ddp", "world.nproc_per_node=2", "trainer.grad_accum_steps=2", SCRIPT, "backward_outside",
               str(tmp_path))
    assert r.returncode == 2, r.stderr
    assert "rt.backward outside rt.accumulate(model) with grad_accum_steps=2" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_loop_that_runs_the_module_under_ddp_s_wrapper_is_refused(tmp_path):
    """rt.setup returns DDP's wrapper; a loop that kept running the module it passed in trained each rank on its own
    gradients (the ranks' weights drifted apart, and save_model kept rank 0's), with no error."""
    r = launch("world=ddp", "world.nproc_per_node=2", SCRIPT, "bare_model")
    assert r.returncode == 2, r.stderr
    assert "rt.accumulate got the module passed to rt.setup for 'model', not the DistributedDataParallel" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_forward_of_the_module_under_ddp_s_wrapper_is_refused_at_the_first_step():
    """The same mistake with the wrapper given to rt.accumulate and the module underneath run: each rank stepped on
    its own gradients, with no error. A model run through its wrapper steps as before (its ranks agree)."""
    r = launch("world=ddp", "world.nproc_per_node=2", SCRIPT, "bare_forward")
    assert r.returncode == 2, r.stderr
    assert "the gradients of 'model_2' differ between ranks at its first step (weight:" in r.stderr
    assert "Traceback" not in r.stderr
    assert r.stdout.count("good stepped: True") == 2 and r.stdout.count("bad unchanged: True") == 2, r.stdout
    assert r.stdout.count("local stepped: True") == 2, r.stdout  # (rt.no_sync on purpose: left alone)


def test_your_own_loop_on_two_pipeline_stages_equals_one_process(tmp_path):
    """rt.forward_backward with a mean loss: under world.pp each microbatch's mean is averaged, so two stages
    (2 microbatches of 4) give one process's losses and weights."""
    one, pp = tmp_path / "one", tmp_path / "pp"
    for d in (one, pp):
        d.mkdir()
    r = run_here("launch", FP32, SCRIPT, "pipeline", str(one), cwd=one)
    assert r.returncode == 0, r.stderr
    r2 = launch("world=ddp", "world.nproc_per_node=2", "world.pp=2", SCRIPT, "pipeline", str(pp))
    assert r2.returncode == 0, r2.stderr
    losses = [json.loads(line)["losses"] for line in (r.stdout, r2.stdout) for line in line.splitlines()
              if line.startswith('{"losses"')]
    assert len(losses) == 2 and losses[1] == pytest.approx(losses[0], rel=1e-5)
    # The gradient is summed over two microbatches instead of one batch: the order of the sums (test_pipeline).
    assert_close_weights(pp / "model.safetensors", one / "model.safetensors", atol=1e-4)


def test_backward_under_pipeline_stages_is_an_error_that_names_forward_backward(tmp_path):
    from test_errors import assert_clean_error

    r = launch("world=ddp", "world.nproc_per_node=2", "world.pp=2", SCRIPT, "pipeline_backward", str(tmp_path))
    assert_clean_error(r, "rt.backward under pipeline parallelism (world.pp)", "rt.forward_backward")
    # Batches of 3 rows in 2 microbatches: a ValueError from inside the schedule (the last stage's rows were not
    # its targets'), where the Trainer refuses such a data.batch_size before it starts.
    r = launch("world=ddp", "world.nproc_per_node=2", "world.pp=2", SCRIPT, "pipeline_uneven", str(tmp_path))
    assert_clean_error(r, "world.microbatches=2 does not divide this batch's 3 rows")


# -- misuse on one process -------------------------------------------------------------------------------------
@pytest.fixture
def rt():
    import trainer

    return trainer.Runtime("single", "fp32", grad_accum_steps=2)


def test_what_is_not_a_set_up_model_or_parameters_is_refused_by_accumulate_and_clipping(rt):
    model = rt.setup(nn.Linear(2, 2))
    for wrong, says in (("model", "got a str, not a model"), (nn.Linear(2, 2), "got a Linear that was not set up")):
        with pytest.raises(UserError, match=says):
            rt.accumulate(wrong)
    with pytest.raises(UserError, match="rt.clip_grad_norm_ got a str: pass a set-up model or its parameters"):
        rt.clip_grad_norm_("model", 1.0)
    # What it takes: the model, its parameters as a list or a generator, a tensor.
    model(torch.ones(1, 2)).sum().backward()
    norms = [rt.clip_grad_norm_(t, None) for t in (model, list(model.parameters()), model.parameters())]
    assert norms[0] == norms[1] == norms[2] > 0
    assert rt.clip_grad_norm_(model.weight, None) == model.weight.grad.norm()
    with rt.accumulate(torch.compile(model)):  # a compiled set-up model is that model (compiled on first call only)
        pass
    import trainer

    one = trainer.Runtime("single", "fp32")
    parts = one.setup(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    with one.accumulate(parts[0]):  # a part of a set-up model that no wrapper stands in for (one process)
        pass


def test_rt_loader_refuses_bad_counts_an_empty_dataset_and_a_name_it_cannot_take(rt):
    import numpy as np

    data = torch.utils.data.TensorDataset(torch.arange(8.0))
    for kwargs, says in (({"batch_size": 0}, r"batch_size=0\): batch_size must be an integer >= 1"),
                         ({"batch_size": "4"}, r"batch_size='4'\)"), ({"batch_size": 2.5}, r"batch_size=2.5\)"),
                         ({"batch_size": 2, "num_workers": -1}, r"num_workers=-1\): num_workers must be an integer >= 0")):
        with pytest.raises(UserError, match=says):
            rt.loader(data, **kwargs)
    with pytest.raises(UserError, match="got an empty TensorDataset"):
        rt.loader(torch.utils.data.TensorDataset(torch.zeros(0)), batch_size=2)
    with pytest.raises(UserError, match=r"rt.eval_loader\(limit=-1\)"):
        rt.eval_loader(data, batch_size=2, limit=-1)
    rt.register("schedule", torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1)], lr=1.0), lambda s: 1))
    for taken, by in (("schedule", "rt.register"), ("rng", "the run itself")):
        with pytest.raises(UserError, match=rf"rt.loader\(name='{taken}'\): the name is taken by {by}"):
            rt.loader(data, batch_size=2, name=taken)
    # A loader made again under its name (a new phase) replaces the old one in save_state.
    rt.loader(data, batch_size=2, name="train")
    again = rt.loader(data, batch_size=4, name="train")
    assert rt.stateful["train"] is again
    assert rt.loader(data, batch_size=2) is rt.stateful["loader"] and rt.loader(data, np.int64(2)).batch_size == 2


def test_a_loop_rolled_back_to_an_earlier_checkpoint_keeps_the_branch_it_leaves(tmp_path, capsys):
    """rt.load_state(step 2) of checkpoints 2 and 4, then a save of step 4: the save replaced the abandoned branch's
    step 4, and the rewind cut its metrics. A load alone (for an eval) moves nothing."""
    import trainer

    ck = tmp_path / "checkpoints"
    rt = trainer.Runtime(run_dir=tmp_path)
    model = rt.setup(nn.Linear(2, 2))
    for step in (1, 2, 3, 4):
        rt.log({"loss": float(step)}, step)
        if step % 2 == 0:
            rt.save_state(ck, step)
    rt.end()
    branch = (tmp_path / "metrics.jsonl").read_text()
    old_4 = (ck / "step_00000004" / "model.safetensors").read_bytes()

    rt = trainer.Runtime(run_dir=tmp_path)
    model = rt.setup(nn.Linear(2, 2))
    assert rt.load_state(ck / "step_00000002") == 2
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step_")) == ["step_00000002", "step_00000004"]
    with torch.no_grad():
        model.weight.add_(1.0)  # (another branch)
    rt.save_state(ck, 4)
    rt.end()
    assert (tmp_path / "checkpoints.prev" / "step_00000004" / "model.safetensors").read_bytes() == old_4
    assert (ck / "step_00000004" / "model.safetensors").read_bytes() != old_4
    assert (tmp_path / "metrics.prev.jsonl").read_text() == branch
    assert "step_00000002 is older than step_00000004, written before this rollback: they are kept in" in \
        capsys.readouterr().err


def test_a_loop_started_from_another_runs_checkpoint_keeps_this_run_dirs_own_history_aside(tmp_path, capsys):
    """rt.load_state(another run's checkpoint) in a run_dir that held a run of its own: metrics.jsonl went on from
    its own steps 1-4 with the other run's 3-4, and its checkpoints were set aside under another number than its
    metrics. As the Trainer does: its metrics and checkpoints are kept under one number, and the history starts at
    the checkpoint. Checkpoints a loop keeps outside any run dir are its own (its restarts continue the history)."""
    import trainer

    def loop(run_dir, load=None, ck=None, steps=4, lr=1.0):
        rt = trainer.Runtime(run_dir=run_dir)
        rt.setup(nn.Linear(2, 2))
        start = rt.load_state(load) if load is not None else 0
        for step in range(start + 1, steps + 1):
            rt.log({"loss": lr * step}, step)
            if step % 2 == 0:
                rt.save_state(ck or run_dir / "checkpoints", step)
        rt.end()

    loop(tmp_path / "ref", lr=0.5)
    loop(tmp_path / "b")
    own = (tmp_path / "b" / "metrics.jsonl").read_text()
    capsys.readouterr()
    loop(tmp_path / "b", load=tmp_path / "ref" / "checkpoints" / "step_00000002", lr=0.5)
    assert "is another run's checkpoint" in capsys.readouterr().err
    assert (tmp_path / "b" / "metrics.prev.jsonl").read_text() == own
    assert [e["step"] for e in read_metrics(tmp_path / "b")] == [3, 4]
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints.prev").iterdir()) == ["step_00000002",
                                                                                      "step_00000004"]
    # Checkpoints outside any run dir: a restart from them continues the run's history (steps 1-2, then 3-4).
    loop(tmp_path / "c", ck=tmp_path / "elsewhere", steps=2)
    loop(tmp_path / "c", load=tmp_path / "elsewhere", ck=tmp_path / "elsewhere")
    assert [e["step"] for e in read_metrics(tmp_path / "c")] == [1, 2, 3, 4]


def test_a_restart_that_built_its_optimizer_with_another_learning_rate_is_told_which_it_trains_with(tmp_path, capsys):
    """The checkpoint's learning rate replaces the one the restarted script built its optimizer with (torch's
    load_state_dict), without a word, where the Trainer applies a new optim.lr and says so. Said; a restart mid-way
    through a schedule with the same base rate says nothing."""
    import trainer

    def run(lr, save, schedule=False):
        rt = trainer.Runtime("single", "fp32")
        torch.manual_seed(0)
        model = nn.Linear(2, 1)
        model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=lr))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1 / (k + 1)) if schedule else None
        if sched is not None:
            rt.register("sched", sched)
        if save:
            for _ in range(3):
                rt.backward(model(torch.ones(1, 2)).sum())
                rt.step(opt, sched)
            rt.save_state(tmp_path / ("s" if schedule else "p"), 3)
        else:
            rt.load_state(tmp_path / ("s" if schedule else "p"))
        return opt.param_groups[0]["lr"]

    for schedule in (False, True):
        run(0.05, save=True, schedule=schedule)
        capsys.readouterr()
        assert run(0.05, save=False, schedule=schedule) == pytest.approx(0.05 / (4 if schedule else 1))
        assert "learning rate" not in capsys.readouterr().err
        run(0.01, save=False, schedule=schedule)
        said = capsys.readouterr().err
        base = "base " if schedule else ""
        assert f"the optimizer 'optimizer' takes the checkpoint's {base}learning rate 0.05 (this script built it " \
               "with 0.01)" in said


def test_load_state_of_a_step_name_save_state_did_not_write_or_of_a_file_is_refused(rt, tmp_path):
    """save_state names checkpoints step_00000005; "step_5" was taken for a directory of checkpoints holding none,
    so `rt.load_state(...) or 0` restarted from step 0 without a word. Now it names the checkpoint meant."""
    model = rt.setup(nn.Linear(2, 2))
    saved = rt.save_state(tmp_path / "ck", 5)
    assert saved.name == "step_00000005"
    with pytest.raises(UserError, match=r"there is no such checkpoint. The checkpoint of step 5 is .*step_00000005"):
        rt.load_state(tmp_path / "ck" / "step_5")
    with pytest.raises(UserError, match=r"there is no such checkpoint\. \S+ holds step_00000005\. Pass one that exists"):
        rt.load_state(tmp_path / "ck" / "step_7")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(UserError, match="is a file: pass a checkpoint save_state wrote"):
        rt.load_state(tmp_path / "notes.txt")
    # (a StorageError, exit 74, that said to rerun with resume=auto, which a loop of one's own does not take)
    with pytest.raises(UserError, match="is a file: pass a directory, which save_state writes its checkpoints into"):
        rt.save_state(tmp_path / "notes.txt", 6)
    assert rt.load_state(tmp_path / "ck") == 5 and rt.load_state(saved) == 5
    del model


def test_a_checkpoint_of_another_model_shape_names_the_tensors_and_the_script_not_a_config(tmp_path):
    """An own loop has no config.yaml to point at: the advice is the script's model."""
    import trainer

    rt = trainer.Runtime("single", "fp32")
    rt.setup(nn.Linear(2, 2))
    rt.save_state(tmp_path, 1)
    other = trainer.Runtime("single", "fp32")
    other.setup(nn.Linear(3, 2))
    with pytest.raises(CheckpointError, match=r"does not match the model \(1 tensors\): .*weight.*Build the model as "
                                              r"the script that saved it did") as e:
        other.load_state(tmp_path)
    assert "config.yaml" not in str(e.value)


def test_a_checkpoint_of_another_optimizer_class_says_so(tmp_path):
    import trainer

    def set_up(rt, optimizer_class, **kwargs):
        model = nn.Linear(2, 2)
        model, opt = rt.setup(model, optimizer_class(model.parameters(), **kwargs))
        with rt.accumulate(model):
            rt.backward(model(torch.ones(1, 2)).sum())
        rt.step(opt)

    set_up(rt := trainer.Runtime("single", "fp32"), torch.optim.Adam)
    rt.save_state(tmp_path, 1)
    set_up(other := trainer.Runtime("single", "fp32"), torch.optim.SGD, lr=0.1, momentum=0.9)
    with pytest.raises(CheckpointError, match=r"'/optimizer/state/weight' lacks momentum_buffer. The optimizer it was saved with kept other "
                                              r"state or settings: another optimizer class.*in a loop of one's own, "
                                              r"model.load_state_dict\(safetensors.torch.load_file\(CHECKPOINT/model"):
        other.load_state(tmp_path)
    # What it says to do: the weights alone, into a model that is then set up with the new optimizer.
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "step_00000001" / "model.safetensors")
    model = nn.Linear(2, 2)
    model.load_state_dict(saved)
    trainer.Runtime("single", "fp32").setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())


def test_a_model_set_up_twice_is_refused(rt):
    model = nn.Linear(2, 2)
    rt.setup(model)
    with pytest.raises(UserError, match="set up already"):
        rt.setup(model)


def test_an_optimizer_over_a_model_that_was_not_set_up_is_refused(rt):
    rt.setup(nn.Linear(2, 2))
    stray = nn.Linear(2, 2)
    with pytest.raises(UserError, match="parameters of no model set up here"):
        rt.setup(torch.optim.SGD(stray.parameters(), lr=0.1))


def test_one_optimizer_over_two_models_is_refused(rt):
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    with pytest.raises(UserError, match="give each model its own optimizer"):
        rt.setup(a, b, torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1))


def test_a_scheduler_stepped_every_micro_batch_is_refused_and_one_stepped_with_the_optimizer_is_not(rt):
    """Accelerate's prepared scheduler skips the scheduler.step() its loops call every micro-batch; here the
    scheduler is the user's own, so such a loop ran the schedule grad_accum_steps times too fast. A learning rate
    that moves within two steps running is refused (an epoch's scheduler, stepped where an epoch ends mid-step, is
    not); stepped by rt.step, or by hand when rt.step returns True (or set by hand after it), the schedule takes
    one step per optimizer step."""
    model = nn.Linear(2, 1)
    model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    for way in ("rt.step", "by hand", "lr by hand"):
        for _ in range(2):  # two optimizer steps of two micro-steps each
            for _ in range(2):
                with rt.accumulate(model):
                    rt.backward(model(torch.ones(1, 2)).sum())
                if way == "rt.step":
                    rt.step(opt, sched)
                elif rt.step(opt):
                    if way == "by hand":
                        sched.step()
                    else:
                        opt.param_groups[0]["lr"] = 0.1 / (sched.last_epoch + 1)
    assert sched.last_epoch == 4 and opt.param_groups[0]["lr"] == pytest.approx(0.1 / 5)  # 4 scheduler steps
    for step in range(6):  # an epoch's scheduler, stepped where an epoch of 3 micro-batches ends mid-step: allowed
        for micro in range(2):
            with rt.accumulate(model):
                rt.backward(model(torch.ones(1, 2)).sum())
            rt.step(opt)
            if (2 * step + micro) % 3 == 2:
                sched.step()
    for step in range(3):  # every micro-batch, as in an Accelerate loop: refused in the third step
        with rt.accumulate(model):
            rt.backward(model(torch.ones(1, 2)).sum())
        rt.step(opt)
        sched.step()
        if step == 2:
            break
        with rt.accumulate(model):
            rt.backward(model(torch.ones(1, 2)).sum())
        rt.step(opt)
        sched.step()
    with pytest.raises(UserError, match=r"learning rate of the optimizer of 'model' keeps changing in the middle of "
                                        r"accumulations \(again before micro-step 2 of 2\).*2 times too fast.*"
                                        r"rt.step\(optimizer, scheduler\)"):
        rt.accumulate(model)
    # Four micro-steps a step: an epoch of 5 micro-batches ends mid-step in three steps running (allowed); a scheduler
    # stepped every micro-batch moves the rate twice in the first step (refused).
    import trainer

    rt4 = trainer.Runtime("single", "fp32", grad_accum_steps=4)
    model4 = nn.Linear(2, 1)
    model4, opt4 = rt4.setup(model4, torch.optim.SGD(model4.parameters(), lr=0.1))
    sched4 = torch.optim.lr_scheduler.LambdaLR(opt4, lambda step: 1.0 / (step + 1))
    for micro in range(1, 21):
        with rt4.accumulate(model4):
            rt4.backward(model4(torch.ones(1, 2)).sum())
        rt4.step(opt4)
        if micro % 5 == 0:
            sched4.step()
    with pytest.raises(UserError, match=r"keeps changing.*before micro-step 3 of 4"):
        for _ in range(3):
            with rt4.accumulate(model4):
                rt4.backward(model4(torch.ones(1, 2)).sum())
            rt4.step(opt4)
            sched4.step()


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # (torch's, at the habit's start)
@pytest.mark.parametrize("accum", [2, 4])
def test_a_registered_step_scheduler_stepped_every_micro_batch_is_refused(accum):
    """A StepLR (or MultiStepLR) stepped by the loop every micro-batch, the Accelerate way, moves the learning rate
    at most once a step, which the rate check cannot tell from an epoch's scheduler: it ran the schedule
    grad_accum_steps times too fast without a word (last_epoch 20 after 10 optimizer steps). Its count tells:
    refused at the third step boundary, before that update; stepped when rt.step returns True, or where epochs of a
    few micro-batches end, it runs."""
    import trainer

    def fresh():
        rt = trainer.Runtime("single", "fp32", grad_accum_steps=accum)
        model = nn.Linear(2, 1)
        model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        return rt, model, opt, rt.register("scheduler", torch.optim.lr_scheduler.StepLR(opt, step_size=10))

    def micro_step(rt, model, opt) -> bool:
        with rt.accumulate(model):
            rt.backward(model(torch.ones(1, 2)).sum())
        return rt.step(opt)

    rt, model, opt, sched = fresh()
    for _ in range(6 * accum):  # stepped after applied updates only: 6 steps, 6 scheduler steps
        if micro_step(rt, model, opt):
            sched.step()
    for micro in range(1, 6 * accum + 1):  # an epoch's scheduler, epochs of 3 micro-batches (5 at accum 4)
        micro_step(rt, model, opt)
        if micro % (3 if accum == 2 else 5) == 0:
            sched.step()
    assert sched.last_epoch == 6 + 6 * accum // (3 if accum == 2 else 5)
    chained = rt.register("chained", torch.optim.lr_scheduler.ChainedScheduler(  # (no count of its own: was an
        [torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)]))                      # AttributeError at rt.step)
    for _ in range(3 * accum):
        if micro_step(rt, model, opt):
            chained.step()

    rt, model, opt, sched = fresh()
    for _ in range(2 * accum + accum - 1):  # every micro-batch: two steps' worth, then the third's first micro-steps
        micro_step(rt, model, opt)
        sched.step()
    before = model.weight.detach().clone()
    with pytest.raises(UserError, match=rf"the StepLR registered as 'scheduler' \(the optimizer of 'model'\) moved "
                                        rf"{accum} times between optimizer steps, 2 steps running.*Nothing was updated"):
        micro_step(rt, model, opt)
    assert torch.equal(model.weight, before) and sched.last_epoch == 3 * accum - 1


def test_a_loop_that_ends_in_the_middle_of_an_accumulation_says_what_it_never_applied(tmp_path, capfd):
    """A DataLoader of the loop's own, 5 micro-batches an epoch with grad_accum_steps=2: the last one's gradients were
    never applied, and rt.save_model and rt.end() said nothing. A note names them and the way to step on them;
    passing last=True to the epoch's last micro-batch applies them (the same update as a big batch of the two), and
    last=False before it leaves the steps to the count."""
    import trainer

    batches = [torch.full((1, 2), float(i)) for i in range(5)]

    def run(last: bool):
        rt = trainer.Runtime("single", "fp32", grad_accum_steps=2)
        torch.manual_seed(0)
        model = nn.Linear(2, 1)
        model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        stepped = []
        for i, x in enumerate(batches):
            with rt.accumulate(model, last=(i == len(batches) - 1) if last else None):
                rt.backward((model(x) - 1).square().sum())
            stepped.append(rt.step(opt))
        rt.save_model(model, tmp_path / f"last_{last}")
        rt.end()
        return model, stepped

    assert run(last=False)[1] == [False, True, False, True, False]
    err = capfd.readouterr().err  # (at rt.end(); not at the rt.save_model before it, where a loop may go on)
    assert err.count("note: the loop's last 1 micro-batch(es) were never applied: it ended after micro-step 1 of 2 "
                     "of a step") == 1 and "rt.accumulate(model, last=i == len(loader) - 1)" in err, err
    # last=False before the last micro-batch is no end of the data: the count still ends steps there (it once held
    # every step back, and the epoch was one step of five micro-batches)
    model, stepped = run(last=True)
    assert stepped == [False, True, False, True, True]
    assert "never applied" not in capfd.readouterr().err
    rt = trainer.Runtime("single", "fp32", grad_accum_steps=2)  # a save in the middle of a step, the loop going on
    net = nn.Linear(2, 1)
    net, opt = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for i in range(4):
        with rt.accumulate(net):
            rt.backward(net(torch.ones(1, 2)).sum())
        rt.step(opt)
        if i == 2:
            rt.save_model(net, tmp_path / "mid")
    rt.end()
    assert "never applied" not in capfd.readouterr().err
    torch.manual_seed(0)  # by hand: two steps of two micro-batches, then the fifth alone (its loss halved, as each is)
    ref = nn.Linear(2, 1)
    for step in (batches[0:2], batches[2:4], batches[4:]):
        for x in step:
            ((ref(x) - 1).square().sum() / 2).backward()
        with torch.no_grad():
            for p in ref.parameters():
                p -= 0.1 * p.grad
                p.grad = None
    # (the same float operations in the same order: a few ulps at most, against 0.06 for one step of all five)
    torch.testing.assert_close(model.weight, ref.weight, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(model.bias, ref.bias, rtol=1e-6, atol=1e-6)


def test_under_fp16_a_clip_of_ones_own_before_unscaling_is_warned_of_and_after_it_is_rt_s_clip(capfd):
    """torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) under fp16 measured the loss-scaled norm (37,532) and
    cut the true gradients to a sliver, silently. Said at rt.step, once (an edit that does not depend on the scale,
    zeroing rows, is right: a warning, not a refusal); after rt.unscale_(optimizer) the same call is the update
    rt.clip_grad_norm_ gives, and nothing is said."""
    import trainer

    def fresh():
        rt = trainer.Runtime("single", "fp16", grad_accum_steps=2)
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        return rt, model, opt

    def grads(rt, model):
        for x in (torch.ones(2, 4), torch.full((2, 4), 3.0)):
            with rt.accumulate(model):
                rt.backward(model(x).pow(2).mean())

    rt, model, opt = fresh()
    before = model.weight.detach().clone()
    for _ in range(2):
        grads(rt, model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        assert rt.step(opt) is True
    err = capfd.readouterr().err
    assert err.count("warning: the gradients of 'model' were changed in place while they still carried fp16's loss "
                     "scale") == 1 and "rt.clip_grad_norm_(model, max_norm), which unscales first" in err, err
    assert (model.weight - before).abs().max() < 1e-3  # (two steps of lr 0.1 on gradients cut to ~1/65536)

    ways = []
    for way in ("rt", "unscale, then torch's"):
        rt, model, opt = fresh()
        grads(rt, model)
        if way == "rt":
            rt.clip_grad_norm_(model, 1.0)
        else:
            rt.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        assert rt.step(opt) is True
        ways.append(model.weight.detach().clone())
    assert torch.equal(ways[0], ways[1]) and not torch.equal(ways[0], before)
    assert "warning" not in capfd.readouterr().err


def test_zero_grad_in_the_middle_of_an_accumulation_is_refused(rt):
    """In every form that throws away earlier micro-batches: the optimizer's zero_grad after a micro-step that is
    not the last, inside the next micro-step before its backward, or with set_to_none=False (zeros, not None), each
    refused before it zeroes; a module's zero_grad, which nothing intercepts, at the next micro-step. A step's first
    micro-step may zero before its backward (a plain PyTorch loop's habit)."""
    model = nn.Linear(2, 1)
    model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with rt.accumulate(model):
        opt.zero_grad()  # the step's first micro-step, before its backward: nothing to lose
        rt.backward(model(torch.ones(1, 2)).sum())
        with pytest.raises(UserError, match=r"optimizer.zero_grad\(\) in the middle of an accumulation"):
            opt.zero_grad()  # after its backward, in a micro-step that is not the last
    assert rt.step(opt) is False  # mid-accumulation: no step, gradients kept
    for zero in (opt.zero_grad, lambda: opt.zero_grad(set_to_none=False)):
        with pytest.raises(UserError, match=r"micro-step 1 of 2\): it would throw away the gradients"):
            zero()
    with rt.accumulate(model):
        with pytest.raises(UserError, match=r"in the middle of an accumulation \(micro-step 2 of 2"):
            opt.zero_grad()
        assert torch.equal(model.weight.grad, torch.full((1, 2), 0.5))  # the first micro-step's, kept throughout
        rt.backward(model(torch.ones(1, 2)).sum())
    assert rt.step(opt) is True
    with rt.accumulate(model):  # the next step
        rt.backward(model(torch.ones(1, 2)).sum())
    model.zero_grad()
    with pytest.raises(UserError, match="zeroed in the middle of an accumulation"), rt.accumulate(model):
        pass


def test_optimizer_step_of_the_users_own_is_refused_where_it_would_be_wrong_and_changes_nothing(rt):
    """A set-up optimizer's own step() (an Accelerate loop's habit) in the middle of an accumulation would apply half
    the step's gradients as a step of its own; under fp16 it would apply gradients still multiplied by the loss
    scale. Both are refused before the weights change; at the boundary in fp32 it is the same update as rt.step."""
    import trainer

    model = nn.Linear(2, 1)
    model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = model.weight.detach().clone()
    with rt.accumulate(model):
        rt.backward(model(torch.ones(1, 2)).sum())
    with pytest.raises(UserError, match=r"in the middle of an accumulation \(after micro-step 1 of 2\).*rt.step"):
        opt.step()
    assert torch.equal(model.weight, before)
    with rt.accumulate(model):  # the boundary: a plain step is what rt.step would do
        rt.backward(model(torch.ones(1, 2)).sum())
    opt.step()
    assert torch.equal(model.weight, before - 0.1 * torch.ones(1, 2))

    fp16 = trainer.Runtime("single", "fp16")
    model = nn.Linear(2, 1)
    model, opt = fp16.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = model.weight.detach().clone()
    fp16.backward(model(torch.ones(1, 2)).sum())
    with pytest.raises(UserError, match="under precision=fp16: the gradients are still multiplied by the loss scale"):
        opt.step()
    assert torch.equal(model.weight, before)
    assert fp16.step(opt) is True  # through the scaler: the true gradient
    assert torch.equal(model.weight, before - 0.1 * torch.ones(1, 2))


def test_clipping_in_the_middle_of_an_accumulation_is_refused_and_at_the_boundary_clips_the_whole_step(rt):
    """Clipping every micro-step clipped a part of the step's gradients (and under fp16 unscaled the first
    micro-step's, then added scaled ones to them: NaN weights, without a word)."""
    model = nn.Linear(2, 1, bias=False)
    model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
    before = model.weight.detach().clone()
    with rt.accumulate(model):
        rt.backward(model(torch.ones(1, 2)).sum() * 10)
    with pytest.raises(UserError, match=r"rt.clip_grad_norm_ in the middle of an accumulation.*if rt.sync_gradients"):
        rt.clip_grad_norm_(model, 1.0)
    assert torch.equal(model.weight.grad, torch.full((1, 2), 5.0))  # untouched
    with rt.accumulate(model):
        rt.backward(model(torch.ones(1, 2)).sum() * 10)
    norm = rt.clip_grad_norm_(model, 1.0)  # the whole step's: (10, 10)
    torch.testing.assert_close(norm, torch.tensor(200.0).sqrt())
    assert rt.step(opt) is True
    torch.testing.assert_close(model.weight.detach(), before - 2 ** -0.5)


def test_fp16_one_models_overflow_does_not_rescale_another_optimizers_update():
    """Two models, two optimizers, one loss scaler: A's gradients overflow, so its step is skipped and the scale
    backs off. B's gradients were scaled by the scale before that backoff, and must be unscaled by it too: B's
    update is bit for bit B's update when trained alone (the scaler updated after every optimizer, so B's update
    was twice its gradient's)."""
    import trainer

    def run(with_a: bool):
        rt = trainer.Runtime("single", "fp16")
        torch.manual_seed(0)
        a, b = nn.Linear(4, 1), nn.Linear(4, 1)
        a, b, opt_a, opt_b = rt.setup(a, b, torch.optim.SGD(a.parameters(), lr=0.1),
                                      torch.optim.SGD(b.parameters(), lr=0.1))
        x = torch.ones(2, 4)
        with rt.accumulate(a, b):
            with rt.autocast():  # (the linear layers' gradients in fp16)
                loss_a = (a(x).float() * 1e4).pow(2).mean() if with_a else None
                loss_b = 1e-3 * b(x).float().pow(2).mean()
            if with_a:
                rt.backward(loss_a)  # its scaled gradients overflow fp16's range
            rt.backward(loss_b)
        applied = [rt.step(opt_a), rt.step(opt_b)] if with_a else [rt.step(opt_b)]
        return applied, b.weight.detach().clone()

    (a_applied, b_applied), together = run(True)
    [alone_applied], alone = run(False)
    assert (a_applied, b_applied, alone_applied) == (False, True, True)
    torch.testing.assert_close(together, alone, rtol=0, atol=0)


def test_mistakes_that_would_step_or_save_in_the_middle_of_an_accumulation_are_refused(rt, tmp_path):
    """On one process too: a backward outside rt.accumulate stepped every micro-batch (each loss halved), a
    save_state after the first micro-step lost its gradients on resume, and load_state of a checkpoint that is
    not there started afresh."""
    model = nn.Linear(2, 1)
    model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(UserError, match="rt.backward outside rt.accumulate.*grad_accum_steps=2"):
        rt.backward(model(torch.ones(1, 2)).sum())
    with rt.accumulate(model):
        rt.backward(model(torch.ones(1, 2)).sum())
    with pytest.raises(UserError, match=r"rt.save_state in the middle of an accumulation \(after micro-step 1 of 2\)"):
        rt.save_state(tmp_path / "ckpt", step=1)
    assert not (tmp_path / "ckpt").exists()
    with rt.accumulate(model):
        rt.backward(model(torch.ones(1, 2)).sum())
    assert rt.step(opt) is True
    rt.save_state(tmp_path / "ckpt", step=1)  # at the boundary
    with pytest.raises(UserError, match="step_00000099'\\): there is no such checkpoint"):
        rt.load_state(tmp_path / "ckpt" / "step_00000099")
    assert rt.load_state(tmp_path / "ckpt") == 1 and rt.load_state(tmp_path / "none") is None


def test_a_micro_step_that_raises_leaves_the_strategys_no_sync_and_the_accumulation(rt, monkeypatch):
    """rt.accumulate enters the strategy's no_sync of each model (DDP's restores its sync flag on exit): a step that
    raises inside the block must still leave them, and leave the Runtime out of its accumulation."""
    events = []

    class Recording:
        def __enter__(self):
            events.append("enter")

        def __exit__(self, *exc):
            events.append(("exit", exc[0]))

    model = nn.Linear(2, 1)
    model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ZeroDivisionError), rt.accumulate(model, last=True):  # one process: no_sync is a nullcontext
        assert rt._in_accumulate
        raise ZeroDivisionError("the step failed")
    assert not rt._in_accumulate
    monkeypatch.setattr(rt.strategy, "no_sync", lambda m, enabled: Recording())
    with pytest.raises(ZeroDivisionError), rt.accumulate(model):
        assert rt._in_accumulate and events == ["enter"]
        rt.backward(model(torch.ones(1, 2)).sum())
        raise ZeroDivisionError("the step failed")
    assert events == ["enter", ("exit", ZeroDivisionError)] and not rt._in_accumulate
    with rt.accumulate(model):  # and the next micro-step (the boundary) enters and leaves it again
        rt.backward(model(torch.ones(1, 2)).sum())
    assert events[2:] == ["enter", ("exit", None)] and rt.step(opt) is True


def test_accumulating_two_micro_batches_equals_one_batch_of_both(rt):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    twin = nn.Linear(3, 1)
    twin.load_state_dict(model.state_dict())
    model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(4, 3)
    for half in (x[:2], x[2:]):
        with rt.accumulate(model):
            rt.backward(model(half).pow(2).mean())
    assert rt.step(opt) is True
    ref_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    twin(x).pow(2).mean().backward()
    ref_opt.step()
    torch.testing.assert_close(model.weight, twin.weight, rtol=0, atol=1e-7)
    assert model.weight.grad is None  # zeroed by rt.step at the boundary


def test_clipping_a_set_up_model_follows_freezing_and_unfreezing_after_its_first_step(rt):
    """rt.clip_grad_norm_(model) lists a set-up model's parameters once (not a walk of its modules every step), but
    reads their requires_grad at every call: a layer frozen or unfrozen between steps leaves or rejoins the norm."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))

    def norm_of(params) -> torch.Tensor:
        return torch.nn.utils.get_total_norm([p.grad for p in params])

    for _ in range(2):  # one whole step (grad_accum_steps=2): the parameters are listed by now
        with rt.accumulate(model):
            rt.backward(model(torch.randn(4, 3)).pow(2).mean())
    everything = list(model.parameters())
    torch.testing.assert_close(rt.clip_grad_norm_(model, None), norm_of(everything), rtol=0, atol=0)
    model[0].requires_grad_(False)  # its gradients are still there: a stale list would count them
    torch.testing.assert_close(rt.clip_grad_norm_(model, None), norm_of(model[1].parameters()), rtol=0, atol=0)
    model[0].requires_grad_(True)
    torch.testing.assert_close(rt.clip_grad_norm_(model, None), norm_of(everything), rtol=0, atol=0)


def test_save_model_writes_safetensors_with_the_hugging_face_index_above_the_shard_size(rt, tmp_path):
    from safetensors.torch import load_file

    model = rt.setup(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)))  # 2 x 16.6 KB of fp32 weights
    written = rt.save_model(model, tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert "model.safetensors.index.json" in written and len(set(index["weight_map"].values())) == 2
    assert not (tmp_path / "model_config.json").exists()  # (it was an empty {}: nothing says how to build the model)
    loaded = {k: v for f in set(index["weight_map"].values()) for k, v in load_file(str(tmp_path / f)).items()}
    assert loaded.keys() == model.state_dict().keys()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    before = sorted(p.name for p in tmp_path.iterdir())
    for bad in ("1 gigabyte", -5, 0, "0GB"):  # (a negative size wrote one shard file per tensor)
        with pytest.raises(UserError, match=f"max_shard_size={bad!r} is invalid"):
            rt.save_model(model, tmp_path, max_shard_size=bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_an_export_leaves_no_earlier_exports_file_that_a_reader_would_prefer(rt, tmp_path):
    """A whole-file export, then a sharded one into the same dir (a run continued with a smaller
    checkpoint.max_shard_mb) left the old model.safetensors, which trainer.load and from_pretrained read first:
    the old weights, without a word. And the other way round: no stale index over missing shards."""
    from trainer.inference.finished import exported_weights

    model = rt.setup(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)))
    rt.save_model(model, tmp_path)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # trained on
    rt.save_model(model, tmp_path, max_shard_size="20KB")
    assert sorted(f.name for f in tmp_path.iterdir()) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    loaded = exported_weights(tmp_path)  # (what trainer.load reads)
    assert loaded.keys() == model.state_dict().keys()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    rt.save_model(model, tmp_path)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["model.safetensors"]


def test_the_loader_is_one_global_stream_and_a_resumed_epoch_ends_where_it_would_have(rt, tmp_path):
    """rt.loader's micro-batches are the Trainer's sampler's (one stream, any split); an epoch of 10 samples in global
    batches of 4 (2 micro-batches of 2) is 3 steps; a loader restored in the middle of an epoch finishes that epoch."""
    from torch.utils.data import TensorDataset

    from trainer.data.sampling import GlobalBatchSampler

    data = TensorDataset(torch.arange(10))
    loader = rt.loader(data, batch_size=2)
    first = [b[0].tolist() for b in loader]
    stream = iter(GlobalBatchSampler(10, 2, 2, seed=rt.seed))
    assert first == [next(stream) for _ in range(6)] and len(loader) == 6
    state = None
    again = rt.loader(data, batch_size=2, name="again")
    for i, _ in enumerate(again):
        if i == 2:
            state = again.state_dict()  # after 3 micro-batches: in the middle of step 2
    resumed = rt.loader(data, batch_size=2, name="resumed")
    resumed.load_state_dict(state)
    assert [b[0].tolist() for b in resumed] == first[3:]


def test_under_launch_what_the_script_passes_wins_and_the_jobs_config_gives_the_rest(monkeypatch):
    """Runtime(grad_accum_steps=2) under `launch` ran with the config's trainer.grad_accum_steps, and
    Runtime(precision=...) dropped the whole launch config."""
    import json

    from omegaconf import OmegaConf

    import trainer
    from trainer.loop.runtime import LAUNCH_ENV
    from trainer.parallel.precision import BF16, FP32

    cfg = trainer.compose(["debug=smoke", "trainer.grad_accum_steps=3", "trainer.seed=7", "precision=bf16"])
    monkeypatch.setenv(LAUNCH_ENV, json.dumps(OmegaConf.to_container(cfg)))
    rt = trainer.Runtime()
    assert (rt.grad_accum_steps, rt.seed, type(rt.precision)) == (3, 7, BF16)
    rt = trainer.Runtime(grad_accum_steps=2, seed=1)
    assert (rt.grad_accum_steps, rt.seed, type(rt.precision)) == (2, 1, BF16)
    rt = trainer.Runtime(precision="fp32")
    assert (rt.grad_accum_steps, rt.seed, type(rt.precision)) == (3, 7, FP32)
    before = torch.get_num_threads()
    try:
        trainer.Runtime("single", threads=1)  # the job's world.threads (smoke: 1) would be taken without it
        assert torch.get_num_threads() == 1
        monkeypatch.setenv(LAUNCH_ENV, json.dumps(OmegaConf.to_container(OmegaConf.merge(cfg, {"world": {"threads": 2}}))))
        trainer.Runtime("single", threads=1)
        assert torch.get_num_threads() == 1  # what the script passes wins
        trainer.Runtime("single")
        assert torch.get_num_threads() == 2  # the job's config gives the rest
    finally:
        torch.set_num_threads(before)


def test_under_launch_precision_auto_says_what_it_chose(monkeypatch, capsys):
    """`launch` without precision= computed in bf16 on a CPU with bf16 units, without the line `python -m trainer`
    prints (a plain script's Runtime() is fp32, as Accelerate's default)."""
    import json

    from omegaconf import OmegaConf

    import trainer
    from trainer.loop.runtime import LAUNCH_ENV

    cfg = trainer.compose(["debug=smoke", "precision=auto"])
    monkeypatch.setenv(LAUNCH_ENV, json.dumps(OmegaConf.to_container(cfg)))
    rt = trainer.Runtime()
    assert f"precision=auto: {rt.precision.name} (" in capsys.readouterr().out  # (the mode it computes in)


def test_a_loader_state_continues_the_same_sample_stream_with_another_batch_size(rt, tmp_path):
    """The state's check compared the next batches at this run's global batch, so a checkpoint of batch 2 was
    "another dataset, seed or shuffle" for batch 3: save_state is resumable under another world size or batch."""
    from torch.utils.data import TensorDataset

    from trainer.data.sampling import GlobalBatchSampler

    data = TensorDataset(torch.arange(10))
    before = rt.loader(data, batch_size=2, name="before")
    for i, _ in enumerate(before):
        if i == 1:
            state = before.state_dict()  # 4 samples in
            break
    after = rt.loader(data, batch_size=3, name="after")
    after.check_state(state, "state")
    after.load_state_dict(state)
    stream = iter(GlobalBatchSampler(10, 3, rt.grad_accum_steps, seed=rt.seed, start=4))
    got = [b[0].tolist() for _, b in zip(range(2), after)]
    assert got == [next(stream) for _ in range(2)]
    other = rt.loader(TensorDataset(torch.arange(11)), batch_size=3, name="other")
    with pytest.raises(CheckpointError, match="differs from the checkpoint's"):
        other.check_state(state, "state")


def test_a_state_saved_before_the_loader_recorded_its_global_batch_still_loads(tmp_path):
    """The loader's state gained `global_batch`; a checkpoint written without it must still load (every key the live
    state has was required)."""
    import hashlib

    from torch.utils.data import TensorDataset

    import trainer

    def fresh():
        rt = trainer.Runtime("single", "fp32", grad_accum_steps=2)
        model = rt.setup(nn.Linear(1, 1))
        rt.setup(torch.optim.SGD(model.parameters(), lr=0.1))
        return rt, rt.loader(TensorDataset(torch.arange(10.0)[:, None]), batch_size=2)

    rt, loader = fresh()
    for i, _ in enumerate(loader):
        if i == 2:
            break
    path = rt.save_state(tmp_path, step=1)
    state = json.loads((path / "state.json").read_text())
    assert state["loader"].pop("global_batch") == 4
    (path / "state.json").write_text(json.dumps(state))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["state.json"] = hashlib.sha256((path / "state.json").read_bytes()).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))
    rt2, loader2 = fresh()
    assert rt2.load_state(tmp_path) == 1
    assert loader2.samples_seen == loader.samples_seen


def test_a_resume_at_another_global_batch_says_where_it_continues(tmp_path, capsys):
    """The Trainer says so when the global batch changed on resume; a loop of one's own said nothing."""
    from torch.utils.data import TensorDataset

    import trainer

    def fresh(accum: int):
        rt = trainer.Runtime("single", "fp32", grad_accum_steps=accum)
        model = nn.Linear(1, 1)
        rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        return rt, rt.loader(TensorDataset(torch.arange(10.0)[:, None]), batch_size=2)

    rt, loader = fresh(1)
    next(iter(loader))
    rt.save_state(tmp_path, step=1)
    rt, loader = fresh(2)
    capsys.readouterr()
    assert rt.load_state(tmp_path) == 1
    assert ("global batch of 2 samples and this loop's is 4 (processes x batch_size x grad_accum_steps): it continues "
            "at sample 2") in capsys.readouterr().out


def test_a_checkpoint_saved_under_other_names_says_which_names(tmp_path):
    """rt.setup(..., names=[...]) names what a checkpoint holds; a load under other names said the model's tensors
    were all missing (or that '/optimizer' lacked a key), as if the model differed. It names both sides."""
    import trainer

    def setup(*names):
        rt = trainer.Runtime("single", "fp32")
        torch.manual_seed(0)
        a, b = nn.Linear(2, 2), nn.Linear(2, 3)
        rt.setup(a, b, torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1),
                 names=list(names) if names else None)
        return rt

    setup("gen", "disc", "opt_g", "opt_d").save_state(tmp_path, step=1)
    for names, says in ((("model", "model_1", "opt_g", "opt_d"), "its models are named 'disc', 'gen' where this "
                                                                  "script set up 'model', 'model_1'"),
                        (("gen", "disc", "g", "d"), "its optimizers 'opt_d', 'opt_g' where this script set up 'g', "
                                                    "'d'")):
        with pytest.raises(UserError, match="holds what this script set up under other names: " + re.escape(says)
                           + r".*names=\[...\]"):
            setup(*names).load_state(tmp_path)
    assert setup("gen", "disc", "opt_g", "opt_d").load_state(tmp_path) == 1


def test_a_for_over_a_stream_without_len_says_it_reads_on_into_the_next_pass(capsys):
    """An Accelerate loop's `for epoch in range(2): for batch in loader:` over an IterableDataset without __len__ ran
    its first epoch for ever, silently (the stream runs on across passes), and rt.loader's default shuffle=True
    refused the stream outright. The default is the stream's own order; reading into a second pass is said once."""
    from torch.utils.data import IterableDataset

    import trainer

    class Twenty(IterableDataset):
        def __iter__(self):
            yield from (torch.tensor([float(i)]) for i in range(20))

    rt = trainer.Runtime("single", "fp32")
    loader = rt.loader(Twenty(), batch_size=4)
    seen = [b[:, 0].tolist() for _, b in zip(range(5), loader)]
    assert seen[-1] == [16.0, 17.0, 18.0, 19.0] and "never ends" not in capsys.readouterr().out  # one pass
    seen += [b[:, 0].tolist() for _, b in zip(range(3), loader)]
    assert seen[5] == [0.0, 1.0, 2.0, 3.0]  # the next pass
    out = capsys.readouterr().out
    assert out.count("Twenty has no __len__, and its stream has ended a pass") == 1 and "give the dataset a __len__" in out


def test_gather_for_metrics_called_per_batch_says_it_takes_the_whole_eval_once(rt):
    """Accelerate's gather_for_metrics is called every batch; this one takes the eval's rows once. A call with one
    batch's rows said only that rows were missing; it says where the call goes. The whole eval's rows, in order."""
    from torch.utils.data import TensorDataset

    loader = rt.eval_loader(TensorDataset(torch.arange(5.0)), batch_size=2)
    batches = [b[0] for b in loader]
    with pytest.raises(UserError, match=r"2 rows for the 5 samples this rank's loader yields, one batch's: it takes "
                                        r"the whole eval's rows once, after the loop.*torch.cat\(list\)"):
        rt.gather_for_metrics(batches[0], loader)
    assert rt.gather_for_metrics(torch.cat(batches), loader).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_a_registered_state_with_numpy_scalars_round_trips_and_an_array_is_one_paragraph(tmp_path):
    """A counter kept as a numpy scalar (np.int64 from an array's sum, np.float64 from a mean) stopped rt.save_state
    with a bare TypeError; it is saved as the Python number it holds. An array is refused with what to return
    instead, before anything is written."""
    import numpy as np

    import trainer

    class Stats:
        def __init__(self, seen, mean, extra=None):
            self.seen, self.mean, self.extra = seen, mean, extra

        def state_dict(self):
            return {"seen": self.seen, "mean": self.mean, "flag": np.bool_(True), "half": np.float32(0.1),
                    **({"extra": self.extra} if self.extra is not None else {})}

        def load_state_dict(self, state):
            self.seen, self.mean, self.flag, self.half = state["seen"], state["mean"], state["flag"], state["half"]

    rt = trainer.Runtime("single", "fp32")
    rt.setup(nn.Linear(1, 1))
    rt.register("stats", Stats(np.arange(4).sum(), np.mean([0.1, 0.2])))
    rt.save_state(tmp_path / "ck", step=3)
    back = Stats(0, 0.0)
    other = trainer.Runtime("single", "fp32")
    other.setup(nn.Linear(1, 1))
    other.register("stats", back)
    other.load_state(tmp_path / "ck")
    assert (back.seen, back.mean, back.flag, back.half) == (6, np.mean([0.1, 0.2]), True, float(np.float32(0.1)))
    assert type(back.seen) is int and type(back.flag) is bool

    rt.register("arrays", Stats(1, 1.0, extra=np.zeros(3)))
    with pytest.raises(UserError, match=r"cannot checkpoint a numpy array at '/arrays/extra'.*torch.from_numpy"):
        rt.save_state(tmp_path / "ck", step=4)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step_00000003"]


def test_a_registered_state_comes_back_as_saved_where_the_fresh_object_has_none_or_fewer_keys(tmp_path):
    """A fresh object's best score None, later (step, loss); its counts by label {"cat": 0}, later with "dog" too:
    rt.load_state gave back the checkpoint's encoding of the tuple ({'__tuple__': [...]}) and dropped "dog", with no
    error."""
    import trainer

    class Stats:
        def __init__(self):
            self.best, self.counts, self.by_id = None, {"cat": 0}, None

        def state_dict(self):
            return {"best": self.best, "counts": dict(self.counts), "by_id": self.by_id}

        def load_state_dict(self, state):
            self.best, self.counts, self.by_id = state["best"], dict(state["counts"]), state["by_id"]

    class Counts(dict):  # (its whole state the mapping: {"cat": 0} fresh)
        def state_dict(self):
            return dict(self)

        def load_state_dict(self, state):
            self.clear()
            self.update(state)

    saved, counts = Stats(), Counts(cat=2, dog=1)
    saved.best, saved.counts, saved.by_id = (5, 0.125), {"cat": 3, "dog": 4}, {7: [(1, "a")]}
    rt = trainer.Runtime("single", "fp32")
    rt.setup(nn.Linear(1, 1))
    rt.register("stats", saved)
    rt.register("counts", counts)
    rt.save_state(tmp_path / "ck", step=3)
    back, back_counts = Stats(), Counts(cat=0)
    other = trainer.Runtime("single", "fp32")
    other.setup(nn.Linear(1, 1))
    other.register("stats", back)
    other.register("counts", back_counts)
    other.load_state(tmp_path / "ck")
    assert back.state_dict() == saved.state_dict() and back_counts == {"cat": 2, "dog": 1}


def test_saving_checkpoints_into_the_run_dir_never_moves_the_run_dir(tmp_path):
    """`rt.save_state(run_dir, step)` (as `accelerator.save_state(output_dir)`): a second run's first save set the
    earlier run's checkpoints aside by moving the whole dir, with the running run's metrics.jsonl (open) and its lock
    in it. It is refused now, nothing moved, and says where to save instead."""
    import torch.nn.functional as F

    import trainer

    def run(seed, fail=False):
        rt = trainer.Runtime("single", "fp32", run_dir=tmp_path)
        torch.manual_seed(seed)
        model = nn.Linear(4, 1)
        model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
        try:
            for step, (x, y) in enumerate(rt.loader(data, batch_size=4), 1):
                with rt.accumulate(model):
                    rt.backward(F.mse_loss(model(x), y))
                rt.step(opt)
                rt.log({"loss": float(step)}, step)
                if step % 2 == 0:
                    rt.save_state(tmp_path, step)
        finally:
            rt.end()

    run(0)
    with pytest.raises(UserError, match=r"beside a run's own files \(.*metrics.jsonl.*\).*nothing was written or moved"):
        run(1)
    assert not any(p.name.startswith(tmp_path.name + ".prev") for p in tmp_path.parent.iterdir())
    assert {p.name for p in tmp_path.glob("step_*")} == {"step_00000002", "step_00000004"}
    assert (tmp_path / "metrics.jsonl").is_file() and (tmp_path / "metrics.prev.jsonl").is_file()


def test_a_new_run_in_the_run_dir_keeps_the_earlier_runs_exported_weights(tmp_path, capsys):
    """A second run of the same loop in the same run dir set the earlier run's metrics aside (metrics.prev.jsonl) but
    its rt.save_model replaced the earlier run's model.safetensors: those weights were gone."""
    import torch.nn.functional as F

    import trainer

    def run(steps):
        rt = trainer.Runtime("single", "fp32", run_dir=tmp_path)
        model = nn.Linear(4, 1)
        model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
        for step, (x, y) in enumerate(rt.loader(data, batch_size=4), 1):
            with rt.accumulate(model):
                rt.backward(F.mse_loss(model(x), y))
            rt.step(opt)
            rt.log({"loss": float(step)}, step)
            if step == steps:
                break
        rt.save_model(model, tmp_path)
        rt.end()
        return load_weights(tmp_path / "model.safetensors")

    first = run(6)
    second = run(3)
    kept = load_weights(tmp_path / "export.prev" / "model.safetensors")
    assert kept.keys() == first.keys() and all(torch.equal(kept[k], first[k]) for k in first)
    assert not all(torch.equal(second[k], first[k]) for k in first)
    assert f"weights are kept in {tmp_path / 'export.prev'}" in capsys.readouterr().err


def test_save_model_writes_inside_its_directory_or_refuses(tmp_path):
    """rt.save_model(model, d, name="../../escape") wrote escape.safetensors two directories above d, and a directory
    under a file was a NotADirectoryError traceback."""
    import trainer

    rt = trainer.Runtime("single", "fp32")
    model = rt.setup(nn.Linear(2, 2))
    (tmp_path / "FILE").write_text("")
    for args, says in [((tmp_path / "a" / "b", "1GB", "../../escape"), "without a directory part"),
                       ((tmp_path / "FILE" / "exp",), "FILE is not a directory; nothing was written"),
                       ((None,), "expected a path")]:
        with pytest.raises(UserError, match=says):
            rt.save_model(model, *args)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["FILE"]


def _one_model_loop(accum: int = 1):
    import trainer

    rt = trainer.Runtime("single", "fp32", grad_accum_steps=accum)
    model = nn.Linear(4, 1)
    model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return rt, model, opt, torch.randn(4, 4)


def test_a_backward_of_ones_own_where_rt_backward_does_more_is_refused():
    """`loss.backward()` in place of `rt.backward(loss)` under grad_accum_steps=4 trained on the unscaled sum of the
    micro-batches' losses (4 times a big batch's gradients), with no error; under fp16 it was torch's "Attempted
    unscale_ but _scale is None" traceback."""
    rt, model, opt, x = _one_model_loop(accum=4)
    for _ in range(4):
        with rt.accumulate(model):
            model(x).pow(2).mean().backward()
    before = model.weight.detach().clone()
    with pytest.raises(UserError, match=r"backward of your own.*loss must be scaled by 1/4.*Nothing was updated"):
        rt.step(opt)
    assert torch.equal(model.weight, before)
    rt, model, opt, x = _one_model_loop(accum=1)  # (where rt.backward would only call it: the same update)
    model(x).pow(2).mean().backward()
    assert rt.step(opt)


def test_a_zero_grad_inside_an_accumulation_block_is_refused_at_its_backward():
    """model.zero_grad() inside the block of a step's second micro-batch, before its backward: the first micro-batch's
    gradients were thrown away with no error (only a zero_grad before entering the block was caught)."""
    rt, model, opt, x = _one_model_loop(accum=2)
    with rt.accumulate(model):
        rt.backward(model(x).pow(2).mean())
    with pytest.raises(UserError, match=r"zeroed in the middle of an accumulation \(before micro-step 2 of 2's"), \
            rt.accumulate(model):
        model.zero_grad()
        rt.backward(model(x).pow(2).mean())


def test_a_scheduler_stepped_besides_rt_step_or_of_another_optimizer_is_refused():
    """A scheduler.step() left over after rt.step(opt, sched) ran the schedule twice a step (10 steps: the learning
    rate at its end, 0); a scheduler of another optimizer passed with this one never moved this one's rate."""
    rt, model, opt, x = _one_model_loop()
    sched = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.0, total_iters=10)
    other = torch.optim.lr_scheduler.LinearLR(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0), 1.0, 0.0)
    rt.backward(model(x).pow(2).mean())
    with pytest.raises(UserError, match="schedules another optimizer"):
        rt.step(opt, other)
    rt.step(opt, sched)
    sched.step()  # (left over from a plain loop)
    rt.backward(model(x).pow(2).mean())
    with pytest.raises(UserError, match=r"stepped 1 time\(s\) outside rt.step"):
        rt.step(opt, sched)


@pytest.mark.parametrize(("call", "says"), [
    (lambda rt, m, tmp: trainer_runtime(threads="abc"), "threads='abc'"),
    (lambda rt, m, tmp: trainer_runtime(threads=0), "threads=0"),
    (lambda rt, m, tmp: trainer_runtime(seed="1"), "seed='1'"),
    (lambda rt, m, tmp: trainer_runtime(run_dir=5), "run_dir=...\\): expected a path"),
    (lambda rt, m, tmp: rt.save_state(None, 1), "expected a path"),
    (lambda rt, m, tmp: rt.load_state(123), "expected a path"),
    (lambda rt, m, tmp: rt.reduce("abc"), "takes a tensor or a number"),
    (lambda rt, m, tmp: rt.gather([1.0, 2.0]), "takes a tensor"),
    (lambda rt, m, tmp: rt.register(5, torch.optim.SGD(m.parameters(), lr=1.0)), "non-empty string"),
    (lambda rt, m, tmp: rt.loader(torch.utils.data.TensorDataset(torch.zeros(4, 1)), 2, shuffle="no"), "shuffle='no'"),
    (lambda rt, m, tmp: rt.accumulate(m, last="no"), "last='no'"),
    (lambda rt, m, tmp: rt.clip_grad_norm_(m, -1.0), "max_norm=-1.0"),
    (lambda rt, m, tmp: __import__("trainer").Runtime("fsdp", world_options={"reshard_after_forward": "no"}),
     "world.reshard_after_forward='no' is invalid: expected a bool"),
])
def test_a_wrong_argument_to_the_runtime_is_one_paragraph(tmp_path, call, says):
    """Each was a traceback from inside the framework or torch (threads, run_dir, paths, reduce, gather, a world
    option of the wrong kind), an error at
    a later call (seed, register), or silently taken ("no" as True: shuffled, ended the step; a negative max_norm
    flipped the gradients)."""
    rt = trainer_runtime()
    model = rt.setup(nn.Linear(1, 1))
    with pytest.raises(UserError, match=says):
        call(rt, model, tmp_path)
    assert rt.gather(1.5).tolist() == [1.5]  # (a plain number: one row per rank, as rt.reduce takes one)


def trainer_runtime(**kwargs):
    import trainer

    return trainer.Runtime("single", "fp32", **kwargs)


def test_load_state_of_a_dir_whose_checkpoints_are_one_level_down_says_where_they_are(tmp_path, capsys):
    """rt.load_state(run_dir) with the checkpoints in run_dir/ckpt returned None (a fresh start) without a word."""
    rt = trainer_runtime()
    rt.setup(nn.Linear(1, 1))
    rt.save_state(tmp_path / "ckpt", 1)
    rt.end()
    rt = trainer_runtime()
    rt.setup(nn.Linear(1, 1))
    assert rt.load_state(tmp_path) is None
    assert f"but {tmp_path / 'ckpt'} holds some: pass that directory" in capsys.readouterr().err


def test_a_registered_scheduler_loads_from_a_checkpoint_numbered_by_epoch(tmp_path):
    """One checkpoint an epoch, `rt.save_state(dir, epoch)`, with the scheduler stepped every batch: the save went
    through and the load refused it ("scheduler.last_epoch=16 is not a position within step 2"), the run's work
    unreachable. A loop's own step numbers its checkpoints; it bounds no schedule."""
    rt, model, opt, x = _one_model_loop()
    sched = rt.register("scheduler", torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s)))
    for _ in range(8):
        rt.backward(model(x).pow(2).mean())
        rt.step(opt, sched)
    rt.save_state(tmp_path, 1)  # (epoch 1, eight updates in)
    rt.end()
    rt, model, opt, x = _one_model_loop()
    back = rt.register("scheduler", torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s)))
    assert rt.load_state(tmp_path) == 1 and back.last_epoch == 8


def test_a_loop_that_skips_a_batch_still_steps_under_accumulation_and_fp16():
    """A batch skipped (no backward), then rt.step anyway, as a loop over bad batches does: under fp16 the second
    rt.step with no backward between was torch's "step() has already been called since the last update()"; under
    accumulation a skipped first micro-batch was refused as gradients zeroed in the middle of the step."""
    import trainer

    rt = trainer.Runtime("single", "fp16")
    model = nn.Linear(4, 1)
    model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(4, 4)
    for skip in (False, True, True, False):
        if not skip:
            with rt.autocast():
                rt.backward(model(x).pow(2).mean())
        rt.clip_grad_norm_(model, 1.0)
        rt.step(opt)
    rt, model, opt, x = _one_model_loop(accum=2)
    before = model.weight.detach().clone()
    with rt.accumulate(model):
        pass  # (the step's first micro-batch, skipped)
    with rt.accumulate(model):
        rt.backward(model(x).pow(2).mean())
    assert rt.step(opt) and not torch.equal(model.weight, before)


def test_a_scheduler_that_rt_step_steps_must_be_registered_to_be_saved(tmp_path, capsys):
    """rt.step(optimizer, scheduler) with a scheduler never registered: save_state left it out, and a resume started
    the schedule over (the learning rate back at its first value, the weights off the uninterrupted run's) without
    a word. Refused at the save, before anything is written; registered, it is saved and loaded. (rt.print takes
    print's keywords, flush= among them, as accelerator.print does.)"""
    import trainer

    rt = trainer.Runtime("single", "fp32")
    model = nn.Linear(1, 1)
    model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    rt.backward(model(torch.ones(2, 1)).sum())
    rt.step(opt, sched)
    with pytest.raises(UserError, match=r"the StepLR that rt.step steps is not registered.*rt.register\("):
        rt.save_state(tmp_path, step=1)
    assert not tmp_path.exists() or not list(tmp_path.iterdir())
    rt.register("scheduler", sched)
    rt.save_state(tmp_path, step=1)
    rt2 = trainer.Runtime("single", "fp32")
    with pytest.raises(UserError, match=r"before rt.setup: no model is set up"):  # (it said "not in the model")
        rt2.load_state(tmp_path)
    with pytest.raises(UserError, match=r"before rt.setup: no model is set up"):  # (and a first run, with nothing
        rt2.load_state(tmp_path / "none_yet")  # to load yet, is told too: not only its restart)
    model2 = nn.Linear(1, 1)
    model2, opt2 = rt2.setup(model2, torch.optim.SGD(model2.parameters(), lr=0.1))
    sched2 = rt2.register("scheduler", torch.optim.lr_scheduler.StepLR(opt2, 1, 0.5))
    assert rt2.load_state(tmp_path) == 1 and sched2.get_last_lr() == sched.get_last_lr() == [0.05]
    rt2.print("printed", end="!", flush=False)
    assert capsys.readouterr().out.endswith("printed!")
    # (gather_for_metrics over the training loader, and rt.log after rt.end, are one paragraph each, not an
    # AttributeError and a ValueError from a closed file)
    train_loader = rt2.loader(torch.utils.data.TensorDataset(torch.arange(8.0)), batch_size=2)
    with pytest.raises(UserError, match=r"must be rt.eval_loader's.*rt.loader's training stream"):
        rt2.gather_for_metrics(torch.zeros(8), train_loader)
    with pytest.raises(UserError, match=r"rt.backward takes the loss as one number.*a tensor of shape \[2, 1\]"):
        rt2.backward(model2(torch.ones(2, 1)))  # (torch's "grad can be implicitly created only for scalar outputs")
    with pytest.raises(UserError, match=r"got an int\. Reduce it first"):  # ("got a int")
        rt2.backward(3)
    # (a loss without its graph was told to reduce itself, which gives it none)
    with pytest.raises(UserError, match=r"got a tensor without a graph .*Compute it from the model's output"):
        rt2.backward(model2(torch.ones(2, 1)).sum().detach())
    rt2.end()
    with pytest.raises(UserError, match=r"rt.log after rt.end\(\)"):
        rt2.log({"val/loss": 1.0}, step=1)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_schedule_that_moves_betas_or_momentum_resumes_as_the_uninterrupted_loop(tmp_path, optimizer):
    """OneCycleLR cycles AdamW's beta1 (SGD's momentum) with the learning rate: rt.load_state kept the fresh
    scheduler's first value (0.95) where the checkpoint had 0.869, and the resumed run drifted (0.04 in the weights
    after 4 steps). A loop's own optimizer gets the checkpoint's hyperparameters back, as torch's load_state_dict
    gives them."""
    from torch.utils.data import TensorDataset

    import trainer

    def run(steps, load):
        rt = trainer.Runtime("single", "fp32")
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = (torch.optim.AdamW(model.parameters(), lr=0.01) if optimizer == "adamw" else
               torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=10)
        model, opt = rt.setup(model, opt)
        rt.register("scheduler", sched)
        g = torch.Generator().manual_seed(1)
        loader = rt.loader(TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)),
                           batch_size=8)
        step = rt.load_state(tmp_path) if load else 0
        for x, y in loader if step < steps else ():
            rt.backward(nn.functional.mse_loss(model(x), y))
            rt.step(opt, sched)
            step += 1
            if step == steps:
                break
        return rt, model, opt

    whole = run(8, load=False)[1]
    rt, _, opt = run(4, load=False)
    saved = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    rt.save_state(tmp_path, 4)
    assert saved["betas"][0] < 0.87 if optimizer == "adamw" else saved["momentum"] < 0.87  # (cycled from 0.95)
    _, resumed, _ = run(8, load=True)
    assert torch.equal(resumed.weight, whole.weight) and torch.equal(resumed.bias, whole.bias)
    _, _, opt = run(4, load=True)  # (right after the load: the checkpoint's groups, every key)
    assert {k: v for k, v in opt.param_groups[0].items() if k != "params"} == saved


def test_a_checkpoint_without_its_manifest_is_named_not_skipped_silently(tmp_path, capfd):
    """A step dir whose manifest.json is gone (a copy that stopped before it, a damaged disk): rt.load_state(DIR)
    started the loop fresh, or from an older step, without a word, and rt.load_state(that step) returned None, a
    fresh start, for a checkpoint named by hand."""
    import trainer

    def fresh():
        rt = trainer.Runtime("single", "fp32")
        model = nn.Linear(1, 1)
        model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        return rt, model, opt

    rt, model, opt = fresh()
    for step in (2, 4):
        rt.backward(model(torch.ones(1, 1)).sum())
        rt.step(opt)
        rt.save_state(tmp_path, step)
    (tmp_path / "step_00000004" / "manifest.json").unlink()
    capfd.readouterr()
    assert fresh()[0].load_state(tmp_path) == 2
    err = capfd.readouterr().err
    assert "step_00000004 has no readable manifest.json" in err and "skipped, so it loads step_00000002" in err, err
    with pytest.raises(CheckpointError, match=r"step_00000004'\): that checkpoint has no manifest.json.*Nothing was "
                                              r"loaded"):
        fresh()[0].load_state(tmp_path / "step_00000004")
    (tmp_path / "step_00000002" / "manifest.json").unlink()
    assert fresh()[0].load_state(tmp_path) is None
    assert "step_00000002, step_00000004 have no readable manifest.json" in capfd.readouterr().err


def test_load_state_of_a_dir_that_does_not_exist_is_a_fresh_start_noted_only_beside_a_close_name(rt, tmp_path, capfd):
    """A typo in the resume path (ckpts for the ckpt the loop saves to) returned None without a word, and every
    restart trained from step 0; Accelerate raises there. A first run's dir that does not exist yet stays quiet."""
    net = nn.Linear(2, 2)
    rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert rt.load_state(tmp_path / "ckpts") is None  # (a first run: nothing saved anywhere yet)
    rt.save_state(tmp_path / "ckpt", 1)
    assert rt.load_state(tmp_path / "other") is None  # (no close name: a first run of another loop beside it)
    assert "note:" not in capfd.readouterr().err
    assert rt.load_state(tmp_path / "ckpts") is None
    err = capfd.readouterr().err
    assert f"rt.load_state('{tmp_path / 'ckpts'}'): no such directory, so the loop starts fresh (None), but " \
           f"{tmp_path / 'ckpt'} beside it holds checkpoints" in err, err
    assert rt.load_state(tmp_path / "ckpt") == 1


def test_load_state_before_the_loader_and_registered_objects_exist_is_refused(tmp_path):
    """An Accelerate habit, load right after setup: the checkpoint's loader and scheduler states were skipped
    without a word, and the run restarted its epoch and its learning rate. Refused, having changed nothing; loaded
    once they exist."""
    from torch.utils.data import TensorDataset

    import trainer

    def fresh():
        rt = trainer.Runtime("single", "fp32")
        torch.manual_seed(0)
        model = nn.Linear(1, 1)
        model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        return rt, model, opt, torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)

    def with_state(rt, sched):
        rt.register("sched", sched)
        return rt.loader(TensorDataset(torch.arange(10.0)[:, None]), batch_size=2)

    rt, model, opt, sched = fresh()
    loader = with_state(rt, sched)
    for _, (x,) in zip(range(2), loader):
        rt.backward(model(x).sum())
        rt.step(opt, sched)
    rt.save_state(tmp_path, step=2)
    early, model2, _, _ = fresh()
    before = model2.weight.detach().clone()
    with pytest.raises(CheckpointError, match=r"holds the state of 'loader', 'sched', which nothing set up here takes"):
        early.load_state(tmp_path)
    assert torch.equal(model2.weight, before)
    rt3, model3, _, sched3 = fresh()
    loader3 = with_state(rt3, sched3)
    assert rt3.load_state(tmp_path) == 2
    assert sched3.get_last_lr() == sched.get_last_lr() and loader3.samples_seen == loader.samples_seen
    assert torch.equal(model3.weight, model.weight)


def test_accelerate_launch_flags_and_hydra_settings_before_the_script_are_named(tmp_path):
    """`launch --num_processes 2 ga.py` said "the script --num_processes is not a file"; the error names the launch
    command that does the same. `launch hydra.run.dir=DIR ga.py` and `launch optim.lr=0.5 ga.py` ran the script
    and ignored the settings, which trainer.Runtime() never reads."""
    from conftest import run_main
    from test_errors import assert_clean_error

    (tmp_path / "ga.py").write_text("print('ran')\n")
    r = run_main("launch", "--num_processes", "2", "ga.py", "--lr", "1", cwd=tmp_path)
    assert_clean_error(r, "--num_processes 2 is not a flag", "python -m trainer launch world=ddp "
                       "world.nproc_per_node=2 ga.py --lr 1")

    r = run_main("launch", f"hydra.run.dir={tmp_path / 'run'}", "ga.py", cwd=tmp_path)  # (it was ignored silently)
    assert_clean_error(r, "launch hydra.run.dir=", "trainer.Runtime(run_dir=DIR)")
    assert "ran" not in r.stdout and not (tmp_path / "run").exists()
    r = run_main("launch", "optim.lr=0.5", "world.hang_timeout=5", "data.batch_size=64", "ga.py", cwd=tmp_path)
    assert_clean_error(r, "launch optim.lr=0.5 data.batch_size=64: a launched script's trainer.Runtime() reads world,",
                       "as its arguments, after it")
    assert "ran" not in r.stdout and "Did you mean" not in r.stderr
    r = run_main("launch", "trainer.grad_acum_steps=2", "ga.py", cwd=tmp_path)  # a typo of a key it reads
    assert_clean_error(r, "would do nothing. Did you mean trainer.grad_accum_steps?")
    r = run_main("launch", "world=ddp", "nproc_per_node=2", "ga.py", cwd=tmp_path)  # a world setting, its section left out
    assert_clean_error(r, "would do nothing. Did you mean world.nproc_per_node=2?")
    # launch's overrides after the script are the script's arguments: it ran at precision=auto, without a word
    r = run_main("launch", "ga.py", "precision=fp32", "--lr", "1", "optim.lr=2", cwd=tmp_path)
    assert r.returncode == 0 and "ran" in r.stdout, r.stderr
    assert r.stderr.startswith("note: precision=fp32 comes after the script, so the script gets it as its own argument "
                               "(sys.argv) and launch does not: launch's overrides go before the script"), r.stderr
    # The README's `launch recipes/lm/own_loop.py`, outside a clone (a pip install): the installed copy is named.
    r = run_main("launch", "recipes/lm/own_loop.py", "--data", "ga.py", cwd=tmp_path)
    assert_clean_error(r, "the script recipes/lm/own_loop.py is not a file. This trainer's copy of it is "
                       f"{ROOT / 'recipes' / 'lm' / 'own_loop.py'} (the README's recipes/ paths are a clone's).")


def _line_of(text: str) -> int:
    lines = Path(SCRIPT).read_text().splitlines()
    return next(n for n, line in enumerate(lines, 1) if text in line)


def test_a_launched_loop_that_hangs_is_stopped_naming_the_rank_and_its_line():
    """A loop of your own under `launch` is watched as the Trainer is (world.hang_timeout): rank 1 stops in the
    user's code at its third step while rank 0 waits in the gradient all-reduce; after 3 s without progress the
    job stops with one paragraph naming both, every rank's stack kept on disk, exit 70. One process alone names
    its own line; neither says to resume with resume=auto, which a script of one's own does not take."""
    import re

    from trainer.errors import HangDetected
    from trainer.loop.watchdog import STACKS_FILE

    line = _line_of("time.sleep(3600)")
    for world, rank, says in [(("world=ddp", "world.nproc_per_node=2"), "1", "rank 1 is stuck in"),
                              ((), "0", "the process is stuck in")]:
        r = launch(*world, "world.hang_timeout=3", SCRIPT, "hang", rank)
        assert r.returncode == HangDetected.exit_code, r.stdout + r.stderr
        assert "Traceback" not in r.stderr + r.stdout and "finished" not in r.stdout, r.stderr
        errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, r.stderr
        assert f"{says} tests/helpers/runtime_script.py:{line} in hang" in errors[0], errors
        assert "world.hang_timeout=3" in errors[0] and "resume=auto" not in errors[0], errors[0]
        if world:
            assert "rank 0 waits in " in errors[0], errors[0]
        named = re.search(r"(Every rank's|Its) stack: (\S+)\. ", errors[0])
        assert named and Path(named[2]).name == STACKS_FILE, errors[0]
        stacks = Path(named[2]).read_text()  # (kept: a launch's scratch dir otherwise goes at its end)
        shutil.rmtree(Path(named[2]).parent)
        assert "runtime_script.py" in stacks and (not world or "rank 1" in stacks), stacks


def test_a_rank_whose_script_ends_early_is_named_and_torch_adds_nothing():
    """Rank 1's script leaves at its third step (sys.exit(0): a `return` on some ranks only) while rank 0 waits for
    it in the gradient all-reduce. The finished rank's process lives on (torchelastic keeps it until every rank is
    done), so rank 0 waits until world.hang_timeout; then one paragraph says rank 1 ended its loop, and torch's
    own "Terminating process ... via signal SIGTERM" line, as it stops the rest, is not printed beside it."""
    from trainer.errors import HangDetected

    r = launch("world=ddp", "world.nproc_per_node=2", "world.hang_timeout=3", SCRIPT, "leave", "1")
    assert r.returncode == HangDetected.exit_code, r.stdout + r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip() and not line.startswith("precision=auto")]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "rank 1 of this machine ended its loop while the others wait for it in a collective" in lines[0], lines[0]
    assert "rank 0 waits in backward's gradient all-reduce" in lines[0], lines[0]


def test_a_launched_loop_is_watched_from_its_first_progress_and_its_forwards_count(tmp_path):
    """Neither a set-up phase before the loop's first forward, nor an eval of forwards only, nor what the script does
    after rt.end() is a hang, however long: each lasts longer than world.hang_timeout here, and the job finishes."""
    r = launch("world.hang_timeout=1", SCRIPT, "slow_phases", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "finished" in r.stdout


def test_under_launch_a_logger_without_a_run_dir_is_said_once_not_dropped_silently(monkeypatch, capsys, tmp_path):
    """`launch logger=wandb` with a script's trainer.Runtime() and no run_dir: rt.log wrote nowhere without a word.
    The first rt.log says so, naming the logger and run_dir=; with a run_dir the metrics are written."""
    import json

    from omegaconf import OmegaConf

    import trainer
    from trainer.loop.runtime import LAUNCH_ENV

    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = trainer.compose(["debug=smoke", "precision=fp32", "logger=tensorboard"])
    monkeypatch.setenv(LAUNCH_ENV, json.dumps(OmegaConf.to_container(cfg)))
    rt = trainer.Runtime()
    rt.log({"a": 1.0}, step=1)
    rt.log({"a": 2.0}, step=2)
    err = capsys.readouterr().err
    assert err.count("note: rt.log: the job's logger=tensorboard has no directory") == 1, err
    assert "trainer.Runtime(run_dir=DIR)" in err
    rt = trainer.Runtime(run_dir=tmp_path)
    rt.log({"a": 3.0}, step=3)
    rt.end()
    assert "note: rt.log" not in capsys.readouterr().err
    assert [json.loads(line)["a"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [3.0]
    cfg = trainer.compose(["debug=smoke", "precision=fp32"])  # logger=none: nothing to say
    monkeypatch.setenv(LAUNCH_ENV, json.dumps(OmegaConf.to_container(cfg)))
    trainer.Runtime().log({"a": 1.0}, step=1)
    assert "note: rt.log" not in capsys.readouterr().err


def test_two_accumulate_blocks_a_micro_batch_are_refused_one_block_of_both_steps_each_model():
    """A GAN loop with `rt.accumulate(disc)` then `rt.accumulate(gen)` each micro-batch, at grad_accum_steps=2: every
    call was a micro-step, so the generator stepped every micro-batch on half its gradient and the discriminator
    never stepped, without a word. Refused at the second block; one block of both steps each model every 2."""
    import trainer

    def setup():
        rt = trainer.Runtime(grad_accum_steps=2)
        torch.manual_seed(0)
        gen, disc = nn.Linear(4, 4), nn.Linear(4, 1)
        og, od = torch.optim.SGD(gen.parameters(), lr=0.1), torch.optim.SGD(disc.parameters(), lr=0.1)
        return rt, *rt.setup(gen, disc, og, od, names=["gen", "disc", "og", "od"])

    rt, gen, disc, og, od = setup()
    steps = [0, 0]
    for _ in range(8):
        x = torch.randn(4, 4)
        with rt.accumulate(gen, disc):
            rt.backward(disc(x).mean() - disc(gen(x).detach()).mean())
            steps[0] += rt.step(od)
            rt.backward(-disc(gen(x)).mean())
            steps[1] += rt.step(og)
    assert steps == [4, 4]
    rt, gen, disc, og, od = setup()
    with rt.accumulate(disc):
        rt.backward(disc(torch.ones(1, 4)).sum())
    with pytest.raises(UserError, match=r"^rt\.accumulate\(gen\) in the middle of an accumulation of disc .*"
                                        r"`with rt\.accumulate\(gen, disc\):`"):
        with rt.accumulate(gen):
            pass


def test_rt_loader_takes_a_collate_fn_and_says_why_it_takes_no_other_dataloader_argument(rt):
    """Sequences of different lengths, Accelerate's usual NLP loop: rt.loader(..., collate_fn=pad) was a TypeError
    traceback (only a collate_fn attribute on the dataset, undocumented, was taken), torch's default_collate refused
    the unpadded samples with a traceback through the loader (from a worker: "Trying to resize storage"), and a
    DataLoader with a collate_fn of its own was told to pass its dataset alone. drop_last was a TypeError too."""
    from odd_callbacks import Ragged, pad
    from torch.utils.data import DataLoader

    class Padded(Ragged):  # the way that worked before: the dataset's own collate_fn attribute
        collate_fn = staticmethod(pad)

    for loader in (rt.loader, rt.eval_loader):  # the function given equals the dataset's own attribute, batch by batch
        given = [tuple(t.tolist() for t in b) for b in loader(Ragged(), batch_size=4, collate_fn=pad)]
        own = [tuple(t.tolist() for t in b) for b in loader(Padded(), batch_size=4)]
        assert given == own and len(given) == 16, given
    for workers in (0, 1):  # (in this process, and raised again by torch from a loader worker)
        with pytest.raises(UserError, match=r"^the samples of Ragged do not make one batch: torch's default_collate, "
                                            r"which stacks them, said .*give the dataset a `collate_fn`"):
            next(iter(rt.loader(Ragged(), batch_size=4, num_workers=workers)))
    with pytest.raises(UserError, match=r"rt.loader\(loader.dataset, batch_size=..., collate_fn=loader.collate_fn"):
        rt.loader(DataLoader(Ragged(), batch_size=4, collate_fn=pad), batch_size=4)
    with pytest.raises(UserError, match=r"rt.loader takes no drop_last: an epoch is whole steps"):
        rt.loader(Ragged(), batch_size=4, drop_last=True)
    with pytest.raises(UserError, match=r"rt.eval_loader\(colate_fn=...\): no such argument. Did you mean collate_fn"):
        rt.eval_loader(Ragged(), batch_size=4, colate_fn=pad)
    with pytest.raises(UserError, match=r"rt.loader\(collate_fn='pad'\): expected a function"):
        rt.loader(Ragged(), batch_size=4, collate_fn="pad")


def test_a_dataloader_given_to_rt_loader_and_a_tensor_to_rt_log_are_one_paragraph_each(rt):
    """rt.loader(DataLoader(ds)), as Accelerate's prepare takes it: read as a dataset of 16 batches, len() said 4 and
    the first batch raised a TypeError traceback. rt.log of a vector or a string raised a bare ValueError."""
    from torch.utils.data import DataLoader, TensorDataset

    ds = TensorDataset(torch.randn(64, 4))
    with pytest.raises(UserError, match=r"rt\.loader got a DataLoader.*rt\.loader\(loader\.dataset, batch_size"):
        rt.loader(DataLoader(ds, batch_size=4), batch_size=4)
    with pytest.raises(UserError, match=r"rt\.eval_loader got a DataLoader"):
        rt.eval_loader(DataLoader(ds, batch_size=4), batch_size=4)
    with pytest.raises(UserError, match=r"rt\.log: 'v' is a tensor of shape \[2\], not a number"):
        rt.log({"v": torch.ones(2)}, 1)
    with pytest.raises(UserError, match=r"rt\.log: 's' is 'hello', not a number"):
        rt.log({"s": "hello"}, 1)
    rt.log({"ok": torch.ones(1), "n": 2}, 1)
    assert len(rt.loader(ds, batch_size=4)) == 16


def test_wrong_arguments_to_the_runtime_s_calls_are_one_paragraph_each_and_change_nothing(tmp_path):
    """Each was a traceback from inside torch, pathlib or a format string: a device the machine lacks, save_model
    of an optimizer or into a file, save_state with a step that is not a count (step -1 wrote step_-0000001, which
    load_state never found), rt.log of None, rt.step with a ReduceLROnPlateau (after the update) or with its
    arguments swapped (it named the scheduler an optimizer not set up)."""
    import numpy as np

    import trainer

    if not torch.cuda.is_available():
        with pytest.raises(UserError, match=r"^Runtime\(device='cuda'\) is invalid here: this machine .* has no CUDA"):
            trainer.Runtime(device="cuda")
    with pytest.raises(UserError, match=r"^Runtime\(device='gpu'\) is not a device: expected 'auto', 'cpu'"):
        trainer.Runtime(device="gpu")
    trainer.Runtime(device=torch.device("cpu")).end()  # (a torch.device, as resolve_device takes it)
    rt = trainer.Runtime("single", "fp32")
    model = nn.Linear(2, 2)
    model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with rt.accumulate(model):
        rt.backward(model(torch.ones(1, 2)).sum())
    before = model.weight.detach().clone()
    (tmp_path / "file").write_text("mine")
    mistakes = [(lambda: rt.save_model(opt, tmp_path), r"rt\.save_model got a SGD: pass the model"),
                (lambda: rt.save_model(model, tmp_path / "file"), r"that path is a file; save_model writes a directory"),
                (lambda: rt.save_state(tmp_path, -1), r"step=-1\): the step must be a whole number >= 0"),
                (lambda: rt.save_state(tmp_path, 5.0), r"step=5\.0\): the step must be a whole number"),
                (lambda: rt.save_state(tmp_path, 1, keep_last=0), r"rt\.save_state\(keep_last=0\): expected"),
                (lambda: rt.log({"x": None}, 1), r"rt\.log: 'x' is None, not a number"),
                (lambda: rt.log({"x": 1.0}, "3"), r"rt\.log\(\.\.\., step='3'\): the step must be a whole number"),
                (lambda: rt.step(opt, torch.optim.lr_scheduler.ReduceLROnPlateau(opt)),
                 r"the ReduceLROnPlateau given as the scheduler steps on a metric .* Nothing was updated"),
                (lambda: rt.step(torch.optim.lr_scheduler.StepLR(opt, 1), opt),
                 r"rt\.step got a StepLR where the optimizer goes: the order is rt\.step\(optimizer, scheduler\)")]
    for call, message in mistakes:
        with pytest.raises(UserError, match=message):
            call()
    assert torch.equal(model.weight, before) and model.weight.grad is not None  # (nothing stepped, nothing zeroed)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"] and (tmp_path / "file").read_text() == "mine"
    assert rt.step(opt) and not torch.equal(model.weight, before)
    assert rt.save_state(tmp_path, np.int64(1)).name == "step_00000001"  # (numpy's integers are counts)
    rt.end()


def test_a_layout_for_several_processes_in_a_script_run_as_one_says_how_to_start_it():
    """Runtime('fsdp', world_options={'tp': 2}) in `python script.py` said "Change world.tp or
    world.nproc_per_node", keys a script run alone has nowhere to set: the fix is how it is started."""
    import torch.distributed as dist

    import trainer
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError, match=r"world.tp=2 is invalid.* This script runs as one process: start it on "
                                          r"several, e.g. `python -m trainer launch"):
        trainer.Runtime("fsdp", world_options={"tp": 2})
    assert not dist.is_initialized()  # (its process group was left: the next Runtime in the process could not start)
    trainer.Runtime("fsdp").end()
    with pytest.raises(ConfigError) as other:  # another mistake of setup's: not told to start more processes
        trainer.Runtime("deepspeed", precision="fp16", device="cpu")  # (or DeepSpeed is not installed)
    assert "runs as one process" not in str(other.value)


def test_launching_a_file_that_is_not_python_is_one_paragraph(tmp_path):
    """`launch README.md` or a script with a syntax error was a SyntaxError traceback through the framework's CLI."""
    from test_errors import assert_clean_error

    (tmp_path / "notes.md").write_text("# My notes\nIt's a markdown file.\n")
    (tmp_path / "broken.py").write_text("x = (\n")
    for name, says in (("notes.md", "unterminated string literal"), ("broken.py", "'(' was never closed, line 1")):
        r = run_here("launch", str(tmp_path / name), cwd=tmp_path)
        assert_clean_error(r, f"{tmp_path / name} is not a Python script that compiles ({says}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.py", "notes.md"]


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_stateless_optimizers_learning_rate_resumes(tmp_path, momentum):
    """SGD without momentum keeps no per-parameter state, and the checkpoint then held none of its groups either: a
    resume stepped at the initial rate (1.0 where ExponentialLR had it at 0.125), so the resumed run was not the
    uninterrupted one. Now both runs end with the same weights, and the rate after the load is the one saved."""
    import trainer

    def make():
        rt = trainer.Runtime()
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=momentum)
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, 0.5)
        model, opt = rt.setup(model, opt)
        rt.register("sched", sched)
        return rt, model, opt, sched

    def train(rt, model, opt, sched, steps):
        for _ in range(steps):
            rt.backward(model(torch.ones(2, 4)).pow(2).mean())
            rt.step(opt, sched)

    rt, model, opt, sched = make()
    steps = []
    opt.register_step_pre_hook(lambda *args: steps.append(1))
    rt.save_state(tmp_path / "first", 0)  # (no step of the optimizer's own at a save: a zero-gradient one was taken)
    assert not steps
    train(rt, model, opt, sched, 6)
    straight = [p.detach().clone() for p in model.parameters()]
    rt, model, opt, sched = make()
    train(rt, model, opt, sched, 3)
    rt.save_state(tmp_path, 3)
    rt, model, opt, sched = make()
    assert rt.load_state(tmp_path) == 3
    assert opt.param_groups[0]["lr"] == sched.get_last_lr()[0] == 0.125
    train(rt, model, opt, sched, 3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), straight))


def test_fp16s_loss_scale_resumes(tmp_path):
    """rt.save_state left the fp16 loss scale out: a resume started it over at 65536, skipped the steps that had
    brought it down once more, and the resumed run was not the uninterrupted one."""
    import trainer

    def make():
        rt = trainer.Runtime("single", "fp16")
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
        return rt, model, opt

    def train(rt, model, opt, steps):
        for _ in range(steps):
            with rt.autocast():
                loss = model(torch.full((2, 4), 100.0)).pow(2).mean()
            rt.backward(loss)
            rt.step(opt)

    rt, model, opt = make()
    train(rt, model, opt, 8)
    straight = ([p.detach().clone() for p in model.parameters()], rt.precision.scaler.get_scale())
    rt, model, opt = make()
    train(rt, model, opt, 4)
    rt.save_state(tmp_path, 4)
    saved = rt.precision.scaler.get_scale()  # (after the save: the scale the next step uses)
    rt, model, opt = make()
    rt.load_state(tmp_path)
    assert rt.precision.scaler.get_scale() == saved < 65536.0
    train(rt, model, opt, 4)
    assert rt.precision.scaler.get_scale() == straight[1]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), straight[0]))


def test_a_new_run_saving_where_an_earlier_one_did_keeps_the_earlier_checkpoints(tmp_path, capsys):
    """A second run of a script into the same dir, without rt.load_state: its saves replaced the first run's step_6
    and pruned its step_9 (only metrics.jsonl was set aside). Now the first run's checkpoints move to DIR.prev at the
    new run's first save; a run that loaded from the dir (a resume) moves nothing."""
    import trainer

    def run(steps: int, load: bool = False) -> None:
        rt = trainer.Runtime()
        model = rt.setup(nn.Linear(2, 2))
        start = (rt.load_state(tmp_path / "ckpt") or 0) if load else 0
        for step in range(start + 1, steps + 1):
            with torch.no_grad():
                model.weight.add_(1.0)
            if step % 3 == 0:
                rt.save_state(tmp_path / "ckpt", step)
        rt.end()

    run(9)
    first = {p.name: (p / "model.safetensors").read_bytes() for p in (tmp_path / "ckpt").glob("step_*")}
    assert sorted(first) == ["step_00000006", "step_00000009"]
    capsys.readouterr()
    run(6)
    assert {p.name: (p / "model.safetensors").read_bytes() for p in (tmp_path / "ckpt.prev").glob("step_*")} == first
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_00000003", "step_00000006"]
    assert f"they are kept in {tmp_path / 'ckpt.prev'}" in capsys.readouterr().err  # (this process loaded none)
    run(9, load=True)
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_00000006", "step_00000009"]
    assert not (tmp_path / "ckpt.prev-2").exists()


def test_a_gathered_number_is_one_row_per_rank_on_one_process_too(rt):
    assert rt.gather(torch.tensor(2.0)).tolist() == [2.0]  # (2 ranks: one row each, in the launched gather test)
    assert rt.reduce(2, "sum") == 2 and isinstance(rt.reduce(2.0), float)  # (a number for a number there too)


def test_a_one_process_world_started_on_two_is_refused(tmp_path):
    """Runtime("single") in a script started on 2 processes: each rank trained a copy of its own on half the batches,
    gradients never averaged, and rank 0 saved its copy alone."""
    r = launch("world=ddp", "world.nproc_per_node=2", SCRIPT, "single")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Runtime('single') was started on 2 processes" in r.stderr and "Use Runtime('ddp')" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_parameter_the_forward_leaves_unused_under_ddp_is_named_with_the_setting_that_fixes_it(tmp_path):
    """The first-step check blamed a forward of the module underneath the wrapper, which the script did not run; what
    left the gradients unaveraged was a parameter the forward never used, and DDP's find_unused_parameters off."""
    r = launch("world=ddp", "world.nproc_per_node=2", SCRIPT, "unused")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "got no gradient (or exact zeros) on any rank (unused.weight, ...)" in r.stderr
    assert "world.find_unused_parameters=true" in r.stderr and "module underneath" not in r.stderr
    r = launch("world=ddp", "world.nproc_per_node=2", "world.find_unused_parameters=true", SCRIPT, "unused")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize(("mode", "says"), [("freeze", "2 of its parameters were frozen since its first step"),
                                            ("unfreeze", "2 of its parameters were unfrozen since its first step")])
def test_changing_what_a_ddp_model_trains_after_its_first_step_is_one_paragraph(tmp_path, mode, says):
    """Freezing a layer of a DDP model after its first step: torch's "Expected to have finished reduction" traceback
    at the next forward, after a step whose gradients were partly unaveraged. Unfreezing one: DDP never averages it,
    and each rank stepped it on its own gradients, silently."""
    r = launch("world=ddp", "world.nproc_per_node=2", SCRIPT, mode)
    assert r.returncode == 2, r.stdout + r.stderr
    assert says in r.stderr and "Nothing was updated" in r.stderr  # (2: the layer's weight and bias)
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(("how", "code"), [("", 0), ("fail", 1), ("exit3", 3)], ids=["ends", "fails", "sys_exit"])
def test_a_launched_scripts_atexit_handlers_run_on_every_rank_as_under_torchrun(tmp_path, how, code):
    """A worker leaves by os._exit (gloo's C++ teardown can abort a finished job), which skipped the interpreter's
    atexit handlers: a script's own never ran under `launch`, as they do under torchrun. A failing rank runs its
    handlers too (its peer is stopped by the launcher: its own may not run), and so does one ending with
    sys.exit(N)."""
    r = launch("world=ddp", "world.nproc_per_node=2", SCRIPT, "at_exit", str(tmp_path), *([how] if how else []))
    assert r.returncode == code, r.stdout + r.stderr
    assert (tmp_path / "rank1.txt").read_text() == "ran"
    if how != "fail":
        assert (tmp_path / "rank0.txt").read_text() == "ran"


def test_a_model_left_out_of_setup_is_refused_at_its_optimizers_first_step_on_several_processes(tmp_path):
    """A discriminator never set up, stepped by its own optimizer on 2 DDP ranks: each rank stepped its copy on its own
    gradients, and the copies drifted apart with no word."""
    r = launch("world=ddp", "world.nproc_per_node=2", SCRIPT, "not_set_up")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "steps 2 parameters of no model set up here" in r.stderr and "stepped the discriminator" not in r.stdout
    assert "Traceback" not in r.stderr


def test_a_mistake_in_a_plain_python_script_is_one_paragraph_with_the_scripts_line(tmp_path):
    """`python SCRIPT.py` (or torchrun): a UserError printed a traceback through the framework, where under launch it
    is one paragraph. Now it is the paragraph and the script's line that made the call; TRAINER_DEBUG=1 shows all."""
    import os
    import subprocess
    import sys

    script = tmp_path / "script.py"
    # (run_dir='new': refused after Runtime made it, the new dir goes with the script: it held the lock and an
    # empty metrics.jsonl)
    script.write_text("import torch, trainer\nrt = trainer.Runtime(run_dir='new')\nmodel = rt.setup(torch.nn.Linear(2, 2))\n"
                      f"rt.save_state({str(tmp_path / 'ck')!r}, step=-1)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRAINER_DEBUG", None)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("error: rt.save_state(directory, step=-1): the step must be a whole number >= 0")
    assert f"(at {script}:4: rt.save_state(" in r.stderr and not (tmp_path / "new").exists()
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path,
                       env={**env, "TRAINER_DEBUG": "1"})
    assert "Traceback" in r.stderr and "UserError" in r.stderr
    # Accelerator's keywords, the first line an Accelerate user writes: refused before the paragraph's hook was set.
    script.write_text("import trainer\nrt = trainer.Runtime(mixed_precision='bf16', gradient_accumulation_steps=2)\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr and r.stderr.startswith("error: "), r.stderr
    assert "mixed_precision is Accelerate's" in r.stderr and f"(at {script}:2: rt = trainer.Runtime(" in r.stderr


def test_a_run_dir_the_runtime_made_stays_once_the_script_ends_or_writes_there(tmp_path):
    """The other side of the rule above: a dir that was there before stays as it was, rt.end() keeps the dir it
    made, even empty, and a dir with a logged step stays without rt.end() (a script that forgot it)."""
    import gc

    import trainer

    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "notes.txt").write_text("mine")
    rt = trainer.Runtime(run_dir=earlier)
    with pytest.raises(UserError, match="Runtime.setup got a str"):
        rt.setup(nn.Linear(2, 2), "adam")
    del rt
    gc.collect()
    assert sorted(p.name for p in earlier.iterdir()) == [".lock", "metrics.jsonl", "notes.txt"]
    def trained_in_a_function():  # (dropped before the script writes there: the dir stays until the exit)
        trainer.Runtime(run_dir=tmp_path / "dropped")

    trained_in_a_function()
    gc.collect()
    assert (tmp_path / "dropped").is_dir()
    (tmp_path / "dropped" / "model.pt").write_bytes(b"the script's own")
    for name, finish in (("ended", lambda rt: rt.end()), ("logged", lambda rt: rt.log({"loss": 1.0}, step=1))):
        rt = trainer.Runtime(run_dir=tmp_path / name)
        finish(rt)
        if name == "logged":
            rt.loggers.finish({})  # (its file closed, as rt.end() would; the Runtime itself not ended)
        del rt
        gc.collect()
        assert (tmp_path / name / "metrics.jsonl").exists(), name


def test_an_optimizer_left_out_of_setup_under_fsdp_is_refused_at_its_first_step():
    """Under FSDP rt.setup(model) replaces the parameters with shards: an optimizer built over the old ones and stepped
    by hand changed nothing the model uses, and the run trained nothing without a word."""
    import trainer

    rt = trainer.Runtime("fsdp")
    try:
        net = nn.Linear(4, 1)
        forgotten = torch.optim.SGD(net.parameters(), lr=0.5)
        model = rt.setup(net)
        rt.backward(model(torch.ones(2, 4)).sum())
        with pytest.raises(UserError, match=r"this SGD holds the parameters of 'model' from before rt\.setup sharded "
                                            r"them \(weight\).*model, opt = rt\.setup\(model, opt\)"):
            forgotten.step()
        other = torch.optim.SGD(model.parameters(), lr=0.5)  # (built over the shards: it steps them)
        before = model.weight.detach().full_tensor().clone()
        other.step()
        assert not torch.equal(model.weight.detach().full_tensor(), before)
        del forgotten, net
        # Parameters made after the old ones were freed take their ids: they are no stale ones (they were refused).
        for _ in range(20):
            fresh = nn.Linear(4, 1)
            fresh(torch.ones(1, 4)).sum().backward()
            torch.optim.SGD(fresh.parameters(), lr=0.1).step()
    finally:
        rt.end()


def test_a_script_that_exits_with_a_code_of_its_own_under_launch_says_so(tmp_path):
    """sys.exit(3) in a launched script: the launcher said "worker rank 0 failed:" and torch's "To enable traceback
    see: URL", about an exit that was the script's own."""
    script = tmp_path / "script.py"
    script.write_text("import sys\nimport trainer\nrt = trainer.Runtime()\nsys.exit(3)\n")
    r = launch("world=ddp", "world.nproc_per_node=2", str(script))
    assert r.returncode == 3, r.stderr
    assert "exited with code 3 and no error record: the script's own exit" in r.stderr
    assert "To enable traceback" not in r.stderr


def test_numpys_global_generator_resumes_with_the_others(tmp_path):
    """rt.save_state kept Python's and torch's generators but not numpy's (Accelerate keeps it): a loop drawing its
    augmentations from np.random drew others after a resume."""
    import random

    import numpy as np

    import trainer

    def make():
        rt = trainer.Runtime()
        rt.setup(nn.Linear(1, 1))
        return rt

    rt = make()
    np.random.seed(5)
    np.random.rand(3)
    rt.save_state(tmp_path, 1)
    after_save = (float(np.random.rand()), random.random(), torch.rand(1).item())
    rt.end()
    rt = make()
    np.random.seed(99)
    rt.load_state(tmp_path)
    assert (float(np.random.rand()), random.random(), torch.rand(1).item()) == after_save
    rt.end()


def test_a_checkpoint_saved_before_the_trackers_and_precision_were_kept_still_loads(tmp_path, monkeypatch):
    """rt.save_state keeps the trackers' and the precision's state now: a checkpoint without them (as every one saved
    before) was refused as "saved by another configuration"."""
    import trainer
    from trainer.checkpoint.manager import CheckpointManager

    def make():
        rt = trainer.Runtime()
        torch.manual_seed(0)
        model = nn.Linear(2, 2)
        return rt, *rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    rt, model, opt = make()
    rt.backward(model(torch.ones(1, 2)).sum())
    rt.step(opt)
    built = CheckpointManager.__init__

    def as_before(self, checkpointer, parts, run, components, every_component=False):
        built(self, checkpointer, parts, run, {k: v for k, v in components.items() if k not in ("loggers", "precision")},
              every_component)

    monkeypatch.setattr(CheckpointManager, "__init__", as_before)
    rt.save_state(tmp_path, 1)
    monkeypatch.undo()
    rt, again, opt = make()
    assert rt.load_state(tmp_path) == 1
    assert torch.equal(again.weight, model.weight)


def test_what_a_new_runs_first_log_and_first_save_set_aside_takes_one_number(tmp_path):
    """The earlier run's metrics.jsonl (set aside at the first rt.log) and its checkpoints (at the first save) took two
    numbers: metrics.prev.jsonl went with checkpoints.prev-2/."""
    import trainer

    for saves in (False, True, True):  # (the first run saves nothing: its number is its metrics' alone)
        rt = trainer.Runtime(run_dir=tmp_path)
        rt.setup(nn.Linear(2, 2))
        rt.log({"loss": 1.0}, 1)
        if saves:
            rt.save_state(tmp_path / "checkpoints", 1)
        rt.end()
    assert (tmp_path / "metrics.prev-2.jsonl").is_file() and (tmp_path / "checkpoints.prev-2" / "step_00000001").is_dir()
    assert not (tmp_path / "checkpoints.prev").exists()


def test_save_state_and_save_model_refuse_another_runs_files(corpus, tmp_path):
    """rt.save_model into a `python -m trainer` run's dir replaced its exported weights (trainer.load then refused
    them), into one of its checkpoints broke that checkpoint; rt.save_state into its checkpoints/ set them aside (its
    resume found none it could continue), into a checkpoint nested a step in it. Each is refused, nothing changed;
    the Runtime's own run_dir, and a plain dir, are written as before. (Beside: a weights name given with its
    .safetensors, and setup names that are not strings.)"""
    import trainer

    run = tmp_path / "run"
    assert run_here(*tiny_overrides(corpus, "trainer.max_steps=2"), f"hydra.run.dir={run}").returncode == 0
    step = run / "checkpoints" / "step_00000002"
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".lock"}
    rt = trainer.Runtime()
    model = rt.setup(nn.Linear(2, 2))
    for call, where, needle in ((rt.save_model, run, "is the run dir of a `python -m trainer` run"),
                                (rt.save_model, step, "is inside the checkpoint"),
                                (lambda m, d: rt.save_state(d, 1), run / "checkpoints", "is the run dir of"),
                                (lambda m, d: rt.save_state(d, 1), step, "is inside the checkpoint"),
                                (lambda m, d: rt.save_state(d, 1), run, "is the run dir of")):
        with pytest.raises(UserError, match=needle):
            call(model, where)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".lock"} == before
    rt.save_model(model, tmp_path / "mine")
    app = tmp_path / "app"  # (a Hydra app's own dir, .hydra/ and a config.yaml of its own: no run of ours)
    (app / ".hydra").mkdir(parents=True)
    (app / "config.yaml").write_text("lr: 0.1\n")
    rt.save_model(model, app)
    rt.save_model(model, tmp_path / "named", name="weights.safetensors")  # (it wrote weights.safetensors.safetensors)
    assert sorted(p.name for p in (tmp_path / "named").iterdir()) == ["weights.safetensors"]
    with pytest.raises(UserError, match=r"names=\[1, 2\]\): expected a list of names"):  # (refused only at a resume)
        rt.setup(nn.Linear(2, 2), nn.Linear(2, 2), names=[1, 2])
    rt.save_state(tmp_path / "mine" / "checkpoints", 1)
    assert (tmp_path / "mine" / "model.safetensors").is_file() and (tmp_path / "mine" / "checkpoints" / "step_00000001").is_dir()
    rt.end()


def test_an_optimizer_in_the_schedulers_place_and_a_metric_named_step_are_refused(tmp_path):
    """rt.step(opt, opt) updated twice (update/(lr*grad) = 2.0), rt.step(opt_g, opt_d) stepped the second as the
    first's schedule; rt.log({"step": 5}, step=0) wrote {"step": 5.0} as the record's step. And a step after
    rt.end() (whose process group is gone) is refused, as rt.log's was."""
    import trainer

    rt = trainer.Runtime(run_dir=tmp_path / "run")
    torch.manual_seed(0)
    net = nn.Linear(2, 1)
    model, opt = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    rt.backward(model(torch.ones(4, 2)).sum())
    with pytest.raises(UserError, match="the second argument is an optimizer .*the same optimizer, updated twice"):
        rt.step(opt, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(UserError, match="a metric named 'step' would replace the step"):
        rt.log({"step": 5, "loss": 1.0}, step=0)
    rt.log({"step": 0, "loss": 1.0}, step=0)  # (Accelerate's habit, the same step twice: taken)
    rt.end()
    assert [e["step"] for e in read_metrics(tmp_path / "run")] == [0]
    with pytest.raises(UserError, match=r"rt.step after rt.end\(\): the run is finished"):  # (its group left)
        rt.step(opt)
    with pytest.raises(UserError, match="rt.save_state before anything was set up or registered"):
        trainer.Runtime().save_state(tmp_path / "empty", 1)  # (a checkpoint of nothing but the RNG)
    assert not (tmp_path / "empty").exists()


@pytest.mark.parametrize("call, needle", [
    (lambda trainer: trainer.Runtime(precision=torch.float16), "Runtime(precision=torch.float16) is invalid"),
    (lambda trainer: trainer.Runtime(world_options="tp=2"), "Runtime(world_options='tp=2') is invalid: expected a dict"),
    (lambda trainer: trainer.Runtime(log_with=5), "Runtime(log_with=5) is invalid"),
    (lambda trainer: trainer.Runtime(""), "Runtime(world='') is empty"),
    (lambda trainer: trainer.Runtime().loader(None, batch_size=4), "rt.loader got a NoneType: it takes a dataset"),
    (lambda trainer: _backward_scaled(trainer, float("nan")), "rt.backward(loss, scale=nan): expected a finite number"),
    (lambda trainer: _backward_scaled(trainer, "x"), "rt.backward(loss, scale='x'): expected a finite number"),
], ids=["precision_dtype", "world_options_text", "log_with_number", "world_empty", "loader_none", "scale_nan",
        "scale_text"])
def test_wrong_arguments_to_the_runtime_are_one_paragraph_not_torchs_error(call, needle):
    """From a sweep of the API: each was a raw AttributeError, ValueError or TypeError from inside (a dtype as the
    precision failed only at the first rt.autocast), or, for scale=nan, every parameter NaN without a word."""
    import trainer

    with pytest.raises(UserError) as refused:
        call(trainer)
    assert needle in str(refused.value)


def test_a_backward_scale_of_any_finite_number_is_taken():
    """Gradient ascent (-1), a deliberate zero backward and numpy's scalars are legitimate scales (a review found
    the first check refused them)."""
    import numpy as np

    import trainer

    for scale in (-1.0, 0, np.float32(0.5), torch.tensor(2.0)):
        _backward_scaled(trainer, scale)


def _backward_scaled(trainer, scale):
    rt = trainer.Runtime()
    model = rt.setup(nn.Linear(2, 1))
    rt.backward(model(torch.ones(1, 2)).sum(), scale=scale)


def test_a_launched_scripts_crash_shows_the_scripts_traceback_alone(tmp_path):
    """`launch SCRIPT` whose script raised showed a dozen frames of the CLI, the launcher and runpy before the
    script's own; its traceback now starts at the script (exit 1, as a crash); TRAINER_DEBUG=1 shows all."""
    script = tmp_path / "bad.py"
    script.write_text("import torch\n\n\ndef f():\n    raise ValueError('boom in my script')\n\n\nf()\n")
    r = run_cli("launch", str(script), cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[0] == "Traceback (most recent call last):" and lines[1].startswith(f'  File "{script}", line 8')
    assert lines[-1] == "ValueError: boom in my script" and "trainer/entry" not in r.stderr
    r = run_cli("launch", "world=ddp", "world.nproc_per_node=2", str(script), cwd=tmp_path)  # (each worker's, reported)
    assert r.returncode == 1 and "ValueError: boom in my script" in r.stderr, r.stderr
    assert f'File "{script}", line 8' in r.stderr and "trainer/entry" not in r.stderr and "runpy" not in r.stderr
