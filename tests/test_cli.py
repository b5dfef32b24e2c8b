"""`python -m trainer` as a user runs it: run dirs, Hydra flags, multirun, config groups, custom recipes."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import pytest
import yaml
from conftest import (
    ROOT,
    TINY,
    compose_cfg,
    load_weights,
    read_metrics,
    run_cli,
    run_here,
    run_main,
    tiny_overrides,
)
from omegaconf import OmegaConf

CONF = ROOT / "conf"


def test_cli_end_to_end_from_another_directory_into_a_per_run_dir_under_outputs(corpus, tmp_path):
    r = run_cli(*tiny_overrides(corpus, "trainer.eval_every=10", "task.sample_tokens=20", "trainer.progress=lines"),
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    runs = list((tmp_path / "outputs").glob("*/*/metrics.jsonl"))  # Hydra's default outputs/<date>/<time>
    assert len(runs) == 1 and (runs[0].parent / ".hydra" / "overrides.yaml").exists()
    run_dir = runs[0].parent
    events = read_metrics(run_dir)
    assert [e["step"] for e in events if "train/loss" in e] == list(range(1, 21))
    for key in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s"):
        assert key in events[0]
    assert {"val/loss", "val/bpb"} <= set(events[-1])
    # The resolved config (no interpolations left) and the weights with their model config.
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["model"]["seq_len"] == 32 and cfg["trainer"]["max_steps"] == 20
    assert json.loads((run_dir / "model_config.json").read_text())["_target_"] == "trainer.recipes.lm.model.GPT"
    assert "tok_emb.weight" in load_weights(run_dir / "model.safetensors")
    assert "sample at step 10" in r.stdout and "step 20/20 loss=" in r.stdout


def test_run_dir_records_how_to_reproduce_the_run_and_what_it_cost(corpus, tmp_path):
    import subprocess

    r = run_here(*tiny_overrides(corpus, "trainer.max_steps=4", "trainer.seed=7"), f"hydra.run.dir={tmp_path}",
                 cwd=ROOT)
    assert r.returncode == 0, r.stderr
    info = json.loads((tmp_path / "run_info.json").read_text())
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert info["git_commit"] == head and isinstance(info["git_dirty"], bool)
    assert info["seed"] == 7 and info["world_size"] == 1 and info["packages"]["torch"].startswith("2.")
    assert "trainer.seed=7" in info["command"]
    assert info["overrides"] == [*tiny_overrides(corpus, "trainer.max_steps=4", "trainer.seed=7")]  # (the job's own)
    assert "trainer.seed=7" in (tmp_path / ".hydra" / "overrides.yaml").read_text()
    last = [e for e in read_metrics(tmp_path) if "train/loss" in e][-1]
    assert 0 < last["train/mfu"] < 1 and last["train/peak_mem_mb"] > 50
    assert "summary: steps=4" in r.stdout


def test_help_and_cfg_job_do_not_train(tmp_path):
    r = run_here("--help", cwd=tmp_path)  # (in this process: Hydra prints and returns without a job)
    assert r.returncode == 0 and "precision: auto, bf16, fp16, fp32" in r.stdout
    assert "python -m trainer env" in r.stdout and "python -m trainer check" in r.stdout  # the commands too
    r = run_here("--cfg", "job", "precision=bf16", "optim.lr=0.01", cwd=tmp_path)
    assert r.returncode == 0
    cfg = yaml.safe_load(r.stdout)
    assert cfg["precision"]["_target_"] == "trainer.parallel.precision.BF16" and cfg["optim"]["lr"] == 0.01
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize(("args", "says"), [
    (("--help", "world=dpp"), "world=dpp is not an option of config group 'world'"),
    (("--info", "lr=1"), "unknown config key 'lr'. Did you mean optim.lr=1?"),
    (("--help", "optim.betas=[0.9"), "the value of optim.betas does not parse"),
    (("--help", "-m", "optim.lr=1e-3,2e-3"), "--help shows one job's config, so it does not go with -m"),
    (("--hydra-help", "optim.lr=1e-3"), "--hydra-help shows Hydra's own options and takes none of the job's")])
def test_help_with_a_mistaken_override_is_the_runs_paragraph(tmp_path, args, says):
    """--help, --info and --hydra-help compose the config with the overrides given: a mistake there was Hydra's
    traceback, exit 1, where a run or --cfg job gives one paragraph."""
    from test_errors import assert_clean_error

    assert_clean_error(run_here(*args, cwd=tmp_path), says)


def test_a_sweep_points_missing_data_file_stops_the_sweep_before_any_point_runs(corpus, tmp_path):
    """Each point builds its datasets when it starts: the missing file of point 1 was found after point 0 had run."""
    from test_errors import assert_clean_error

    r = run_here("-m", *tiny_overrides(corpus), f"data.path={corpus},{tmp_path / 'missing.txt'}",
                 f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    assert_clean_error(r, f"data.path='{tmp_path / 'missing.txt'}' does not exist (point 1 of the sweep's 2)")
    assert not (tmp_path / "sweep").exists()


# Options that belong to a recipe other than lm compose with it; `smoke` is picked by debug=smoke itself.
RECIPE_OF = {("recipe", "diffusion"): "diffusion", ("model", "unet"): "diffusion", ("data", "digits"): "diffusion",
             ("recipe", "gan"): "gan", ("model", "gan"): "gan"}


# Options that need an optional extra's package (pyproject.toml): covered where it is installed, skipped elsewhere.
NEEDS = {("model", "llama_tiny"): "transformers", ("data", "hf_text"): "datasets"}


# Data options that read the files data.path names (the tests' corpus here).
FILES_DATA = ("text", "text_stream", "hf_text")


def _options() -> list[tuple[str, str]]:
    return [(g.name, f.stem) for g in sorted(CONF.iterdir()) if g.is_dir() and g.name != "smoke"
            for f in sorted(g.glob("*.yaml"))]


@pytest.mark.parametrize(("group", "option"), _options())
def test_every_config_option_composes_and_instantiates(corpus, group, option):
    import torch
    from hydra.utils import instantiate

    from trainer.config.schema import per_part
    from trainer.entry.run import build_data, build_loggers, build_optimizer, build_strategy
    from trainer.task import split_loss

    if (group, option) in NEEDS:  # an option of an optional extra: covered where the extra is installed
        pytest.importorskip(NEEDS[(group, option)])
    recipe = RECIPE_OF.get((group, option), "lm")
    base = tiny_overrides(corpus) if recipe == "lm" else [f"recipe={recipe}", "debug=smoke"]
    overrides = [o for o in base if not o.startswith(f"{group}=")] + [f"{group}={option}"]
    if group == "data" and option not in FILES_DATA:
        overrides = [o for o in overrides if not o.startswith("data.path")]
    if group == "model" and option.startswith("gpt"):
        overrides.append("model.n_layer=1")  # keep instantiation cheap; the shape logic is the same
    cfg = compose_cfg(overrides)
    model = instantiate(cfg.model)
    # One optimizer, or one per model part (optim.generator: {...}, for a task's own training_step).
    opts = [build_optimizer(node, getattr(model, part) if part else model) for part, node in per_part(cfg.optim).items()]
    scheds = [instantiate(cfg.scheduler)(opt, total_steps=10) for opt in opts]
    precision = instantiate(cfg.precision, device_type="cpu")
    train, val = build_data(cfg.data)
    assert len(train) > 0
    task = instantiate(cfg.task)
    if hasattr(task, "setup"):
        task.setup(train, val, None)
    collate = getattr(train, "collate_fn", torch.utils.data.default_collate)
    if isinstance(train, torch.utils.data.IterableDataset):  # a stream: its first two samples
        samples = iter(train)
        batch = collate([next(samples), next(samples)])
    else:
        batch = collate(train.__getitems__([0, 1]))
    with precision.autocast():
        loss, _ = split_loss(task.loss(model, batch))
    assert loss.dim() == 0 and torch.isfinite(loss)
    precision.backward(loss)
    for opt, sched in zip(opts, scheds):
        opt.step()
        sched.step()
    build_loggers(cfg.logger, Path("/nonexistent-never-written"), is_main=False)
    build_strategy(cfg.world)


def test_every_config_file_starts_with_a_command_comment():
    for f in CONF.rglob("*.yaml"):
        head = f.read_text().splitlines()[:4]
        assert any("python -m trainer" in line for line in head if line.startswith("#")), f


def test_a_recipe_whose_package_header_is_not_its_first_line(tmp_path):
    """Hydra reads `# @package _global_` on the first line only; below a comment, the recipe's keys land in a
    `recipe` node the schema does not have. The error keeps Hydra's cause and says where the header goes.
    (The README's working recipe runs in tests/test_readme.py.)"""
    (tmp_path / "conf" / "recipe").mkdir(parents=True)
    (tmp_path / "conf" / "recipe" / "regress.yaml").write_text(
        "# conf/recipe/regress.yaml\n# @package _global_\ntrainer: {max_steps: 3}\n")
    r = run_main("--config-dir", "conf", "recipe=regress", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "Key 'recipe' not in 'Config'" in r.stderr, r.stderr
    assert "recipe/regress.yaml" in r.stderr and "first line must be '# @package _global_'" in r.stderr
    assert not (tmp_path / "outputs").exists()


def test_a_misspelt_key_in_a_recipe_with_its_header_is_named_with_the_key_it_means(tmp_path):
    """The header in place, a typo in the file's keys was told that the header must be on the first line (it was),
    and got no "Did you mean" as the same typo on the command line gets."""
    (tmp_path / "conf" / "recipe").mkdir(parents=True)
    (tmp_path / "conf" / "recipe" / "typo.yaml").write_text("# @package _global_\ntrainer: {max_step: 3}\n")
    r = run_main("--config-dir", "conf", "recipe=typo", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "@package" not in r.stderr, r.stderr
    assert "recipe/typo.yaml sets trainer.max_step, a key the config does not have. Did you mean trainer.max_steps?" \
        in r.stderr, r.stderr
    assert not (tmp_path / "outputs").exists()
    (tmp_path / "conf" / "recipe" / "typo.yaml").write_text("# @package _global_\ndefaults:\n  - override /precision: "
                                                          "fp33\n  - _self_\n")
    r = run_main("--config-dir", "conf", "recipe=typo", cwd=tmp_path)  # (an option it chooses: the file named too)
    assert "precision=fp33 is not an option of config group 'precision', chosen in conf/recipe/typo.yaml." in r.stderr


def test_a_config_dir_of_ones_own_draws_no_warning_about_the_machine_defaults_dir():
    """--config-dir puts this machine's defaults dir (TRAINER_CONFIG_HOME) on the search path again, through the
    command line, and on a machine without one Hydra warned about it at every start: the filter that silences the
    same warning for conf/config.yaml's search path ("in main") did not cover the command line's."""
    import re

    from trainer.config.compose import SEARCHPATH_WARNING  # (what compose.py's filter ignores)

    for provider in ("main", "command-line"):
        text = f"provider=hydra.searchpath in {provider}, path=/root/.config/trainer is not available."
        assert re.match(SEARCHPATH_WARNING, text), provider


def test_a_config_file_of_ones_own_named_as_a_shipped_one_is_refused_not_passed_over(tmp_path):
    """Hydra searches the shipped configs first: --config-dir's model/gpt_tiny.yaml (2 x 32) was passed over for the
    shipped one without a word, and the run trained the shipped model."""
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "gpt_tiny.yaml").write_text("# mine\n_target_: trainer.recipes.lm.model.GPT\n")
    r = run_main("--config-dir", "conf", "model=gpt_tiny", "--cfg", "job", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--config-dir conf has model/gpt_tiny.yaml, which the framework ships under the same name" in r.stderr
    assert "model/my_gpt_tiny.yaml" in r.stderr
    # A config.yaml at the dir's root (a project's own) is no option of a group: not refused.
    (tmp_path / "conf" / "model" / "gpt_tiny.yaml").rename(tmp_path / "conf" / "model" / "mine.yaml")
    (tmp_path / "conf" / "config.yaml").write_text("something: else\n")
    r = run_here("--config-dir", "conf", "debug=smoke", "--cfg", "job", cwd=tmp_path)
    assert r.returncode == 0 and "framework ships under the same name" not in r.stderr, r.stderr


def test_the_smoke_config_is_a_run_of_seconds(corpus):
    cfg = compose_cfg(tiny_overrides(corpus))
    assert TINY == ["debug=smoke"]
    assert cfg.data.batch_size == 4 and cfg.model.seq_len == 32 and cfg.model.n_layer == 1
    assert cfg.trainer.max_steps == 20 and cfg.precision._target_.endswith("FP32") and cfg.world.threads == 1


def test_a_command_composes_its_config_once_and_parses_each_config_file_once(corpus, tmp_path, monkeypatch):
    """Issue 33 (start-up), issue 24 (the suite's time): a run's config is composed by the up-front check, and
    no more: Hydra's get_mode (a whole composition to read hydra.mode) and Hydra's run take the check's. Each
    config file's text is parsed once for all compositions, here and in the next command of the same process."""
    from collections import OrderedDict

    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    from trainer.config import shortcuts

    composed = []
    original = ConfigLoaderImpl.load_configuration

    def counting(self, config_name, *args, **kwargs):
        composed.append(config_name)
        return original(self, config_name, *args, **kwargs)

    parsed = []
    parse = yaml.load
    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration", counting)
    monkeypatch.setattr(shortcuts, "_PARSED", OrderedDict())
    monkeypatch.setattr(yaml, "load", lambda text, Loader: parsed.append(text) or parse(text, Loader=Loader))
    for n in range(2):
        composed.clear()
        r = run_here(*tiny_overrides(corpus, "trainer.max_steps=2"), f"hydra.run.dir={tmp_path / str(n)}")
        assert r.returncode == 0, r.stderr
        assert composed.count("config") == 1, composed
        if n == 0:
            first = len(parsed)
            assert first > 10 and len(set(parsed)) == first  # the tree's files, each once
    assert len(parsed) == first  # the second command parsed nothing again


@pytest.mark.parametrize("overrides", [
    ["debug=smoke"], ["recipe=diffusion", "precision=bf16", "+hydra.job.env_set.X=1"],
    ["hydra.mode=RUN", "debug=smoke", "hydra.job.name=other"], ["--cfg", "hydra", "recipe=gan", "world=fsdp"]])
def test_hydra_runs_the_config_it_would_have_composed_itself(overrides, tmp_path, monkeypatch):
    """The config Hydra's run takes from the up-front check is the one it composes without it: the job's config
    and the whole `hydra` node (the overrides it records, hydra.mode, its choices and sources), key for key. A
    command whose composition differs from the check's (another working directory) composes anew."""
    import io

    from hydra.core.hydra_config import HydraConfig

    from trainer.config import shortcuts
    from trainer.entry import cli

    seen = []

    def record(cfg):
        seen.append((OmegaConf.to_container(cfg), OmegaConf.to_container(HydraConfig.get())))

    def command(reuse: bool):
        take = shortcuts.Precomposed.take
        with monkeypatch.context() as m, contextlib.redirect_stdout(io.StringIO()) as out:
            m.setattr(cli, "run_job", record)
            m.setattr(sys, "argv", ["trainer"])
            m.setattr(shortcuts.Precomposed, "take", lambda *a: taken.append(take(*a) if reuse else None) or taken[-1])
            cli.main([*overrides, f"hydra.run.dir={tmp_path}"])
        return out.getvalue()

    taken: list = []
    plain, reused = command(reuse=False), command(reuse=True)
    assert taken[0] is None and taken[-1] is not None  # the second command ran on the check's config
    assert plain == reused  # (--cfg hydra prints the config Hydra composed)
    if "--cfg" not in overrides:
        assert len(seen) == 2 and seen[0] == seen[1]
        assert seen[1][1]["mode"].name == "RUN" and "hydra.mode=RUN" in seen[1][1]["overrides"]["hydra"]


def test_the_checks_config_is_handed_out_once_and_only_for_what_it_was_composed_from(tmp_path, monkeypatch):
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    from trainer.entry import cli

    def take(known, overrides=("debug=smoke", "hydra.mode=RUN"), mode=RunMode.RUN, name="config"):
        with initialize_config_module("trainer.conf", version_base="1.3"):
            return known.take(GlobalHydra.instance().config_loader(), name, list(overrides), mode)

    known = cli.precheck(["debug=smoke"])
    assert take(known, mode=RunMode.MULTIRUN) is None and take(known, name="other") is None
    assert take(known, ("debug=smoke", "trainer.max_steps=3")) is None and take(known, ("precision=bf16",)) is None
    monkeypatch.chdir(tmp_path)
    assert take(known) is None  # (Hydra records the working directory)
    monkeypatch.undo()
    cfg = take(known)
    assert cfg.hydra.mode == RunMode.RUN and cfg.trainer.max_steps == 20
    assert take(known) is None  # Hydra's run writes into it: handed out once
    assert cli.precheck(["-m", "debug=smoke", "optim.lr=1e-3,1e-4"]).config is None  # a sweeper composes its own


def test_hydra_mode_set_by_an_override_still_decides_the_run_mode(tmp_path):
    """hydra.mode=MULTIRUN without -m: Hydra runs a sweep of one job (into the sweep dir), as it decides when it
    composes for get_mode itself."""
    r = run_here("debug=smoke", "trainer.max_steps=2", "hydra.mode=MULTIRUN", f"hydra.sweep.dir={tmp_path}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "0" / "model.safetensors").is_file()


@pytest.mark.parametrize("overrides", [["debug=smoke"], ["recipe=diffusion", "precision=bf16"],
                                       ["recipe=gan", "world=fsdp", "optim.lr=0.01"]])
def test_a_config_composed_with_each_file_parsed_once_is_the_config_composed_without(overrides):
    """The shortcuts change no value: compositions with and without them (each file's config built once, the
    structured configs shared by the repository's copies) are equal, with and without Hydra's own node, and a
    config they hand out is the caller's own (changing it changes no later composition)."""
    from hydra._internal.core_plugins.structured_config_source import StructuredConfigSource

    from trainer.config import shortcuts
    from trainer.config.compose import compose
    from trainer.entry.cli import compose_with_hydra

    def both():
        hydra_node = OmegaConf.to_container(compose_with_hydra(overrides, None))
        hydra_node["hydra"]["runtime"].pop("output_dir", None)
        return OmegaConf.to_container(compose(overrides)), hydra_node

    plain = both()
    with shortcuts.composing():
        first = compose(overrides)
        first.trainer.max_steps = -1
        assert both() == plain
        assert both() == plain
    assert both() == plain
    assert not getattr(OmegaConf.load, "_parses_once", False)  # in force only inside
    assert "__deepcopy__" not in StructuredConfigSource.__dict__
    from hydra._internal import defaults_list

    assert not getattr(defaults_list._create_interpolation_map, "_where_used", False)


def test_the_store_is_shared_in_a_fresh_process_where_hydras_first_plugin_scan_comes_inside_the_shortcuts():
    """Hydra's first plugin scan runs its core_plugins modules again and makes a new StructuredConfigSource class, so
    the shortcut patched a class no source had in any fresh process (a command's own): each of `--help`'s ~100
    compositions copied the whole ConfigStore (2 s). Checked in a fresh interpreter, where the scan comes inside."""
    import subprocess
    import sys

    code = ("import copy\n"
            "from hydra import compose, initialize_config_module\n"
            "from hydra.core.global_hydra import GlobalHydra\n"
            "import trainer.config.compose  # (the schema the config names)\n"
            "from trainer.config.shortcuts import composing\n"
            "with composing(), initialize_config_module('trainer.conf', version_base='1.3'):\n"
            "    compose('config')\n"
            "    source = GlobalHydra.instance().config_loader().repository.get_sources()[-1]\n"
            "    print(type(source).__name__, copy.deepcopy(source).store is source.store)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["StructuredConfigSource", "True"], r.stdout + r.stderr


@pytest.mark.parametrize("choice", [[], ["a=two"]])
def test_a_defaults_list_interpolation_resolves_the_same_with_the_shortcuts(tmp_path, choice):
    """`defaults_interpolated_where_they_are` builds Hydra's map of the choices made so far only for a defaults list
    that holds an interpolation: a list that does (`- b: ${a}`, under a group too) picks what it picks without it."""
    from hydra import compose, initialize_config_dir

    from trainer.config import shortcuts

    for group, option in (("a", "one"), ("a", "two"), ("b", "one"), ("b", "two"), ("c", "one"), ("c/d", "one"),
                          ("c/d", "two")):
        (tmp_path / group).mkdir(parents=True, exist_ok=True)
        (tmp_path / group / f"{option}.yaml").write_text(f"picked: {group}/{option}\n")
    (tmp_path / "c" / "one.yaml").write_text("defaults:\n  - d: ${a}\n  - _self_\nhere: c\n")
    # (Hydra reads a list from its end: `a` is a known choice by the time c's own list is read)
    (tmp_path / "config.yaml").write_text("defaults:\n  - c: one\n  - b: ${a}\n  - a: one\n  - _self_\n")

    def composed():
        with initialize_config_dir(str(tmp_path), version_base="1.3"):
            return OmegaConf.to_container(compose("config", overrides=choice))

    plain = composed()
    with shortcuts.composing():
        assert composed() == plain
    picked = "two" if choice else "one"
    assert plain["b"] == {"picked": f"b/{picked}"} and plain["c"]["d"] == {"picked": f"c/d/{picked}"}


def test_a_yaml_mistake_is_the_same_error_with_the_parse_cache(tmp_path):
    from trainer.config import shortcuts

    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    errors = []
    for cached in (False, True):
        with shortcuts.yaml_parsed_once() if cached else contextlib.nullcontext(), open(bad) as f:
            with pytest.raises(Exception) as info:
                OmegaConf.load(f)
            errors.append((type(info.value), str(info.value)))
    assert errors[0] == errors[1]


@pytest.mark.parametrize("command", ["eval", "sample", "config", "tune", "launch"])
def test_every_command_answers_help_with_its_usage(tmp_path, command):
    """`eval --help` (and sample, config, tune) printed its usage as an error, exit 2; env and check answered."""
    r = run_main(command, "--help", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith(f"usage: python -m trainer {command} "), r.stdout + r.stderr
    assert not r.stderr


def test_a_misspelt_command_is_named(tmp_path):
    """`evl RUN` said "'evl' is not an override: write KEY=VALUE", naming no command."""
    r = run_main("evl", str(tmp_path), cwd=tmp_path)
    assert r.returncode == 2 and "'evl' is neither a command nor an override" in r.stderr and "Did you mean eval?" in r.stderr


def test_version_names_the_framework(tmp_path):
    """`python -m trainer --version` printed Hydra's version ("Hydra 1.3.8")."""
    from trainer import __version__

    r = run_main("--version", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith(f"trainer {__version__} (torch ")


def test_ctrl_c_before_training_is_exit_130_without_a_traceback(corpus, tmp_path, monkeypatch):
    """Ctrl-C in a run's first seconds (torch importing, Hydra composing) was a KeyboardInterrupt traceback and exit
    -2, where a moment later (the run dir made) it is exit 130 and one line."""
    import trainer.entry.cli as cli
    import trainer.entry.launcher as launcher

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(cli, "precheck", interrupted)  # (while composing)
        r = run_here(*tiny_overrides(corpus), f"hydra.run.dir={tmp_path / 'a'}")
    assert (r.returncode, r.stderr) == (130, "interrupted: stopped before training started.\n")
    assert not (tmp_path / "a").exists()
    monkeypatch.setattr(launcher, "run", interrupted)  # (the run dir made: its records stay, a run that was stopped)
    r = run_here(*tiny_overrides(corpus), f"hydra.run.dir={tmp_path / 'b'}")
    assert r.returncode == 130 and "Traceback" not in r.stderr and "interrupted: stopped all processes." in r.stderr
    assert (tmp_path / "b" / "config.yaml").is_file()


def test_a_machines_defaults_keep_the_last_choice_of_a_group_given_twice():
    """`python -m trainer config precision=bf16 precision=fp32` saved both choices, and every later run took the
    first (bf16), where a run's command line takes the last."""
    from trainer.config.machine import render

    saved = yaml.safe_load(render(["precision=bf16", "world=ddp", "precision=fp32"]))
    assert saved["defaults"] == [{"override /world": "ddp"}, {"override /precision": "fp32"}]


def test_compose_from_python_refuses_a_config_dir_file_named_as_a_shipped_one(tmp_path):
    """trainer.compose(['recipe=lm'], config_dir=D) with D/recipe/lm.yaml of one's own returned the shipped recipe,
    without a word (the CLI's --config-dir refuses it)."""
    import trainer
    from trainer.errors import ConfigError

    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "lm.yaml").write_text("# @package _global_\n")
    with pytest.raises(ConfigError, match="recipe/lm.yaml, which the framework ships under the same name"):
        trainer.compose(["recipe=lm"], config_dir=str(tmp_path))
