"""precision=auto (issue 13): the rule against faked capabilities, its resolution before a run, what a run
records of it, the note on resuming in another mode, and MFU on a CPU."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import compose_cfg, series, tiny_overrides, train_in_process
from hydra.utils import instantiate
from omegaconf import OmegaConf

from trainer.parallel import precision as P


def no_probe() -> float:
    raise AssertionError("the probe ran although the flags decide")


AVX512 = {"avx2", "avx512f", "avx512bw"}


@pytest.mark.parametrize(("device_type", "capability", "flags", "probe", "want", "why"), [
    ("cuda", (7, 0), None, no_probe, "fp16", "compute capability 7.0) has no bf16 units"),
    ("cuda", (7, 5), None, no_probe, "fp16", "fp16 with loss scaling"),
    ("cuda", (8, 0), None, no_probe, "bf16", "compute capability 8.0) computes bf16 natively"),
    ("cuda", (9, 0), None, no_probe, "bf16", "compute capability 9.0"),
    ("cpu", None, AVX512 | {"avx512_bf16"}, no_probe, "bf16", "this CPU has avx512_bf16"),
    ("cpu", None, AVX512 | {"amx_tile", "amx_bf16"}, no_probe, "bf16", "this CPU has amx_bf16"),
    ("cpu", None, AVX512, lambda: 0.3, "fp32", "no avx512_bf16 or amx_bf16, and bf16 matmuls ran 0.30x as fast"),
    ("cpu", None, AVX512, lambda: 3.0, "bf16", "bf16 matmuls ran 3.0x as fast as fp32"),
    ("cpu", None, AVX512, lambda: 1.2, "fp32", "1.20x"),  # faster, but not clearly: casts would eat it
    ("cpu", None, None, lambda: 2.5, "bf16", "CPU flags unknown"),  # not Linux: the probe decides
    ("cpu", None, None, None, "fp32", "no native bf16 on this CPU"),
    ("mps", None, None, no_probe, "fp32", "no bf16 rule for device type 'mps'"),
])
def test_the_rule_on_faked_capabilities(device_type, capability, flags, probe, want, why):
    name, reason = P.choose(device_type, capability, flags, probe)
    assert name == want and why in reason, (name, reason)


def test_the_rule_on_this_machine():
    """Linux's flags decide where they show bf16 units; torch.ops.mkldnn._is_mkldnn_bf16_supported() is
    not asked (it is true where bf16 is emulated, too)."""
    flags = P.cpu_flags()
    assert flags is not None  # Linux: /proc/cpuinfo
    name, reason = P.choose_for("cpu")
    if set(P.NATIVE_BF16_FLAGS) & flags:
        assert name == "bf16" and reason.startswith("this CPU has")
    else:
        assert name in ("bf16", "fp32") and "no avx512_bf16 or amx_bf16" in reason


@pytest.mark.parametrize("explicit", ["fp32", "bf16", "fp16"])
def test_resolve_auto_keeps_an_explicit_precision(corpus, explicit):
    cfg = compose_cfg(tiny_overrides(corpus, f"precision={explicit}"))
    assert P.resolve_auto(cfg) == (cfg, None)


@pytest.mark.parametrize(("choice", "target"), [("bf16", "BF16"), ("fp32", "FP32"), ("fp16", "FP16")])
def test_resolve_auto_writes_the_concrete_mode_and_why(corpus, monkeypatch, choice, target):
    monkeypatch.setattr(P, "choose_for", lambda device: (choice, "because of a test"))
    cfg = compose_cfg(tiny_overrides(corpus, "precision=auto"))
    resolved, line = P.resolve_auto(cfg)
    assert line == f"precision=auto: {choice} (because of a test)"
    assert cfg.precision._target_ == P.AUTO_TARGET  # the caller's config is left as it was
    node = resolved.precision
    assert node._target_ == f"trainer.parallel.precision.{target}" and node.reason == "precision=auto: because of a test"
    if choice == "fp16":  # with precision=fp16's loss scaler settings
        assert (node.init_scale, node.growth_interval) == (65536.0, 2000)
    else:
        assert set(node) == {"_target_", "reason"}
    assert OmegaConf.is_struct(resolved) and P.resolve_auto(resolved) == (resolved, None)
    built = instantiate(node, device_type="cpu")
    assert built.name == choice and built.reason == "precision=auto: because of a test"


def test_recipes_and_debug_smoke_pick_their_precision():
    assert compose_cfg([]).precision._target_ == P.AUTO_TARGET
    assert compose_cfg(["recipe=lm"]).precision._target_ == P.AUTO_TARGET
    assert compose_cfg(["recipe=diffusion"]).precision._target_ == "trainer.parallel.precision.FP32"
    assert compose_cfg(["debug=smoke"]).precision._target_ == "trainer.parallel.precision.FP32"


def test_a_run_with_auto_prints_and_records_its_choice(corpus, tmp_path, capsys):
    events = train_in_process(corpus, tmp_path, "precision=auto", "trainer.max_steps=6")
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("precision=auto: "))
    name, why = line.removeprefix("precision=auto: ").split(" ", 1)
    info = json.loads((tmp_path / "run_info.json").read_text())
    assert info["precision"] == {"name": name, "reason": f"precision=auto: {why[1:-1]}"}
    if set(P.NATIVE_BF16_FLAGS) & (P.cpu_flags() or set()):  # as on this machine's CPU
        assert name == "bf16" and why.startswith("(this CPU has")
    assert all(math.isfinite(x) for x in series(events, "train/loss"))
    # The checkpoint holds the choice and why, beside the (empty, outside fp16) loss scaler state.
    state = json.loads(next((tmp_path / "checkpoints").glob("step_*/state.json")).read_text())
    assert state["precision"] == {"name": name, "reason": f"precision=auto: {why[1:-1]}", "scaler": []}


def test_every_mode_has_the_same_checkpoint_keys():
    keys = {frozenset(cls("cpu").state_dict()) for cls in (P.FP32, P.BF16, P.FP16)}
    assert keys == {frozenset({"name", "reason", "scaler"})}


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """A bf16 run and an fp16 run (loss scale 1024) of 4 steps, each with its final checkpoint."""
    runs = {}
    for mode, extra in (("bf16", ()), ("fp16", ("precision.init_scale=1024",))):
        run_dir = tmp_path_factory.mktemp(mode)
        train_in_process(corpus, run_dir, f"precision={mode}", *extra, "trainer.max_steps=4")
        runs[mode] = run_dir / "checkpoints" / "step_00000004"
    return runs


@pytest.mark.parametrize(("saved", "now"), [("bf16", "fp32"), ("fp16", "bf16"), ("bf16", "fp16"), ("fp16", "fp32")])
def test_resume_in_another_mode_works_and_says_so(corpus, tmp_path, capsys, trained, saved, now):
    capsys.readouterr()
    events = train_in_process(corpus, tmp_path, f"precision={now}", "trainer.max_steps=6", f"resume={trained[saved]}")
    out = capsys.readouterr().out
    fresh = "; fp16's loss scale starts over, at precision.init_scale=65536" if now == "fp16" else ""
    assert (f"note: the checkpoint was trained in {saved} (set in the config); this run uses {now} "
            f"(set in the config){fresh}") in out.splitlines()
    assert [e["step"] for e in events if "train/loss" in e] == [5, 6]
    assert all(math.isfinite(x) for x in series(events, "train/loss"))


def test_fp16_resume_restores_the_loss_scaler(corpus, tmp_path, capsys, trained):
    from trainer.entry.run import build

    saved = json.loads((trained["fp16"] / "state.json").read_text())["precision"]
    assert saved["name"] == "fp16" and len(saved["scaler"]) == 1
    trainer = build(compose_cfg(tiny_overrides(corpus, "precision=fp16", "trainer.max_steps=6")), tmp_path)
    try:
        assert trainer.precision.scaler.get_scale() == 65536.0
        trainer.load_checkpoint(trained["fp16"])
        assert trainer.precision.scaler.get_scale() == saved["scaler"][0]["scale"] <= 1024.0
    finally:
        trainer.backend.teardown()
    assert "the checkpoint was trained in" not in capsys.readouterr().out  # same mode: nothing to say


@pytest.mark.parametrize("mode", ["fp32", "bf16", "fp16"])
def test_mfu_stays_below_one_in_every_mode_on_this_cpu(corpus, tmp_path, capsys, mode):
    """On a CPU the peak is the faster of fp32 and the run's dtype (fp16 is emulated on most CPUs: measured
    against its own slow matmuls it reported mfu=1.159)."""
    events = train_in_process(corpus, tmp_path, f"precision={mode}", "trainer.max_steps=6")
    mfu = series(events, "train/mfu")
    assert mfu and all(0 < x < 1 for x in mfu), mfu
    out = capsys.readouterr().out
    if mode == "fp16" and not set(P.NATIVE_FP16_FLAGS) & (P.cpu_flags() or set()):
        assert out.count("note: precision=fp16 is emulated on this CPU") == 1


def test_a_cpu_peak_is_the_faster_of_fp32_and_the_run_dtype(monkeypatch):
    from trainer.parallel import hardware

    threads = torch.get_num_threads()
    assert hardware.cpu_matmul_tflops(torch.bfloat16, size=64, seconds=0.001) > 0
    assert torch.get_num_threads() == threads  # the one-thread probe gives the threads back
    speed = {torch.float32: 0.1, torch.bfloat16: 0.4, torch.float16: 0.002}  # TFLOP/s of one thread, as here
    probed = []
    monkeypatch.setattr(hardware, "cpu_matmul_tflops", lambda dtype, **probe: probed.append(dtype) or speed[dtype])
    monkeypatch.setattr(hardware, "_ONE_THREAD", {})  # (what this process probed before)
    assert hardware.cpu_peak_tflops(torch.float16) == pytest.approx(threads * 0.1)  # emulated: against fp32
    assert hardware.cpu_peak_tflops(torch.bfloat16) == pytest.approx(threads * 0.4)
    assert hardware.cpu_peak_tflops(torch.float32) == pytest.approx(threads * 0.1)
    # Probed once per process, each dtype in rounds: the next runs of this process pay nothing for it.
    rounds = hardware.PROBE_ROUNDS
    assert sorted(map(str, probed)) == sorted(map(str, [torch.float32, torch.float16, torch.bfloat16] * rounds))
    torch.set_num_threads(1)
    try:
        assert hardware.cpu_peak_tflops(torch.bfloat16) == pytest.approx(0.4)  # x this process's threads now
    finally:
        torch.set_num_threads(threads)
    assert len(probed) == 3 * rounds


def test_emulated_bf16_gets_a_note(monkeypatch):
    cpu = torch.device("cpu")
    node = compose_cfg(["precision=bf16"]).precision
    monkeypatch.setattr(P, "choose_for", lambda device: ("fp32", "no native bf16 on this CPU: no avx512_bf16 or "
                                                         "amx_bf16, and bf16 matmuls ran 0.30x as fast as fp32"))
    note = P.emulation_note(node, cpu)
    assert note.startswith("note: precision=bf16 is emulated here (no native bf16 on this CPU") and note.endswith(
        "precision=auto would choose fp32.")
    monkeypatch.setattr(P, "choose_for", lambda device: ("bf16", "this CPU has avx512_bf16"))
    assert P.emulation_note(node, cpu) is None
    assert P.emulation_note(compose_cfg(["precision=fp32"]).precision, cpu) is None


def test_an_emulated_explicit_bf16_run_says_so_once(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(P, "choose_for", lambda device: ("fp32", "no native bf16 on this CPU: faked"))
    events = train_in_process(corpus, tmp_path, "precision=bf16", "trainer.max_steps=2")
    assert capsys.readouterr().out.count("note: precision=bf16 is emulated here (no native bf16 on this CPU: faked)") == 1
    assert len(series(events, "train/loss")) == 2


@pytest.mark.parametrize(("setting", "says"), [
    ("init_scale=0", "precision.init_scale=0 is invalid"),  # (every loss 0: stopped as "non-finite: lower optim.lr")
    ("init_scale=-1", "precision.init_scale=-1 is invalid"),  # (ran on with a scale that means nothing)
    ("init_scale=big", "precision.init_scale='big' is invalid"),
    ("growth_interval=0", "precision.growth_interval=0 is invalid: expected an integer >= 1"),
])
def test_fp16s_loss_scaler_settings_are_checked(corpus, tmp_path, setting, says):
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError, match=says):
        train_in_process(corpus, tmp_path, "precision=fp16", f"precision.{setting}")
    assert not (tmp_path / "checkpoints").exists()


def test_a_run_whose_every_step_was_skipped_says_its_weights_did_not_change(corpus, tmp_path, capsys):
    """fp16 with a loss scale that overflows every step: the run printed done, exit 0, and exported its initial
    weights without a word."""
    events = train_in_process(corpus, tmp_path, "precision=fp16", "precision.init_scale=1e30", "trainer.max_steps=3")
    assert series(events, "train/skipped_steps")[-1] == 3
    assert "warning: every one of this run's 3 steps was skipped" in capsys.readouterr().out
    train_in_process(corpus, tmp_path / "ok", "precision=fp16", "trainer.max_steps=3")
    assert "was skipped" not in capsys.readouterr().out
