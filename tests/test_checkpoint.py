"""Checkpoints with real processes and real signals: exact resume, corruption, pickle, preemption, elastic."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from conftest import ROOT, load_weights, read_metrics, run_cli, series, tiny_overrides, train_in_process

pytestmark = pytest.mark.slow

STEPS = ("trainer.max_steps=16", "checkpoint.every_n_steps=4", "checkpoint.keep_last=2", "trainer.eval_samples=32")
FAULTY_ENV = {"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}


def faulty(action: str, at_call: int, rank: int = 0, first_attempt_only: bool = False) -> list[str]:
    return ["task._target_=faulty.Faulty", f"+task.action={action}", f"+task.at_call={at_call}",
            f"+task.rank={rank}", f"+task.first_attempt_only={first_attempt_only}"]


def assert_identical(run_dir: Path, ref_dir: Path) -> None:
    """Bitwise: the same loss stream (every step logged once) and the same final weights."""
    got, ref = read_metrics(run_dir), read_metrics(ref_dir)
    assert [e["step"] for e in got] == [e["step"] for e in ref]
    assert series(got, "train/loss") == series(ref, "train/loss")
    assert series(got, "val/loss") == series(ref, "val/loss")
    wa, wb = load_weights(run_dir / "model.safetensors"), load_weights(ref_dir / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ref")
    train_in_process(corpus, run_dir, *STEPS)
    return run_dir


@pytest.mark.parametrize(("kill_call", "workers"), [(7, 0), (14, 2)])
def test_sigkill_then_resume_auto_is_bit_identical(corpus, tmp_path, reference, kill_call, workers):
    args = [*tiny_overrides(corpus, *STEPS, f"data.num_workers={workers}"), f"hydra.run.dir={tmp_path}"]
    r = run_cli(*args, *faulty("sigkill", kill_call), env=FAULTY_ENV)
    assert r.returncode == -9  # really killed mid-step, no chance to clean up
    r = run_cli(*args, "resume=auto")
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stdout
    assert_identical(tmp_path, reference)


def test_keep_last_and_a_finished_run(corpus, tmp_path, reference):
    ckpts = sorted(p.name for p in (reference / "checkpoints").iterdir())
    assert ckpts == ["step_00000012", "step_00000016"]
    manifest = json.loads((reference / "checkpoints" / "step_00000016" / "manifest.json").read_text())
    assert set(manifest["files"]) == {"model.safetensors", "state.safetensors", "state.json", "config.yaml"}
    # Resuming a finished run says so and exits 0; raising max_steps continues it.
    shutil.copytree(reference, tmp_path, dirs_exist_ok=True)
    args = [*tiny_overrides(corpus, *STEPS), f"hydra.run.dir={tmp_path}", "resume=auto"]
    r = run_cli(*args)
    assert r.returncode == 0 and "already finished" in r.stdout
    r = run_cli(*args, "trainer.max_steps=20")
    assert r.returncode == 0, r.stderr
    assert [e["step"] for e in read_metrics(tmp_path) if "train/loss" in e] == list(range(1, 21))


def test_corrupt_newest_checkpoint_falls_back_on_auto_and_fails_on_path(corpus, tmp_path, reference):
    args = [*tiny_overrides(corpus, *STEPS), f"hydra.run.dir={tmp_path}"]
    r = run_cli(*args, *faulty("sigkill", 15), env=FAULTY_ENV)  # dies in step 15: checkpoints 8 and 12 exist
    assert r.returncode == -9
    bad = tmp_path / "checkpoints" / "step_00000012" / "state.safetensors"
    bad.write_bytes(bad.read_bytes()[:-100])  # truncated
    r = run_cli(*args, f"resume={bad.parent}")
    assert r.returncode == 2 and str(bad) in r.stderr and "Traceback" not in r.stderr
    r = run_cli(*args, "resume=auto")
    assert r.returncode == 0, r.stderr
    assert str(bad) in r.stdout and "step_00000008" in r.stdout  # says what it skipped and used
    assert_identical(tmp_path, reference)


def test_a_pickle_payload_in_a_checkpoint_never_runs(corpus, tmp_path, reference):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference / "checkpoints" / "step_00000012", ckpt)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    from trainer.checkpoint import sha256

    for name in ("model.safetensors", "state.safetensors"):  # the attacker also rewrites the checksums
        (ckpt / name).write_bytes(pickle.dumps({"x": Payload()}))
        manifest["files"][name] = sha256(ckpt / name)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    r = run_cli(*tiny_overrides(corpus, *STEPS), f"hydra.run.dir={tmp_path / 'run'}", f"resume={ckpt}")
    assert r.returncode == 2 and "not a valid trainer checkpoint" in r.stderr
    assert not marker.exists()
    assert pickle.loads(pickle.dumps(Payload())) is None and marker.exists()  # the payload was live


def test_resume_refuses_a_different_model_or_data_order(corpus, tmp_path, reference):
    ckpt = reference / "checkpoints" / "step_00000012"
    base = [*tiny_overrides(corpus, *STEPS), f"hydra.run.dir={tmp_path}", f"resume={ckpt}"]
    r = run_cli(*base, "model.d_model=32")
    assert r.returncode == 2
    assert "tok_emb.weight: checkpoint (256, 64) vs model (256, 32)" in r.stderr
    assert "blocks.0.mlp.0.weight: checkpoint (256, 64) vs model (128, 32)" in r.stderr
    r = run_cli(*base, "trainer.seed=5")
    assert r.returncode == 2 and "data order" in r.stderr and "trainer.seed" in r.stderr


def test_sigterm_saves_a_checkpoint_and_resume_continues_exactly(corpus, tmp_path, reference):
    args = [*tiny_overrides(corpus, *STEPS), f"hydra.run.dir={tmp_path}"]
    r = run_cli(*args, *faulty("sigterm", 6), env=FAULTY_ENV)
    assert r.returncode == 75, r.stderr
    assert "resume=auto" in r.stderr
    assert (tmp_path / "checkpoints" / "step_00000006" / "manifest.json").exists()  # step 6 finished first
    r = run_cli(*args, "resume=auto")
    assert r.returncode == 0, r.stderr
    assert_identical(tmp_path, reference)


@pytest.fixture(scope="module")
def ddp_reference(corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ddp_ref")
    r = run_cli(*tiny_overrides(corpus, *STEPS, "world=ddp", "world.nproc_per_node=2"), f"hydra.run.dir={run_dir}")
    assert r.returncode == 0, r.stderr
    return run_dir


def test_ddp_preemption_of_one_rank_then_resume_is_exact(corpus, tmp_path, ddp_reference):
    args = [*tiny_overrides(corpus, *STEPS, "world=ddp", "world.nproc_per_node=2"), f"hydra.run.dir={tmp_path}"]
    r = run_cli(*args, *faulty("sigusr1", 10, rank=1), env=FAULTY_ENV)  # only rank 1 gets the signal
    assert r.returncode == 75, r.stderr
    assert (tmp_path / "checkpoints" / "step_00000010").exists()
    r = run_cli(*args, "resume=auto")
    assert r.returncode == 0, r.stderr
    assert_identical(tmp_path, ddp_reference)


def test_sigterm_to_the_launcher_stops_workers_with_a_checkpoint(corpus, tmp_path, ddp_reference):
    args = [*tiny_overrides(corpus, *STEPS, "world=ddp", "world.nproc_per_node=2"), f"hydra.run.dir={tmp_path}"]
    r = run_cli(*args, *faulty("sigterm_parent", 9, rank=0), env=FAULTY_ENV)
    assert r.returncode == 75, r.stderr
    assert any((p / "manifest.json").exists() for p in (tmp_path / "checkpoints").glob("step_*"))
    r = run_cli(*args, "resume=auto")
    assert r.returncode == 0, r.stderr
    assert_identical(tmp_path, ddp_reference)


def test_elastic_restart_after_a_rank_dies_ends_with_the_same_weights(corpus, tmp_path, ddp_reference):
    args = [*tiny_overrides(corpus, *STEPS, "world=ddp", "world.nproc_per_node=2", "world.max_restarts=1"),
            f"hydra.run.dir={tmp_path}"]
    r = run_cli(*args, *faulty("sigkill", 11, rank=1, first_attempt_only=True), env=FAULTY_ENV)
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stdout
    assert_identical(tmp_path, ddp_reference)


def test_two_process_checkpoint_resumes_on_one_process(corpus, tmp_path, ddp_reference):
    """Same global batch (2 x 4 = 1 x 8): the 1-process run continues the same sample stream."""
    args = [*tiny_overrides(corpus, *STEPS, "world=ddp", "world.nproc_per_node=2"), f"hydra.run.dir={tmp_path}"]
    r = run_cli(*args, *faulty("sigkill", 15, rank=1), env=FAULTY_ENV)
    assert r.returncode != 0
    r = run_cli(*tiny_overrides(corpus, *STEPS, "data.batch_size=8"), f"hydra.run.dir={tmp_path}", "resume=auto")
    assert r.returncode == 0, r.stderr
    got, ref = read_metrics(tmp_path), read_metrics(ddp_reference)
    assert series(got, "train/loss") == pytest.approx(series(ref, "train/loss"), rel=1e-5, abs=1e-5)


def test_export_shards_above_the_size_limit(corpus, tmp_path):
    train_in_process(corpus, tmp_path, "trainer.max_steps=2", "checkpoint.max_shard_mb=0.1")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    merged = {}
    for s in shards:
        merged.update(load_weights(tmp_path / s))
    assert set(merged) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in merged.values())
    assert not (tmp_path / "model.safetensors").exists()
