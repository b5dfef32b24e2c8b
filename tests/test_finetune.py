"""Fine-tuning: a run that starts from pretrained weights (finetune.weights=PATH: a file, a Hugging Face model
directory with a sharded index, a finished run dir), read exactly and shard by shard, its source recorded; LoRA
adapters that are all the optimizer trains, equal on 1 and 2 processes and under FSDP x tensor parallelism, and
exported merged and alone (peft's format); and each mistake one paragraph before any worker starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import load_weights, read_metrics, run_cli, run_here, series, tiny_overrides
from test_errors import assert_clean_error

LORA = ("finetune.lora.rank=4", "finetune.lora.targets=[qkv,proj,mlp.0]")  # colwise and rowwise layers alike
STEPS = ("trainer.max_steps=4", "data.batch_size=4")


@pytest.fixture(scope="module")
def pretrained(corpus, tmp_path_factory) -> Path:
    """A finished run (gpt_tiny, 3 steps): the weights the others start from."""
    from trainer import compose, train

    run_dir = tmp_path_factory.mktemp("pretrained")
    train(compose(tiny_overrides(corpus, "trainer.max_steps=3")), run_dir)
    return run_dir


@pytest.fixture(scope="module")
def lora_single(corpus, pretrained, tmp_path_factory) -> Path:
    from trainer import compose, train

    run_dir = tmp_path_factory.mktemp("lora_single")
    train(compose(tiny_overrides(corpus, *STEPS, f"finetune.weights={pretrained}", *LORA)), run_dir)
    return run_dir


def built(corpus, run_dir: Path, *extra: str):
    from trainer import build, compose

    return build(compose(tiny_overrides(corpus, *extra)), run_dir)


def test_pretrained_weights_load_exactly_from_a_run_a_sharded_index_and_a_file(corpus, tmp_path, pretrained):
    from trainer.models.export import export_model, file_digests

    want = load_weights(pretrained / "model.safetensors")
    # The same weights as a Hugging Face model directory: shards and model.safetensors.index.json.
    hub = tmp_path / "hub"
    hub.mkdir()
    files = export_model(want, hub, "model", {}, max_shard_mb=0.1)
    assert "model.safetensors.index.json" in files and len([f for f in files if "-of-" in f]) > 1
    for source in (pretrained, hub, pretrained / "model.safetensors"):
        t = built(corpus, tmp_path / "run", f"finetune.weights={source}")
        got = t.raw_model.state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), source
    digests = file_digests(pretrained, ["model.safetensors"])
    assert t.weights_source == {"path": str(pretrained / "model.safetensors"), "files": digests}
    # finetune.dtype: the weights kept in bf16 (the values rounded once, on load).
    t = built(corpus, tmp_path / "bf16", f"finetune.weights={pretrained}", "finetune.dtype=bf16")
    assert all(torch.equal(v, want[k].bfloat16()) for k, v in t.raw_model.state_dict().items())


def test_lora_trains_only_its_adapters_and_exports_them_merged_and_alone(corpus, tmp_path, pretrained, lora_single):
    import trainer

    t = built(corpus, tmp_path, *STEPS, f"finetune.weights={pretrained}", *LORA)
    trained = {id(p) for g in t.optimizer.param_groups for p in g["params"]}
    names = {n for n, p in t.raw_model.named_parameters() if id(p) in trained}
    assert names == {f"blocks.0.{layer}.lora_{ab}" for layer in ("attn.qkv", "attn.proj", "mlp.0") for ab in "AB"}
    # The export: the merged weights under the plain model's keys, and the adapter alone in peft's layout.
    base, merged = load_weights(pretrained / "model.safetensors"), load_weights(lora_single / "model.safetensors")
    adapter = load_weights(lora_single / "adapter" / "adapter_model.safetensors")
    config = json.loads((lora_single / "adapter" / "adapter_config.json").read_text())
    assert not (lora_single / "adapter_config.json").exists()  # (from_pretrained would apply it to the merge again)
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 16.0
    assert config["base_model_name_or_path"] == str(pretrained)  # (was null: peft applies it to any base silently)
    assert merged.keys() == base.keys()
    for k in base:
        layer = k.removesuffix(".weight")
        if layer in config["target_modules"]:
            a, b = adapter[f"base_model.model.{layer}.lora_A.weight"], adapter[f"base_model.model.{layer}.lora_B.weight"]
            assert b.abs().max() > 0  # trained
            torch.testing.assert_close(merged[k], base[k] + 4.0 * b @ a)
        else:
            assert torch.equal(merged[k], base[k]), k  # frozen
    assert sorted(config["target_modules"]) == sorted(f"blocks.0.{n}" for n in ("attn.qkv", "attn.proj", "mlp.0"))
    assert type(trainer.load(lora_single)).__name__ == "GPT"
    info = json.loads((lora_single / "run_info.json").read_text())
    assert info["finetune_weights"]["files"]["model.safetensors"]["sha256"] == \
        json.loads((pretrained / "export.json").read_text())["files"]["model.safetensors"]["sha256"]


def test_a_bf16_fine_tune_is_loaded_in_bf16_by_every_reader(corpus, tmp_path, pretrained):
    """finetune.dtype=bf16 exports bf16 weights: trainer.load built the fp32 model and computed in fp32 (logits off
    from_pretrained's and the run's own eval), device_map did too, and trainer.load(checkpoint=...) refused the
    checkpoint's bf16 tensors as "edited apart"."""
    import trainer
    from trainer import compose, train

    run = tmp_path / "bf16"
    train(compose(tiny_overrides(corpus, *STEPS, f"finetune.weights={pretrained}", "finetune.dtype=bf16")), run)
    exported = load_weights(run / "model.safetensors")
    assert {v.dtype for v in exported.values()} == {torch.bfloat16}
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    models = [trainer.load(run), trainer.load(run, checkpoint="latest"), trainer.load(run, device_map="auto")]
    with torch.no_grad():
        logits = [m(ids) for m in models]
    for model in models[:2]:
        state = model.state_dict()
        assert all(state[k].dtype == torch.bfloat16 and torch.equal(state[k], v) for k, v in exported.items())
    assert logits[0].dtype == torch.bfloat16 and all(torch.equal(x, logits[0]) for x in logits[1:])


def test_the_adapter_loads_with_peft(pretrained, lora_single):
    peft = pytest.importorskip("peft")
    import trainer

    adapted = peft.PeftModel.from_pretrained(trainer.load(pretrained), str(lora_single / "adapter"))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids), trainer.load(lora_single)(ids), rtol=1e-5, atol=1e-5)


def test_a_lora_checkpoint_holds_the_adapters_only_and_resumes_to_the_same_run(corpus, tmp_path, pretrained,
                                                                             lora_single):
    """The frozen base is rebuilt from finetune.weights on resume, so a checkpoint holds the adapters (and their
    optimizer moments, and the EMA's) only; resumed from step 2 the run ends where the uninterrupted one does,
    bitwise. If the base file changes in between, the resume stops with one paragraph naming it."""
    import shutil

    from safetensors.torch import save_file

    from trainer import compose, train
    from trainer.checkpoint.store import read
    from trainer.errors import CheckpointError

    base = tmp_path / "base.safetensors"
    shutil.copy(pretrained / "model.safetensors", base)
    run = (*STEPS, f"finetune.weights={base}", *LORA)
    first = tmp_path / "first"
    train(compose(tiny_overrides(corpus, *run, "checkpoint.every_n_steps=2", "ema.enabled=true")), first)
    step2 = first / "checkpoints" / "step_00000002"
    loaded = read(step2)
    adapters = {f"blocks.0.{layer}.lora_{ab}" for layer in ("attn.qkv", "attn.proj", "mlp.0") for ab in "AB"}
    scales = {f"blocks.0.{layer}.lora_scale" for layer in ("attn.qkv", "attn.proj", "mlp.0")}  # (buffers)
    assert set(loaded.model) == adapters | scales
    assert set(loaded.tree["ema"]["shadow"]) == adapters
    assert set(loaded.tree["optimizer"]["state"]) == adapters
    # step 2 -> 4 equals 0 -> 4 (lora_single: the same run without checkpoints or EMA), bitwise.
    resumed = tmp_path / "resumed"
    train(compose(tiny_overrides(corpus, *run, "ema.enabled=true", f"resume={step2}")), resumed)
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        got, want = load_weights(resumed / name), load_weights(lora_single / name)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), name
    assert series(read_metrics(resumed), "train/loss") == series(read_metrics(lora_single), "train/loss")[2:]
    # A resume with another finetune.lora.alpha trains at the new scale from there on, and exports at it too (the
    # checkpoint's scale buffer, loaded, had the export merge at the old one).
    alpha = tmp_path / "alpha"
    train(compose(tiny_overrides(corpus, *run, f"resume={step2}", "finetune.lora.alpha=32")), alpha)
    config = json.loads((alpha / "adapter" / "adapter_config.json").read_text())
    adapter, merged = load_weights(alpha / "adapter" / "adapter_model.safetensors"), load_weights(alpha / "model.safetensors")
    assert config["lora_alpha"] == 32.0
    a, b = (adapter[f"base_model.model.blocks.0.attn.qkv.lora_{x}.weight"] for x in "AB")
    torch.testing.assert_close(merged["blocks.0.attn.qkv.weight"],
                               load_weights(base)["blocks.0.attn.qkv.weight"] + 8.0 * b @ a)
    # Another base under the same path: refused before anything is loaded.
    weights = load_weights(base)
    save_file({k: v + 1e-3 if k == "tok_emb.weight" else v for k, v in weights.items()}, str(base))
    with pytest.raises(CheckpointError, match=r"other pretrained weights than finetune.weights=.*base.safetensors"
                                              r" holds now \(base.safetensors differ by sha256\)"):
        train(compose(tiny_overrides(corpus, *run, "ema.enabled=true", f"resume={step2}")), tmp_path / "again")
    # No finetune.weights at all: the frozen base would be random (it resumed, trained on and exported that, with only
    # a note of the changed setting). Refused naming the path to give again, and nothing written.
    with pytest.raises(CheckpointError, match=rf"but this run has no finetune.weights: the frozen base would be a "
                                              rf"random initialisation. Resume with finetune.weights={base}"):
        train(compose(tiny_overrides(corpus, *STEPS, *LORA, "ema.enabled=true", f"resume={step2}")), tmp_path / "none")
    assert not (tmp_path / "none" / "checkpoints").exists()


def assert_same_run(run_dir: Path, ref: Path) -> None:
    """fp32 on several processes: one process's losses, merged weights and adapter, up to the order of the sums."""
    assert series(read_metrics(run_dir), "train/loss") == pytest.approx(series(read_metrics(ref), "train/loss"),
                                                                        rel=1e-5)
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        got, want = load_weights(run_dir / name), load_weights(ref / name)
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("world", [
    ("world=ddp", "world.nproc_per_node=2", "data.batch_size=2"),
    # dp 2 x tp 2: each rank reads a box of each tensor (rows by FSDP's strided shard, columns by tp's rowwise);
    # colwise and rowwise layers split their adapters with their weights.
    ("world=fsdp", "world.nproc_per_node=4", "world.tp=2", "data.batch_size=2"),
], ids=["ddp2", "fsdp2xtp2"])
def test_pretrained_lora_on_several_processes_equals_one(corpus, tmp_path, pretrained, lora_single, world):
    r = run_cli(*tiny_overrides(corpus, *STEPS, f"finetune.weights={pretrained}", *LORA, *world),
                f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    assert_same_run(tmp_path, lora_single)


def unfinished(tmp_path: Path) -> Path:
    run = tmp_path / "unfinished"
    run.mkdir()
    (run / "config.yaml").write_text("model: {}\n")
    return run


def a_sharded_checkpoint(tmp_path: Path) -> Path:
    """A checkpoint dir whose weights are split over two ranks' files (each model.safetensors holds one rank's
    part): refused, not read."""
    import hashlib
    import shutil

    from trainer.checkpoint.store import Checkpointer

    path = Checkpointer(tmp_path / "checkpoints").save(1, {"w": torch.zeros(2)}, {"trainer": {"step": 1}})
    shutil.copy(path / "model.safetensors", path / "model.rank00001.safetensors")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["model.rank00001.safetensors"] = hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def a_lora_checkpoint(tmp_path: Path) -> Path:
    """A LoRA run's checkpoint: its model file holds the adapters alone (the base is the run's finetune.weights)."""
    from trainer.checkpoint.store import Checkpointer

    return Checkpointer(tmp_path / "checkpoints").save(1, {"blocks.0.attn.qkv.lora_A": torch.zeros(2, 2)},
                                                       {"trainer": {"step": 1}})


def pickled(tmp_path: Path) -> Path:
    d = tmp_path / "hub"
    d.mkdir()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")
    return d


@pytest.mark.parametrize(("extra", "needles"), [
    (["model.d_model=32"], ["do not fit the model (GPT)", "shapes that differ", "tok_emb.weight (256, 64) in the "
                            "file vs (256, 32) in the model"]),
    (["model.n_layer=2"], ["missing from the files (", "blocks.1.attn.qkv.weight"]),
    (["finetune.weights=/nonexistent/w.safetensors"], ["finetune.weights=/nonexistent/w.safetensors does not exist"]),
    ([lambda tmp: f"finetune.weights={pickled(tmp)}"], ["pytorch_model.bin is a pickle file", "never unpickles",
                                                        "safetensors.torch"]),
    ([lambda tmp: f"finetune.weights={unfinished(tmp)}"], ["run dir without an export", "resume=auto"]),
    ([lambda tmp: f"finetune.weights={a_sharded_checkpoint(tmp)}"], ["weights are split over its ranks' files",
                                                                    "resume=", "st.save_model(trainer.load("]),
    ([lambda tmp: f"finetune.weights={a_lora_checkpoint(tmp)}"], ["is a checkpoint of a LoRA run", "adapters alone",
                                                                 "finetune.weights=RUN_DIR"]),
    (["finetune.lora.rank=4", "finetune.lora.targets=[q_proj]"], ["'q_proj', which is no linear layer of GPT",
                                                                  "qkv"]),
    (["finetune.lora.rank=4", "finetune.lora.targets=[head]"], ["adapts head, whose weight is shared"]),
    (["finetune.lora.rank=4"], ["finetune.lora.targets=[] is invalid"]),
])
def test_finetune_mistakes_are_one_paragraph_before_any_worker(corpus, tmp_path, pretrained, extra, needles):
    extra = [e(tmp_path) if callable(e) else e for e in extra]
    r = run_here(*tiny_overrides(corpus, "world=ddp", "world.nproc_per_node=2", f"finetune.weights={pretrained}",
                                 *extra), f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert_clean_error(r, *needles)
    assert not (tmp_path / "run").exists()


def test_a_lora_checkpoint_loads_and_samples_as_the_runs_export_from_its_base(corpus, tmp_path, pretrained, lora_single):
    """A LoRA checkpoint holds the adapters alone: `trainer.load(RUN, checkpoint=...)` and `sample RUN checkpoint=...`
    refused it, so a preempted LoRA run could not be looked at until it finished. They rebuild the base from
    finetune.weights (checked by sha256) as the run did: the final checkpoint gives the export's weights exactly."""
    import trainer
    from trainer import compose, train
    from trainer.errors import CheckpointError

    final = sorted((lora_single / "checkpoints").glob("step_*"))[-1]
    assert final.name.endswith("4")  # (the last step's: what the export holds)
    loaded, exported = trainer.load(lora_single, checkpoint="latest"), trainer.load(lora_single)
    assert type(loaded) is type(exported)  # the plain model, the adapters merged as the export merges them
    want = exported.state_dict()
    got = loaded.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    said = [run_here("sample", str(lora_single), *c, "task.sample_tokens=12", cwd=tmp_path) for c in ([], [f"checkpoint={final}"])]
    assert all(r.returncode == 0 for r in said), [r.stderr for r in said]
    assert said[0].stdout.strip() and said[1].stdout == said[0].stdout
    # The advice of finetune.weights=LORA_CHECKPOINT's refusal: its weights written whole start a run at them.
    from safetensors.torch import save_model

    save_model(trainer.load(final), str(tmp_path / "w.safetensors"))
    start = built(corpus, tmp_path / "next", f"finetune.weights={tmp_path / 'w.safetensors'}").raw_model.state_dict()
    assert all(torch.equal(start[k], want[k]) for k in want)
    # A LoRA run without finetune.weights (its base is what the seed draws, drawn again), with its EMA's adapters.
    train(compose(tiny_overrides(corpus, "trainer.max_steps=2", "ema.enabled=true", *LORA)), tmp_path / "seeded")
    for ema in (False, True):
        got, want = (trainer.load(tmp_path / "seeded", ema=ema, **k).state_dict() for k in ({"checkpoint": "latest"}, {}))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), ema
    # finetune.weights given relative to where the run started: eval, sample and trainer.load of its checkpoints from
    # another directory read it there ("finetune.weights=../pretrained does not exist. Give a .safetensors file").
    import os

    (tmp_path / "rel").mkdir()
    relative = os.path.relpath(pretrained, tmp_path / "rel")
    r = run_here(*tiny_overrides(corpus, "trainer.max_steps=2", f"finetune.weights={relative}", *LORA),
                 f"hydra.run.dir={tmp_path / 'rel' / 'run'}", cwd=tmp_path / "rel")
    assert r.returncode == 0, r.stderr
    for args in (["eval", str(tmp_path / "rel" / "run")], ["sample", str(tmp_path / "rel" / "run"), "checkpoint=latest",
                                                            "task.sample_tokens=4"]):
        r = run_here(*args, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
    got, want = (trainer.load(tmp_path / "rel" / "run", **k).state_dict() for k in ({"checkpoint": "latest"}, {}))
    assert all(torch.equal(got[k], want[k]) for k in want)
    # A base file replaced since (same keys and shapes): the adapters were not trained on it.
    base = tmp_path / "base.safetensors"
    base.write_bytes((pretrained / "model.safetensors").read_bytes())
    train(compose(tiny_overrides(corpus, "trainer.max_steps=2", f"finetune.weights={base}", *LORA)), tmp_path / "on")
    base.write_bytes((lora_single / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match=r"trained on other pretrained weights than finetune\.weights="):
        trainer.load(tmp_path / "on", checkpoint="latest")


def test_a_run_refused_for_changed_data_starts_over_from_its_checkpoints_weights_as_the_refusal_says(corpus, tmp_path):
    """The refusal named finetune.weights=CHECKPOINT_OR_RUN_DIR, and finetune.weights=CHECKPOINT was refused ("is a
    checkpoint, not a model"), as is an unfinished run dir: a circle. A checkpoint of one file is the whole weights:
    a run from it starts at them exactly."""
    data = tmp_path / "data.txt"
    data.write_bytes(corpus.read_bytes()[:8192])
    base = ("trainer.max_steps=4", "checkpoint.every_n_steps=2")
    assert run_here(*tiny_overrides(data, *base), f"hydra.run.dir={tmp_path / 'first'}").returncode == 0
    ckpt = tmp_path / "first" / "checkpoints" / "step_00000002"
    data.write_bytes(b"Z" + data.read_bytes()[1:])  # edited in place
    r = run_here(*tiny_overrides(data, *base), f"resume={ckpt}", f"hydra.run.dir={tmp_path / 'resumed'}")
    assert_clean_error(r, "other data than this run's", "finetune.weights=CHECKPOINT")
    r = run_here(*tiny_overrides(data, "trainer.max_steps=2", f"finetune.weights={ckpt}"),
                 f"hydra.run.dir={tmp_path / 'again'}")
    assert r.returncode == 0, r.stderr
    import trainer

    start = trainer.load(ckpt).state_dict()
    got = built(data, tmp_path / "built", f"finetune.weights={ckpt}").raw_model.state_dict()
    assert got.keys() == start.keys() and all(torch.equal(got[k], start[k]) for k in start)


def test_weights_from_the_runs_own_dir_are_refused_before_anything_there_changes(corpus, tmp_path, pretrained):
    """A LoRA run started from the finished run in its own hydra.run.dir trained, then replaced the weights it
    started from with its export: its checkpoints could no longer be resumed or evaluated."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(pretrained, run)
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    for weights in (run, run / "model.safetensors"):
        r = run_here(*tiny_overrides(corpus, f"finetune.weights={weights}", *LORA), f"hydra.run.dir={run}", cwd=tmp_path)
        assert_clean_error(r, f"finetune.weights={weights} is in this run's own dir", "hydra.run.dir=DIR")
    assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
