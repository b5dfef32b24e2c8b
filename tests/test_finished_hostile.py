"""A finished run dir is untrusted input for `trainer.load`, `python -m trainer eval` and `sample`: a damaged or
hostile file is one paragraph naming it (exit 2), never a traceback, a hang, minutes of parsing, a read outside
the run dir, or a secret printed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
from pathlib import Path

import pytest
from conftest import run_here, tiny_overrides
from test_errors import assert_clean_error

SECRET = "s3cr3t-7f0e9a1c"  # short enough to fit the tiny model's 32 positions as a prompt


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory) -> dict[str, Path]:
    """Two finished runs of 2 steps: the lm recipe's, and the diffusion recipe's (a task with exported state)."""
    from trainer import compose, train

    root = tmp_path_factory.mktemp("finished")
    train(compose(tiny_overrides(corpus, "trainer.max_steps=2", "task.sample_tokens=8")), root / "lm")
    train(compose(["recipe=diffusion", "debug=smoke", "trainer.max_steps=2"]), root / "diffusion")
    return {"lm": root / "lm", "diffusion": root / "diffusion"}


@pytest.fixture(autouse=True)
def deadline():
    """A FIFO that is opened, or a file parsed for minutes, fails the test instead of hanging the suite."""
    def expired(signum, frame):
        raise TimeoutError("the command blocked or ran for more than 60 s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def copy_of(runs: dict[str, Path], recipe: str, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(runs[recipe], run)
    return run


def write(name: str, data: bytes | str):
    def damage(run: Path) -> None:
        (run / name).write_bytes(data.encode() if isinstance(data, str) else data)
    return damage


def fifo(name: str):
    def damage(run: Path) -> None:
        (run / name).unlink()
        os.mkfifo(run / name)
    return damage


def edit_json(name: str, **changes):
    def damage(run: Path) -> None:
        (run / name).write_text(json.dumps({**json.loads((run / name).read_text()), **changes}))
    return damage


def truncate(name: str):
    def damage(run: Path) -> None:
        data = (run / name).read_bytes()
        (run / name).write_bytes(data[:len(data) // 2])
    return damage


def sharded_with_a_list(run: Path) -> None:
    (run / "model.safetensors").rename(run / "model-00001-of-00001.safetensors")
    (run / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model-00001-of-00001.safetensors"]}))


def wrong_task_keys(run: Path) -> None:
    """Written with export.json's record to match (as whoever can write a run dir can): the task's own check of its
    keys is what refuses it."""
    import hashlib

    import torch
    from safetensors.torch import save_file

    save_file({"nothing.like_it": torch.zeros(3)}, str(run / "task_state.safetensors"))
    record = json.loads((run / "export.json").read_text())
    data = (run / "task_state.safetensors").read_bytes()
    record["files"]["task_state.safetensors"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (run / "export.json").write_text(json.dumps(record))


def best_outside(run: Path) -> None:
    """best.json names a (complete, valid) checkpoint outside the run dir."""
    shutil.copytree(run / "checkpoints" / "step_00000002", run.parent / "outside" / "step_00000002")
    (run / "checkpoints" / "best.json").write_text(json.dumps({"checkpoint": "../../outside/step_00000002"}))


def alias_bomb(run: Path) -> None:
    """A small billion laughs (10^6 strings once expanded; the real one has 10^9) at the top of config.yaml."""
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 6)]
    (run / "config.yaml").write_text("\n".join(lines) + "\n" + (run / "config.yaml").read_text())


LOAD, SAMPLE, EVAL, BEST = "load", ("sample",), ("eval",), ("eval", "checkpoint=best")
MODEL = (LOAD, SAMPLE)  # what reads model_config.json and the weights
CASES = {
    # what the checkpoint reader refuses is refused here too: YAML aliases, FIFOs, files larger than they can be
    "config.yaml alias bomb": ("lm", alias_bomb, (SAMPLE, EVAL), ["config.yaml", "alias"]),
    "model_config.json FIFO": ("lm", fifo("model_config.json"), MODEL, ["model_config.json", "a FIFO"]),
    "model_config.json of 60 MB": ("lm", write("model_config.json", '{"_target_": "trainer.recipes.lm.model.GPT", '
                                               '"pad": "' + "x" * (60 << 20) + '"}'), MODEL,
                                   ["model_config.json", "more than"]),
    # damaged or foreign files: each was a traceback (exit 1)
    "model_config.json a list": ("lm", write("model_config.json", "[1, 2]"), MODEL,
                                 ["model_config.json", "not a JSON object"]),
    "model_config.json 100,000 deep": ("lm", write("model_config.json", "[" * 100_000 + "]" * 100_000), MODEL,
                                       ["model_config.json"]),  # (refused by its size: 200 KB)
    "model_config.json 30,000 deep": ("lm", write("model_config.json", "[" * 30_000 + "]" * 30_000), MODEL,
                                      ["model_config.json", "nests too deep"]),
    "model_config.json 100 deep": ("lm", write("model_config.json", '{"a": ' * 100 + "0" + "}" * 100), MODEL,
                                   ["model_config.json", "nests more than"]),
    "model_config.json _partial_": ("lm", edit_json("model_config.json", _partial_=True), MODEL,
                                    ["model_config.json", "_partial_: True", "not the model"]),
    "model_config.json wrong d_model": ("lm", edit_json("model_config.json", d_model=32), MODEL,
                                        ["model_config.json", "tok_emb.weight", "(256, 64)", "(256, 32)"]),
    "model.safetensors truncated": ("lm", truncate("model.safetensors"), MODEL,
                                    ["model.safetensors", "truncated", "resume=auto"]),
    "model.safetensors random bytes": ("lm", write("model.safetensors", os.urandom(4096)), MODEL,
                                       ["model.safetensors", "not a valid safetensors file"]),
    "model.safetensors 2^40 header": ("lm", write("model.safetensors", struct.pack("<Q", 2**40) + b"{}" * 64),
                                      MODEL, ["model.safetensors", "header length"]),
    "config.yaml a list": ("lm", write("config.yaml", "- 1\n- 2\n"), (SAMPLE, EVAL), ["config.yaml", "not a mapping"]),
    "config.yaml syntax error": ("lm", write("config.yaml", "trainer: {max_steps: 2\n"), (SAMPLE, EVAL),
                                 ["config.yaml", "not YAML"]),
    "index weight_map a list": ("lm", sharded_with_a_list, MODEL, ["model.safetensors.index.json", "weight_map"]),
    "task_state truncated": ("diffusion", truncate("task_state.safetensors"), (SAMPLE,),
                             ["task_state.safetensors", "truncated"]),
    "task_state wrong keys": ("diffusion", wrong_task_keys, (SAMPLE,), ["task_state.safetensors", "nothing.like_it"]),
    "task_state FIFO": ("diffusion", fifo("task_state.safetensors"), (SAMPLE,), ["task_state.safetensors", "a FIFO"]),
    # best.json names a checkpoint outside the run dir
    "best.json outside": ("lm", best_outside, (BEST,), ["best.json", "../../outside/step_00000002"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_run_dir_is_one_paragraph(runs, tmp_path, case):
    from trainer import load
    from trainer.errors import UserError

    recipe, damage, commands, needles = CASES[case]
    run = copy_of(runs, recipe, tmp_path)
    damage(run)
    for command in commands:
        if command == LOAD:
            with pytest.raises(UserError) as err:
                load(run)
            message = str(err.value)
            assert "\n" not in message and all(n in message for n in (str(run), *needles)), message
        else:
            r = run_here(command[0], str(run), *command[1:], cwd=tmp_path)
            assert_clean_error(r, str(run), *needles)


def test_eval_skips_a_checkpoint_that_is_a_symbolic_link(runs, tmp_path, capsys):
    """checkpoint=latest evaluates the newest of the run's own checkpoints (saying which link it skipped);
    checkpoint=best refuses a link."""
    from trainer.inference.finished import checkpoint_of

    run, other = copy_of(runs, "lm", tmp_path), tmp_path / "other"
    shutil.copytree(run / "checkpoints" / "step_00000002", other / "step_00000009")
    (run / "checkpoints" / "step_00000009").symlink_to(other / "step_00000009")
    assert checkpoint_of(run, "latest") == run / "checkpoints" / "step_00000002"
    assert "checkpoints/step_00000009 is a symbolic link" in capsys.readouterr().err

    (run / "checkpoints" / "best.json").write_text(json.dumps({"checkpoint": "step_00000009"}))
    r = run_here("eval", str(run), "checkpoint=best", cwd=tmp_path)
    assert_clean_error(r, "checkpoints/step_00000009", "symbolic link")


def test_eval_names_a_later_checkpoint_it_passes_over(runs, tmp_path, capsys):
    """checkpoint=latest evaluates the newest complete checkpoint, and says which later step it could not read
    (no manifest: a save cut off; a damaged one), so that its numbers are never taken for the later step's."""
    from trainer.inference.finished import checkpoint_of

    run = copy_of(runs, "lm", tmp_path)
    checkpoints = run / "checkpoints"
    shutil.copytree(checkpoints / "step_00000002", checkpoints / "step_00000007")
    (checkpoints / "step_00000007" / "manifest.json").unlink()
    shutil.copytree(checkpoints / "step_00000002", checkpoints / "step_00000009")
    (checkpoints / "step_00000009" / "manifest.json").write_text("{not json")
    assert checkpoint_of(run, "latest") == checkpoints / "step_00000002"
    err = capsys.readouterr().err
    assert all(f"checkpoints/step_0000000{n} has no readable manifest.json" in err for n in (7, 9)), err
    assert "evaluating step_00000002" in err

    shutil.rmtree(checkpoints / "step_00000007"), shutil.rmtree(checkpoints / "step_00000009")
    assert checkpoint_of(run, "latest") == checkpoints / "step_00000002"
    assert "note" not in capsys.readouterr().err
    # A checkpoint completed between the listing and the look at later steps (a run still saving, read in a loop)
    # is not damaged: "no readable manifest.json" was said of it.
    from trainer.checkpoint.store import Checkpointer

    listed = Checkpointer.complete

    def completed_after_the_listing(self):
        done = listed(self)
        if not hasattr(completed_after_the_listing, "listed"):
            completed_after_the_listing.listed = True
            return [p for p in done if p.name != "step_00000004"]
        return done

    shutil.copytree(checkpoints / "step_00000002", checkpoints / "step_00000004")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(Checkpointer, "complete", completed_after_the_listing)
        assert checkpoint_of(run, "latest") == checkpoints / "step_00000002"
    assert "no readable manifest" not in capsys.readouterr().err


def test_sample_redacts_a_secret_from_the_command_line_or_config_yaml(runs, tmp_path):
    run = copy_of(runs, "lm", tmp_path)
    r = run_here("sample", str(run), "task.sample_prompt=${oc.env:MY_API_TOKEN}", cwd=tmp_path,
                 env={"MY_API_TOKEN": SECRET})
    assert r.returncode == 0, r.stderr
    assert SECRET not in r.stdout + r.stderr and "<redacted>" in r.stdout

    text = (run / "config.yaml").read_text().replace("sample_prompt: 'def '", "sample_prompt: ${oc.env:MY_API_TOKEN}")
    assert "MY_API_TOKEN" in text
    (run / "config.yaml").write_text(text)
    r = run_here("sample", str(run), cwd=tmp_path, env={"MY_API_TOKEN": SECRET})
    assert r.returncode == 0, r.stderr
    assert SECRET not in r.stdout + r.stderr and "<redacted>" in r.stdout


def test_eval_redacts_a_secret_that_config_yaml_holds(runs, tmp_path):
    """A config.yaml written by hand may hold a secret under a secret key; eval's messages never show it."""
    run = copy_of(runs, "lm", tmp_path)
    (run / "config.yaml").write_text((run / "config.yaml").read_text().replace("progress: 'off'", f"progress: {SECRET}")
                                     + f"hf_token: {SECRET}\n")
    r = run_here("eval", str(run), cwd=tmp_path)
    assert_clean_error(r, "<redacted>")
    assert SECRET not in r.stdout + r.stderr
