"""The non-finite guard's two ways of checking (`trainer.nonfinite_check`): every step, or at log steps
with the skip done on the device. Both must leave the same weights; `log` must not read the device
between log steps. Runs on the CPU by forcing `log`, which `auto` picks only on accelerators."""

from __future__ import annotations

import pytest
import torch
from conftest import load_weights, read_metrics, series, train_in_process

NAN_AT_STEP_6 = ("task._target_=faulty.Faulty", "+task.action=nan_once", "+task.at_call=6", "+task.rank=0")
# A constant schedule, so a 5-step run is exactly the first 5 steps of a 20-step one.
COMMON = ("scheduler=constant", "trainer.log_every=5", "checkpoint.every_n_steps=4")


@pytest.fixture
def trainers(monkeypatch) -> list:
    """Every Trainer whose fit() runs in this test, for a look at its state after the run."""
    from trainer.loop.trainer import Trainer

    seen, fit = [], Trainer.fit

    def recording_fit(self):
        seen.append(self)
        return fit(self)

    monkeypatch.setattr(Trainer, "fit", recording_fit)
    return seen


@pytest.mark.parametrize("check", ["step", "log"])
def test_a_nan_stops_with_the_weights_from_before_it(corpus, tmp_path, trainers, check):
    from trainer.errors import NonFiniteError

    # log: step 6's NaN is on the device only; the host sees it at the checkpoint due at step 8.
    # step: the loss itself is read, and named (faulty's NaN is the loss's).
    expected = "at step 6 on rank 0; that update and the 2 after it" if check == "log" else \
        r"non-finite loss \(nan\) at step 6 on rank 0; .* A sample of the batch or the loss function can make"
    with pytest.raises(NonFiniteError, match=expected):
        train_in_process(corpus, tmp_path / "nan", *COMMON, f"trainer.nonfinite_check={check}", *NAN_AT_STEP_6)
    train_in_process(corpus, tmp_path / "five", *COMMON, "trainer.max_steps=5")
    after_five = load_weights(tmp_path / "five" / "model.safetensors")
    stopped = trainers[0].raw_model.state_dict()
    assert stopped.keys() == after_five.keys()
    for k, v in after_five.items():
        assert torch.equal(stopped[k], v), k  # bit-identical: steps 6, 7 and 8 changed nothing
    # Nothing after the NaN was saved: the checkpoint due at step 8 never happened.
    assert [p.name for p in sorted((tmp_path / "nan" / "checkpoints").glob("step_*"))] == ["step_00000004"]
    assert [e["step"] for e in read_metrics(tmp_path / "nan")] == [5]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_log_check_trains_exactly_like_step_check(corpus, tmp_path, precision):
    by_step = train_in_process(corpus, tmp_path / "step", "trainer.nonfinite_check=step", f"precision={precision}")
    by_log = train_in_process(corpus, tmp_path / "log", "trainer.nonfinite_check=log", f"precision={precision}")
    assert series(by_log, "train/loss") == series(by_step, "train/loss")
    a, b = load_weights(tmp_path / "log" / "model.safetensors"), load_weights(tmp_path / "step" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in b)


READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


@pytest.mark.parametrize("check", ["step", "log"])
def test_log_check_reads_nothing_from_the_device_between_log_steps(corpus, tmp_path, trainers, monkeypatch, check):
    """Every Python-level read of a tensor's value, tagged with the step it happened in."""
    from trainer.data.sampling import GlobalBatchSampler
    from trainer.loop.trainer import Trainer

    reads: list[tuple[str, int]] = []  # (where, trainer.step at the time)
    phase = ["loop"]
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            if trainers:
                reads.append((phase[0], trainers[0].step))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    # The sampler's order is drawn and cut in host memory (a CPU tensor even on a GPU run): not a device read.
    for cls, method, where in ((Trainer, "train_step", "step"), (Trainer, "sync_counts", "step"),
                               (GlobalBatchSampler, "indices", "data order")):
        original = getattr(cls, method)

        def tagged(self, *args, _original=original, _where=where, **kwargs):
            phase[0] = _where
            try:
                return _original(self, *args, **kwargs)
            finally:
                phase[0] = "loop"

        monkeypatch.setattr(cls, method, tagged)

    train_in_process(corpus, tmp_path, "trainer.log_every=5", "trainer.max_steps=10", f"trainer.nonfinite_check={check}")
    in_steps = [s for where, s in reads if where == "step"]
    if check == "step":
        assert len(in_steps) == 10  # the instrument sees the per-step read it is there to catch
    else:
        assert in_steps == []
        # The log steps (and the final eval and checkpoint), nowhere else.
        assert {s for where, s in reads if where != "data order"} == {5, 10}


def test_log_check_refuses_what_it_cannot_do(corpus, tmp_path):
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError, match="fused=true"):
        train_in_process(corpus, tmp_path / "a", "trainer.nonfinite_check=log", "optim.fused=false")
    with pytest.raises(ConfigError, match="precision=fp16"):
        train_in_process(corpus, tmp_path / "b", "trainer.nonfinite_check=log", "precision=fp16")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_device_sync_between_log_steps_on_cuda(corpus, tmp_path, monkeypatch):
    """`auto` on CUDA: torch raises on any synchronizing call inside the steps between log steps."""
    from trainer.loop.trainer import Trainer

    original = Trainer.train_step

    def strict(self, *args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(Trainer, "train_step", strict)
    events = train_in_process(corpus, tmp_path, "world.device=cuda", "precision=bf16", "trainer.log_every=5",
                              "trainer.max_steps=10")
    assert len(series(events, "train/loss")) == 2


def test_a_stop_names_the_loss_where_it_was_non_finite_and_else_the_gradient_norm():
    """A NaN loss makes a NaN gradient norm, and the stop said only the norm (and offered only a lower rate)."""
    from trainer.errors import NonFiniteError
    from trainer.loop.nonfinite import NonFiniteGuard
    from trainer.parallel.backend import Backend

    guard = NonFiniteGuard("stop", "step", max_skips=10, backend=Backend(device="cpu"))
    assert guard.allows(torch.tensor(1.0), 1, torch.tensor(float("nan")))  # (a finite norm: applied)
    with pytest.raises(NonFiniteError, match=r"^non-finite loss \(inf\) at step 2 .* A sample of the batch or the "):
        guard.allows(torch.tensor(float("nan")), 2, torch.tensor(float("inf")))
    with pytest.raises(NonFiniteError) as stop:
        guard.allows(torch.tensor(float("nan")), 3, torch.tensor(2.5))  # (an op's NaN gradient: the loss was finite)
    assert str(stop.value).startswith("non-finite gradient norm (nan) at step 3") and "sample" not in str(stop.value)


def test_guard_skips_on_the_device_names_the_first_bad_step_and_recovers_after_a_caught_stop():
    from trainer.errors import NonFiniteError
    from trainer.loop.nonfinite import NonFiniteGuard
    from trainer.parallel.backend import Backend
    from trainer.parallel.precision import FP32

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    guard = NonFiniteGuard("stop", "log", max_skips=10, backend=Backend(device="cpu"))

    def step(n: int, grad: float) -> dict:
        for p in model.parameters():
            p.grad = torch.full_like(p, grad)
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        assert guard.allows(norm, n)  # `log` mode decides on the device
        with guard.skip_on_device(opt):
            guard.record(FP32().step(opt), n)
        opt.zero_grad(set_to_none=True)
        return {k: v.clone() for k, v in model.state_dict().items()}

    before = step(1, 0.5)
    for n, grad in ((2, float("nan")), (3, 0.5), (4, float("inf"))):
        after = step(n, grad)
        assert all(torch.equal(after[k], before[k]) for k in before)  # skipped on the device, and so are later ones
    assert all(int(s["step"]) == 1 for s in opt.state.values())  # AdamW's step count too
    with pytest.raises(NonFiniteError, match=r"\(nan\) at step 2 on rank 0; that update and the 2 after it"):
        guard.read(4)
    after = step(5, 0.5)  # the caller caught the error: training goes on normally
    assert not all(torch.equal(after[k], before[k]) for k in before)
    guard.read(5)


def test_fp16_stops_on_a_nan_loss_and_counts_skips_across_a_resume(corpus, tmp_path):
    """fp16's loss scaler skips overflowed gradients (routine), but a NaN loss is no overflow: with
    trainer.nonfinite=stop it stops like any precision; with skip, the consecutive-skip count survives a
    resume (it is in the checkpoint)."""
    from trainer.errors import NonFiniteError

    with pytest.raises(NonFiniteError, match="non-finite loss .* at step 6"):
        train_in_process(corpus, tmp_path / "stop", "precision=fp16", *NAN_AT_STEP_6)
    args = ("precision=fp16", "trainer.nonfinite=skip", "trainer.max_nonfinite_skips=4", "task._target_=faulty.Faulty",
            "+task.action=nan_always", "+task.at_call=3", "+task.rank=0", "checkpoint.every_n_steps=4")
    with pytest.raises(NonFiniteError, match="4 consecutive non-finite steps up to step 6"):
        train_in_process(corpus, tmp_path / "skip", *args)
    # Resumed from step 4 (steps 3 and 4 skipped, counted in the checkpoint) with NaNs from its first call on:
    # two more make four, at step 6 again (a count that restarted at 0 would stop at step 8).
    resumed = [a.replace("+task.at_call=3", "+task.at_call=1") for a in args]
    with pytest.raises(NonFiniteError, match="4 consecutive non-finite steps up to step 6"):
        train_in_process(corpus, tmp_path / "skip", *resumed, f"resume={tmp_path}/skip/checkpoints/step_00000004")
