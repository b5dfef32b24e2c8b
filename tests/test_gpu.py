"""On a CUDA device: what the CPU suite proves, proved again where the kernels, autocast, NCCL and the copies
between host and device differ. Skipped without a GPU (CI has none); on a machine with one:
`pytest -m gpu tests/test_gpu.py tests/test_nonfinite.py` (or benchmarks/gpu_check.sh, with the GPU figures).

Tolerances. fp32 runs on the CPU and on the GPU differ only in summation order (TF32 is off for matmuls unless a
user turns it on, which the first test checks): each operation's result moves by a few float32 ulps (~1e-7
relative), and 20 AdamW steps of the smoke model carry that into the loss at about 1e-6. `rel=1e-4` leaves two
orders of margin, while a real fault (a lost micro-batch, a missed loss scale, a step from the wrong weights)
moves the loss by 1e-2 or more. bf16 keeps 8 significant bits (2^-9 ~ 2e-3 relative rounding per element) and fp16
11 bits: their losses stay within a few parts in a thousand of fp32's over these steps, so `rel=2e-2` for both.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import (
    load_weights,
    read_metrics,
    run_cli,
    series,
    tiny_overrides,
    train_in_process,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# cuBLAS reads this when it creates its handle: set before any test of this process multiplies on the GPU, so
# that the deterministic-algorithms test below gets reproducible matmuls (docs: "Reproducibility").
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

CUDA, CPU = "world.device=cuda", "world.device=cpu"
FP32_REL, HALF_REL = 1e-4, 2e-2


def losses(events: list[dict]) -> list[float]:
    out = series(events, "train/loss")
    assert len(out) == 20, out  # every step of debug=smoke's 20 logged (log_every=1)
    return out


def test_fp32_on_cuda_trains_as_on_the_cpu(corpus, tmp_path):
    assert not torch.backends.cuda.matmul.allow_tf32  # else "fp32" matmuls would round to 10 bits on the GPU
    cpu = losses(train_in_process(corpus, tmp_path / "cpu", CPU))
    gpu = losses(train_in_process(corpus, tmp_path / "cuda", CUDA))
    assert gpu == pytest.approx(cpu, rel=FP32_REL)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_on_cuda_tracks_fp32_and_really_runs_in_half(corpus, tmp_path, precision):
    fp32 = losses(train_in_process(corpus, tmp_path / "fp32", CUDA))
    half = losses(train_in_process(corpus, tmp_path / precision, CUDA, f"precision={precision}"))
    assert half == pytest.approx(fp32, rel=HALF_REL)
    assert half != fp32  # identical losses would mean autocast never ran in 16 bits
    weights = load_weights(tmp_path / precision / "model.safetensors")
    assert {w.dtype for w in weights.values()} == {torch.float32}  # fp32 master weights, as exported


def test_the_lm_model_runs_flash_attention_in_bf16():
    """Under autocast to bf16 the GPT's attention is one that torch's flash kernel takes (causal, no mask, a
    head size it supports): with only that kernel allowed, a model it could not take raises."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from trainer.recipes.lm.model import GPT

    model = GPT(vocab_size=256, seq_len=128, n_layer=2, n_head=4, d_model=256).cuda()
    idx = torch.randint(0, 256, (4, 128), device="cuda")
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(idx)
    logits.float().logsumexp(-1).mean().backward()
    assert model.tok_emb.weight.grad is not None and torch.isfinite(model.tok_emb.weight.grad).all()


def stop_and_resume(corpus, tmp_path, first: str, then: str, *extra: str) -> tuple[Path, Path]:
    """20 steps on `first` with a checkpoint at step 10 (the same schedule as any 20-step run), and a second run
    dir that resumes that checkpoint on `then` and trains steps 11 to 20: (the uninterrupted dir, the resumed)."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    train_in_process(corpus, whole, first, "checkpoint.every_n_steps=10", *extra)
    train_in_process(corpus, resumed, then, *extra, f"resume={whole / 'checkpoints' / 'step_00000010'}")
    return whole, resumed


def test_a_run_moves_from_the_gpu_to_the_cpu_mid_way_and_trains_as_if_it_had_stayed(corpus, tmp_path):
    """A checkpoint written on CUDA (async: copied to host memory at the step, written by a thread) resumes on
    the CPU: the model, AdamW's moments and the RNG all cross, so steps 11-20 match the run that stayed."""
    stayed, moved = stop_and_resume(corpus, tmp_path, CUDA, CPU)
    assert series(read_metrics(moved), "train/loss") == pytest.approx(losses(read_metrics(stayed))[10:],
                                                                      rel=FP32_REL)


def test_resume_on_cuda_is_bit_identical_under_deterministic_algorithms(corpus, tmp_path):
    """With torch's deterministic algorithms on (what a user asks for to get bitwise reproducibility on a GPU),
    steps 11-20 resumed from the step-10 checkpoint give the same losses and final weights, EMA's too, as the
    run that went on. An op without a deterministic CUDA kernel raises here instead of passing by luck."""
    torch.use_deterministic_algorithms(True)
    try:
        whole, resumed = stop_and_resume(corpus, tmp_path, CUDA, CUDA, "ema.enabled=true", "ema.decay=0.9")
    finally:
        torch.use_deterministic_algorithms(False)
    assert series(read_metrics(resumed), "train/loss") == losses(read_metrics(whole))[10:]
    for name in ("model.safetensors", "model_ema.safetensors"):
        a, b = load_weights(resumed / name), load_weights(whole / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


@pytest.mark.parametrize("world", ["ddp", "fsdp"])
def test_a_launched_worker_trains_on_the_gpu_as_a_single_process_does(corpus, tmp_path, world):
    """One worker through the launcher: forked from its forkserver (which must not have touched CUDA, or the
    child's first CUDA call fails), NCCL initialised, the model wrapped by DDP or sharded by FSDP2."""
    single = losses(train_in_process(corpus, tmp_path / "single", CUDA))
    r = run_cli(*tiny_overrides(corpus, CUDA, f"world={world}", "world.nproc_per_node=1"),
                f"hydra.run.dir={tmp_path / world}")
    assert r.returncode == 0, r.stderr
    assert losses(read_metrics(tmp_path / world)) == pytest.approx(single, rel=FP32_REL)


def test_compile_on_cuda_trains_as_eager(corpus, tmp_path):
    eager = losses(train_in_process(corpus, tmp_path / "eager", CUDA))
    compiled = losses(train_in_process(corpus, tmp_path / "compiled", CUDA, "trainer.compile=true"))
    assert compiled == pytest.approx(eager, rel=FP32_REL)  # inductor fuses in fp32: rounding moves, no more


def test_a_device_map_over_the_gpu_and_the_cpu_computes_what_the_cpu_alone_does(corpus, tmp_path):
    """Blocks 0 and 2 on the GPU, the rest on the CPU: each block's inputs are moved to it and the outputs come
    back to the input's device. fp32 on both sides: the logits match to summation order, and a sampled
    continuation (drawn on the CPU, where the head is) is the same."""
    import trainer

    run = tmp_path / "run"
    train_in_process(corpus, run, CPU, "model.n_layer=3", "trainer.max_steps=4")
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))

    def outputs(model):
        with torch.no_grad():
            return model(x), model.generate(x[:, :4], 12, generator=torch.Generator().manual_seed(1))

    logits, generated = outputs(trainer.load(run))
    model = trainer.load(run, device_map={"": "cpu", "blocks.0": 0, "blocks.2": 0})
    assert [model.device_map[f"blocks.{i}"] for i in range(3)] == ["cuda:0", "cpu", "cuda:0"]
    assert next(model.blocks[2].parameters()).device.type == "cuda"
    got_logits, got_generated = outputs(model)
    assert got_logits.device == x.device
    torch.testing.assert_close(got_logits, logits, rtol=FP32_REL, atol=1e-5)
    assert torch.equal(got_generated, generated)


def test_the_training_loader_hands_cuda_pinned_batches_equal_to_the_cpus():
    """With data.num_workers=0 the batches are cut in the process (no DataLoader's bookkeeping) and pinned, as a
    DataLoader's pin_memory=True left them: the same values as the CPU's, in page-locked memory."""
    from trainer.data.sampling import train_loader

    data = [(torch.full((3,), i), {"y": torch.tensor(i)}) for i in range(8)]
    sampler = [[0, 1], [2, 3], [4, 5]]
    on_cpu = list(train_loader(data, sampler, 0, torch.device("cpu"), 0))
    on_cuda = list(train_loader(data, sampler, 0, torch.device("cuda"), 0))
    assert len(on_cuda) == len(on_cpu) == 3
    for a, b in zip(on_cpu, on_cuda):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1]["y"], b[1]["y"])
        assert b[0].is_pinned() and b[1]["y"].is_pinned() and not a[0].is_pinned()
