"""Hugging Face models on every strategy: transformers' tensor-parallel vocabulary mapped to DTensor styles, and
initial weights that do not depend on the strategy. tests/helpers/hf_like.py reproduces transformers' init and plan
pattern, so the first tests run without transformers; the last ones need it (pip install -e '.[hf]') and skip
cleanly without it."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch
from conftest import ROOT, load_weights, read_metrics, run_cli, run_here, series, tiny_overrides
from test_errors import assert_clean_error

from trainer.errors import ConfigError

# The HF-like model with its head tied to its input embedding: the plan then splits one weight as
# embedding_rowwise and as colwise_gather_output, and keeps a per-head norm (replicated_with_grad_allreduce).
HF_LIKE = ("model._target_=hf_like.HFLike", "+model.tie=true")
STEPS = ("trainer.max_steps=4", "data.batch_size=4")
ENV = {"PYTHONPATH": f"{ROOT}:{ROOT / 'tests' / 'helpers'}"}


def built_weights(overrides: list[str], run_dir: Path) -> dict[str, torch.Tensor]:
    from trainer import build, compose

    t = build(compose(overrides), run_dir)
    try:
        return t.strategy.full_state_dict(t.strategy.model_state_dict(t.model))
    finally:
        t.backend.teardown()


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_sharded_init_of_a_hugging_face_pattern_model_equals_one_process(corpus, tmp_path):
    """FSDP builds the model on the meta device and runs its init shard by shard: transformers' init (guarded
    torch.nn.init wrappers, marks, children first) draws what one process draws."""
    from hf_like import HFLikeConfig, HFLikeForCausalLM

    from trainer.parallel import seed_everything
    from trainer.parallel.materialize import forget_initialization

    one = built_weights(tiny_overrides(corpus, *HF_LIKE), tmp_path / "one")
    sharded = built_weights(tiny_overrides(corpus, *HF_LIKE, "world=fsdp", "world.nproc_per_node=1"), tmp_path / "fsdp")
    assert_same_weights(sharded, one)
    # transformers' class as it ships: its constructor's marks make a second init_weights() draw nothing, so it keeps
    # the constructor's draws; forget_initialization makes it re-draw from the seed, as the sharded path does.
    seed_everything(0)
    raw = HFLikeForCausalLM(HFLikeConfig(max_position_embeddings=32, num_hidden_layers=1, tie_word_embeddings=True))
    seed_everything(0)
    raw.init_weights()
    assert not torch.equal(raw.lm_head.weight, one["lm_head.weight"])
    forget_initialization(raw)
    seed_everything(0)
    raw.init_weights()
    assert_same_weights({k: v for k, v in raw.state_dict().items()}, one)


@pytest.fixture(scope="module")
def hf_like_single(corpus, tmp_path_factory) -> Path:
    from trainer import compose, train

    run_dir = tmp_path_factory.mktemp("hf_like_single")
    train(compose(tiny_overrides(corpus, *HF_LIKE, *STEPS)), run_dir)
    return run_dir


def assert_same_run(run_dir: Path, ref: Path) -> None:
    """fp32 on 1 vs 2 processes: the same losses and weights up to the order of the sums."""
    assert series(read_metrics(run_dir), "train/loss") == pytest.approx(series(read_metrics(ref), "train/loss"),
                                                                        rel=1e-5)
    got, want = load_weights(run_dir / "model.safetensors"), load_weights(ref / "model.safetensors")
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_hugging_face_plan_on_tensor_parallel_by_fsdp_equals_one_process(corpus, tmp_path, hf_like_single):
    """transformers' plan vocabulary (colwise, rowwise, embedding_rowwise and colwise_gather_output on one tied
    weight, replicated_with_grad_allreduce) on world.tp=2 under FSDP: one process's losses and weights. The init
    on the shards draws the whole tensors (with the earlier function-level hook, step 1 was 5.539 against 5.510)."""
    r = run_cli(*tiny_overrides(corpus, *HF_LIKE, *STEPS, "world=fsdp", "world.nproc_per_node=2", "world.tp=2"),
                f"hydra.run.dir={tmp_path}", env=ENV)
    assert r.returncode == 0, r.stderr
    assert_same_run(tmp_path, hf_like_single)


@pytest.mark.parametrize(("style", "needles"), [
    ("packed_colwise", ["'lm_head': 'packed_colwise'", "strided shard", "world=fsdp and no world.tp"]),
    ("fancy_new_style", ["'fancy_new_style'", "not a style of transformers'", "colwise_gather_output"]),
])
def test_a_plan_style_without_a_dtensor_equivalent_is_one_paragraph(corpus, tmp_path, style, needles):
    r = run_here(*tiny_overrides(corpus, *HF_LIKE, "world=ddp", "world.nproc_per_node=2", "world.tp=2",
                                 f"+model.plan={{lm_head: {style}}}"), f"hydra.run.dir={tmp_path}", cwd=tmp_path,
                 env=ENV)
    assert_clean_error(r, *needles)


# -- with transformers installed ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama_single(transformers, corpus, tmp_path_factory) -> Path:
    from trainer import compose, train

    run_dir = tmp_path_factory.mktemp("llama_single")
    train(compose(tiny_overrides(corpus, "model=llama_tiny", *STEPS)), run_dir)
    return run_dir


def test_every_style_of_transformers_is_mapped_or_explained(transformers):
    import transformers.distributed.expert_parallel  # noqa: F401  (registers its styles on import)
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    from trainer.parallel.tensor_parallel import STYLES, UNMAPPED

    assert set(ALL_PARALLEL_STYLES) <= set(STYLES) | set(UNMAPPED)


@pytest.mark.slow
def test_llama_on_tensor_parallel_equals_one_process_and_loads_with_from_pretrained(
        transformers, corpus, tmp_path, llama_single):
    """LlamaForCausalLM's own plan (embedding_rowwise, colwise, rowwise, colwise_gather_output) on world.tp=2 under
    FSDP: one process's losses and weights. Its export loads with from_pretrained, giving trainer.load's logits."""
    r = run_cli(*tiny_overrides(corpus, "model=llama_tiny", *STEPS, "world=fsdp", "world.nproc_per_node=2",
                                "world.tp=2"), f"hydra.run.dir={tmp_path}", env=ENV)
    assert r.returncode == 0, r.stderr
    assert_same_run(tmp_path, llama_single)

    import trainer

    ours = trainer.load(llama_single)
    for cls in (transformers.LlamaForCausalLM, transformers.AutoModelForCausalLM):
        theirs = cls.from_pretrained(str(llama_single)).eval()
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert torch.equal(theirs(ids).logits, ours(ids))


@pytest.mark.slow
@pytest.mark.parametrize("world", [("world.nproc_per_node=2", "world.pp=2"),
                                   ("world.nproc_per_node=4", "world.pp=2", "world.tp=2")], ids=["pp2", "pp2xtp2"])
def test_llama_in_two_pipeline_stages_equals_one_process_and_resumes_on_one(transformers, corpus, tmp_path, world):
    """A transformers decoder (four layers) cut into two stages: each stage rebuilds the rotary embeddings and the
    causal mask, so the losses, evals and weights are one process's; the pipeline's checkpoint resumes on one
    process, and its export loads with from_pretrained. With tensor parallelism inside each stage too: Llama's
    untied head (a placeholder on stage 0, as the embedding is on stage 1) was matched by its _tp_plan and failed
    in torch's parallelize_module (NotImplementedError: "ColwiseParallel currently only support nn.Linear")."""
    from trainer import compose, train

    llama = ("model=llama_tiny", "model.n_layer=4", *STEPS, "trainer.eval_every=2", "checkpoint.every_n_steps=2")
    one = tmp_path / "one"
    train(compose(tiny_overrides(corpus, *llama)), one)
    pp = tmp_path / "pp"
    r = run_cli(*tiny_overrides(corpus, *llama, "world=ddp", *world), f"hydra.run.dir={pp}", env=ENV)
    assert r.returncode == 0, r.stderr
    assert "models/hf.py" not in r.stderr, r.stderr  # (a FutureWarning per rank: the cache's old argument name)
    import conftest

    conftest.assert_same_run(pp, one, weights_atol=1e-4)  # microbatches sum gradients in another order (test_pipeline)
    resumed = tmp_path / "resumed"
    __import__("shutil").copytree(pp, resumed)
    train(compose(tiny_overrides(corpus, *llama, f"resume={pp}/checkpoints/step_00000002")), resumed)
    conftest.assert_same_run(resumed, one, weights_atol=1e-4)

    import trainer

    theirs = transformers.LlamaForCausalLM.from_pretrained(str(pp)).eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(theirs(ids).logits, trainer.load(pp)(ids))


def test_gpt2_init_under_fsdp_equals_one_process(transformers, corpus, tmp_path):
    gpt2 = ("model=llama_tiny", "model.architecture=GPT2LMHeadModel", "~model.hidden_size", "~model.intermediate_size",
            "~model.num_hidden_layers", "~model.num_attention_heads", "~model.num_key_value_heads",
            "~model.max_position_embeddings", "+model.n_positions=32", "+model.n_embd=64")
    one = built_weights(tiny_overrides(corpus, *gpt2), tmp_path / "one")
    assert_same_weights(built_weights(tiny_overrides(corpus, *gpt2, "world=fsdp", "world.nproc_per_node=1"),
                                      tmp_path / "fsdp"), one)


def test_a_hub_directorys_config_is_matched_and_its_settings_give_from_pretraineds_model(transformers, corpus,
                                                                                         tmp_path):
    """finetune.weights=DIR loaded the weights into the model the run's config built and never read DIR's
    config.json: a Llama saved with rope_theta 500000 and rms_norm_eps 1e-5 fine-tuned as one of 10000 and 1e-6,
    silently (every shape fits). Now the differing settings are refused, naming the overrides; with them, the run
    starts from from_pretrained(DIR)'s model."""
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                                      rope_theta=500000.0, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hub")
    args = tiny_overrides(corpus, "model=llama_tiny", "trainer.max_steps=1", "optim.lr=1e-12",
                          f"finetune.weights={tmp_path / 'hub'}")
    r = run_here(*args, f"hydra.run.dir={tmp_path / 'refused'}")
    assert_clean_error(r, "its config.json describes another model", "rms_norm_eps 1e-05 there, 1e-06 here")
    fix = re.search(r"settings: (.+) \(`\+\+` sets", r.stderr).group(1)
    assert fix == "++model.rms_norm_eps=1e-05 '++model.rope_parameters={rope_theta: 500000.0, rope_type: default}'"
    r = run_here(*args, *shlex.split(fix), f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hub")).eval()(ids).logits
        ours = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "run")).eval()(ids).logits
    # One AdamW step of lr 1e-12 moves a weight by at most 1e-12 (its first step is lr times the gradient's sign):
    # the logits, of order 1, move by far less than a few of their fp32 ulps (1.2e-7). rope_theta's change alone
    # moves them by ~1e-2.
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


def test_the_readme_fine_tuning_code_runs(transformers, corpus, tmp_path, llama_single):
    """The Python block of the README's Fine-tuning section, on runs of this test's making: a finished run (the
    starting point, and the full fine-tune's stand-in), a LoRA run from it, and the Llama run."""
    peft = pytest.importorskip("peft")
    from test_readme import section_blocks

    from trainer import compose, train

    start, adapted = tmp_path / "start", tmp_path / "lora"
    train(compose(tiny_overrides(corpus, "trainer.max_steps=2")), start)
    train(compose(tiny_overrides(corpus, "trainer.max_steps=2", f"finetune.weights={start}", "finetune.lora.rank=4",
                                 "finetune.lora.targets=[qkv]")), adapted)
    (_, code), = section_blocks("Fine-tuning: pretrained weights, LoRA, Hugging Face models", "python")
    for name, path in {"outputs/ft/full": start, "outputs/ft/lora/adapter": adapted / "adapter",
                       "outputs/ft/lora": adapted, "RUN_DIR": start, "outputs/ft/llama": llama_single}.items():
        code = code.replace(f'"{name}"', f'"{path}"')
    scope: dict = {}
    exec(code, scope)
    assert isinstance(scope["adapted"], peft.PeftModel) and type(scope["lora"]).__name__ == "GPT"
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(scope["adapted"](ids), scope["lora"](ids), rtol=1e-5, atol=1e-5)
        assert torch.equal(scope["llama"](ids).logits, __import__("trainer").load(llama_single)(ids))


def test_a_lora_run_of_a_hugging_face_model_loads_with_from_pretrained_as_trained(transformers, corpus, tmp_path,
                                                                                  llama_single):
    """The run dir of a LoRA run holds the merged weights; with peft installed, transformers' from_pretrained read
    an adapter_config.json beside them as an adapter to apply, on top of the merge: W + 2 scale B A."""
    pytest.importorskip("peft")
    import trainer
    from trainer import compose, train

    train(compose(tiny_overrides(corpus, "model=llama_tiny", "trainer.max_steps=2", "optim.lr=1e-2",
                                 f"finetune.weights={llama_single}", "finetune.lora.rank=4",
                                 "finetune.lora.targets=[q_proj,v_proj]")), tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, trainer.load(tmp_path)(ids), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(theirs(ids).logits, trainer.load(llama_single)(ids), atol=1e-4)  # (it trained)


def test_the_models_own_size_keys_win_over_the_lm_recipes_names_for_them():
    """debug=smoke's model.n_layer=1 replaced a model.num_hidden_layers=4 the user gave: a 1-layer model, and pp=2
    then refused it as having one block. A run saved before, with the two keys differing, still builds the model
    its weights are for (the recipe's name wins in the builder; the resolved config makes them agree)."""
    pytest.importorskip("transformers")
    import trainer
    from trainer.models.hf import causal_lm

    cfg = trainer.compose(["model=llama_tiny", "debug=smoke", "model.num_hidden_layers=4"])
    assert (cfg.model.num_hidden_layers, cfg.model.n_layer) == (4, 4)
    assert trainer.compose(["model=llama_tiny", "debug=smoke", "model.n_layer=3"]).model.num_hidden_layers == 3
    assert trainer.compose(["model=llama_tiny", "debug=smoke"]).model.num_hidden_layers == 1
    sizes = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
             "num_key_value_heads": 2}
    saved_before = causal_lm("LlamaForCausalLM", **sizes, num_hidden_layers=2, n_layer=1)  # an older model_config.json
    assert saved_before.config.num_hidden_layers == 1


def test_two_names_of_one_setting_of_a_hugging_face_config_differing_are_refused():
    """GPT2Config's hidden_size is its n_embd (attribute_map). `model=llama_tiny model.architecture=GPT2LMHeadModel
    +model.n_embd=32` kept llama_tiny's hidden_size (from model.d_model, 64): a 64-wide model was trained while
    config.yaml said n_embd: 32. Both names agreeing still build."""
    pytest.importorskip("transformers")
    from trainer.models.hf import causal_lm

    sizes = {"vocab_size": 64, "n_layer": 1, "n_head": 2}
    with pytest.raises(ConfigError, match=r"model.d_model=64 and model.n_embd=32 set one setting of GPT2Config "
                                          r"\(hidden_size is its other name for n_embd\)"):
        causal_lm("GPT2LMHeadModel", **sizes, d_model=64, n_embd=32)
    with pytest.raises(ConfigError, match="model.hidden_size=64 and model.n_embd=32"):
        causal_lm("GPT2LMHeadModel", **sizes, n_embd=32, hidden_size=64)
    assert causal_lm("GPT2LMHeadModel", **sizes, d_model=32, hidden_size=32, n_embd=32).config.n_embd == 32


def test_an_eval_override_of_a_size_key_reaches_the_model_by_either_name(tmp_path):
    """`eval RUN model.d_model=32` on a Hugging Face model: the run's config.yaml records both d_model and
    hidden_size, and the recorded hidden_size used to win when the config was resolved, so the eval ran the
    trained size without a word. Either name now sets both (the checkpoint then refuses the shapes, naming them)."""
    from omegaconf import OmegaConf

    import trainer
    from trainer.config.compose import resolve
    from trainer.inference.finished import config_of

    OmegaConf.save(trainer.compose(["model=llama_tiny", "debug=smoke"]), tmp_path / "config.yaml")
    for given, twin in (("d_model", "hidden_size"), ("hidden_size", "d_model"), ("n_layer", "num_hidden_layers"),
                        ("num_attention_heads", "n_head")):
        model = resolve(config_of(tmp_path, [f"model.{given}=8"])).model
        assert (model[given], model[twin]) == (8, 8), given
    assert resolve(config_of(tmp_path, ["model.intermediate_size=8"])).model.hidden_size == 64  # no twin: its own


def test_rt_save_model_of_a_hugging_face_model_loads_with_from_pretrained(transformers, tmp_path):
    """A loop of one's own: rt.save_model writes config.json beside the weights (it wrote the weights alone, so
    from_pretrained could not read the directory), and from_pretrained gives the same logits."""
    import trainer

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(config).eval()
    rt = trainer.Runtime("single", "fp32")
    model = rt.setup(model)
    written = rt.save_model(model, tmp_path)
    assert "config.json" in written and (tmp_path / "config.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".config-")]  # (the scratch dir is gone)
    # The class, as transformers' save_pretrained records it (serving tools pick the model class by it).
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    assert config.architectures is None  # (the live model's config is left as it was)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
        # trainer.load reads such a directory too (it said "not a run dir" without a device_map)
        ours = trainer.load(tmp_path)
        assert not ours.training and torch.equal(ours(ids).logits, model(ids).logits)


def test_rt_save_model_of_a_peft_model_writes_its_adapter_not_a_config_that_loads_random_weights(transformers,
                                                                                                  tmp_path):
    """A peft model's state has peft's keys (base_model.model.*.base_layer): with the base model's config.json beside
    them, from_pretrained(dir) loaded none of them and gave a randomly initialised model, with no error. The adapter
    is written in peft's layout in adapter/, and PeftModel.from_pretrained on the starting model gives the saved
    model's logits; from_pretrained(dir) finds no config.json."""
    peft = pytest.importorskip("peft")
    import trainer

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    start = transformers.GPT2LMHeadModel(config).state_dict()
    base = transformers.GPT2LMHeadModel(config)
    base.load_state_dict(start)
    lora = peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True, init_lora_weights=False)
    rt = trainer.Runtime("single", "fp32")
    model = rt.setup(peft.get_peft_model(base, lora)).eval()
    (tmp_path / "config.json").write_text("{}")  # an earlier save's, of the base model: from_pretrained would read it
    written = rt.save_model(model, tmp_path)
    assert written == ["model.safetensors", "adapter/adapter_model.safetensors", "adapter/adapter_config.json"]
    assert not (tmp_path / "config.json").exists() and (tmp_path / "config.json.prev").read_text() == "{}"
    again = transformers.GPT2LMHeadModel(config)
    again.load_state_dict(start)
    loaded = peft.PeftModel.from_pretrained(again, str(tmp_path / "adapter")).eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
        plain = transformers.GPT2LMHeadModel(config).eval()
        plain.load_state_dict(start)
        assert not torch.allclose(loaded(ids).logits, plain(ids).logits, atol=1e-3)  # (the adapter is in them)


def test_a_peft_model_is_told_by_its_class_s_bases_as_fsdp_re_classes_its_root(transformers):
    """fully_shard gives the root module a class of its own (FSDPPeftModel, in torch's module) over peft's: told by
    the class's own module, the peft model under world=fsdp got the base config.json again."""
    peft = pytest.importorskip("peft")
    from trainer.models.export import is_peft_model

    model = peft.get_peft_model(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2,
                                                                                     vocab_size=16, n_positions=8)),
                                peft.LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True))
    model.__class__ = type("FSDPPeftModel", (type(model),), {"__module__": "torch.distributed.fsdp._fully_shard"})
    assert is_peft_model(model)
    assert not is_peft_model(model.get_base_model())
