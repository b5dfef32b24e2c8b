"""The diffusion recipe through the framework: world size is a performance knob for it too (its noise is
per sample), a killed run resumes bit-identically, the normaliser is fitted once and shared, samples
are PNG grids and metrics, and the export is enough to sample from."""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

import pytest
import torch
import yaml
from conftest import (
    DIFFUSION,
    FAULTY_ENV,
    assert_identical,
    checkpoints,
    faulty,
    load_weights,
    read_metrics,
    run_cli,
    run_here,
    series,
)

from trainer.loop.schedule import WarmupCosine

pytestmark = pytest.mark.slow



def run(run_dir: Path, *extra: str, env: dict | None = None, code: int = 0, here: bool = False):
    """The diffusion command in a subprocess, or with `here` in this process (a run that ends by itself)."""
    r = (run_here if here else run_cli)(*DIFFUSION, *extra, f"hydra.run.dir={run_dir}", env=env)
    assert r.returncode == code, r.stderr
    return r


def adam_drift_bound(lrs: list[float], betas: tuple[float, float]) -> float:
    """How far apart one weight can end in two Adam(W) runs from the same weights, whatever their gradients.

    Step t moves a weight by lr_t * m_hat / (sqrt(v_hat) + eps), and Cauchy-Schwarz on m's and v's sums
    gives |m_hat| / sqrt(v_hat) <= a_t below (~1 for betas (0.9, 0.95)); two runs can step in opposite
    directions. eps only shortens steps, and decoupled weight decay shrinks any gap."""
    b1, b2 = betas
    bound = 0.0
    for t, lr in enumerate(lrs, 1):
        a_t = ((1 - b1) / math.sqrt(1 - b2) * math.sqrt(sum((b1 * b1 / b2) ** k for k in range(t)))
               * math.sqrt(1 - b2**t) / (1 - b1**t))
        bound += 2 * lr * a_t
    return bound


def test_two_ranks_draw_the_same_noise_as_one_and_share_one_normaliser(tmp_path, diffusion_reference):
    """DDP 2 x 8 = 1 x 16: the same losses (noise and times are a function of each image's place in the
    global sample stream, not of the process).

    What may differ is fp32 rounding: 2 partial batches and an all-reduce, and kernels whose blocking
    follows the batch size and the CPU's SIMD width (AVX2, AVX-512), sum in other orders. That moves a
    step's loss by <= ~1e-6 relative (16 ulps), and the runs drift apart by at most that per step: 12 x
    1e-6 after 12 steps. (Measured on an AVX2 EPYC, also with ATen's SIMD, MKL's and oneDNN's ISA turned
    down: 3e-8 at the first logged step, 2e-6 at worst.) The weights cannot be compared that closely:
    Adam turns the rounding noise of a gradient that is ~0 (conv biases that a per-channel GroupNorm
    removes; single weights whose gradient cancels) into full-size steps of either sign, so such a weight
    can end anywhere within `adam_drift_bound` (0.06 here; measured up to 1.6e-3, on one weight 1.5e-4 or
    1.5e-3 depending on the SIMD width). The loss does not depend on those weights (their gradient is
    ~0): they move it at second order only, so the losses, val/loss after the last step included, are
    the check that the final weights agree where they matter.

    The normaliser is fitted once, on the main process, and the other rank gets it from rank 0 (the
    task records, per rank, whether it fitted it and a hash of the statistics it ended with)."""
    run(tmp_path, "world=ddp", "world.nproc_per_node=2", "data.batch_size=8",
        "task._target_=recording.RecordingDiffusion", f"+task.log={tmp_path / 'fits'}", env=FAULTY_ENV)
    fits = sorted((tmp_path / "fits").read_text().splitlines())
    assert [line.split()[:2] for line in fits] == [["rank0", "fitted"], ["rank1", "loaded"]]
    assert len({line.split()[2] for line in fits}) == 1  # the same statistics on both ranks
    got, ref = read_metrics(tmp_path), read_metrics(diffusion_reference)
    steps = 12  # DIFFUSION's trainer.max_steps
    for key in ("train/loss", "val/loss", "val_ema/loss", "val_ema/nn_distance"):
        assert series(got, key) == pytest.approx(series(ref, key), rel=steps * 1e-6), key
    cfg = yaml.safe_load((diffusion_reference / "config.yaml").read_text())
    shape = WarmupCosine(steps, cfg["scheduler"]["warmup_steps"], cfg["scheduler"]["min_lr_ratio"])
    bound = adam_drift_bound([cfg["optim"]["lr"] * shape(s) for s in range(steps)], cfg["optim"]["betas"])
    wa, wb = load_weights(tmp_path / "model.safetensors"), load_weights(diffusion_reference / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wb:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=bound)


def test_sigkill_then_resume_auto_is_bit_identical(tmp_path, diffusion_reference):
    r = run(tmp_path, "data.batch_size=16", "checkpoint.async_save=false",
            *faulty("sigkill", 11), "+task.base=trainer.recipes.diffusion.task.Diffusion", env=FAULTY_ENV, code=-9)
    assert r.returncode == -9 and checkpoints(tmp_path)[-1] == "step_00000008"
    run(tmp_path, "data.batch_size=16", "resume=auto", here=True)  # (the resume needs no signal)
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
    r = run_here(*DIFFUSION, f"data.path={tmp_path / path}", "hydra.run.dir=run", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: data.path=") and needle in r.stderr
    assert not (tmp_path / "run").exists()


def test_a_directory_where_the_normaliser_goes_is_one_paragraph(tmp_path):
    """normalizer.safetensors replaced by a directory: one paragraph naming it and what to do, exit 2, and no
    "to continue this run" command (it would fail the same way). Removed as told, the same command runs. And a
    refused resume leaves the record as it was."""
    run_dir = tmp_path / "run"
    args = (*DIFFUSION[:2], "checkpoint.every_n_steps=2", "trainer.eval_every=0", f"hydra.run.dir={run_dir}")
    assert run_here(*args, "trainer.max_steps=2").returncode == 0
    # A resume refused for other data (another val_fraction) leaves the record as it was (it was rewritten before).
    before = (run_dir / "normalizer.safetensors").read_bytes()
    r = run_here(*args, "trainer.max_steps=4", "data.val_fraction=0.3", "resume=auto")
    assert r.returncode == 2 and "Nothing in the run dir was changed" in r.stderr, r.stderr
    assert (run_dir / "normalizer.safetensors").read_bytes() == before
    (run_dir / "normalizer.safetensors").unlink()
    (run_dir / "normalizer.safetensors").mkdir()
    r = run_here(*args, "trainer.max_steps=4", "resume=auto")
    assert r.returncode == 2, r.stderr
    assert re.fullmatch(rf"error: [^\n]*{re.escape(str(run_dir / 'normalizer.safetensors'))} is a directory[^\n]*"
                        r"Remove it[^\n]*\n", r.stderr), r.stderr
    (run_dir / "normalizer.safetensors").rmdir()
    r = run_here(*args, "trainer.max_steps=4", "resume=auto")
    assert r.returncode == 0, r.stderr
