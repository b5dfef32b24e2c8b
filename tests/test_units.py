"""Unit tests for pieces only whole runs reached before (issue 24): the state tree's flatten / conform / assemble
(what a checkpoint's state.json and tensor files become again), and the choice of FSDP units and
activation-checkpointing blocks. In memory, no process group, no files."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

from trainer.checkpoint import snapshot
from trainer.errors import CheckpointError, ConfigError
from trainer.parallel import Strategy


def stored(state):
    """What a checkpoint of `state` holds: its JSON tree and the chunks of each tensor, as checkpoint.read gives."""
    chunks: dict[str, snapshot.Chunk] = {}
    tree = snapshot.flatten(state, chunks)
    views = {k: c.local for k, c in chunks.items()}
    found = snapshot.stored_chunks(snapshot.chunk_metadata(chunks), views, "test")
    return tree, {k: [v] for k, v in found.items()}


def test_a_state_tree_comes_back_as_it_was():
    state = {"step": 3, "opt": {"state": {"w": {"exp_avg": torch.arange(6.0).view(2, 3)}}, "lr": 0.1},
             "rng": [(1, 2, 3)], "name": "fp32", "none": None}
    tree, chunks = stored(state)
    like = {"step": 0, "opt": {"state": {"w": {"exp_avg": torch.zeros(2, 3)}}, "lr": 1.0}, "rng": [],
            "name": "", "none": None}
    back = snapshot.conform(tree, like, chunks, "ckpt")
    assert back["step"] == 3 and back["opt"]["lr"] == 0.1 and back["name"] == "fp32"
    assert torch.equal(back["opt"]["state"]["w"]["exp_avg"], state["opt"]["state"]["w"]["exp_avg"])
    assert [list(r) for r in back["rng"]] == [[1, 2, 3]]  # an empty live list takes the checkpoint's


@pytest.mark.parametrize(("live", "message"), [
    ({"step": torch.zeros(())}, "'/step' is int in the checkpoint but a tensor here"),
    ({"w": 1.0}, "'/w' is a tensor in the checkpoint but float here"),
    ({"w": torch.zeros(3, 2)}, "'/w' is (2, 3) in the checkpoint but (3, 2) here"),
    ({"w": torch.zeros(2, 3, dtype=torch.float64)}, "'/w' is torch.float32 in the checkpoint but torch.float64 here"),
    ({"missing": 1}, "'<root>' lacks missing"),
    ({"pair": (0, 0, 0)}, "'/pair' has 2 items in the checkpoint but 3 here"),
])
def test_conform_refuses_what_does_not_fit_the_live_state_and_names_it(live, message):
    tree, chunks = stored({"step": 1, "w": torch.ones(2, 3), "pair": (1, 2)})
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        snapshot.conform(tree, live, chunks, "ckpt")


def test_conform_ignores_keys_the_live_state_no_longer_has():
    tree, chunks = stored({"step": 1, "old": torch.ones(2)})
    assert snapshot.conform(tree, {"step": 0}, chunks, "ckpt") == {"step": 1}


def test_assemble_joins_the_chunks_of_a_sharded_tensor_and_refuses_a_gap():
    whole = torch.arange(12.0).view(4, 3)
    top = snapshot.Stored(whole[:2].clone(), (4, 3), (0, 0))
    bottom = snapshot.Stored(whole[2:].clone(), (4, 3), (2, 0))
    assert torch.equal(snapshot.assemble("w", [bottom, top], torch.zeros(4, 3), "ckpt"), whole)
    with pytest.raises(CheckpointError, match="chunks of 'w'"):
        snapshot.assemble("w", [top], torch.zeros(4, 3), "ckpt")
    with pytest.raises(CheckpointError, match="'w' is missing from the checkpoint"):
        snapshot.assemble("w", [], torch.zeros(4, 3), "ckpt")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(2, 2)


class Net(nn.Module):
    def __init__(self, declared: list[str] | None = None):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(2, 2)
        if declared is not None:
            self._no_split_modules = declared


def test_units_are_the_declared_blocks_else_the_module_lists_children_children_first():
    st = Strategy()
    net = Net()
    assert st.units(net) == list(reversed(list(net.blocks)))  # each ModuleList child, children before parents
    declared = Net(["Linear"])
    assert set(map(id, st.units(declared))) == {id(m) for m in declared.modules() if isinstance(m, nn.Linear)}
    st.unit_classes = ["Block"]  # world.wrap overrides what the model declares
    assert st.units(declared) == list(reversed(list(declared.blocks)))


def test_a_wrap_class_the_model_lacks_is_one_paragraph_naming_its_blocks():
    st = Strategy()
    st.unit_classes = ["Blok"]
    with pytest.raises(ConfigError, match=r"world.wrap names Blok, which the model \(Net\) does not contain\..*"
                                          r"Did you mean Block\?.*world.wrap=\[Block\]"):
        st.units(Net())


def test_a_block_class_the_models_own_no_split_modules_lacks_names_that_not_world_wrap():
    """A model whose `_no_split_modules` names a class it lacks (a copied Hugging Face declaration) was told "world.wrap
    names Blok", a setting the user never gave, with world.wrap=[Blok] itself as the fix."""
    with pytest.raises(ConfigError) as refused:
        Strategy().units(Net(["Blok"]))
    message = str(refused.value)
    assert message.startswith("Net._no_split_modules names Blok, which the model does not contain") and \
        "Did you mean Block?" in message and message.endswith("or override it: its repeated blocks: world.wrap=[Block].")
    assert "world.wrap names" not in message


@pytest.mark.parametrize(("override", "named"), [
    ("trainer.grad_accum_steps=0", "trainer.grad_accum_steps"),
    ("data.batch_size=-1", "data.batch_size"),
    ("optim.lr=0", "optim.lr"),
    ("optim.betas=[0.9,1.5]", "optim.betas"),
    ("scheduler.warmup_steps=-2", "scheduler.warmup_steps"),
    ("ema.decay=1.0", "ema.decay"),
    ("checkpoint.best_metric=train/loss", "checkpoint.best_metric"),
    ("world.tp=0", "world.tp"),
])
def test_config_validation_names_the_key_it_refuses(override, named):
    """trainer.compose checks the composed config (trainer/config/schema.py) before anything is built."""
    import trainer

    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        trainer.compose(["debug=smoke", "ema.enabled=true", override])  # (an ema.* key with the EMA off: another error)


def test_a_typed_section_is_its_own_and_checked_against_the_schema_each_time():
    """`typed` builds each schema's config once per process: what one section sets never reaches the next."""
    from omegaconf.errors import ValidationError

    from trainer.config.schema import TrainerConfig, launch_config, typed

    first = typed(TrainerConfig, {"max_steps": 5, "grad_clip": None})
    first.log_every = 3
    assert (first.max_steps, first.grad_clip) == (5, None)
    again = typed(TrainerConfig, {})
    assert (again.max_steps, again.grad_clip, again.log_every) == (1000, 1.0, 10) and again is not first
    # The same values again (each section is typed from a cache once per process): a copy of its own each time.
    same = typed(TrainerConfig, {"max_steps": 5, "grad_clip": None})
    assert same.log_every == 10 and same is not first
    # An interpolation is resolved at each call, not frozen at the first (${oc.env:...} may change in between).
    import os

    os.environ["TRAINER_TEST_SEED"] = "3"
    assert typed(TrainerConfig, {"seed": "${oc.env:TRAINER_TEST_SEED}"}).seed == 3
    os.environ["TRAINER_TEST_SEED"] = "5"
    assert typed(TrainerConfig, {"seed": "${oc.env:TRAINER_TEST_SEED}"}).seed == 5
    del os.environ["TRAINER_TEST_SEED"]
    with pytest.raises(ValidationError, match="max_steps"):
        typed(TrainerConfig, {"max_steps": "many"})
    with pytest.raises(ConfigError, match=r"world\.nnodes"):
        launch_config({"nnodes": "two"})
    assert launch_config({}).nnodes == 1


def test_per_part_optimizer_settings_are_checked_as_the_base_optimizer_s():
    """recipe=gan's optim.generator: {...} is the base optim with those keys changed: checked the same way."""
    import trainer

    assert trainer.compose(["recipe=gan", "debug=smoke"]).optim.generator.lr == 1e-3
    with pytest.raises(ConfigError, match=r"optim\.discriminator\.lr"):
        trainer.compose(["recipe=gan", "debug=smoke", "optim.discriminator.lr=-1"])
    with pytest.raises(ConfigError, match=r"optim\.generator\.momentun is not an option"):
        trainer.compose(["recipe=gan", "debug=smoke", "+optim.generator.momentun=0.9"])


def test_each_file_of_a_checkpoint_is_hashed_by_one_rank_and_a_damaged_one_is_found_by_its_rank(tmp_path):
    """checkpoint.read spreads the sha256 checks over the ranks (the largest file first, to the least loaded
    rank): every file is verified exactly once, and the rank that verifies a damaged file reports it (the ranks
    then agree on that verdict: test_reliability.py's one-rank failure)."""
    from types import SimpleNamespace

    from trainer.checkpoint import store as ckpt

    sizes = {"state.safetensors": 700, "model.safetensors": 400, "model-1.safetensors": 300, "state.json": 10}
    shares = [ckpt._share({n: bytes(s) for n, s in sizes.items()}, r, 2) for r in range(2)]
    assert sorted([*shares[0], *shares[1]]) == sorted(sizes) and not set(shares[0]) & set(shares[1])
    assert set(shares[0]) == {"state.safetensors", "state.json"}  # 710 bytes against 700
    path = ckpt.Checkpointer(tmp_path).save(1, {"w": torch.ones(64, 64)}, {"opt": {"m": torch.zeros(256, 64)}})
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4:] = b"\0\0\0\1"
    weights.write_bytes(bytes(data))
    rank = [SimpleNamespace(rank=r, world_size=2, is_main=r == 0, distributed=False) for r in range(2)]
    ckpt.read(path, rank[0])  # state.safetensors is rank 0's to hash; model.safetensors rank 1's
    with pytest.raises(CheckpointError, match="model.safetensors is corrupted or truncated"):
        ckpt.read(path, rank[1])


# The packages of trainer/, lowest first (README, Development: Layout). A module imports only from its own package,
# from the top-level modules (errors, io, redaction, task, noise) and from the packages below its own.
LAYERS = ["tracking", "checkpoint", "parallel", "data", "config", "models", "loop", "inference", "entry"]


def _imports_of_trainer(path):
    import ast

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "trainer":
            names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "trainer" else [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] == "trainer"]
        else:
            continue
        for name in names:
            yield node.lineno, name


def test_no_module_imports_from_a_package_above_its_own_and_the_top_level_imports_no_package():
    """Lazy imports included: an import inside a function is still a dependency (and the way cycles hide)."""
    from pathlib import Path

    import trainer

    root = Path(trainer.__file__).parent
    rank = {name: i + 1 for i, name in enumerate(LAYERS)}  # a top-level module: 0
    packages = {p.name for p in root.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(LAYERS), "a new package of trainer/ needs its place in LAYERS (and in the README)"
    upward = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if parts[0] in ("__init__.py", "__main__.py"):  # the public API and `python -m trainer`: above everything
            continue
        own = rank.get(parts[0], 0) if len(parts) > 1 else 0
        for line, name in _imports_of_trainer(path):
            target = name.split(".")[1]
            if target in ("recipes", "conf"):
                continue
            public_api = target in trainer._EXPORTS  # `from trainer import build`: whatever module it lives in
            if public_api or rank.get(target, 0) > own:
                upward.append(f"{path.relative_to(root)}:{line} imports {name}")
    assert not upward, "\n".join(upward)


def test_configs_not_importable_from_a_source_tree_say_why_and_what_to_do():
    """`pip install .` (not -e), then `python -m trainer` inside the checkout: the checkout's trainer/ comes first on
    sys.path and has no conf/ of its own (seen on the GPU machine). The error names the tree and the two ways out."""
    from pathlib import Path

    import trainer
    from trainer.config.compose import explain

    err = explain(Exception("Primary config module 'trainer.conf' not found."), [], None)
    tree = str(Path(trainer.__file__).resolve().parent)
    assert tree in str(err) and "pip install -e" in str(err) and "another directory" in str(err)


def test_the_sample_order_is_each_epochs_permutation_and_holds_no_python_list_of_the_dataset():
    """The stream is epoch 0's randperm, then epoch 1's (the order checkpoints fingerprint), cut at any position; and
    the sampler keeps it as a tensor: a Python list of every sample index cost ~40 bytes a sample (400 MB per rank
    at 10 M samples) and was walked by every full garbage collection."""
    import tracemalloc

    from trainer.data.sampling import GlobalBatchSampler

    n, seed = 1_000, 7
    epochs = [torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + e)).tolist() for e in (0, 1)]
    sampler = GlobalBatchSampler(n, 6, seed=seed)
    assert sampler.indices(0, 2 * n) == epochs[0] + epochs[1]
    assert sampler.indices(n - 4, 10) == epochs[0][-4:] + epochs[1][:6]  # across the epoch boundary
    assert GlobalBatchSampler(n, 6, shuffle=False).indices(n - 2, 4) == [n - 2, n - 1, 0, 1]

    big = GlobalBatchSampler(2_000_000, 8, seed=seed)
    tracemalloc.start()
    try:
        batch = big.indices(1_999_996, 8)  # draws epochs 0 and 1
        held = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(batch) == 8 and held < 1_000_000, f"{held} bytes of Python objects for an 8-sample batch"


@pytest.mark.parametrize("run_dir", ["/tmp/runs/plain-dir_1.x", "/tmp/it's mine", "/tmp/a,b", '/tmp/a"b', "/tmp/a=b[1]",
                                     "/tmp/back\\'slash", "/tmp/ends\\", "/tmp/a~b", "/home/josé/run", "/tmp/$HOME",
                                     "/tmp/${oc.env:HOME}"])
def test_the_command_that_continues_a_run_names_its_run_dir_as_the_shell_and_hydra_read_it_back(run_dir):
    """The printed "to continue this run" command, split as a shell splits it, then parsed as Hydra parses the
    override, gives the run dir itself: a quote, space or comma in the path once made it fail or sweep."""
    import shlex
    from pathlib import Path

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from trainer.entry.rundir import continue_command

    words = shlex.split(continue_command(Path(run_dir), ["recipe=lm", "optim.lr=1e-3"]))
    assert words[:5] == ["python", "-m", "trainer", "recipe=lm", "optim.lr=1e-3"] and words[-1] == "resume=auto"
    override = OverridesParser.create().parse_override(next(w for w in words if w.startswith("hydra.run.dir=")))
    assert not override.is_sweep_override()
    assert OmegaConf.create({"dir": override.value()}).dir == run_dir  # (as the config then resolves it)


def test_the_command_that_continues_a_sweeps_point_is_that_point_alone(tmp_path):
    """A sweep's command (-m) ignores hydra.run.dir and would run every point again, and a launcher's job (submitit)
    has another command line altogether: a point is continued as one job of its own overrides, from Hydra's record
    of the job (its hydra.job.* overrides and --config-dir kept, the sweep's own settings left out)."""
    import shlex
    from pathlib import Path

    from hydra.conf import ConfigSourceInfo
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import open_dict

    from trainer.entry.cli import compose_with_hydra
    from trainer.entry.rundir import continue_command

    cfg = compose_with_hydra(["debug=smoke", "optim.lr=3e-4", "+hydra.job.env_set.FOO=1", "hydra.sweep.dir=/tmp/sw"],
                             None)
    with open_dict(cfg):
        cfg.hydra.mode = RunMode.MULTIRUN
        cfg.hydra.runtime.config_sources.append(ConfigSourceInfo(path=str(tmp_path), schema="file",
                                                                 provider="command-line"))  # (--config-dir's)
    submitit_argv = ["-u", "-m", "submitit.core._submit", "/tmp/submitit/1"]
    HydraConfig.instance().set_config(cfg)
    try:
        words = shlex.split(continue_command(Path("/tmp/sw/1"), submitit_argv))
    finally:
        HydraConfig.instance().cfg = None
    assert words == ["python", "-m", "trainer", "--config-dir", str(tmp_path), "+hydra.job.env_set.FOO=1",
                     "debug=smoke", "optim.lr=3e-4", "hydra.run.dir=/tmp/sw/1", "resume=auto"]


def test_a_refused_resumes_advice_gives_a_changed_group_back_as_its_option(tmp_path):
    """A checkpoint of world=single refused under world=ddp: the advice listed world._target_ and every world.* key
    (`world.pp=null ...`, cut off after 8, and `world.pp=None` does not even parse back). Now: world=single."""
    from omegaconf import OmegaConf

    import trainer
    from trainer.checkpoint.manager import _differences

    OmegaConf.save(trainer.compose(["debug=smoke"]), tmp_path / "config.yaml")
    said = _differences(tmp_path, trainer.compose(["debug=smoke", "world=ddp", "optim.weight_decay=0.5",
                                                   "model.n_layer=3"]))
    assert "world: trainer.parallel.SingleDevice -> trainer.parallel.DDP (it ran with world=single)" in said, said
    assert "(rerun with world=single model.n_layer=1, or without the overrides" in said, said
    assert "world.pp" not in said and "world._target_" not in said, said
    # Options that share a _target_ (gpt_tiny, gpt_small, gpt_medium): the keys that differ, one by one.
    OmegaConf.save(trainer.compose(["model=gpt_small"]), tmp_path / "config.yaml")
    said = _differences(tmp_path, trainer.compose(["model=gpt_tiny"]))
    assert "model=gpt" not in said and "(rerun with model.d_model=128 model.n_head=4 model.n_layer=4," in said, said
    # A world option run with other launch keys: the option and those keys, each of which the rerun can take (the
    # keys every world has are never `+`-added, and those this run sets alike, debug=smoke's threads, are left out).
    OmegaConf.save(trainer.compose(["debug=smoke", "world=ddp", "world.nproc_per_node=2"]), tmp_path / "config.yaml")
    said = _differences(tmp_path, trainer.compose(["debug=smoke", "model.n_layer=2"]))
    assert "(rerun with world=ddp world.nproc_per_node=2 model.n_layer=1, or without" in said, said
    trainer.compose(["debug=smoke", "world=ddp", "world.nproc_per_node=2", "model.n_layer=1"])  # (it composes)


# The settings of trainer/checkpoint/ema as run dirs have saved them since resume=auto compared configs key by key.
SAVED_SETTINGS = {
    "trainer": {"max_steps", "grad_accum_steps", "grad_clip", "log_every", "eval_every", "eval_samples",
                "eval_batch_size", "seed", "compile", "compile_backend", "nonfinite", "max_nonfinite_skips",
                "nonfinite_check", "progress", "peak_tflops", "max_epochs", "eval_every_epochs",
                "activation_checkpointing"},
    "checkpoint": {"every_n_steps", "keep_last", "best_metric", "best_mode", "every_n_epochs", "save_final",
                   "async_save", "max_shard_mb"},
    "ema": {"enabled", "decay", "warmup", "update_every"},
}


def test_a_setting_added_to_the_framework_s_sections_says_what_older_runs_did():
    """A config.yaml saved before a setting existed lacks it, and resume=auto, comparing key by key, never matched
    such a run again: it started a new one beside it. Every setting since SAVED_SETTINGS is in settings.ADDED,
    with the value that does what those runs did, and that value is the schema's default."""
    import dataclasses

    from trainer.checkpoint.settings import ADDED
    from trainer.config.schema import CheckpointConfig, EMAConfig, TrainerConfig

    for section, schema in (("trainer", TrainerConfig), ("checkpoint", CheckpointConfig), ("ema", EMAConfig)):
        fields = {f.name: f for f in dataclasses.fields(schema)}
        saved = SAVED_SETTINGS[section]
        added = ADDED.get(section, {})
        assert set(fields) == saved | set(added), (
            f"{section}: {sorted(set(fields) - saved - set(added))} need an entry in trainer/checkpoint/settings.py's "
            "ADDED (the value that does what a run saved before them did)")
        for key, value in added.items():
            f = fields[key]
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            assert value == default, (section, key, value, default)


class PickyConfig:
    """A model config that refuses its sizes as transformers' validation does: the reason on the second line."""

    def __init__(self, hidden_size: int, heads: int):
        raise ValueError("Class validation error for validator 'validate_architecture':\n"
                         f"    ValueError: The hidden size ({hidden_size}) is not a multiple of the number of "
                         f"attention heads ({heads}).")


def test_a_section_that_cannot_be_built_names_the_whole_reason_in_one_paragraph():
    from omegaconf import OmegaConf

    from trainer.config.instantiate import build_node

    node = OmegaConf.create({"_target_": f"{__name__}.PickyConfig", "hidden_size": 65, "heads": 4})
    with pytest.raises(ConfigError) as e:
        build_node("model", node)
    text = str(e.value)
    assert "validate_architecture': ValueError: The hidden size (65) is not a multiple of the number of attention " \
           "heads (4) (at " in text and "The keys under model are what it was called with" in text
    assert "\n" not in text


def keyerr(path: str):
    return {"path": path}["paht"]  # a typo in a data function of one's own


def test_an_error_raised_inside_a_targets_own_code_names_its_type_and_line():
    """A KeyError in a `data._target_` function of one's own said only `could not build 'data' (...keyerr):
    'paht'. Check the keys under data`: no type, no line, and the keys were right. TRAINER_DEBUG=1 keeps the cause."""
    import os
    from unittest import mock

    from omegaconf import OmegaConf

    from trainer.config.instantiate import build_node

    node = OmegaConf.create({"_target_": f"{__name__}.keyerr", "path": "x"})
    with pytest.raises(ConfigError) as e:
        build_node("data", node)
    line = keyerr.__code__.co_firstlineno + 1
    assert f"{__name__}.keyerr raised KeyError: 'paht' (at {__file__}:{line}, in keyerr)" in str(e.value)
    assert "TRAINER_DEBUG=1 shows the traceback" in str(e.value) and e.value.__cause__ is None
    with mock.patch.dict(os.environ, {"TRAINER_DEBUG": "1"}), pytest.raises(ConfigError) as e:
        build_node("data", node)
    assert isinstance(e.value.__cause__, KeyError)
    # A key the target does not take is the config's: the hint stays.
    with pytest.raises(ConfigError, match=r"unexpected keyword argument 'paht'.*Check the keys under data"):
        build_node("data", OmegaConf.create({"_target_": f"{__name__}.keyerr", "paht": "x"}))


def test_the_checkpoint_advice_knows_every_launch_key_of_world():
    """The refused-resume advice (`rerun with world=ddp world.nproc_per_node=2`) gives a launch key only where it
    differs from this run's: it must know them all, or it proposes `+world.device=auto`, which Hydra refuses."""
    from trainer.checkpoint.manager import _SHARED
    from trainer.config.schema import LAUNCH_KEYS

    assert _SHARED["world"] == LAUNCH_KEYS


def test_the_summary_line_gives_counts_whole():
    from trainer.loop.trainer import summary_line

    assert summary_line({"summary/steps": 10001, "summary/train_time_s": 123.456789, "summary/mfu": 0.0123456}) == \
        "summary: steps=10001 train_time_s=123.5 mfu=0.01235"


def test_supervised_task_takes_pairs_or_dicts_by_their_keys_and_says_what_it_takes_otherwise():
    """Dict samples (a Hugging Face habit) were a KeyError traceback from inside the loop, the run dir left behind."""
    from trainer.task import SupervisedTask

    model = nn.Linear(4, 1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    pair = SupervisedTask("torch.nn.MSELoss")
    keyed = SupervisedTask("torch.nn.MSELoss", input_key="inputs", target_key="labels")
    assert pair.num_targets((x, y)) == keyed.num_targets({"inputs": x, "labels": y, "id": torch.arange(8)}) == 8
    assert torch.equal(pair.loss(model, (x, y)), keyed.loss(model, {"inputs": x, "labels": y}))
    for task, batch, says in ((pair, {"inputs": x, "labels": y}, "batches of dicts (keys: inputs, labels), and "
                               "task.input_key and task.target_key are not set"),
                              (keyed, {"inputs": x, "y": y}, "'labels' is not among them"),
                              (pair, (x, y, y), "batches are a tuple of 3"),
                              (pair, x, "batches are a Tensor")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            task.num_targets(batch)
    with pytest.raises(ConfigError, match="task.input_key='x' and task.target_key=None: give both"):
        SupervisedTask("torch.nn.MSELoss", input_key="x")


def test_a_full_disk_under_safetensors_is_an_oserror_with_its_errno_and_leaves_no_temp_file(tmp_path, monkeypatch):
    """safetensors raises its own error type for a full disk ("... (os error 28)"): the export's full disk was a
    traceback and exit 1, not the storage paragraph and exit 74 that an OSError gets."""
    import errno

    import safetensors.torch
    from safetensors import SafetensorError

    from trainer.io import atomic_save_safetensors

    def full(tensors, path, metadata=None):
        open(path, "wb").write(b"\0" * 8)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(OSError) as e:
        atomic_save_safetensors(tmp_path / "model.safetensors", {"w": torch.zeros(2)})
    assert e.value.errno == errno.ENOSPC and "model.safetensors" in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_a_large_seed_shuffles_and_a_small_one_keeps_its_order():
    """trainer.seed=1732881234567890 (a timestamp in microseconds) overflowed the sampler's generator at the first
    batch, a traceback: its seed times 1,000,003 passed 64 bits. Seeds below that keep the order they always had."""
    import torch

    from trainer.data.sampling import GlobalBatchSampler

    order = GlobalBatchSampler(50, 4, seed=1732881234567890).indices(0, 50)
    assert sorted(order) == list(range(50))
    g = torch.Generator().manual_seed(7 * 1_000_003)
    assert GlobalBatchSampler(50, 4, seed=7).indices(0, 50) == torch.randperm(50, generator=g).tolist()


def test_the_loader_worker_bound_reads_the_cores_where_the_os_has_no_affinity(monkeypatch):
    """Config validation bounds data.num_workers by the cores; os.sched_getaffinity is Linux's alone, and reading it
    directly made every config fail to validate elsewhere (macOS) with an AttributeError."""
    import os

    import trainer

    monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert trainer.compose(["debug=smoke", "data.num_workers=500"]).data.num_workers == 500  # (8 x 64 = 512)
    with pytest.raises(ConfigError, match=r"data.num_workers=513 is invalid: expected an integer in \[0, 512\]"):
        trainer.compose(["debug=smoke", "data.num_workers=513"])
