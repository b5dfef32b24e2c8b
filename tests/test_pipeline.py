"""Pipeline parallelism (world.pp) on CPU with gloo: stages of the model's blocks on several ranks, run by
torch.distributed.pipelining's schedules, are a pure performance knob (the same losses, clipping, EMA, eval
and weights as one process, alone or with data and tensor parallelism, with accumulation); each stage writes
its own part of a checkpoint, which resumes on any layout; and the mistakes are one paragraph before any
process starts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import (
    FAULTY_ENV,
    SHARED,
    assert_identical,
    assert_same_run,
    compose_cfg,
    faulty,
    load_weights,
    once_per_run,
    run_cli,
    run_here,
    tiny_overrides,
    train_in_process,
)

pytestmark = pytest.mark.slow

# Four blocks: two stages of two for 1F1B, four stages of one for the looped and V schedules. The clipping
# of SHARED's runs (grad_clip 1.0) is active from the first step (norm ~4), so it must cover every stage.
DEEP = ("model.n_layer=4",)
PP2 = ("world=ddp", "world.nproc_per_node=2", "world.pp=2", "data.batch_size=8")


# The weights as tensor parallelism's (test_parallel.py): microbatches sum each gradient in another order (fp32
# rounding, ~1e-7 of it), and AdamW's step lr * m / (sqrt(v) + eps) carries that difference undamped where an
# element's gradient is near zero; 12 steps at lr 5e-3 move an element by up to ~6e-2, and 1e-4 is 0.2% of it.
WEIGHTS_ATOL = 1e-4


def same_run(run_dir: Path, ref_dir: Path) -> None:
    assert_same_run(run_dir, ref_dir, weights_atol=WEIGHTS_ATOL)


def cli_run(corpus: Path, run_dir: Path, *extra: str, env: dict | None = None) -> None:
    r = run_cli(*tiny_overrides(corpus, *SHARED, *DEEP, *extra), f"hydra.run.dir={run_dir}", env=env)
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="session")
def deep_reference(corpus, tmp_path_factory) -> Path:
    """One process, batch 8, the four-block GPT, in-process."""
    return once_per_run(tmp_path_factory, "deep_reference",
                        lambda d: train_in_process(corpus, d, "data.batch_size=8", *SHARED, *DEEP))


@pytest.fixture(scope="session")
def pp_reference(corpus, tmp_path_factory) -> Path:
    """Two stages on two processes (1F1B, 2 microbatches of 4), batch 8."""
    return once_per_run(tmp_path_factory, "pp_reference", lambda d: cli_run(corpus, d, *PP2))


def test_two_stages_equal_one_process_and_each_stage_writes_its_own_part(pp_reference, deep_reference):
    same_run(pp_reference, deep_reference)  # losses, val and val_ema, export and EMA export
    ckpt = pp_reference / "checkpoints" / "step_00000012"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert set(manifest["files"]) == {"model.safetensors", "model.rank00001.safetensors", "state.safetensors",
                                      "state.rank00001.safetensors", "state.json", "config.yaml"}
    from safetensors import safe_open

    def keys(name: str) -> set[str]:
        with safe_open(str(ckpt / name), "pt") as f:
            return set(f.keys())

    first, last = keys("model.safetensors"), keys("model.rank00001.safetensors")
    # The embedding and the first two blocks on stage 0; the last two, the final norm and the head on stage 1.
    # The head's weight is the embedding's (tied): each stage holds a copy, each key is written once.
    assert {"tok_emb.weight", "pos_emb.weight", "blocks.1.mlp.2.weight"} <= first
    assert {"blocks.2.mlp.2.weight", "blocks.3.mlp.2.weight", "ln_f.weight", "head.weight"} <= last
    assert not first & last and not any(k.startswith(("blocks.2", "blocks.3")) for k in first)
    assert first | last == set(load_weights(deep_reference / "checkpoints" / "step_00000012" / "model.safetensors"))
    state_first, state_last = keys("state.safetensors"), keys("state.rank00001.safetensors")
    assert "/optimizer/state/blocks.3.mlp.2.weight/exp_avg" in state_last - state_first
    assert "/ema/shadow/blocks.0.mlp.2.weight" in state_first - state_last
    # The export is the whole model under the plain model's keys.
    assert load_weights(pp_reference / "model.safetensors").keys() == \
        load_weights(deep_reference / "model.safetensors").keys()


@pytest.mark.parametrize("layout", [
    # dp 2 x pp 2, with 2 micro-batches of 2 per data-parallel rank (the global batch stays 8).
    ("world.nproc_per_node=4", "world.pp=2", "data.batch_size=2", "trainer.grad_accum_steps=2"),
    # pp 2 x tp 2, with 2 micro-batches of 4.
    ("world.nproc_per_node=4", "world.pp=2", "world.tp=2", "data.batch_size=4", "trainer.grad_accum_steps=2"),
], ids=["dp2xpp2_accumulating", "pp2xtp2_accumulating"])
def test_pipeline_with_data_or_tensor_parallelism_and_accumulation_equals_one_process(
        corpus, tmp_path, deep_reference, layout):
    cli_run(corpus, tmp_path, "world=ddp", "world.threads=1", *layout)
    same_run(tmp_path, deep_reference)


@pytest.mark.parametrize("schedule, extra", [
    ("Interleaved1F1B", ()),
    ("ZBVZeroBubble", ("data.batch_size=4", "trainer.grad_accum_steps=2")),  # pp 2 alone, accumulating
])
def test_looped_and_v_schedules_equal_one_process(corpus, tmp_path, deep_reference, schedule, extra):
    """Two stages per rank (four in all): looped (stages 0 and 2 on rank 0) and in a V (0 and 3)."""
    run = tmp_path / "pp"
    cli_run(corpus, run, *PP2, f"world.pp_schedule={schedule}", "world.microbatches=4", *extra)
    same_run(run, deep_reference)
    # Its checkpoint resumes on one process: a rank lists its parameters in its stages' order (blocks 0, 2, 1, 3),
    # which was refused as "the optimizer's parameter groups differ".
    one = tmp_path / "one"
    shutil.copytree(run, one)
    train_in_process(corpus, one, "data.batch_size=8", *SHARED, *DEEP, f"resume={run}/checkpoints/step_00000008")
    same_run(one, deep_reference)


def test_sampling_at_eval_runs_the_stages_in_turn_and_samples_what_one_process_samples(corpus, tmp_path):
    """The lm task samples at each eval: under pp its model's forward runs the stages in turn, and the text
    must be what one process samples from the same weights (the run's export, with `python -m trainer sample`).
    (Against a separate one-process run the weights agree only to float tolerance, and bytes the corpus never
    shows keep near-equal logits that such a difference reorders.)"""
    cli_run(corpus, tmp_path, *PP2, "trainer.max_steps=4", "trainer.eval_every=2", "task.sample_tokens=16")
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [2, 4]
    r = run_here("sample", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert samples[-1]["text"] in r.stdout


def test_a_pipeline_checkpoint_resumes_on_any_layout_and_any_checkpoint_resumes_on_a_pipeline(
        corpus, tmp_path, pp_reference, deep_reference):
    # 2 stages -> 1 process.
    one = tmp_path / "one"
    shutil.copytree(pp_reference, one)
    train_in_process(corpus, one, "data.batch_size=8", *SHARED, *DEEP,
                     f"resume={pp_reference}/checkpoints/step_00000008")
    same_run(one, deep_reference)
    # 1 process -> 2 stages.
    two = tmp_path / "two"
    shutil.copytree(deep_reference, two)
    cli_run(corpus, two, *PP2, f"resume={deep_reference}/checkpoints/step_00000008")
    same_run(two, deep_reference)
    # 2 stages -> FSDP over 2 ranks (batch 4 each).
    fsdp = tmp_path / "fsdp"
    shutil.copytree(pp_reference, fsdp)
    cli_run(corpus, fsdp, "world=fsdp", "world.nproc_per_node=2", "data.batch_size=4",
            f"resume={pp_reference}/checkpoints/step_00000008")
    same_run(fsdp, deep_reference)


def test_last_stage_killed_mid_run_restarts_and_ends_bit_identical(corpus, tmp_path, pp_reference):
    # Synchronous saves, so step 8's is complete when the last stage's rank dies in step 9. Its task's loss is
    # called 3 times a step (once to find the model's inputs, once per microbatch) and once more in the first
    # step (the schedule's shape inference): call 28 is in step 9. The elastic agent restarts both ranks, which
    # resume from step 8.
    killed = tmp_path.parent / f"{tmp_path.name}-killed"  # created by the faulty task as it kills its rank
    cli_run(corpus, tmp_path, *PP2, "world.max_restarts=1", "checkpoint.async_save=false",
            *faulty("sigkill", 28, rank=1, first_attempt_only=True), f"+task.once={killed}", env=FAULTY_ENV)
    assert killed.exists()
    assert_identical(tmp_path, pp_reference)


@pytest.mark.parametrize("extra, needle", [
    (("world.nproc_per_node=3", "world.pp=2"), "world.pp=2 is invalid with world.tp=1: expected pp x tp to divide"),
    (("world.nproc_per_node=2", "world.pp=2"), "GPT has only one block (blocks)"),  # (gpt_tiny's one)
    (("world.nproc_per_node=2", "world.pp=2", "data.batch_size=3"), "world.microbatches=2 (null: one per stage) "
                                                                    "does not divide data.batch_size=3"),
    (("world.nproc_per_node=2", "world.pp=2", "world.pp_schedule=Zigzag"),
     "world.pp_schedule='Zigzag' is not a pipeline schedule: expected one of GPipe, 1F1B, Interleaved1F1B"),
    (("world=fsdp", "world.nproc_per_node=2", "world.pp=2"),
     "unknown config key 'world.pp'. Pipeline stages (world.pp, world.pp_schedule, world.microbatches) are an "
     "option of world=ddp."),
], ids=["pp_does_not_divide", "more_stages_than_blocks", "microbatches_do_not_divide", "no_such_schedule",
        "pp_under_fsdp"])
def test_pipeline_mistakes_are_one_paragraph_before_any_process_starts(corpus, tmp_path, extra, needle):
    run_dir = tmp_path / "run"
    from test_errors import assert_clean_error

    r = run_here(*tiny_overrides(corpus, "world=ddp", *extra), f"hydra.run.dir={run_dir}")
    assert_clean_error(r, needle)
    assert len(r.stderr.strip().splitlines()) == 1 and not run_dir.exists()


def test_a_batch_the_microbatches_do_not_divide_is_told_only_the_counts_its_schedule_takes():
    """ZBVZeroBubble on 2 ranks (4 stages) and batch 2: the advice to set world.microbatches to a divisor of 2 was
    then refused, since that schedule needs one microbatch per stage."""
    from trainer.errors import ConfigError
    from trainer.parallel.layout import check_pipeline

    with pytest.raises(ConfigError, match=r"=4 \(null: one per stage\) does not divide data.batch_size=2: .* multiple "
                                          r"of 4\.$"):
        check_pipeline(2, "ZBVZeroBubble", None, 2, batch_size=2)
    with pytest.raises(ConfigError, match=r"world.microbatches to one that divides it and suits 1F1B \(2, 3, 6\)"):
        check_pipeline(2, "1F1B", 4, 2, batch_size=6)


def test_a_microbatchs_noise_is_the_whole_batchs_for_its_rows():
    """The last stage calls the task's loss once per microbatch, on some rows of the micro-batch: the noise a
    task draws there (trainer.noise) must be what the whole micro-batch's call draws for those rows."""
    import torch

    from trainer import noise

    with noise.for_samples(torch.arange(100, 108), seed=3):
        whole = [noise.randn(8, 5), noise.rand(8, 2)]
        with noise.rows(torch.tensor([4, 5, 6, 7])):
            part = [noise.randn(4, 5), noise.rand(4, 2)]
        after = noise.randn(8, 5)  # the whole batch's third draw, as if the block had not been there
    assert torch.equal(part[0], whole[0][4:]) and torch.equal(part[1], whole[1][4:])
    with noise.for_samples(torch.arange(100, 108), seed=3):
        noise.randn(8, 5), noise.rand(8, 2)
        assert torch.equal(noise.randn(8, 5), after)
    assert not torch.equal(part[0], whole[0][:4])


def test_noise_drawn_in_compiled_code_compiles_once_for_every_micro_batch_and_block_entered_twice():
    """A compiled forward that draws noise takes the micro-batch's positions as an input: one compilation for
    every micro-batch (positions held as a Python range or ints would be constants, recompiled at each), the
    eager values. And a block entered again inside itself restores what was before each entry."""
    import torch
    from torch._dynamo.testing import CompileCounter

    from trainer import noise

    counter = CompileCounter()

    def forward(x):
        return x + noise.randn_like(x)

    compiled = torch.compile(forward, backend=counter)
    for first in range(0, 24, 4):
        with noise.for_samples(torch.arange(first, first + 4), seed=3):
            got = compiled(torch.zeros(4, 3))
        with noise.for_samples(torch.arange(first, first + 4), seed=3):
            assert torch.equal(got, forward(torch.zeros(4, 3)))
    assert counter.frame_count == 1

    block = noise.for_samples(torch.arange(4), seed=1)
    with block:
        with block:
            noise.rand(4)
        assert noise._state["positions"] is not None and noise._state["draws"] == 0  # the outer entry's state
    assert noise._state["positions"] is None


def test_a_schedule_in_any_case_is_recorded_as_torch_spells_it(corpus):
    """`world.pp_schedule=interleaved1f1b` is taken and recorded as `Interleaved1F1B`: a resume spelling it
    `1F1B`-style or not is the same setting (config.yaml would otherwise list it as changed)."""
    from trainer.config.compose import prepare

    cfg = prepare(compose_cfg(tiny_overrides(corpus, *PP2, "world.pp_schedule=interleaved1f1b")), targets=False)
    assert cfg.world.pp_schedule == "Interleaved1F1B"
