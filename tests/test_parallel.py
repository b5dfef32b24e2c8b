"""Sharded and tensor-parallel training on CPU with gloo: FSDP2 and tensor parallelism are pure performance
knobs (the same losses and weights as one process), their checkpoints are pickle-free shards that resume
under any strategy and world size, and their mistakes are one paragraph before any process starts."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from conftest import (
    FAULTY_ENV,
    SHARED,
    assert_identical,
    assert_same_run,
    faulty,
    load_weights,
    once_per_run,
    run_cli,
    run_here,
    series,
    start_processes,
    tiny_overrides,
    train_in_process,
)

pytestmark = pytest.mark.slow

FSDP2 = ("world=fsdp", "world.nproc_per_node=2", "data.batch_size=4")
# dp 2 x tp 2 on 4 processes of one thread each: the global batch stays 8 (4 per data-parallel rank).
FSDP2_TP2 = ("world=fsdp", "world.nproc_per_node=4", "world.tp=2", "world.threads=1", "data.batch_size=4")


def cli_run(corpus: Path, run_dir: Path, *extra: str, env: dict | None = None):
    r = run_cli(*tiny_overrides(corpus, *SHARED, *extra), f"hydra.run.dir={run_dir}", env=env)
    assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="session")
def fsdp_reference(corpus, tmp_path_factory) -> Path:
    """FSDP over 2 processes x batch 4, EMA on, a checkpoint every 4 steps (written in the background)."""
    return once_per_run(tmp_path_factory, "fsdp_reference", lambda d: cli_run(corpus, d, *FSDP2))


@pytest.fixture(scope="session")
def tp_reference(corpus, tmp_path_factory) -> Path:
    """FSDP 2 x tensor parallel 2 on 4 processes. Only rank 0 prints: DTensor's warning about its two-step
    redistributions (the gradient norm, the export's gather) came from every rank, twice a run."""
    def run(d: Path) -> None:
        r = run_cli(*tiny_overrides(corpus, *SHARED, *FSDP2_TP2), f"hydra.run.dir={d}")
        assert r.returncode == 0 and "[rank" not in r.stderr + r.stdout, r.stderr

    return once_per_run(tmp_path_factory, "tp_reference", run)


def test_fsdp_equals_one_process_and_each_rank_writes_its_shards(fsdp_reference, reference):
    assert_same_run(fsdp_reference, reference)
    ckpt = fsdp_reference / "checkpoints" / "step_00000012"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert set(manifest["files"]) == {"model.safetensors", "model.rank00001.safetensors", "state.safetensors",
                                      "state.rank00001.safetensors", "state.json", "config.yaml"}
    # Rank 1's file holds its half of the embedding, with the global shape and offset in the metadata.
    from safetensors import safe_open

    with safe_open(str(ckpt / "model.rank00001.safetensors"), "pt") as f:
        chunks = json.loads(f.metadata()["chunks"])
        assert tuple(f.get_tensor("tok_emb.weight").shape) == (128, 64)
    assert chunks["tok_emb.weight"] == {"shape": [256, 64], "offset": [128, 0]}
    # The export is whole and keyed like the plain model's state_dict.
    assert load_weights(fsdp_reference / "model.safetensors")["tok_emb.weight"].shape == (256, 64)
    # trainer.load of the sharded checkpoint assembles each tensor on one process: the export's numbers.
    import trainer

    for ema, name in ((False, "model.safetensors"), (True, "model_ema.safetensors")):
        weights, loaded = load_weights(fsdp_reference / name), trainer.load(ckpt, ema=ema).state_dict()
        assert loaded.keys() == weights.keys() and all(torch.equal(loaded[k], weights[k]) for k in weights)


def test_sgd_under_fsdp_takes_its_loop_kernel_and_equals_one_process(corpus, tmp_path):
    """SGD inherits the base optim's fused: true, and torch's fused SGD kernel takes no DTensor shards: the README's
    own way to swap the optimizer (~optim.betas ~optim.eps) was a NotImplementedError traceback on every rank."""
    sgd = ("optim._target_=torch.optim.SGD", "~optim.betas", "~optim.eps", "trainer.max_steps=4", "ema.enabled=false",
           "trainer.eval_every=4")
    r = run_cli(*tiny_overrides(corpus, *sgd, *FSDP2), f"hydra.run.dir={tmp_path / 'fsdp'}")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("torch.optim.SGD's fused kernel takes no DTensor shards") == 1, r.stdout
    train_in_process(corpus, tmp_path / "one", *sgd, "data.batch_size=8")
    assert_same_run(tmp_path / "fsdp", tmp_path / "one")


def test_fsdp_checkpoint_resumes_on_one_process_and_one_resumes_on_fsdp_with_accumulation(
        corpus, tmp_path, fsdp_reference, reference):
    # 2 processes -> 1: the same global batch continues the same loss stream.
    one = tmp_path / "one"
    shutil.copytree(fsdp_reference, one)
    train_in_process(corpus, one, "data.batch_size=8", *SHARED, f"resume={fsdp_reference}/checkpoints/step_00000008")
    assert_same_run(one, reference)
    # 1 process -> 2, now as 2 micro-batches of 2 per rank (FSDP's gradient sync only on the last).
    two = tmp_path / "two"
    shutil.copytree(reference, two)
    cli_run(corpus, two, "world=fsdp", "world.nproc_per_node=2", "data.batch_size=2", "trainer.grad_accum_steps=2",
            f"resume={reference}/checkpoints/step_00000008")
    assert_same_run(two, reference)


def test_fsdp_rank_killed_mid_run_restarts_and_ends_bit_identical(corpus, tmp_path, fsdp_reference):
    # Synchronous saves, so step 8's is complete when rank 1 dies in step 11; the elastic agent restarts
    # both ranks, which resume from it.
    r = cli_run(corpus, tmp_path, *FSDP2, "world.max_restarts=1", "checkpoint.async_save=false",
                *faulty("sigkill", 11, rank=1, first_attempt_only=True), env=FAULTY_ENV)
    assert_identical(tmp_path, fsdp_reference)
    assert r.stdout.count("elastic restart 1 of world.max_restarts=1") == 1, r.stdout  # (it was silent)


def test_meta_init_gives_the_weights_of_the_plain_model(corpus, tmp_path):
    """One FSDP process (a group of one): the model is built on the meta device and materialised shard by
    shard; its weights must equal the plain path's for the same seed."""
    from trainer import build, compose

    plain = build(compose(tiny_overrides(corpus)), tmp_path / "plain")
    sharded = build(compose(tiny_overrides(corpus, "world=fsdp", "world.nproc_per_node=1")), tmp_path / "fsdp")
    try:
        whole = sharded.strategy.full_state_dict(sharded.strategy.model_state_dict(sharded.model))
        assert sharded.raw_model.tok_emb.weight is sharded.raw_model.head.weight  # still tied
    finally:
        sharded.backend.teardown()
    expected = plain.raw_model.state_dict()
    assert whole.keys() == expected.keys()
    for k in expected:
        assert torch.equal(whole[k], expected[k]), k


def test_bf16_and_fp16_fsdp_learn(corpus, tmp_path):
    for precision in ("bf16", "fp16"):
        events = train_in_process(corpus, tmp_path / precision, "world=fsdp", "world.nproc_per_node=1",
                                  f"precision={precision}", "trainer.max_steps=30", "optim.lr=3e-3")
        loss = series(events, "train/loss")
        assert loss[0] > 5.0 and sum(loss[-5:]) / 5 < loss[0] - 1.5, (precision, loss)


def test_a_pickle_planted_in_a_shard_never_runs(tmp_path, fsdp_reference, corpus):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    ckpt = tmp_path / "ckpt"
    shutil.copytree(fsdp_reference / "checkpoints" / "step_00000008", ckpt)
    from trainer.checkpoint.store import sha256

    bad = ckpt / "model.rank00001.safetensors"
    bad.write_bytes(pickle.dumps({"x": Payload()}))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][bad.name] = sha256(bad)  # the attacker also rewrites the checksum
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    from trainer.errors import CheckpointError

    with pytest.raises(CheckpointError, match="not a valid"):
        train_in_process(corpus, tmp_path / "run", "data.batch_size=8", *SHARED, f"resume={ckpt}")
    assert not marker.exists()


def test_tensor_parallel_by_fsdp_equals_one_process_and_resumes_anywhere(corpus, tmp_path, tp_reference, reference):
    assert_same_run(tp_reference, reference, weights_atol=1e-4)
    # Each of the 4 ranks holds a different chunk of a tensor-parallel weight; the replicated pieces are
    # written once.
    manifest = json.loads((tp_reference / "checkpoints" / "step_00000008" / "manifest.json").read_text())
    assert {f for f in manifest["files"] if f.startswith("model")} == {
        "model.safetensors", *(f"model.rank{r:05d}.safetensors" for r in (1, 2, 3))}
    # The dp 2 x tp 2 checkpoint resumes on one process and on ddp 2, continuing the same loss stream.
    one, ddp = tmp_path / "one", tmp_path / "ddp"
    for d in (one, ddp):
        shutil.copytree(tp_reference, d)
    train_in_process(corpus, one, "data.batch_size=8", *SHARED, f"resume={tp_reference}/checkpoints/step_00000008")
    cli_run(corpus, ddp, "world=ddp", "world.nproc_per_node=2", "data.batch_size=4",
            f"resume={tp_reference}/checkpoints/step_00000008")
    for d in (one, ddp):
        assert_same_run(d, reference, weights_atol=1e-4)


def _traps(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from trainer.parallel.strategy import clip_grad_norm_across_meshes
    from trainer.parallel.tensor_parallel import parallelize
    from trainer.recipes.lm.model import GPT

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = GPT(seq_len=16, n_layer=1, n_head=2, d_model=32)
        plain = GPT(seq_len=16, n_layer=1, n_head=2, d_model=32)
        plain.load_state_dict(model.state_dict())
        parallelize(model, init_device_mesh("cpu", (world,)))
        x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        for m in (model, plain):
            m(x).float().square().mean().backward()
        # The tied embedding and head: one parameter after parallelize_module, as before.
        tied = model.head.weight is model.tok_emb.weight
        # Norms over DTensors on the tp mesh and plain tensors (torch's clip_grad_norm_ refuses the mix).
        ours = clip_grad_norm_across_meshes(list(model.parameters()), None)
        want = torch.nn.utils.get_total_norm([p.grad for p in plain.parameters()])
        if rank == 0:
            Path(out).write_text(json.dumps({"tied": tied, "norm": float(ours), "want": float(want)}))
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_traps_tied_weights_and_norms_across_meshes(tmp_path):

    out = tmp_path / "out.json"
    start_processes(_traps, (2, str(tmp_path / "store"), str(out)), nprocs=2)
    got = json.loads(out.read_text())
    assert got["tied"] is True
    assert got["norm"] == pytest.approx(got["want"], rel=1e-5)


@pytest.mark.parametrize(("args", "needles"), [
    (["world=fsdp", "world.nproc_per_node=2", "world.wrap=[Blok]"],
     ["world.wrap names Blok", "Did you mean Block?", "CausalSelfAttention"]),
    (["world=fsdp", "world.nproc_per_node=2", "world.tp=2", "model.n_head=1", "model.d_model=64"],
     ["world.tp=2 must divide the number of attention heads", "n_head=1"]),
    (["world=ddp", "world.nproc_per_node=3", "world.tp=2"], ["world.tp=2", "divisor of the number of processes (3"]),
    (["world=fsdp", "world.nproc_per_node=2", "world.tp=2", "model._target_=torch.nn.Identity"],
     ["needs a tensor-parallel plan", "Identity has none", "_tp_plan"]),
    (["world=fsdp", "world.tpp=2"], ["unknown config key 'world.tpp'", "Did you mean world.tp=2?"]),
])
def test_parallel_config_mistakes_are_one_paragraph_before_any_process(tmp_path, corpus, args, needles):
    from test_errors import assert_clean_error

    r = run_here(*tiny_overrides(corpus), *args, "hydra.run.dir=run", cwd=tmp_path)
    assert_clean_error(r, *needles)
    assert list(tmp_path.iterdir()) == []
