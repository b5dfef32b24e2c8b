"""Hydra's conventions users already know: HYDRA_FULL_ERROR, -m anywhere, and null to switch a feature off."""

from __future__ import annotations

import pytest
import yaml
from conftest import read_metrics, run_cli, run_here, run_main, series, tiny_overrides

QUIET = {"HYDRA_FULL_ERROR": "0", "TRAINER_DEBUG": "0"}


@pytest.mark.parametrize(("switch", "traceback"), [
    ({}, False),
    ({"HYDRA_FULL_ERROR": "0"}, False),
    ({"TRAINER_DEBUG": "0"}, False),
    ({"HYDRA_FULL_ERROR": "1"}, True),
    ({"TRAINER_DEBUG": "1"}, True),
])
def test_only_an_explicit_1_shows_the_traceback_of_a_config_mistake(tmp_path, switch, traceback):
    args = ("debug=smoke", "trainer.max_stepz=3", f"hydra.run.dir={tmp_path / 'run'}")
    env = {"HYDRA_FULL_ERROR": "", "TRAINER_DEBUG": "", **switch}
    # A traceback is the process's own last words: a subprocess. The one-paragraph cases, in this process.
    r = run_cli(*args, env=env, timeout=60) if traceback else run_main(*args, cwd=tmp_path, env=env)
    assert r.returncode in ((1, 2) if traceback else (2,)), r.stderr
    assert ("Traceback" in r.stderr) is traceback, r.stderr
    if not traceback:  # one paragraph naming the key and the fix
        assert r.stderr.startswith("error: unknown config key 'trainer.max_stepz'. Did you mean trainer.max_steps=3?")
        assert r.stderr.count("\n") == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("full_error", ["0", "1"])
def test_a_mistake_found_while_the_job_runs_follows_the_same_switch(corpus, tmp_path, full_error):
    """A checkpoint path that does not exist is found after Hydra started the job (inside its task function)."""
    # In this process where nothing is raised past the CLI; the traceback's case in a subprocess.
    r = (run_here if full_error == "0" else run_cli)(*tiny_overrides(corpus, f"resume={tmp_path / 'nowhere'}"),
                                                     f"hydra.run.dir={tmp_path / 'run'}",
                                                     env={**QUIET, "HYDRA_FULL_ERROR": full_error})
    assert r.returncode in ((2,) if full_error == "0" else (1, 2)), r.stderr
    assert "does not exist" in r.stderr
    assert ("Traceback" in r.stderr) is (full_error == "1"), r.stderr


@pytest.mark.parametrize("where", ["middle", "end"])
def test_multirun_flag_may_stand_anywhere(corpus, tmp_path, where):
    overrides = tiny_overrides(corpus, "trainer.max_steps=2")
    flag = "-m" if where == "middle" else "--multirun"
    args = ([*overrides, "optim.lr=1e-3,2e-3", flag, f"hydra.sweep.dir={tmp_path}"] if where == "middle"
            else [*overrides, "optim.lr=1e-3,2e-3", f"hydra.sweep.dir={tmp_path}", flag])
    r = run_here(*args, cwd=tmp_path, env=QUIET)
    assert r.returncode == 0, r.stderr
    lrs = [yaml.safe_load((tmp_path / str(i) / "config.yaml").read_text())["optim"]["lr"] for i in (0, 1)]
    assert lrs == [1e-3, 2e-3]
    assert all(len(series(read_metrics(tmp_path / str(i)), "train/loss")) == 2 for i in (0, 1))


def test_hydra_s_other_flags_may_stand_anywhere_too(tmp_path):
    """`debug=smoke --cfg job optim.lr=2e-3` was argparse's usage and "unrecognized arguments: optim.lr=2e-3"
    (Hydra's parser takes its overrides after its flags only)."""
    import yaml

    from trainer.config.flags import flags_first

    r = run_here("debug=smoke", "--cfg", "job", "optim.lr=2e-3", cwd=tmp_path, env=QUIET)
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load(r.stdout)["optim"]["lr"] == 2e-3
    assert flags_first(["a=1", "-cd", "conf", "b=2", "-i", "plugins", "-m", "d=4", "--multirun", "--cfg=job", "e=5"]) == \
        ["-cd", "conf", "-i", "plugins", "-m", "--cfg=job", "a=1", "b=2", "d=4", "e=5"]
    assert flags_first(["a=1", "--info", "b=2"]) == ["a=1", "b=2", "--info"]  # (its topic is optional)
    assert flags_first(["a=1", "--info"]) == ["a=1", "--info"]
    assert flags_first(["--dynamo_backend", "inductor", "a=1"]) == ["--dynamo_backend", "inductor", "a=1"]  # (not Hydra's)
    r = run_here("debug=smoke", "--info", cwd=tmp_path, env=QUIET)  # (a bare --info after an override ran before)
    assert r.returncode == 0 and "Config search path" in r.stdout, r.stdout + r.stderr
    assert list(tmp_path.iterdir()) == []


def test_grad_clip_zero_is_refused_and_the_message_says_null_switches_clipping_off(tmp_path):
    r = run_main("debug=smoke", "trainer.grad_clip=0", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, env=QUIET)
    assert r.returncode == 2
    assert r.stderr == ("error: trainer.grad_clip=0.0 is invalid: expected a number > 0, or null. "
                        "null switches clipping off.\n")
    assert not (tmp_path / "run").exists()


def test_grad_clip_null_switches_clipping_off():
    from trainer import compose
    from trainer.config.compose import prepare

    assert prepare(compose(["debug=smoke", "trainer.grad_clip=null"]), targets=False).trainer.grad_clip is None
