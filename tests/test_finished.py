"""A finished run, used: `trainer.load(RUN_DIR)`, `python -m trainer eval RUN_DIR` (any checkpoint, any world
size) and `python -m trainer sample RUN_DIR`."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from conftest import SHARED, load_weights, read_metrics, run_cli, run_here, run_main, tiny_overrides
from test_errors import assert_clean_error


def test_load_gives_the_model_with_its_final_or_ema_weights(reference):
    import trainer

    for ema, name in ((False, "model.safetensors"), (True, "model_ema.safetensors")):
        model = trainer.load(reference, ema=ema)
        assert not model.training
        weights = load_weights(reference / name)
        assert all(torch.equal(model.state_dict()[k], weights[k]) for k in weights)


def test_a_load_closes_the_files_it_read(reference):
    """Each trainer.load left its files to the collector: a ResourceWarning (unclosed file) per file read, an error
    under pytest -W error."""
    import gc
    import warnings

    import trainer

    gc.collect()  # (what earlier tests of this process left is theirs)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.load(reference)
        trainer.load(reference, checkpoint="latest")
        gc.collect()
    assert not [str(w.message) for w in seen if issubclass(w.category, ResourceWarning)]


def test_load_of_a_checkpoint_gives_its_model_with_its_weights_or_its_ema(reference, tmp_path):
    """Lightning's load_from_checkpoint: trainer.load(RUN_DIR, checkpoint=latest|best|PATH), or a checkpoint's own
    path. It refused a checkpoint, so a run stopped before its export, or its best step, had no model to load."""
    import shutil

    import trainer
    from trainer.errors import CheckpointError, ConfigError

    final, ema = load_weights(reference / "model.safetensors"), load_weights(reference / "model_ema.safetensors")
    step_8 = reference / "checkpoints" / "step_00000008"
    for model, weights in ((trainer.load(reference, checkpoint="latest"), final),  # (the final step's: 12)
                           (trainer.load(reference, checkpoint="latest", ema=True), ema)):
        assert not model.training
        assert model.state_dict().keys() == weights.keys()
        assert all(torch.equal(model.state_dict()[k], weights[k]) for k in weights)
    # Another step's: its own weights, as resuming from it would load them.
    earlier = trainer.load(step_8).state_dict()
    assert earlier.keys() == trainer.load(reference, checkpoint=str(step_8)).state_dict().keys()
    assert not all(torch.equal(earlier[k], final[k]) for k in final)
    from safetensors import safe_open

    with safe_open(str(step_8 / "model.safetensors"), "pt") as f:
        assert all(torch.equal(earlier[k], f.get_tensor(k)) for k in f.keys())
    # A checkpoint copied out of its run still loads: it holds its own config.yaml.
    shutil.copytree(step_8, tmp_path / "copied")
    copied = trainer.load(tmp_path / "copied").state_dict()
    assert all(torch.equal(copied[k], earlier[k]) for k in earlier)
    with pytest.raises(ConfigError, match="has no checkpoints/best.json"):
        trainer.load(reference, checkpoint="best")
    with pytest.raises(ConfigError, match="reads a checkpoint whole"):
        trainer.load(step_8, device_map="auto")
    with pytest.raises(ConfigError, match=r"checkpoint=8\): expected 'latest', 'best'"):
        trainer.load(reference, checkpoint=8)
    # Damaged: refused by its sha256, never loaded.
    bad = tmp_path / "damaged"
    shutil.copytree(step_8, bad)
    data = bytearray((bad / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (bad / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256 does not match"):
        trainer.load(bad)
    # A save cut off (no manifest yet) is named as such (it was taken for a run dir without an export).
    cut = tmp_path / "run" / "checkpoints" / "step_00000008"
    shutil.copytree(step_8, cut)
    (cut / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="has no manifest.json: it is incomplete"):
        trainer.load(cut)
    with pytest.raises(ConfigError, match="step_00000099 is not a directory. Pass a run dir, or the path of one"):
        trainer.load(reference / "checkpoints" / "step_00000099")  # (not the reader's advice about resume=)
    # A loop of one's own records no model config: said so, with the ways it does load.
    rt = trainer.Runtime()
    layer = torch.nn.Linear(2, 2)
    rt.setup(layer, torch.optim.SGD(layer.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match=r"a checkpoint of a loop of one's own \(rt.save_state\) records none"):
        trainer.load(rt.save_state(tmp_path / "own", 1))


def test_exported_weights_changed_since_the_run_wrote_them_are_refused_by_every_reader(reference, tmp_path):
    """A flipped byte inside model.safetensors loaded silently through trainer.load, device_map and
    finetune.weights, although export.json records every file's sha256."""
    import shutil

    import trainer
    from trainer.errors import CheckpointError
    from trainer.models.pretrained import open_weights

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    data = bytearray((run / "model.safetensors").read_bytes())
    data[-3] ^= 0x10  # a bit of the last tensor's last element: the header still checks out
    (run / "model.safetensors").write_bytes(bytes(data))
    needle = "is not the file its run wrote"
    with pytest.raises(CheckpointError, match=needle):
        trainer.load(run)
    with pytest.raises(CheckpointError, match=needle):
        trainer.load(run, device_map="auto")
    with pytest.raises(CheckpointError, match=needle):
        open_weights(run)
    assert trainer.load(run, ema=True).training is False  # model_ema.safetensors is intact: it loads
    # A damaged export.json is no record to check against, not the absence of one: those weights loaded unchecked.
    record = (run / "export.json").read_bytes()
    for damaged in (record[:50], b'{"files": []}', json.dumps({"files": {"model.safetensors": {"sha256": 7}}}).encode()):
        (run / "export.json").write_bytes(damaged)
        with pytest.raises(CheckpointError, match=r"export\.json is damaged .* cannot be checked against it"):
            trainer.load(run)
        with pytest.raises(CheckpointError, match="is damaged"):
            trainer.load(run, device_map="auto")
    # A record from before the digests ({"step", "names"}) has nothing to check against: read as it is.
    (run / "export.json").write_text(json.dumps({"step": 12, "names": ["model", "model_ema"]}))
    assert trainer.load(run).training is False
    # No record in a run dir: the export was cut off before its record, written last (a kill during the export
    # loaded its files without a word, and said the run's EMA had been off). Refused as no export yet.
    (run / "export.json").unlink()
    for ema in (False, True):
        with pytest.raises(CheckpointError, match="has no export yet .*an export cut off.* newest checkpoint is"):
            trainer.load(run, ema=ema)
    # A directory of one's own (no run_info.json, no checkpoints/): no record to check against, read as it is.
    mine = tmp_path / "mine"
    mine.mkdir()
    for name in ("config.yaml", "model.safetensors", "model_config.json"):
        shutil.copy(reference / name, mine / name)
    assert trainer.load(mine).training is False


def test_load_after_the_models_own_code_changed_says_so(tmp_path, monkeypatch):
    """A model class of one's own, changed after the run (another layer size): trainer.load called the export
    damaged and said to rewrite it with resume=auto, which fails the same way; the code is named now."""
    import sys

    import trainer

    model_code = "import torch\n\nclass Net(torch.nn.Sequential):\n    def __init__(self):\n        super().__init__(" \
                 "torch.nn.Linear(2, {}), torch.nn.Linear({}, 1))\n"
    (tmp_path / "changing_net.py").write_text(model_code.format(8, 8))
    monkeypatch.syspath_prepend(str(tmp_path))
    from conftest import ROOT

    run = tmp_path / "run"
    r = run_here("--config-dir", str(ROOT / "tests" / "conf"), "recipe=classify", "model._target_=changing_net.Net",
                 "~model.hidden", "data._target_=own_mistakes.points", "task.loss=torch.nn.MSELoss", "trainer.max_steps=2",
                 f"hydra.run.dir={run}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    (tmp_path / "changing_net.py").write_text(model_code.format(16, 16))  # (the class, edited since)
    sys.modules.pop("changing_net", None)
    from trainer.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"Either the code of changing_net\.Net, which builds it, changed since the run"):
        trainer.load(run)
    sys.modules.pop("changing_net", None)


def test_load_refuses_a_model_config_that_runs_code(reference, tmp_path):
    import shutil

    import trainer
    from trainer.errors import ConfigError

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    (run / "model_config.json").write_text(json.dumps({"_target_": "os.system", "command": f"touch {tmp_path}/x"}))
    with pytest.raises(ConfigError, match="refused"):
        trainer.load(run)
    assert not (tmp_path / "x").exists()


def test_a_secret_the_run_recorded_redacted_is_named_not_rebuilt_as_the_mark(reference, tmp_path):
    """A value the run wrote as <redacted> (a secret is never written down) is refused where eval, sample and load
    would build something with it, naming the key and how to give it again; given again, it is built."""
    import shutil

    import yaml

    import trainer
    from trainer.errors import ConfigError
    from trainer.inference.finished import config_of, load_task
    from trainer.redaction import REDACTED

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["task"]["sample_prompt"] = REDACTED  # what a prompt equal to a secret's value is recorded as
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match=r"records task\.sample_prompt as <redacted>.*command line \(KEY=VALUE"):
        config_of(run, [])
    assert config_of(run, ["task.sample_prompt=abc"]).task.sample_prompt == "abc"
    with pytest.raises(ConfigError, match=r"records task\.sample_prompt as <redacted>.*task\.KEY=VALUE"):
        load_task(run)
    assert load_task(run, {"sample_prompt": "abc"}).sample_prompt == "abc"
    model_config = json.loads((run / "model_config.json").read_text())
    (run / "model_config.json").write_text(json.dumps({**model_config, "dropout": f"x{REDACTED}"}))
    with pytest.raises(ConfigError, match=r"records model\.dropout as <redacted>.*load the run's weights"):
        trainer.load(run)


def test_eval_reports_the_final_checkpoints_metrics(reference, capsys):
    from trainer.entry.commands import evaluate

    assert evaluate([str(reference)]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    final = read_metrics(reference)[-1]
    assert got["step"] == 12 and got["checkpoint"].endswith("step_00000012")
    for key in ("val/loss", "val/bpb", "val_ema/loss"):
        assert got[key] == pytest.approx(final[key], abs=1e-9), key


def test_eval_of_a_run_still_training_takes_the_next_newest_when_its_pick_is_pruned(reference, capsys, monkeypatch):
    """The run's keep_last pruned the checkpoint eval had picked before eval read it: the eval stopped with "does not
    exist ... Pass resume=auto, resume=null", advice for training. It picks the newest again."""
    import trainer.inference.finished as finished
    from trainer.entry.commands import evaluate

    real, picks = finished.checkpoint_of, []

    def pruned_first(run_dir, which="latest"):
        picks.append(which)
        return reference / "checkpoints" / "step_00000010" if len(picks) == 1 else real(run_dir, which)

    monkeypatch.setattr(finished, "checkpoint_of", pruned_first)
    assert evaluate([str(reference)]) == 0
    out, err = capsys.readouterr()
    assert f"note: {reference / 'checkpoints' / 'step_00000010'} was pruned by the run" in err
    assert json.loads(out.strip().splitlines()[-1])["step"] == 12 and picks == ["latest", "latest"]
    monkeypatch.setattr(finished, "checkpoint_of", lambda run_dir, which: reference / "checkpoints" / "step_00000010")
    assert evaluate([str(reference), f"checkpoint={reference / 'checkpoints' / 'step_00000010'}"]) == 2
    assert "was removed while this eval started: the run is still training" in capsys.readouterr().err


def test_eval_reports_a_failed_worker_once_without_the_launchers_traceback(reference, capsys, monkeypatch):
    """A worker of a several-process eval that fails: its own message, its exit code, no traceback."""
    from trainer.entry import launcher
    from trainer.entry.commands import evaluate

    def fails(cfg, run_dir, entry):
        raise launcher.WorkerFailed(1, 3, "error: non-finite loss on rank 1")

    monkeypatch.setattr(launcher, "run", fails)
    for switch in ("TRAINER_DEBUG", "HYDRA_FULL_ERROR"):
        monkeypatch.delenv(switch, raising=False)
    assert evaluate([str(reference)]) == 3
    err = capsys.readouterr().err
    assert err.strip() == "error: non-finite loss on rank 1"

    monkeypatch.setattr(launcher, "run", lambda *a, **k: (_ for _ in ()).throw(launcher.WorkerFailed(0, -15, "Signal 15")))
    assert evaluate([str(reference)]) == 1
    assert capsys.readouterr().err.startswith("error: worker rank 0 failed:\nSignal 15")


def test_eval_of_a_damaged_newest_checkpoint_names_the_runs_other_checkpoints(reference, tmp_path):
    """resume=auto falls back from a damaged newest checkpoint by itself; `eval RUN` (on any number of processes),
    `sample RUN checkpoint=latest` and trainer.load(checkpoint=
    "latest") read the one they are told and stopped at the refusal, leaving the user to find that step_8 was intact.
    They name them."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    newest = run / "checkpoints" / "step_00000012"
    tensors = sorted(newest.rglob("*.safetensors"))[0]
    data = bytearray(tensors.read_bytes())
    data[-3] ^= 0x10
    tensors.write_bytes(bytes(data))
    hint = f"The run's other complete checkpoints: step_00000008; pass one as checkpoint={run / 'checkpoints' / 'step_00000008'}."
    assert_clean_error(run_here("eval", str(run)), hint)
    # (on two processes the refusal is a worker's, which came back without the hint)
    assert_clean_error(run_cli("eval", str(run), "world=ddp", "world.nproc_per_node=2", timeout=120), hint)
    assert_clean_error(run_here("sample", str(run), "checkpoint=latest"), hint)
    import trainer
    from trainer.errors import CheckpointError

    with pytest.raises(CheckpointError) as e:  # (trainer.load from Python alike)
        trainer.load(run, checkpoint="latest")
    assert str(e.value).endswith(hint)


@pytest.mark.slow
def test_eval_on_two_processes_of_another_checkpoint_with_other_eval_settings(reference, corpus, tmp_path):
    """checkpoint=PATH (step 8), 2 ranks, the first 20 val samples: equal to one process's eval of the same."""
    from trainer.entry.commands import evaluate

    step8 = reference / "checkpoints" / "step_00000008"
    r = run_cli("eval", str(reference), f"checkpoint={step8}", "world=ddp", "world.nproc_per_node=2",
                "data.batch_size=4", "trainer.eval_samples=20")
    assert r.returncode == 0, r.stderr
    two = json.loads(r.stdout.strip().splitlines()[-1])
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        evaluate([str(reference), f"checkpoint={step8}", "trainer.eval_samples=20"])
    one = json.loads(buf.getvalue().strip().splitlines()[-1])
    assert two["step"] == one["step"] == 8
    assert two["val/loss"] == pytest.approx(one["val/loss"], rel=1e-6)
    assert two["val_ema/loss"] == pytest.approx(one["val_ema/loss"], rel=1e-6)


def test_eval_mistakes_are_one_paragraph(reference, tmp_path):
    from test_errors import assert_clean_error

    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    for args, needle in ((["eval"], "usage: python -m trainer eval RUN_DIR"),
                         (["eval", str(tmp_path)], "is not a run dir"),
                         (["eval", str(reference), "checkpoint=best"], "no checkpoints/best.json"),
                         (["eval", str(reference), "trainer.nosuch=1"], "nosuch"),
                         # (config.yaml held the task's copy of data.seq_len resolved, so the check passed and the
                         # model's forward raised a traceback)
                         (["eval", str(reference), "data.seq_len=64"], "model.seq_len=32 is shorter than "
                                                                        "data.seq_len=64"),
                         (["eval", str(reference), "data.seq_len=64", "device_map=auto"],
                          "to evaluate a trained model, data.seq_len=32 (or less)"),
                         (["eval", str(reference), "checkpoint=/no/such/step"], "checkpoint=/no/such/step is not a "
                                                                                 "directory. Pass checkpoint=latest"),
                         # (not the advice for a script of one's own run as one process)
                         (["eval", str(reference), "world=ddp", "world.tp=2"],
                          "Change world.tp or world.nproc_per_node."),
                         # (a run's saved config takes overrides without the schema's types: tracebacks before)
                         (["eval", str(reference), "ema=false"], "ema=False is invalid: expected the `ema` settings"),
                         (["eval", str(reference), "trainer.eval_batch_size=abc"],
                          "trainer.eval_batch_size: Value 'abc' of type 'str' could not be converted to Integer"),
                         (["sample", str(reference), "ema=maybe"], "ema=maybe is not true or false"),
                         (["sample", str(reference), "show_map=perhaps"], "show_map=perhaps is not true or false"),
                         # (were a TypeError, an IndexError and an AttributeError from inside the sampling)
                         (["sample", str(reference), "task.temperature=abc"], "task.temperature='abc' is invalid: expected a number"),
                         (["sample", str(reference), "task.top_k=0"], "task.top_k=0 is not an integer >= 1 or null"),
                         (["sample", str(reference), "task.sample_prompt=123"], "task.sample_prompt=123 is not text"),
                         # (a reshape of 0 elements; in training, at the first eval's sample, after its steps)
                         (["sample", str(reference), "task.sample_prompt=''", "task.sample_tokens=5"],
                          "task.sample_prompt is empty: the model continues a prompt"),
                         # an output path that cannot be a file, refused before the sampling (an IsADirectoryError
                         # traceback after it)
                         (["sample", str(reference), f"out={tmp_path}"], f"out={tmp_path}: {tmp_path} is a directory"),
                         # a file sample would replace with a PNG: the run's export (then not loadable), a file of
                         # the user's that is no image (was overwritten, exit 0)
                         (["sample", str(reference), f"out={reference / 'model.safetensors'}"],
                          "that file is the run's own"),
                         (["sample", str(reference), f"out={notes}"], "that file exists and is not a PNG image"),
                         # a place no file can be made in, even by root (whom the permission bits let through: a
                         # PermissionError traceback after the sampling)
                         (["sample", str(reference), "out=/proc/x.png"], "out=/proc/x.png: "),
                         (["tune", "lr", "debug=smoke", "save=/proc/lr.txt"], "save=/proc/lr.txt: "),
                         # (only the wrong one is named: the valid task.sample_tokens=5 was listed with it)
                         (["sample", str(reference), "task.sample_tokens=5", "world.threads=1"],
                          "task.KEY=VALUE, not world.threads=1. Usage")):
        r = (run_here if "world.tp=2" in args else run_main)(*args, cwd=tmp_path)  # (that one builds the Trainer)
        assert_clean_error(r, needle)
        assert "This script runs as one process" not in r.stderr
    assert notes.read_text() == "mine"


def test_a_missing_task_state_that_the_export_lists_is_one_paragraph(diffusion_reference, tmp_path):
    """The diffusion task's normaliser is exported as task_state.safetensors; without it `sample` ended in the
    task's own RuntimeError (a traceback, exit 1)."""
    import shutil

    from test_errors import assert_clean_error

    run = tmp_path / "run"
    shutil.copytree(diffusion_reference, run)
    (run / "task_state.safetensors").unlink()
    assert_clean_error(run_main("sample", str(run), cwd=tmp_path), f"{run / 'task_state.safetensors'} is missing, "
                       "and the run's export lists it")
    # (a TypeError from inside the sampling; training checks the same key's type before it starts)
    assert_clean_error(run_main("sample", str(diffusion_reference), "task.num_samples=abc", cwd=tmp_path),
                       "task.num_samples='abc' is invalid: expected an integer")
    # (a negative count sampled nothing and exited 0)
    assert_clean_error(run_main("sample", str(diffusion_reference), "task.num_samples=-1", cwd=tmp_path),
                       "task.num_samples=-1 must be an integer >= 0")
    # (eval reads a checkpoint, which holds the task's state itself)
    assert run_main("eval", str(run), cwd=tmp_path).returncode == 0


def test_a_run_without_an_export_yet_says_so_not_to_delete_an_export_json_it_lacks(corpus, tmp_path):
    """A run stopped before it finished has checkpoints and no export: the advice was to delete its export.json
    (there is none) and rerun, which trains the rest of the run."""
    from conftest import run_here
    from test_errors import assert_clean_error

    import trainer
    from trainer.errors import CheckpointError

    run = tmp_path / "run"
    r = run_here(*tiny_overrides(corpus, "trainer.max_steps=2", "checkpoint.every_n_steps=1",
                                 "checkpoint.save_final=false"), f"hydra.run.dir={run}")
    assert r.returncode == 0, r.stderr
    for name in ("export.json", "model_config.json", "model.safetensors"):  # (as a run stopped at step 2 of many)
        (run / name).unlink()
    says = (f"{run} has no export yet", f"its newest checkpoint is {run / 'checkpoints' / 'step_00000002'}",
            f"python -m trainer eval {run}")
    assert_clean_error(run_main("sample", str(run), cwd=tmp_path), *says)
    with pytest.raises(CheckpointError, match="has no export yet"):
        trainer.load(run)


def test_a_checkpoint_given_for_a_run_dir_is_named_as_one_and_never_written_over(reference, corpus, tmp_path):
    """A checkpoint holds a config.yaml too: `sample CKPT` was told to rerun training with hydra.run.dir=CKPT
    resume=auto, which trained a new run inside the checkpoint and broke it."""
    from test_errors import assert_clean_error

    from trainer.errors import ConfigError
    from trainer.inference.finished import config_yaml

    ckpt = sorted((reference / "checkpoints").glob("step_*"))[-1]
    before = {f.name: f.read_bytes() for f in ckpt.iterdir()}
    with pytest.raises(ConfigError, match=f"is a checkpoint of the run {reference}, not a run dir"):
        config_yaml(ckpt)  # (what sample and eval read a run dir with; trainer.load(ckpt) loads the checkpoint)
    assert_clean_error(run_main("sample", str(ckpt), cwd=tmp_path), f"eval {reference} checkpoint={ckpt}")
    assert_clean_error(run_main(*tiny_overrides(corpus), f"hydra.run.dir={ckpt}", "resume=auto", cwd=tmp_path),
                       f"hydra.run.dir={ckpt} is a checkpoint of the run {reference}",
                       f"hydra.run.dir={reference} resume={ckpt}")
    # The run's checkpoints dir itself (or a dir in it): a fresh start of that run moved it aside, a live run's files
    # with it.
    for inside in (reference / "checkpoints", reference / "checkpoints" / "mine"):
        assert_clean_error(run_main(*tiny_overrides(corpus), f"hydra.run.dir={inside}", cwd=tmp_path),
                           f"hydra.run.dir={inside} is inside the checkpoints of the run {reference}")
    assert not (reference / "checkpoints" / "mine").exists()
    assert {f.name: f.read_bytes() for f in ckpt.iterdir()} == before


def test_sample_writes_the_grid_from_the_ema_weights_and_needs_nothing_else(diffusion_reference, tmp_path):
    """And replaces a PNG an earlier sample wrote, but no other: it replaced any PNG (another run's training
    images, a picture of one's own). A samples/ it cannot write is one paragraph (a traceback)."""
    import shutil

    from test_errors import assert_clean_error

    out, own = tmp_path / "grid.png", tmp_path / "photo.png"
    for _ in range(2):  # (the second replaces the first's)
        r = run_main("sample", str(diffusion_reference), f"out={out}", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
    assert f"image: {out}" in r.stdout
    png = out.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) > (8, 8)
    trained = sorted((diffusion_reference / "samples").glob("step_*.png"))[0]  # another run's training image
    for path in (own, tmp_path / trained.name):
        shutil.copyfile(trained, path)
        assert_clean_error(run_main("sample", str(diffusion_reference), f"out={path}", cwd=tmp_path),
                           "that PNG was not written by python -m trainer sample")
        assert path.read_bytes() == trained.read_bytes()
    run = tmp_path / "run"
    shutil.copytree(diffusion_reference, run)
    shutil.rmtree(run / "samples")
    (run / "samples").write_text("a file where the samples go")
    r = run_main("sample", str(run), cwd=tmp_path)
    assert r.returncode == 74 and r.stderr.startswith("error: the sample image could not be written to"), r.stderr
    assert "Traceback" not in r.stderr and f"sample {run} out=PATH.png" in r.stderr


def test_sample_replaces_an_earlier_sample_under_the_run_dir_but_never_a_training_image(diffusion_reference, tmp_path):
    """`sample RUN out=RUN/samples/mine.png` a second time was refused as "the run's own" file (sample without out=
    replaces samples/sample.png every time); a training eval's image there is the run's, and is refused."""
    import json
    import shutil

    from test_errors import assert_clean_error

    run = tmp_path / "run"
    shutil.copytree(diffusion_reference, run)
    for _ in range(2):
        r = run_main("sample", str(run), f"out={run / 'samples' / 'mine.png'}", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
    trained = next(json.loads(line)["image"] for line in (run / "samples.jsonl").read_text().splitlines()
                   if "image" in json.loads(line))
    before = (run / trained).read_bytes()
    assert_clean_error(run_main("sample", str(run), f"out={run / trained}", cwd=tmp_path), "that file is the run's own")
    assert (run / trained).read_bytes() == before


def test_sample_of_a_checkpoint_equals_the_exports_and_works_on_a_run_not_finished(diffusion_reference, reference,
                                                                                  tmp_path):
    """`sample RUN checkpoint=latest|best|PATH`, as eval takes it: the final checkpoint's grid and metrics are the
    export's, byte for byte (its EMA weights and its task state, the data normaliser, by default); a run with no
    export yet (still training, or preempted) samples from its checkpoints, and an earlier checkpoint differs."""
    import shutil

    final = run_main("sample", str(diffusion_reference), f"out={tmp_path / 'export.png'}", cwd=tmp_path)
    assert final.returncode == 0, final.stderr
    run = tmp_path / "run"
    shutil.copytree(diffusion_reference, run)
    for name in [*json.loads((run / "export.json").read_text())["files"], "export.json"]:
        (run / name).unlink()  # (the run as it was before it finished: no export, no task_state.safetensors)
    assert not list(run.glob("model*.safetensors")) and not (run / "task_state.safetensors").exists()
    latest = run_main("sample", str(run), "checkpoint=latest", f"out={tmp_path / 'latest.png'}", cwd=tmp_path)
    assert latest.returncode == 0, latest.stderr
    assert (tmp_path / "latest.png").read_bytes() == (tmp_path / "export.png").read_bytes()
    assert latest.stdout.replace("latest.png", "export.png") == final.stdout
    first = sorted((run / "checkpoints").glob("step_*"))[0]
    earlier = run_main("sample", str(run), f"checkpoint={first}", cwd=tmp_path)
    assert earlier.returncode == 0, earlier.stderr
    grid = run / "samples" / f"sample_{first.name}.png"  # (by default beside the final weights' sample.png)
    assert f"image: {grid}" in earlier.stdout and grid.read_bytes() != (tmp_path / "export.png").read_bytes()
    if not torch.cuda.is_available():  # (torch's "not compiled with CUDA" once the weights were read)
        import trainer
        from trainer.errors import ConfigError

        with pytest.raises(ConfigError, match=r"trainer.load\(device='cuda'\) is invalid here: .* no CUDA device"):
            trainer.load(run, checkpoint="latest", device="cuda")
    import trainer
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError, match=r"trainer.load\(ema='false'\): expected True"):  # (loaded the EMA's)
        trainer.load(run, ema="false")
    named = run_main("sample", str(run), f"checkpoint={first.name}", f"out={tmp_path / 'named.png'}", cwd=tmp_path)
    assert named.returncode == 0 and (tmp_path / "named.png").read_bytes() == grid.read_bytes()  # (its name will do)
    assert_clean_error(run_main("sample", str(run), "checkpoint=latest", "device_map=auto", cwd=tmp_path),
                       "sample with device_map reads the run's export")
    assert_clean_error(run_main("sample", str(run), f"checkpoint={run / 'nope'}", cwd=tmp_path), str(run / "nope"))
    # Another run's checkpoint: sampled with this run's task and written over this run's sample_step_N.png (another
    # model's: a traceback, or its text printed as this run's). Another model is refused; the same model takes out=.
    before = {p: p.read_bytes() for p in (diffusion_reference / "samples").glob("*.png")}
    assert_clean_error(run_main("sample", str(diffusion_reference), f"checkpoint={first}", cwd=tmp_path),
                       f"checkpoint={first} is another run's ({run}): its sample would go into {diffusion_reference}")
    lm = sorted((reference / "checkpoints").glob("step_*"))[-1]
    assert_clean_error(run_main("sample", str(diffusion_reference), f"checkpoint={lm}", cwd=tmp_path),
                       f"is another run's ({reference}), whose model differs from {diffusion_reference}'s")
    assert {p: p.read_bytes() for p in (diffusion_reference / "samples").glob("*.png")} == before
    other = run_main("sample", str(diffusion_reference), f"checkpoint={first}", f"out={tmp_path / 'other.png'}",
                     cwd=tmp_path)
    assert other.returncode == 0 and (tmp_path / "other.png").read_bytes() == grid.read_bytes(), other.stderr
    # A run whose checkpoints/ is a link to another disk: its own checkpoints are its own.
    linked = tmp_path / "linked"
    linked.mkdir()
    for p in run.iterdir():
        if p.name != "checkpoints":
            (shutil.copytree if p.is_dir() else shutil.copy2)(p, linked / p.name)
    (linked / "checkpoints").symlink_to(run / "checkpoints")
    own = run_main("sample", str(linked), "checkpoint=latest", cwd=tmp_path)
    newest = sorted((run / "checkpoints").glob("step_*"))[-1].name
    assert own.returncode == 0, own.stderr
    assert (linked / "samples" / f"sample_{newest}.png").read_bytes() == (tmp_path / "latest.png").read_bytes()


def test_a_quoted_path_option_is_unquoted_as_hydra_unquotes_an_override(diffusion_reference, tmp_path):
    """`sample RUN "out='DIR/q.png'"` wrote into a folder named `'` under the current directory (and `config
    "outputs='/scratch'"`, `tune ... "save='...'"` and `offload_dir=` kept the quotes too); `out=''` wrote a file
    named `''`."""
    from trainer.config.machine import render
    from trainer.inference.device_map import cli_options

    out = tmp_path / "my grid.png"
    r = run_main("sample", str(diffusion_reference), f"out='{out}'", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and sorted(p.name for p in tmp_path.iterdir()) == [out.name]
    assert_clean_error(run_main("sample", str(diffusion_reference), "out=''", cwd=tmp_path), "out='' is empty")
    assert f"{tmp_path}/runs/${{now:%Y-%m-%d}}" in render([f'outputs="{tmp_path}/runs"'])
    assert cli_options(["offload_dir='/tmp/a b'", "x=1"]) == ({"offload_dir": "/tmp/a b"}, ["x=1"])


def test_load_of_a_run_continued_past_its_export_says_the_weights_are_the_export_s(reference, tmp_path, capsys):
    """A finished run continued with a larger max_steps and stopped before it finished again: trainer.load, sample
    and eval device_map=... read the earlier finish's export without a word, while `eval RUN` evaluated the newer
    checkpoint."""
    import shutil

    import trainer

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    exported = json.loads((run / "export.json").read_text())["step"]
    newest = sorted((run / "checkpoints").glob("step_*"))[-1]
    shutil.copytree(newest, run / "checkpoints" / f"step_{exported + 10:08d}")  # (the continuation's checkpoint)
    trainer.load(run)
    assert (f"note: {run}'s export is of step {exported}, and the run has a checkpoint of step {exported + 10} since"
            in capsys.readouterr().err)
    trainer.load(reference)  # (a run whose export is its newest: nothing said)
    assert "note:" not in capsys.readouterr().err


def test_sample_prints_the_lm_text(corpus, tmp_path):
    """The run's task settings by default, task.KEY=VALUE to change them (task.seed: another draw); a run whose task samples nothing
    (debug=smoke: task.sample_tokens=0) says so and how to ask for text; a key the task lacks is an error."""
    from trainer import compose, train

    train(compose(tiny_overrides(corpus, "trainer.max_steps=2", "task.sample_tokens=30")), tmp_path / "run")
    r = run_main("sample", str(tmp_path / "run"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("def ") and len(r.stdout.strip()) >= 30
    longer = run_main("sample", str(tmp_path / "run"), "task.sample_tokens=60", cwd=tmp_path)
    assert longer.stdout.startswith(r.stdout.strip()[:30]) and len(longer.stdout.strip()) > len(r.stdout.strip())
    # Another draw of the sampler (its seed was fixed at 0: one sample per temperature), and the same one again.
    seeded = [run_main("sample", str(tmp_path / "run"), f"task.seed={seed}", cwd=tmp_path).stdout for seed in (0, 7, 7)]
    assert seeded[0] == r.stdout and seeded[1] == seeded[2] != seeded[0]
    none = run_main("sample", str(tmp_path / "run"), "task.sample_tokens=0", cwd=tmp_path)
    assert none.returncode == 0 and not none.stdout and "task.sample_tokens=200" in none.stderr
    assert "the task sampled nothing: task.sample_tokens=0 asks for no output" in none.stderr
    # A run whose own config samples nothing names that, not another key given (task.temperature=0 was blamed).
    train(compose(tiny_overrides(corpus, "trainer.max_steps=1", "task.sample_tokens=0")), tmp_path / "quiet")
    quiet = run_main("sample", str(tmp_path / "quiet"), "task.temperature=0", cwd=tmp_path)
    assert quiet.returncode == 0 and "task.temperature" not in quiet.stderr
    assert f"task.sample_tokens=0 (in {tmp_path / 'quiet' / 'config.yaml'}) asks for no output" in quiet.stderr
    bad = run_main("sample", str(tmp_path / "run"), "task.sample_tokenz=5", cwd=tmp_path)
    assert bad.returncode == 2 and "task.sample_tokenz" in bad.stderr and "Did you mean sample_tokens?" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_a_hugging_face_model_gets_its_config_json(corpus, tmp_path):
    """A model with `config.save_pretrained` (Hugging Face's): the export writes config.json beside the weights,
    so `from_pretrained(RUN_DIR)` finds both. (transformers is not installed here: a stand-in model.)"""
    from trainer import compose, train

    train(compose(tiny_overrides(corpus, "trainer.max_steps=2", "model._target_=hf_like.HFLike")), tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "hf-like"
    assert SHARED  # (the shared schedule is not needed here)


OLD_PATHS = {"trainer.parallel.precision.": "trainer.precision.", "trainer.parallel.": "trainer.strategies.",
             "trainer.loop.schedule.": "trainer.schedule."}


def test_a_run_dir_written_before_the_modules_moved_still_loads_and_compares_equal(reference, tmp_path):
    """Run dirs saved `_target_: trainer.precision.BF16` before trainer's modules became packages: reading one
    upgrades its paths, so load works and resume=auto's comparison sees no changed setting."""
    import shutil

    import yaml
    from omegaconf import OmegaConf

    import trainer
    from trainer.checkpoint.settings import changed_settings, read_config

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    new_text = (run / "config.yaml").read_text()
    old_text = new_text
    for new, old in OLD_PATHS.items():
        old_text = old_text.replace(f": {new}", f": {old}")
    assert old_text.count("trainer.precision.") == 1 and old_text.count("trainer.strategies.") == 1
    (run / "config.yaml").write_text(old_text)
    assert read_config(run / "config.yaml") == yaml.safe_load(new_text)
    # A resume compares this job's config with the checkpoint's copy: a changed _target_ would refuse it.
    step = sorted((run / "checkpoints").glob("step_*"))[-1]
    (step / "config.yaml").write_text(old_text)
    assert changed_settings(step, OmegaConf.create(new_text)) == []
    model, weights = trainer.load(run), load_weights(reference / "model.safetensors")
    assert all(torch.equal(model.state_dict()[k], weights[k]) for k in weights)


def test_a_config_naming_a_moved_path_is_told_the_new_one(tmp_path):
    r = run_main("debug=smoke", "precision._target_=trainer.precision.BF16", f"hydra.run.dir={tmp_path / 'run'}",
                 cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.startswith("error: precision._target_='trainer.precision.BF16' moved to "
                               "'trainer.parallel.precision.BF16'"), r.stderr
    assert not (tmp_path / "run").exists()


def test_eval_from_another_directory_does_not_read_another_file_at_the_runs_relative_data_path(corpus, tmp_path):
    """A run trained on data.path=corpus.txt (relative), evaluated from a directory holding another corpus.txt:
    eval read that file and printed its numbers as the run's. Now it is refused naming the file the run read; from
    the run's directory, or given the path absolutely, it evaluates the run's data. The same for data.val_path (the
    file an eval reads), and for a file changed in place at the run's own absolute path (by its fingerprint)."""
    from conftest import run_here
    from test_errors import assert_clean_error

    here, elsewhere, run = tmp_path / "here", tmp_path / "elsewhere", tmp_path / "run"
    here.mkdir()
    elsewhere.mkdir()
    for d, text in ((here, corpus.read_bytes()), (elsewhere, corpus.read_bytes()[::-1])):
        (d / "corpus.txt").write_bytes(text)
        (d / "val.txt").write_bytes(text[:3000])
    overrides = [a for a in tiny_overrides(corpus) if not a.startswith("data.path=")]
    assert run_here(*overrides, "data.path=corpus.txt", f"hydra.run.dir={run}", cwd=here).returncode == 0
    ours = run_here("eval", str(run), cwd=here)
    assert ours.returncode == 0, ours.stderr
    r = run_here("eval", str(run), cwd=elsewhere)
    assert_clean_error(r, f"data.path=corpus.txt is a relative path: the run read {here / 'corpus.txt'}",
                       f"started in {elsewhere}, would read them from here", f"Pass data.path={here / 'corpus.txt'}")
    given = run_here("eval", str(run), f"data.path={here / 'corpus.txt'}", cwd=elsewhere)
    assert given.returncode == 0, given.stderr
    assert json.loads(given.stdout.splitlines()[-1]) == json.loads(ours.stdout.splitlines()[-1])
    # The same path given on purpose is evaluated as named, not refused again.
    other = run_here("eval", str(run), "data.path=corpus.txt", cwd=elsewhere)
    assert other.returncode == 0, other.stderr
    assert json.loads(other.stdout.splitlines()[-1])["val/loss"] != json.loads(ours.stdout.splitlines()[-1])["val/loss"]

    (here / "corpus.txt").write_bytes(corpus.read_bytes()[:-1000])  # changed in place, where the run read it
    assert_clean_error(run_here("eval", str(run), cwd=here), "is not what", "or the file changed since")
    val_run = tmp_path / "val_run"
    stream = [a for a in overrides if not a.startswith("data=")] + ["data=text_stream"]
    assert run_here(*stream, "data.path=corpus.txt", "data.val_path=val.txt", f"hydra.run.dir={val_run}",
                    cwd=here).returncode == 0
    # Each relative one named at once: the advice followed for the first alone read the other from here, unchecked.
    assert_clean_error(run_here("eval", str(val_run), cwd=elsewhere),
                       "data.path=corpus.txt and data.val_path=val.txt are relative paths",
                       f"Pass data.path={here / 'corpus.txt'} data.val_path={here / 'val.txt'}")
    both = run_here("eval", str(val_run), f"data.path={here / 'corpus.txt'}", f"data.val_path={here / 'val.txt'}",
                    cwd=elsewhere)
    assert both.returncode == 0, both.stderr
    assert json.loads(both.stdout.splitlines()[-1])["val/loss"] == \
        json.loads(run_here("eval", str(val_run), cwd=here).stdout.splitlines()[-1])["val/loss"]


def test_sample_refuses_a_run_trained_on_a_tokenizers_ids_as_training_does(reference, tmp_path):
    """A run of data=hf_text with data.tokenizer: the lm task samples bytes, so `sample` printed garbage (its ids
    decoded as bytes, its prompt encoded as bytes) with exit 0; training refuses task.sample_tokens>0 there."""
    import shutil

    import yaml
    from conftest import run_here
    from test_errors import assert_clean_error

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["data"]["tokenizer"] = "tokenizer.json"  # (what an hf_text run records; its tensors are the same shapes)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    r = run_here("sample", str(run), "task.sample_tokens=20")
    assert_clean_error(r, "was trained on token ids of data.tokenizer='tokenizer.json'", "decodes its samples",
                       "python -m trainer eval")
    assert not (run / "samples").exists()


def test_eval_of_a_run_without_a_val_split_says_so(corpus, tmp_path):
    """A stream without data.val_path printed {"checkpoint": ..., "step": 20} and nothing else: no metric, no why."""
    from conftest import run_here

    overrides = [a for a in tiny_overrides(corpus) if not a.startswith("data=")]
    assert run_here(*overrides, "data=text_stream", f"hydra.run.dir={tmp_path}").returncode == 0
    r = run_here("eval", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "note: the run's data has no val split" in r.stderr and "data.val_path=FILE" in r.stderr
    given = run_here("eval", str(tmp_path), f"data.val_path={corpus}")
    assert "val/loss" in json.loads(given.stdout.splitlines()[-1]) and "no val split" not in given.stderr
    # Data whose val split is a fraction of it (data=text, data=hf_text): that setting, not a val_path it lacks.
    assert run_here(*tiny_overrides(corpus, "data.val_fraction=0"), f"hydra.run.dir={tmp_path / 'b'}").returncode == 0
    r = run_here("eval", str(tmp_path / "b"))
    assert "name one with data.val_fraction=F" in r.stderr and "val_path" not in r.stderr


def test_eval_of_a_run_finished_without_a_final_checkpoint_says_which_step_it_evaluates(corpus, tmp_path):
    """checkpoint.save_final=false, 4 steps, checkpoints every 3: eval (checkpoint=latest, "for a finished run the
    final one") evaluated step 3 without a word, while the run's export and last eval are of step 4."""
    run = tmp_path / "run"
    r = run_here(*tiny_overrides(corpus, "trainer.max_steps=4", "checkpoint.every_n_steps=3",
                                 "checkpoint.save_final=false"), f"hydra.run.dir={run}")
    assert r.returncode == 0, r.stderr
    r = run_main("eval", str(run), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "newest checkpoint is step_00000003, before its final step 4 (checkpoint.save_final=false)" in r.stderr
    assert f"python -m trainer eval {run} device_map=auto" in r.stderr


def test_load_refuses_what_is_not_a_path():
    """trainer.load(None) or load(5) was a TypeError from pathlib, load("") loaded whatever run the current directory
    held, and offload_dir=5 a TypeError from the placement."""
    import trainer
    from trainer.errors import ConfigError

    for kwargs in ({"run_dir": None}, {"run_dir": 5}, {"run_dir": ""}, {"run_dir": "RUN", "offload_dir": 5}):
        with pytest.raises(ConfigError, match=r"trainer.load\((run_dir|offload_dir)=.*expected a path"):
            trainer.load(**kwargs)


def test_sample_of_a_text_task_says_out_was_not_written(reference, tmp_path):
    """`sample LM_RUN out=x.png` printed the text and wrote nothing, without a word: out= is where an image goes."""
    r = run_main("sample", str(reference), "out=x.png", "task.sample_tokens=5", "task.sample_prompt=ab", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    assert "note: out=x.png was not written: out= is where an image sample goes" in r.stderr
    assert not (tmp_path / "x.png").exists()


def test_sample_out_of_another_format_is_refused_before_sampling(diffusion_reference, reference, tmp_path):
    """`sample RUN out=x.jpg` wrote PNG bytes under a .jpg name (viewers that trust the suffix refuse it); out=x.txt of
    a text task printed the text and wrote nothing. Both are one paragraph now, before the model is loaded."""
    from test_errors import assert_clean_error

    for run, out in ((diffusion_reference, "x.jpg"), (diffusion_reference, "grid"), (reference, "x.txt")):
        assert_clean_error(run_main("sample", str(run), f"out={out}", cwd=tmp_path),
                           f"out={out}: out= is where an image sample goes, and it is written as a PNG",
                           "python -m trainer sample RUN_DIR > FILE")
    assert list(tmp_path.iterdir()) == []
    r = run_main("sample", str(diffusion_reference), "out=Grid.PNG", cwd=tmp_path)  # (the suffix in any case)
    assert r.returncode == 0 and (tmp_path / "Grid.PNG").read_bytes()[:4] == b"\x89PNG", r.stderr
