"""The config trust model and secrets, through the real CLI.

A config file (`--config-dir`), an override or an interpolation may not name a `_target_` that runs
commands or code, deserialises, or touches files (trainer/config/targets.py: `refusal`); Hydra's own hooks
(callbacks, logging handlers, `hydra.job.env_set`) get the same policy. Each refusal is one paragraph,
exit 2, before any run dir exists, and the file the target would have touched is left as it was.
Every attack points at a path under tmp_path, so a regression touches nothing else.

Secrets: a value equal to (or inside) a secret-looking environment variable's value is redacted
wherever the run writes text: config.yaml, .hydra/, run_info.json, checkpoints, wandb, TensorBoard,
samples.jsonl and the console.
"""

from __future__ import annotations

import os
import pickle
import uuid
from pathlib import Path

import pytest
from conftest import ROOT, run_cli, run_here, run_main, tiny_overrides
from test_errors import assert_clean_error


def assert_refused(r, tmp_path: Path, *needles: str) -> None:
    """Exit 2, one paragraph (one line), and no run dir."""
    assert_clean_error(r, *needles)
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "run").exists()


def config_dir(tmp_path: Path, group: str, name: str, text: str) -> Path:
    """A `--config-dir` holding one option `group/name.yaml` (as an outside config file would)."""
    conf = tmp_path / "conf"
    (conf / group).mkdir(parents=True, exist_ok=True)
    (conf / group / f"{name}.yaml").write_text(text)
    return conf


def attack_overrides(corpus: Path, *extra: str) -> list[str]:
    """Without debug=smoke, whose model sizes would merge into the attacker's model node (and make the call
    fail before it runs): what the attack needs to work on a build without the policy."""
    return ["data=text", f"data.path={corpus}", *extra]


class Payload:
    """Unpickling it creates `marker` (harmless, and visible): what a planted checkpoint could run instead."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


# -- 1. `_target_`s that run code or touch files ---------------------------------------------------------
def _torch_load(tmp_path: Path) -> tuple[str, Path]:
    payload, marker = tmp_path / "payload.pt", tmp_path / "unpickled"
    payload.write_bytes(pickle.dumps(Payload(marker)))
    return f"_target_: torch.load\nf: {payload}\nweights_only: false\n", marker


def _spawn(tmp_path: Path) -> tuple[str, Path]:
    marker = tmp_path / "spawned"
    return f"_target_: setuptools._distutils.spawn.spawn\ncmd: [touch, {marker}]\n", marker


def _os_open(tmp_path: Path) -> tuple[str, Path]:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    return f"_target_: os.open\npath: {victim}\nflags: {flags}\n", victim


def _builtins_open(tmp_path: Path) -> tuple[str, Path]:
    created = tmp_path / "created.txt"
    return f"_target_: builtins.open\nfile: {created}\nmode: w\n", created


@pytest.mark.parametrize(("target", "attack"), [
    ("torch.load", _torch_load),
    ("setuptools._distutils.spawn.spawn", _spawn),
    ("os.open", _os_open),
    ("builtins.open", _builtins_open),
])
def test_targets_that_run_code_or_touch_files_are_refused_from_a_config_file(corpus, tmp_path, target, attack):
    text, witness = attack(tmp_path)
    before = witness.read_bytes() if witness.exists() else None
    conf = config_dir(tmp_path, "model", "evil", text)
    r = run_main("--config-dir", str(conf), *attack_overrides(corpus, "model=evil"), "hydra.run.dir=run", cwd=tmp_path)
    assert_refused(r, tmp_path, f"model._target_='{target}' is refused", "TRAINER_ALLOW_TARGETS=")
    assert (witness.read_bytes() if witness.exists() else None) == before  # not created, not emptied


def test_a_target_nested_in_a_list_or_in_positional_arguments_is_refused(corpus, tmp_path):
    created = tmp_path / "created.txt"
    for extra, key in [
        (f"+data.extra=[1,{{_target_:builtins.open,file:'{created}',mode:w}}]", "data.extra[1]._target_='builtins.open'"),
        (f"+data.extra={{_target_:builtins.list,_args_:[[{{_target_:io.open,_args_:['{created}',w]}}]]}}",
         "data.extra._args_[0][0]._target_='io.open'"),
    ]:
        r = run_main(*tiny_overrides(corpus, extra), "hydra.run.dir=run", cwd=tmp_path)
        assert_refused(r, tmp_path, key, "is refused")
        assert not created.exists()


def test_a_target_from_an_interpolation_is_refused(corpus, tmp_path):
    created = tmp_path / "created.txt"
    r = run_main(*tiny_overrides(corpus, f"+data.extra={{_target_:'${{oc.env:EVIL}}',file:'{created}',mode:w}}"),
                "hydra.run.dir=run", cwd=tmp_path, env={"EVIL": "builtins.open"})
    assert_refused(r, tmp_path, "data.extra._target_='builtins.open' is refused")
    assert not created.exists()


def test_an_alias_re_exported_elsewhere_is_caught_by_what_it_resolves_to(corpus, tmp_path):
    """A third-party module that re-exports a refused function under another name is judged by the origin."""
    import sys

    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "helpers.py").write_text("from os import system as run\nfrom builtins import open as opener\n")
    created = tmp_path / "created.txt"
    sys.path.insert(0, str(tmp_path / "lib"))  # PYTHONPATH=lib, in this process
    try:
        for target, origin, kwargs in [
            ("helpers.opener", "io.open", f"file: {created}\nmode: w\n"),
            ("helpers.run", "posix.system", f"command: touch {created}\n"),
        ]:
            conf = config_dir(tmp_path, "model", "alias", f"_target_: {target}\n{kwargs}")
            r = run_main("--config-dir", str(conf), *attack_overrides(corpus, "model=alias"), "hydra.run.dir=run",
                         cwd=tmp_path)
            assert_refused(r, tmp_path, f"model._target_='{target}' is refused", origin)
            assert not created.exists()
    finally:
        sys.path.remove(str(tmp_path / "lib"))
        sys.modules.pop("helpers", None)


def test_the_allow_switch_is_read_from_the_environment_only(corpus, tmp_path, monkeypatch):
    from trainer.config.compose import load
    from trainer.errors import ConfigError

    # (a node whose keys the framework builds as they are: a logger)
    overrides = tiny_overrides(corpus, "+logger.extra={_target_:tempfile.gettempdir}")
    monkeypatch.delenv("TRAINER_ALLOW_TARGETS", raising=False)
    with pytest.raises(ConfigError, match=r"logger.extra._target_='tempfile.gettempdir' is refused.*"
                                          r"TRAINER_ALLOW_TARGETS=tempfile.gettempdir"):
        load(overrides)
    for allowed in ("tempfile.gettempdir", "os.getcwd,tempfile"):  # a name, or a module and everything in it
        monkeypatch.setenv("TRAINER_ALLOW_TARGETS", allowed)
        load(overrides)
    monkeypatch.setenv("TRAINER_ALLOW_TARGETS", "tempfile.mkdtemp")
    with pytest.raises(ConfigError, match="tempfile.gettempdir"):
        load(overrides)

    # A config cannot allow itself: hydra.job.env_set would set it inside the job.
    monkeypatch.delenv("TRAINER_ALLOW_TARGETS")
    r = run_main(*tiny_overrides(corpus, "+hydra.job.env_set.TRAINER_ALLOW_TARGETS=builtins.open"), "hydra.run.dir=run",
                cwd=tmp_path)
    assert_refused(r, tmp_path, "hydra.job.env_set.TRAINER_ALLOW_TARGETS", "environment")


def test_the_shipped_configs_pass_the_policy():
    from conftest import compose_cfg

    from trainer.config.compose import prepare

    choices = ["world=single", "world=ddp", "world=fsdp", "precision=bf16", "precision=fp16", "scheduler=constant",
               "logger=wandb", "data=stdlib"]
    if (ROOT / "conf" / "logger" / "tensorboard.yaml").exists():
        choices.append("logger=tensorboard")
    for choice in choices:
        prepare(compose_cfg([choice]))
    # Hydra's own logging options, callbacks that only log, and ordinary environment settings are kept.
    r = run_here("--cfg", "hydra", "hydra/hydra_logging=hydra_debug", "hydra/job_logging=stdout",
                "+hydra.callbacks.log={_target_:hydra.experimental.callbacks.LogJobReturnCallback}",
                "+hydra.job.env_set.WANDB_PROJECT=p")
    assert r.returncode == 0, r.stderr


# -- 2. Hydra's own hooks ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("override", "needle"), [
    ("+hydra.callbacks.x={{_target_:builtins.open,file:'{path}',mode:w}}", "hydra.callbacks.x._target_='builtins.open'"),
    ("+hydra.job_logging.handlers.x={{class:logging.FileHandler,filename:'{path}'}}",
     "hydra.job_logging.handlers.x.class='logging.FileHandler'"),
    ("+hydra.hydra_logging.handlers.x={{class:logging.handlers.RotatingFileHandler,filename:'{path}'}}",
     "hydra.hydra_logging.handlers.x.class='logging.handlers.RotatingFileHandler'"),
    # Hydra's default job logging (not ours: we use none) with its file handler pointed elsewhere.
    ("hydra/job_logging=default hydra.job_logging.handlers.file.filename='{path}'",
     "hydra.job_logging.handlers.file.class='logging.FileHandler'"),
    ("+hydra.job_logging.handlers.x={{class:logging.StreamHandler,stream:'ext://os.system'}}", "'ext://os.system'"),
    ("hydra.job.name=../../{name}", "hydra.job.name='../../"),
    ("+hydra.job.env_set.LD_PRELOAD='{path}'", "hydra.job.env_set.LD_PRELOAD"),
])
def test_hydra_hooks_get_the_same_policy(corpus, tmp_path, override, needle):
    path = tmp_path / "hook.log"
    r = run_main(*tiny_overrides(corpus, *override.format(path=path, name=path.stem).split(" ")), "hydra.run.dir=run/job",
                cwd=tmp_path)
    assert_clean_error(r, needle.format(path=path))
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not path.exists() and not (tmp_path / "run").exists()


def test_hydra_hooks_from_a_config_file_are_checked_too(corpus, tmp_path):
    path = tmp_path / "hook.log"
    conf = config_dir(tmp_path, "debug", "evil", "# @package _global_\ndefaults:\n  - smoke\nhydra:\n  callbacks:\n"
                      f"    x:\n      _target_: builtins.open\n      file: {path}\n      mode: w\n")
    r = run_main("--config-dir", str(conf), *tiny_overrides(corpus, "debug=evil"), "hydra.run.dir=run", cwd=tmp_path)
    assert_refused(r, tmp_path, "hydra.callbacks.x._target_='builtins.open' is refused")
    assert not path.exists()


def test_a_logging_config_file_with_a_factory_is_checked(corpus, tmp_path):
    """hydra/job_logging=NAME from --config-dir: a filter built by `()` is a target like any other."""
    path = tmp_path / "hook.log"
    conf = config_dir(tmp_path, "hydra/job_logging", "evil", "version: 1\nfilters:\n  x:\n    (): builtins.open\n"
                      f"    file: {path}\n    mode: w\nroot:\n  level: INFO\n")
    r = run_main("--config-dir", str(conf), *tiny_overrides(corpus, "hydra/job_logging=evil"), "hydra.run.dir=run",
                cwd=tmp_path)
    assert_refused(r, tmp_path, "hydra.job_logging.filters.x.()='builtins.open' is refused")
    assert not path.exists()


# -- 3. Secrets by value ----------------------------------------------------------------------------------
def test_a_tokenizers_special_tokens_are_not_secrets():
    """data.eos_token='<|endoftext|>' was written as <redacted> into config.yaml (and eval rebuilt the data with that
    text as its end-of-text token), and matched no sweep point."""
    from trainer.redaction import is_secret_key, redact

    assert not is_secret_key("data.eos_token") and not is_secret_key("pad_token") and is_secret_key("model.hf_token")
    assert redact({"data": {"eos_token": "<|endoftext|>"}}) == {"data": {"eos_token": "<|endoftext|>"}}


def test_is_secret_env():
    from trainer.redaction import is_secret_env

    for name in ("HF_TOKEN", "MYTOKEN", "GITHUB_PAT", "GH_PAT", "OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY", "MYKEY",
                 "DB_PASSWORD", "PGPASSWORD", "WANDB_API_KEY", "HUGGING_FACE_HUB_TOKEN", "client_secret"):
        assert is_secret_env(name), name
    for name in ("PATH", "KEYBOARD", "XKB_KEYMAP", "TOKENIZERS_PARALLELISM", "PWD", "HOME", "PATHEXT", "PYTHONPATH"):
        assert not is_secret_env(name), name


def test_redact_replaces_secret_values_wherever_they_are(monkeypatch):
    from trainer.redaction import REDACTED, redact

    monkeypatch.setenv("MYTOKEN", "tok-123456")
    tree = {"name": "tok-123456", "note": "run-tok-123456-b", "tags": ["x", "tok-123456"], "hf_token": "abcdefgh",
            "echo": "abcdefgh", "n": 3}
    assert redact(tree) == {"name": REDACTED, "note": f"run-{REDACTED}-b", "tags": ["x", REDACTED],
                            "hf_token": REDACTED, "echo": REDACTED, "n": 3}


def run_files(run_dir: Path) -> list[Path]:
    return [p for p in run_dir.rglob("*") if p.is_file()]


def assert_nowhere(secrets: dict[str, str], files: list[Path], *texts: str) -> None:
    for p in files:
        data = p.read_bytes()
        for name, value in secrets.items():
            assert value.encode() not in data, (name, p)
    for name, value in secrets.items():
        assert value not in "".join(texts), name


@pytest.fixture
def secrets() -> dict[str, str]:
    return {name: f"{name.lower()}-{uuid.uuid4().hex}" for name in ("HF_TOKEN", "MYTOKEN", "GITHUB_PAT")}


SECRET_OVERRIDES = ("logger.wandb.name=${oc.env:HF_TOKEN}", "+note=${oc.env:MYTOKEN}", "+pat=${oc.env:GITHUB_PAT}",
                    "task.sample_prompt=${oc.env:MYTOKEN}", "task.sample_tokens=4")


def test_secret_values_reach_no_sink(corpus, tmp_path, secrets):
    """config.yaml, .hydra/, run_info.json, checkpoints (config.yaml, state.json), samples.jsonl, the wandb
    offline files (binary: searched as bytes), stdout and stderr."""
    literal = f"literal-{uuid.uuid4().hex}"
    run_dir = tmp_path / "run"
    r = run_cli(*tiny_overrides(corpus, "logger=wandb", "trainer.max_steps=4", "checkpoint.every_n_steps=2",
                                *SECRET_OVERRIDES), f"+hf_token={literal}", f"hydra.run.dir={run_dir}",
                env={**secrets, "WANDB_MODE": "offline"}, timeout=240)
    assert r.returncode == 0, r.stderr
    files = run_files(run_dir)
    names = {p.name for p in files}
    assert {"config.yaml", "overrides.yaml", "run_info.json", "state.json", "samples.jsonl"} <= names
    assert any(p.suffix == ".wandb" for p in files)
    assert_nowhere({**secrets, "literal": literal}, files, r.stdout, r.stderr)
    assert "<redacted>" in (run_dir / "samples.jsonl").read_text()
    assert "<redacted>" in (run_dir / "config.yaml").read_text()


def test_a_secret_on_a_sweeps_command_line_reaches_neither_its_files_nor_the_console(corpus, tmp_path):
    """Hydra writes a sweep's multirun.yaml (its overrides and config) and logs each job's overrides (`#0 : ...`)
    itself, and prints --cfg hydra: the value of +hydra.job.env_set.WANDB_API_KEY=... reached all three."""
    key = f"k{uuid.uuid4().hex}"
    sweep = tmp_path / "sweep"
    r = run_here("-m", *tiny_overrides(corpus, "trainer.max_steps=1"), f"+hydra.job.env_set.WANDB_API_KEY={key}",
                 "optim.lr=1e-3,2e-3", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (sweep / "multirun.yaml").is_file() and "#1 : " in r.stdout + r.stderr
    shown = run_here("--cfg", "hydra", f"+hydra.job.env_set.WANDB_API_KEY={key}", cwd=tmp_path)
    assert "WANDB_API_KEY: <redacted>" in shown.stdout
    assert_nowhere({"key": key}, run_files(sweep), r.stdout, r.stderr, shown.stdout, shown.stderr)


def test_a_secret_written_by_hand_into_the_machine_defaults_is_printed_by_no_command(tmp_path):
    """`env` and `config` print the defaults file, and `--cfg hydra` the config composed with it: a WANDB_API_KEY
    written there by hand (README: edit the file by hand if you like) was printed in clear by all three (`env`'s
    output is what a bug report pastes); a run redacted it."""
    home = tmp_path / "home"
    (home / "machine").mkdir(parents=True)
    key = f"k{uuid.uuid4().hex}"
    (home / "machine" / "default.yaml").write_text(f"# @package _global_\nhydra: {{job: {{env_set: {{WANDB_API_KEY: {key}}}}}}}\n")
    shown = [run_here(*args, cwd=tmp_path, env={"TRAINER_CONFIG_HOME": str(home)})
             for args in (["env"], ["config"], ["--cfg", "hydra"])]
    assert all(r.returncode == 0 for r in shown), [r.stderr for r in shown]
    assert all("WANDB_API_KEY: <redacted>" in r.stdout for r in shown)
    assert_nowhere({"key": key}, [], *(r.stdout for r in shown), *(r.stderr for r in shown))


def test_a_job_that_moves_out_of_a_shared_default_run_dir_leaves_the_other_jobs_records_and_no_secret(corpus,
                                                                                                    tmp_path):
    """Two jobs of the same second share the default run dir. Hydra would write the later job's command line into
    that dir's .hydra/ before the job sees the dir is taken and moves to `<dir>-2`, over the earlier job's records
    and with the later job's secrets in them. The job writes them into the dir it owns instead, scrubbed. (The
    default dir is pinned here by the machine's defaults: not the command line's hydra.run.dir, which would make
    it the user's choice, never moved.)"""
    literal = f"literal-{uuid.uuid4().hex}"
    shared = tmp_path / "outputs" / "12-00-00"
    (shared / "checkpoints").mkdir(parents=True)
    (shared / ".hydra").mkdir()
    (shared / ".hydra" / "overrides.yaml").write_text("- the earlier job's override\n")
    (shared / "config.yaml").write_text("the earlier job's\n")
    home = tmp_path / "home"
    (home / "machine").mkdir(parents=True)
    (home / "machine" / "default.yaml").write_text(f"# @package _global_\nhydra:\n  run:\n    dir: {shared}\n")
    r = run_here(*tiny_overrides(corpus, "trainer.max_steps=2"), f"+hf_token={literal}", cwd=tmp_path,
                 env={"TRAINER_CONFIG_HOME": str(home)})
    assert r.returncode == 0, r.stderr
    moved = shared.with_name("12-00-00-2")
    assert f"run dir: {moved}" in r.stdout
    assert_nowhere({"literal": literal}, [*run_files(shared), *run_files(moved)], r.stdout, r.stderr)
    assert (shared / "config.yaml").read_text() == "the earlier job's\n"
    assert sorted(p.name for p in (shared / ".hydra").iterdir()) == ["overrides.yaml"]  # the earlier job's, untouched
    assert (shared / ".hydra" / "overrides.yaml").read_text() == "- the earlier job's override\n"
    assert sorted(p.name for p in (moved / ".hydra").iterdir()) == ["config.yaml", "hydra.yaml", "overrides.yaml"]
    assert "+hf_token=<redacted>" in (moved / ".hydra" / "overrides.yaml").read_text()


def test_secret_values_in_errors_are_redacted(corpus, tmp_path, secrets):
    r = run_main(*tiny_overrides(corpus, "trainer.progress=${oc.env:HF_TOKEN}"), "hydra.run.dir=run", cwd=tmp_path,
                env=secrets)
    assert_clean_error(r, "trainer.progress='<redacted>'")
    assert secrets["HF_TOKEN"] not in r.stderr + r.stdout


def test_secret_values_reach_no_tensorboard_config(corpus, tmp_path, secrets):
    pytest.importorskip("tensorboard")
    pytest.importorskip("trainer.tracking.tensorboard_logger")
    run_dir = tmp_path / "run"
    r = run_here(*tiny_overrides(corpus, "logger=tensorboard", "trainer.max_steps=2", *SECRET_OVERRIDES[1:3]),
                 f"hydra.run.dir={run_dir}", env=secrets)
    assert r.returncode == 0, r.stderr
    files = run_files(run_dir / "tensorboard")
    assert files
    assert_nowhere(secrets, files, r.stdout, r.stderr)


def test_secret_values_reach_no_tensorboard_sample(corpus, tmp_path, secrets):
    pytest.importorskip("tensorboard")
    pytest.importorskip("trainer.tracking.tensorboard_logger")
    run_dir = tmp_path / "run"
    r = run_here(*tiny_overrides(corpus, "logger=tensorboard", "trainer.max_steps=2", *SECRET_OVERRIDES[3:]),
                 f"hydra.run.dir={run_dir}", env=secrets)
    assert r.returncode == 0, r.stderr
    assert_nowhere(secrets, run_files(run_dir / "tensorboard"))
