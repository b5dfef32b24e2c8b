"""Big-model inference (trainer/inference/device_map.py): a finished run's model placed over the CPU and disk gives the logits
and the generation of a full load bit for bit (fp32), within max_memory; `sample` and `eval` take the same
placement; each mistake is one paragraph. No GPU here: GPU placement is checked as a plan over given budgets."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import read_metrics, run_here, tiny_overrides, train_in_process
from test_errors import assert_clean_error

import trainer
from trainer.errors import ConfigError
from trainer.inference.placement import budgets, parse_size, plan, unit_sizes, units_of

N_LAYER = 4
SAMPLE = ("task.sample_tokens=24", "task.temperature=1.0")


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory) -> Path:
    """A finished tiny run with 4 blocks and EMA weights, exported in shards with an index (Hugging Face's layout)."""
    run_dir = tmp_path_factory.mktemp("device_map_run")
    train_in_process(corpus, run_dir, f"model.n_layer={N_LAYER}", "trainer.max_steps=2", "scheduler.warmup_steps=1", "ema.enabled=true",
                     "ema.decay=0.5", "trainer.eval_samples=16", "checkpoint.max_shard_mb=0.02")
    assert (run_dir / "model.safetensors.index.json").is_file()
    return run_dir


@pytest.fixture(scope="module")
def full(run):
    """The full load's logits and generation on a fixed batch."""
    model = trainer.load(run)
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    return x, *outputs(model, x)


def outputs(model, x):
    with torch.no_grad():
        return model(x), model.generate(x[:, :4], 12, generator=torch.Generator().manual_seed(1))


def block_bytes(run) -> int:
    model = trainer.load(run)
    return sum(p.numel() * 4 for p in model.blocks[0].parameters())


def held_bytes(model) -> int:
    """Bytes of the weights materialised now: every storage a parameter or buffer uses, and the stream buffers."""
    storages = {}
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type != "meta":
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    streamer = model.device_map._streamer
    for b in streamer.buffers if streamer else ():
        if b is not None:
            storages[b.untyped_storage().data_ptr()] = b.untyped_storage().nbytes()
    return sum(storages.values())


def test_cpu_only_equals_full_load(run, full):
    x, logits, generated = full
    model = trainer.load(run, device_map="auto")
    assert set(model.device_map.values()) == {"cpu"}
    assert list(model.device_map) == ["tok_emb", "pos_emb", "drop", *(f"blocks.{i}" for i in range(N_LAYER)),
                                      "ln_f", "head"]
    got_logits, got_generated = outputs(model, x)
    assert torch.equal(got_logits, logits) and torch.equal(got_generated, generated)
    assert str(model.device_map).startswith("tok_emb .. head (9 units)  cpu")


def test_cpu_and_disk_equals_full_load_within_max_memory(run, full, tmp_path):
    x, logits, generated = full
    block = block_bytes(run)
    cap = int(3.5 * block)  # two blocks in flight and a little more: the embeddings and a block or so stay
    model = trainer.load(run, max_memory={"cpu": cap}, offload_dir=tmp_path)
    placed = model.device_map
    assert {"cpu", "disk"} == set(placed.values())
    assert [u for u, d in placed.items() if d == "disk"][0].startswith("blocks.")
    assert sum(placed.sizes[u] for u, d in placed.items() if d == "cpu") + 2 * block <= cap
    peaks = []
    for b in model.blocks:
        b.register_forward_hook(lambda *_: peaks.append(held_bytes(model)))
    got_logits, got_generated = outputs(model, x)
    assert torch.equal(got_logits, logits) and torch.equal(got_generated, generated)
    assert max(peaks) <= cap, (max(peaks), cap)
    # Every forward streams each disk block once, and nothing else: the prefetch never guessed wrong (the one read
    # after the last forward is the next forward's first block, which may still be in flight).
    units = placed._streamer.units
    forwards, per_forward = 1 + 12, sum(u.nbytes for u in units)
    assert per_forward >= sum(placed.sizes[u] for u, d in placed.items() if d == "disk")
    assert placed.bytes_read in (forwards * per_forward, forwards * per_forward + units[0].nbytes)
    assert not list(tmp_path.iterdir())  # the offload files were unlinked once opened


def test_dict_map_and_ema_equal_full_load(run, full, tmp_path):
    x, logits, generated = full
    device_map = {"": "disk", "tok_emb": "cpu", "blocks.1": "cpu", "blocks.2.attn": "cpu", "head": "cpu"}
    model = trainer.load(run, device_map=device_map, offload_dir=tmp_path)
    assert model.device_map["blocks.2.attn"] == "cpu" and model.device_map["blocks.2.mlp"] == "disk"
    assert model.device_map["blocks.0"] == "disk" and model.device_map["head"] == "cpu"
    got_logits, got_generated = outputs(model, x)
    assert torch.equal(got_logits, logits) and torch.equal(got_generated, generated)
    ema = trainer.load(run, ema=True, device_map={"": "disk"}, offload_dir=tmp_path)
    with torch.no_grad():
        assert torch.equal(ema(x), trainer.load(run, ema=True)(x))
        assert not torch.equal(ema(x), logits)
    # A device alone, as transformers takes it (was refused as "not a strategy or a map"): the whole model there.
    for device in ("cpu", "disk", torch.device("cpu")):
        model = trainer.load(run, device_map=device, offload_dir=tmp_path)
        assert set(model.device_map.values()) == {str(device)}
        assert all(torch.equal(a, b) for a, b in zip(outputs(model, x), (logits, generated)))


def test_a_tied_weight_a_dict_map_splits_over_disk_stays_where_it_is_read_and_is_counted_there(run, full, tmp_path):
    """The embedding on disk, the head it shares its weight with on the CPU: the weight stays on the CPU (read
    once, never streamed), as the map now says; it was reported on disk and counted twice in the totals."""
    x, logits, generated = full
    model = trainer.load(run, device_map={"": "cpu", "tok_emb": "disk"}, offload_dir=tmp_path)
    placed, weight = model.device_map, model.tok_emb.weight
    assert weight is model.head.weight and weight.device.type == "cpu"
    assert placed["tok_emb"] == "disk" and placed.sizes["tok_emb"] == 0
    assert placed.sizes["head"] == weight.numel() * weight.element_size()
    tensors = {id(t): t for t in trainer.load(run).state_dict(keep_vars=True).values()}  # (the tied weight once)
    assert sum(placed.sizes.values()) == sum(t.numel() * t.element_size() for t in tensors.values())
    got_logits, got_generated = outputs(model, x)
    assert torch.equal(got_logits, logits) and torch.equal(got_generated, generated)
    assert placed.bytes_read == 0 and "disk 0.0 MiB" in str(placed).split("total:")[1]


def test_placement_over_gpus_follows_max_memory(run):
    """GPUs in order, then the CPU, then disk; balanced evens the GPUs out. A plan only: no GPU here."""
    from trainer.inference.device_map import params_on_meta
    from trainer.inference.finished import model_of

    with params_on_meta():
        model = model_of(run)
    units = units_of(model)
    sizes, ties = unit_sizes(model, units)
    assert ties == {"head": "tok_emb"} and sizes["head"] == 0
    block = sizes["blocks.0"]
    caps = budgets({0: 6 * block, "1": 6 * block, "cpu": f"{2 * block}B"}, offload_dir="/tmp")
    assert list(caps) == ["cuda:0", "cuda:1", "cpu", "disk"]
    for strategy in ("sequential", "balanced"):
        placed = plan(units, sizes, ties, caps, strategy)
        for device, cap in caps.items():
            assert sum(sizes[u] for u, d in placed.items() if d == device) <= cap
        assert placed["tok_emb"] == placed["head"] == "cuda:0"
    sequential, balanced = plan(units, sizes, ties, caps, "sequential"), plan(units, sizes, ties, caps, "balanced")
    assert set(sequential.values()) == {"cuda:0"}  # it all fits on the first
    # balanced: the first GPU holds up to half the model plus its largest unit
    assert [balanced[f"blocks.{i}"] for i in range(N_LAYER)] == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]
    assert parse_size("1.5GiB", "x") == 3 * 2**29 and parse_size("2GB", "x") == 2 * 10**9
    with pytest.raises(ConfigError, match=r"puts 'tok_emb' on cuda:99, but this machine has"):
        trainer.load(run, max_memory={99: "1GB"})


def test_sample_and_eval_commands_take_the_placement(run, tmp_path):
    plain = run_here("sample", str(run), *SAMPLE)
    cap = int(3.5 * block_bytes(run))
    mapped = run_here("sample", str(run), f"max_memory.cpu={cap}", f"offload_dir={tmp_path}", "show_map=true", *SAMPLE)
    assert plain.returncode == mapped.returncode == 0, mapped.stderr
    assert mapped.stdout == plain.stdout and len(plain.stdout.strip()) > 0
    assert "disk" in mapped.stderr and "blocks." in mapped.stderr
    plain = run_here("eval", str(run))
    mapped = run_here("eval", str(run), "device_map={'': disk, tok_emb: cpu}", f"offload_dir={tmp_path}")
    assert plain.returncode == mapped.returncode == 0, mapped.stderr
    a, b = json.loads(plain.stdout.strip().splitlines()[-1]), json.loads(mapped.stdout.strip().splitlines()[-1])
    assert b["val/loss"] == a["val/loss"] and b["val_ema/loss"] == a["val_ema/loss"]


def _read_only_dir(tmp_path: Path) -> Path:
    if os.geteuid() == 0:  # root writes anywhere a mode allows nothing: sysfs refuses it a directory
        return Path("/sys")
    path = tmp_path / "ro"
    path.mkdir(mode=0o500)
    return path


@pytest.mark.parametrize(("args", "needles"), [
    (["max_memory.cpu=1KB", "offload_dir={tmp}"], ["does not fit max_memory", "two units in flight", "Raise max_memory.cpu"]),
    (["max_memory.cpu=10KB"], ["does not fit max_memory", "offload_dir=DIR"]),
    (["device_map.blocks.9=cpu"], ["'blocks.9'", "not a module of GPT", "Did you mean"]),
    (["device_map=everywhere"], ["device_map='everywhere'", "auto, balanced, sequential, a device"]),
    (["max_memory.cpu=2GB", "offload_dir={tmp}/missing"], ["offload_dir=", "does not exist", "mkdir"]),
    (["max_memory.cpu=2GB", "offload_dir={ro}"], ["offload_dir=", "could not make a directory in it"]),
    (["device_map.blocks=cuda:99"], ["puts 'blocks' on cuda:99", "GPU"]),  # (not a module the map leaves out)
    (["max_memory.cpu=two gigs"], ["max_memory.cpu='two gigs' is not a size", "2GiB"]),
    (["max_memory.gpu=2GB"], ["'gpu' is not a device", "cuda:N"]),
    # (a placement of nothing: an AttributeError traceback, 'GPT' object has no attribute 'device_map')
    (["device_map="], ["device_map= is empty: give device_map a value"]),
    (["max_memory=null"], ["max_memory=null is empty: give max_memory a value"]),
])
def test_mistakes_are_one_paragraph(run, tmp_path, args, needles):
    args = [a.format(tmp=tmp_path, ro=_read_only_dir(tmp_path)) for a in args]
    assert_clean_error(run_here("sample", str(run), *args, *SAMPLE), *needles)


def test_eval_with_a_device_map_reads_the_runs_data_as_eval_without_one_does(corpus, tmp_path):
    """It built the data without the run's seed (a factory drawing torch.randn gave another val set, and other
    numbers, at every call) and checked nothing of it (a relative data.path read from another directory, or a file
    changed since, was evaluated as the run's)."""
    conf = Path(__file__).resolve().parent / "conf"
    run = tmp_path / "drawn"
    r = run_here("--config-dir", str(conf), "recipe=classify", "data._target_=classify.drawn", "trainer.max_steps=6",
                 "trainer.eval_every=6", f"hydra.run.dir={run}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    trained = [e for e in read_metrics(run) if "val/loss" in e][-1]["val/loss"]
    for _ in range(2):
        mapped = run_here("eval", str(run), "device_map=auto", cwd=tmp_path)
        assert mapped.returncode == 0, mapped.stderr
        assert json.loads(mapped.stdout.strip().splitlines()[-1])["val/loss"] == pytest.approx(trained, rel=1e-6)
    text = tmp_path / "notes.txt"
    text.write_bytes(corpus.read_bytes()[:20000])
    r = run_here(*tiny_overrides(text, "trainer.max_steps=2"), "data.path=notes.txt", f"hydra.run.dir={tmp_path / 'rel'}",
                 cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_bytes(corpus.read_bytes()[20000:40000])
    assert_clean_error(run_here("eval", str(tmp_path / "rel"), "device_map=auto", cwd=elsewhere),
                       "data.path=notes.txt is a relative path")
    text.write_bytes(b"Z" + text.read_bytes()[1:])  # changed in place
    assert_clean_error(run_here("eval", str(tmp_path / "rel"), "device_map=auto", cwd=tmp_path),
                       "is not what", "was trained on")


def test_eval_with_a_device_map_refuses_world_overrides_it_would_ignore(run):
    """It evaluated on this one process, world=ddp world.nproc_per_node=2 ignored without a word."""
    assert_clean_error(run_here("eval", str(run), "device_map=auto", "world=ddp", "world.nproc_per_node=2"),
                       "eval with device_map runs in this one process", "world=ddp world.nproc_per_node=2 does not apply")


def test_the_readme_example_runs(run):
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block, = [b.split("```")[0] for b in readme.split("```python\n")[1:] if "device_map=" in b.split("```")[0]]
    scope: dict = {}
    exec(block.replace("RUN_DIR", str(run)).replace("print(", "str("), scope)
    assert isinstance(scope["model"], torch.nn.Module) and set(scope["model"].device_map.values()) == {"cpu"}


def test_a_hugging_face_directory_equals_from_pretrained(tmp_path):
    """A Hub-style directory (config.json, sharded safetensors with an index) placed over the CPU and disk gives
    from_pretrained's logits bit for bit."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    placed = trainer.load(tmp_path / "hf", device_map={"": "disk", "model.embed_tokens": "cpu", "lm_head": "cpu"},
                          offload_dir=tmp_path)
    assert placed.device_map["model.layers.1"] == "disk"
    x = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(placed(x).logits, reference(x).logits)


class _Backwards(torch.nn.Module):
    """Blocks that run in the reverse of their order in the model: the prefetch must learn the order."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(10, 10) for _ in range(4))  # (400 + 40 bytes: padded)

    def forward(self, x):
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return x


def test_the_prefetch_learns_the_order_blocks_run_in(tmp_path):
    from trainer.inference.device_map import dispatch, params_on_meta

    torch.manual_seed(0)
    reference, x = _Backwards(), torch.randn(3, 10)
    state = reference.state_dict()
    with params_on_meta():
        model = _Backwards()
    dispatch(model, lambda key: state[key].clone(), {"": "disk"}, {}, tmp_path)
    streamer = model.device_map._streamer

    def read_by_one_forward() -> int:
        before = streamer.bytes_read
        with torch.no_grad():
            assert torch.equal(model(x), reference(x))
        streamer.pending[2].result()  # the next forward's first block, read ahead
        return streamer.bytes_read - before

    per_forward = sum(u.nbytes for u in streamer.units)
    # The model's order was the wrong guess: blocks read twice. The first forward teaches each block's successor,
    # the second the way from the last block back to the first; from then on each block is read once.
    assert read_by_one_forward() > per_forward and read_by_one_forward() > per_forward
    assert read_by_one_forward() == read_by_one_forward() == per_forward


def test_the_memory_a_placement_asks_for_is_rounded_up_never_to_what_was_given():
    """1.04 MiB needed under max_memory.cpu=1MiB read "raise it to at least 1.0 MiB": the amount already given."""
    from trainer.inference.placement import _mb

    assert _mb(int(1.04 * 2**20), up=True) == "1.1 MiB" and _mb(int(1.04 * 2**20)) == "1.0 MiB"
    assert _mb(2**20, up=True) == "1.0 MiB" and _mb(3 * 2**30 + 1, up=True) == "3.01 GiB"
