"""The diffusion recipe through the framework: world size is a performance knob for it too (its noise is
per sample), a killed run resumes bit-identically, the normaliser is fitted once and shared, samples
are PNG grids and metrics, and the export is enough to sample from."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from conftest import (
    DIFFUSION,
    FAULTY_ENV,
    assert_identical,
    checkpoints,
    faulty,
    load_weights,
    read_metrics,
    run_cli,
    series,
)

pytestmark = pytest.mark.slow



def run(run_dir: Path, *extra: str, env: dict | None = None, code: int = 0):
    r = run_cli(*DIFFUSION, *extra, f"hydra.run.dir={run_dir}", env=env)
    assert r.returncode == code, r.stderr
    return r


def test_two_ranks_draw_the_same_noise_as_one_and_share_one_normaliser(tmp_path, diffusion_reference):
    """DDP 2 x 8 = 1 x 16: the same losses (noise and times are a function of each image's place in the
    global sample stream, not of the process). Weights: Adam turns the rounding noise of gradients that
    are zero in exact arithmetic (conv biases that a per-channel GroupNorm removes) into full-size steps,
    so a few such biases drift by up to ~lr/4; every weight that matters agrees to 1e-4.

    The normaliser is fitted once, on the main process, and read from its file by the other rank (the
    task records, per rank, which it did and a hash of the statistics it ended with)."""
    run(tmp_path, "world=ddp", "world.nproc_per_node=2", "data.batch_size=8",
        "task._target_=recording.RecordingDiffusion", f"+task.log={tmp_path / 'fits'}", env=FAULTY_ENV)
    fits = sorted((tmp_path / "fits").read_text().splitlines())
    assert [line.split()[:2] for line in fits] == [["rank0", "fitted"], ["rank1", "loaded"]]
    assert len({line.split()[2] for line in fits}) == 1  # the same statistics on both ranks
    got, ref = read_metrics(tmp_path), read_metrics(diffusion_reference)
    for key in ("train/loss", "val/loss", "val_ema/loss", "val_ema/nn_distance"):
        assert series(got, key) == pytest.approx(series(ref, key), rel=1e-5, abs=1e-5), key
    wa, wb = load_weights(tmp_path / "model.safetensors"), load_weights(diffusion_reference / "model.safetensors")
    for k in wb:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-4 if not k.endswith("bias") else 2e-3)


def test_sigkill_then_resume_auto_is_bit_identical(tmp_path, diffusion_reference):
    r = run(tmp_path, "data.batch_size=16", "checkpoint.async_save=false",
            *faulty("sigkill", 11), "+task.base=trainer.recipes.diffusion.task.Diffusion", env=FAULTY_ENV, code=-9)
    assert r.returncode == -9 and checkpoints(tmp_path)[-1] == "step_00000008"
    run(tmp_path, "data.batch_size=16", "resume=auto")
    assert_identical(tmp_path, diffusion_reference)


def test_samples_are_png_grids_and_metrics_and_the_export_is_enough_to_sample(diffusion_reference):
    ref = diffusion_reference
    samples = [json.loads(line) for line in (ref / "samples.jsonl").read_text().splitlines()]
    assert [s["image"] for s in samples] == ["samples/step_6.png", "samples/step_12.png"]
    png = (ref / "samples" / "step_12.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert (width, height) > (8, 8)
    last = read_metrics(ref)[-1]
    assert {"val/loss", "val_ema/loss", "val_ema/nn_distance", "val_ema/class_coverage"} <= set(last)
    # Everything sampling needs is beside the weights: the model config, the EMA weights, the normaliser.
    from hydra.utils import instantiate
    from safetensors.torch import load_file

    from trainer.recipes.diffusion.task import Diffusion

    model = instantiate(json.loads((ref / "model_config.json").read_text()))
    model.load_state_dict(load_file(str(ref / "model_ema.safetensors")))
    task = Diffusion(num_samples=10, sample_steps=4)
    task.load_state_dict(load_file(str(ref / "task_state.safetensors")))
    grid = task.sample(model.eval(), torch.device("cpu"))["image"]
    assert grid.dtype == torch.uint8 and grid.dim() == 2
    state = load_file(str(ref / "task_state.safetensors"))
    assert torch.equal(state["normalizer.mean"], load_file(str(ref / "normalizer.safetensors"))["mean"])


@pytest.mark.parametrize(("path", "needle"), [("nope.csv.gz", "does not exist"), ("bad.csv", "fields")])
def test_a_missing_or_malformed_data_file_is_one_paragraph(tmp_path, path, needle):
    (tmp_path / "bad.csv").write_text("1,2,3\n")
    r = run_cli(*DIFFUSION, f"data.path={tmp_path / path}", "hydra.run.dir=run", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: data.path=") and needle in r.stderr
    assert not (tmp_path / "run").exists()
