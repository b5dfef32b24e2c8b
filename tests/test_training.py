"""The training loop's contracts, in-process on CPU: learning, accumulation, determinism, precision."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import load_weights, read_metrics, series, train_in_process

TIMING = ("train/tokens_per_s", "train/samples_per_s", "train/step_time_ms", "train/mfu", "train/peak_mem_mb")


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_each_precision_learns(corpus, tmp_path, precision):
    events = train_in_process(corpus, tmp_path, f"precision={precision}", "trainer.max_steps=40",
                              "optim.lr=3e-3")
    loss = series(events, "train/loss")
    assert len(loss) == 40 and all(math.isfinite(x) for x in loss)
    # Byte-level uniform guess is ln(256) = 5.55 nats; a working loop gets well below within 40 steps.
    assert loss[0] > 5.0
    assert sum(loss[-5:]) / 5 < loss[0] - 1.5


def test_accumulation_equals_big_batch(corpus, tmp_path):
    """k micro-batches of b must be one batch of k*b: same losses, same final weights (fp32)."""
    big = train_in_process(corpus, tmp_path / "big", "data.batch_size=8")
    acc = train_in_process(corpus, tmp_path / "acc", "data.batch_size=4", "trainer.grad_accum_steps=2")
    # fp32 sums in another order (2 micro-batches; the CPU's SIMD width): <= ~1e-6 relative per step, 20 steps.
    assert series(acc, "train/loss") == pytest.approx(series(big, "train/loss"), rel=20 * 1e-6)
    wa, wb = load_weights(tmp_path / "acc" / "model.safetensors"), load_weights(tmp_path / "big" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)


def test_same_seed_same_metrics(corpus, tmp_path):
    a = train_in_process(corpus, tmp_path / "a", "trainer.seed=3", "trainer.eval_every=10")
    b = train_in_process(corpus, tmp_path / "b", "trainer.seed=3", "trainer.eval_every=10")
    strip = lambda events: [{k: v for k, v in e.items() if k not in TIMING} for e in events]  # noqa: E731
    assert strip(a) == strip(b)
    c = train_in_process(corpus, tmp_path / "c", "trainer.seed=4")
    assert series(c, "train/loss") != series(a, "train/loss")


def test_schedule_steps_once_per_optimizer_step(corpus, tmp_path):
    """With accumulation the LR follows optimizer steps, not micro-batches."""
    events = train_in_process(corpus, tmp_path, "trainer.grad_accum_steps=3", "trainer.max_steps=10",
                              "scheduler=cosine", "scheduler.warmup_steps=4", "scheduler.min_lr_ratio=0.1",
                              "optim.lr=1e-3")
    lrs = series(events, "train/lr")
    from trainer.loop.schedule import WarmupCosine

    f = WarmupCosine(total_steps=10, warmup_steps=4, min_lr_ratio=0.1)
    # Optimizer step s (1-based) uses the rate after s - 1 scheduler steps, f(s - 1): what train/lr logs.
    assert lrs == pytest.approx([1e-3 * f(s) for s in range(0, 10)])


def test_fp16_skipped_steps_are_counted_and_do_not_advance_the_schedule(corpus, tmp_path):
    # A huge initial loss scale overflows the first steps: the scaler halves it and skips each one.
    events = train_in_process(corpus, tmp_path, "precision=fp16", "precision.init_scale=1e30",
                              "trainer.max_steps=30", "scheduler=constant", "scheduler.warmup_steps=10",
                              "optim.lr=1e-3")
    skipped = int(series(events, "train/skipped_steps")[-1])
    assert skipped >= 3
    lrs, skips = series(events, "train/lr"), [0, *series(events, "train/skipped_steps")]
    # The warmup advanced only on real updates: step s used the rate after the updates applied before it.
    updates_before = [(s - 1) - skips[s - 1] for s in range(1, 31)]
    assert lrs == pytest.approx([1e-3 * min(1.0, (u + 1) / 10) for u in updates_before])
    assert lrs[skipped - 1] == pytest.approx(1e-3 * 1 / 10)  # still at the first warmup value


def test_eval_reports_loss_and_bits_per_byte(corpus, tmp_path):
    events = train_in_process(corpus, tmp_path, "trainer.eval_every=10", "trainer.max_steps=20")
    evals = [e for e in events if "val/loss" in e]
    assert [e["step"] for e in evals] == [10, 20]
    for e in evals:
        assert e["val/bpb"] == pytest.approx(e["val/loss"] / math.log(2))


def test_final_weights_load_into_the_model(corpus, tmp_path):
    import json

    from hydra.utils import instantiate

    train_in_process(corpus, tmp_path)
    weights = load_weights(tmp_path / "model.safetensors")
    model_cfg = json.loads((tmp_path / "model_config.json").read_text())
    model = instantiate(model_cfg)
    assert set(weights) == set(model.state_dict())
    model.load_state_dict(weights)
    assert read_metrics(tmp_path)[-1]["step"] == 20


def test_compile_mode_and_options_reach_both_torch_compile_calls(corpus, tmp_path, monkeypatch):
    """trainer.compile_options (nested keys flattened, as inductor names them) and trainer.compile_mode are what
    torch.compile gets, for the model and for the task's loss alike."""
    import torch

    calls = []

    def recording(fn, **kwargs):  # (eager: what is compiled is not this test's concern)
        calls.append(kwargs)
        return fn

    monkeypatch.setattr(torch, "compile", recording)
    train_in_process(corpus, tmp_path / "options", "trainer.max_steps=1", "trainer.compile=true",
                     "+trainer.compile_options.coordinate_descent_tuning=true",
                     "+trainer.compile_options.triton.cudagraphs=false", "+trainer.compile_options.cpu_gpu_bw=50",
                     "+trainer.compile_options.post_grad_fusion_options={batch_linear_post_grad:{}}")
    # (an int given to a float option is a float; an option whose value is a dict keeps it whole)
    options = {"coordinate_descent_tuning": True, "triton.cudagraphs": False, "cpu_gpu_bw": 50.0,
               "post_grad_fusion_options": {"batch_linear_post_grad": {}}}
    assert calls == [{"backend": "inductor", "mode": None, "options": options}] * 2
    calls.clear()
    train_in_process(corpus, tmp_path / "mode", "trainer.max_steps=1", "trainer.compile=true",
                     "trainer.compile_mode=max-autotune-no-cudagraphs")
    assert calls == [{"backend": "inductor", "mode": "max-autotune-no-cudagraphs", "options": None}] * 2


def test_compile_trains_and_saves_the_plain_module(corpus, tmp_path):
    """The model and the task's loss compiled as one graph (so inductor can fuse the loss into the model's last
    layer), training as eager does; the checkpoint holds the plain module."""
    # aot_eager traces and runs the graph as torch.compile does, without inductor's C++ build (40 s on
    # 2 cores); the Trainer's part, compiling the wrapped model and saving the plain one, is the same. The backend
    # registered here is aot_eager, recording the graphs dynamo hands it.
    from torch._dynamo import register_backend
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    graphs = []

    def recording(gm, example_inputs):
        graphs.append({str(node.target) for node in gm.graph.nodes})
        return aot_autograd(fw_compiler=boxed_nop)(gm, example_inputs)

    register_backend(recording, name="test_recording")
    eager = train_in_process(corpus, tmp_path / "eager", "trainer.max_steps=3")
    compiled = train_in_process(corpus, tmp_path / "compiled", "trainer.max_steps=3", "trainer.compile=true",
                                "trainer.compile_backend=test_recording")
    assert series(compiled, "train/loss") == pytest.approx(series(eager, "train/loss"), rel=1e-4)
    # With activation checkpointing too (torch's composable checkpoint failed under compile: its recomputation did
    # not match the compiled forward).
    recomputed = train_in_process(corpus, tmp_path / "recomputed", "trainer.max_steps=3", "trainer.compile=true",
                                  "trainer.compile_backend=aot_eager", "trainer.activation_checkpointing=true")
    assert series(recomputed, "train/loss") == pytest.approx(series(eager, "train/loss"), rel=1e-4)
    # One graph holds both the attention and the cross-entropy (a graph break between them would split it).
    assert any("cross_entropy" in " ".join(g) and "scaled_dot_product_attention" in " ".join(g) for g in graphs), graphs
    weights = load_weights(tmp_path / "compiled" / "model.safetensors")
    assert not any(k.startswith("_orig_mod") for k in weights)
    assert weights.keys() == load_weights(tmp_path / "eager" / "model.safetensors").keys()


def test_text_data_from_a_directory_or_a_glob(tmp_path):
    """data=text takes a directory (every file under it, sorted) or a glob, concatenated with newlines."""
    import numpy as np

    from trainer.recipes.lm.data import text_file

    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "b.txt").write_bytes(b"second " * 50)
    (docs / "a.txt").write_bytes(b"first " * 50)
    (docs / "sub" / "c.md").write_bytes(b"third " * 50)
    (docs / ".hidden").write_bytes(b"never")
    whole = b"first " * 50 + b"\n" + b"second " * 50 + b"\n" + b"third " * 50
    for path, expected in ((docs, whole), (f"{docs}/*.txt", whole[: 300 + 1 + 350])):
        train, val = text_file(str(path), seq_len=16, cache_dir=str(tmp_path / "cache"), val_fraction=0.1)
        got = np.fromfile(train.path, dtype=np.uint8).tobytes() + np.fromfile(val.path, dtype=np.uint8).tobytes()
        assert got == expected
    events = train_in_process(docs, tmp_path / "run", "trainer.max_steps=3")
    assert len(series(events, "train/loss")) == 3
