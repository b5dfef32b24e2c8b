"""Metrics from the task: additive sums (here, correct predictions) reduced over micro-batches and ranks
exactly like the loss, and throughput named after what the task counts."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import FAULTY_ENV, ROOT, read_metrics, run_cli, series

CONF = str(ROOT / "tests" / "conf")


def train_classifier(run_dir, *extra):
    from trainer import compose, train

    train(compose(["recipe=classify", *extra], config_dir=CONF), run_dir)
    return read_metrics(run_dir)


def test_accuracy_is_logged_for_a_classification_loss_and_is_exact(tmp_path):
    from hydra.utils import instantiate
    from safetensors.torch import load_file

    events = train_classifier(tmp_path)
    acc = series(events, "train/accuracy")
    assert len(acc) == 3 and all(0.0 <= a <= 1.0 for a in acc) and acc[-1] > 0.7
    final = [e for e in events if "val/accuracy" in e][-1]
    # Recompute with the exported weights: the logged value is exactly correct / val samples.
    model = instantiate(json.loads((tmp_path / "model_config.json").read_text()))
    model.load_state_dict(load_file(str(tmp_path / "model.safetensors")))
    from classify import blobs

    _, val = blobs()
    x, y = val.tensors
    with torch.no_grad():
        correct = (model(x).argmax(-1) == y).sum().item()
    assert final["val/accuracy"] == pytest.approx(correct / len(y), abs=1e-12)
    # Throughput says what the task counts: samples, not tokens.
    assert "train/samples_per_s" in events[0] and "train/tokens_per_s" not in events[0]


@pytest.mark.slow
def test_accuracy_over_two_ranks_and_micro_batches_equals_one_process_and_both_stop_early_alike(tmp_path):
    """val: 61 samples split 31/30; train: 2 ranks x 2 micro-batches of 4 = 1 x 16. Early stopping on the
    accuracy with mode=min (it rises: the first eval stays the best) stops both at the second eval, step 30."""
    stop = ["trainer.max_steps=60", "callbacks=early_stopping", "callbacks.early_stopping.monitor=val/accuracy",
            "callbacks.early_stopping.mode=min", "callbacks.early_stopping.patience=1"]
    one = train_classifier(tmp_path / "one", *stop)
    r = run_cli("--config-dir", CONF, "recipe=classify", "world=ddp", "world.nproc_per_node=2", "data.batch_size=4",
                "trainer.grad_accum_steps=2", *stop, f"hydra.run.dir={tmp_path / 'two'}", env=FAULTY_ENV)
    assert r.returncode == 0, r.stderr
    two = read_metrics(tmp_path / "two")
    for key in ("train/accuracy", "val/accuracy", "train/loss", "val/loss"):
        # Accuracies are counts (exact); losses (< 1) may differ by fp32 summation order: <= ~1e-6 per
        # step (micro-batches, ranks, the CPU's SIMD width), so <= 30 x 1e-6 after 30 steps.
        assert series(two, key) == pytest.approx(series(one, key), abs=30 * 1e-6), key
    assert one[-1]["step"] == two[-1]["step"] == 30


def test_a_metric_over_the_whole_val_set_equals_one_process_computing_it(tmp_path):
    """Issue 26.4: task.predict rows gathered from 2 ranks (val: 61 samples split 31/30), each sample once; the AUROC
    (no sum over ranks gives it) is what the final weights give on the whole val set in this process."""
    from hydra.utils import instantiate
    from safetensors.torch import load_file

    r = run_cli("--config-dir", CONF, "recipe=classify", "task._target_=classify.Ranking", "~task.loss", "world=ddp",
                "world.nproc_per_node=2", "data.batch_size=8", f"hydra.run.dir={tmp_path}", env=FAULTY_ENV)
    assert r.returncode == 0, r.stderr
    final = [e for e in read_metrics(tmp_path) if "val/auroc" in e][-1]
    model = instantiate(json.loads((tmp_path / "model_config.json").read_text()))
    model.load_state_dict(load_file(str(tmp_path / "model.safetensors")))
    from classify import auroc, blobs

    x, y = blobs()[1].tensors
    with torch.no_grad():
        expected = auroc(model(x).softmax(-1)[:, 0], (y == 0).float())
    assert final["val/scored"] == len(y) == 61  # every sample once: none dropped, none repeated
    # The same scores up to fp32 rounding (batches of 8 on a rank vs 61 here): at most one pair of nearly equal
    # scores could swap, which moves the AUROC by 1 / (positives x negatives).
    positives = int((y == 0).sum())
    assert final["val/auroc"] == pytest.approx(expected, abs=1 / (positives * (len(y) - positives)))


def test_the_runs_training_time_and_targets_keep_the_steps_before_an_eval_or_save_in_a_log_window(monkeypatch):
    """An eval or a save inside a log window started the window over, dropping its steps so far from the run's
    totals (summary/train_time_s, the checkpoints' `trained`): saving every 7 steps and logging every 13 counted a
    third of the time and the tokens. A clock of our own: each step takes 1 s, each eval or save 10 s."""
    from trainer.loop import metrics

    now = [0.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])
    meter, windows = metrics.Throughput(), []
    for step in range(1, 40):
        now[0] += 1.0
        meter.add(128)
        if step % 13 == 0:
            windows.append(meter.window(4))
        if step % 7 == 0:
            now[0] += 10.0  # (an eval or a save)
            meter.restart()
    assert meter.totals() == (39.0, 39 * 128.0)
    assert all(w["step_time_ms"] == 1000.0 and w["targets_per_s"] == 128.0 for w in windows)


def test_the_summary_counts_every_step_trained_with_saves_between_logs(corpus, tmp_path):
    from conftest import train_in_process

    train_in_process(corpus, tmp_path, "trainer.max_steps=30", "trainer.log_every=13", "checkpoint.every_n_steps=7",
                     "checkpoint.async_save=false")
    state = json.loads((tmp_path / "checkpoints" / "step_00000028" / "state.json").read_text())["trainer"]
    assert state["trained"]["targets"] == 28 * 4 * 32  # (debug=smoke: 4 x 32 tokens a step)


def test_a_parameter_the_forward_leaves_unused_under_ddp_is_one_paragraph_naming_it(tmp_path):
    """DDP's "Expected to have finished reduction in the prior iteration" traceback at step 2, naming parameter
    indices; the fix it named was DDP's keyword, not the framework's setting. With that setting the run trains."""
    from test_errors import assert_clean_error

    args = ("--config-dir", CONF, "recipe=classify", "model._target_=classify.WithUnused", "world=ddp",
            "world.nproc_per_node=2", "data.batch_size=4", "trainer.max_steps=4")
    r = run_cli(*args, f"hydra.run.dir={tmp_path / 'refused'}", env=FAULTY_ENV)
    assert_clean_error(r, "trainable parameters its forward left without a gradient (extra.weight, extra.bias)",
                       "world.find_unused_parameters=true")
    r = run_cli(*args, "world.find_unused_parameters=true", f"hydra.run.dir={tmp_path / 'trained'}", env=FAULTY_ENV)
    assert r.returncode == 0, r.stderr


def test_a_logger_of_ones_own_gets_every_logged_step_and_one_that_is_no_nulllogger_is_refused(corpus, tmp_path):
    """README "A logger of your own": `+logger.mine._target_=...` is built with `run_dir=` and gets the config, each
    logged step's metrics (the steps metrics.jsonl has) and the end. A class that does not subclass NullLogger failed
    mid-run at the first call it lacks (a resume's rewind): one paragraph before anything runs, no run dir left."""
    from conftest import run_here, tiny_overrides
    from test_errors import assert_clean_error

    run = tmp_path / "run"
    r = run_here(*tiny_overrides(corpus, "trainer.max_steps=4", "optim.lr=0.003"), "+logger.mine._target_=own_logger.Recorder",
                 f"hydra.run.dir={run}", env=FAULTY_ENV)
    assert r.returncode == 0, r.stderr
    events = [json.loads(line) for line in (run / "mine.jsonl").read_text().splitlines()]
    assert events[0] == {"kind": "config", "lr": 0.003} and events[-1] == {"kind": "finish", "exit_code": 0}
    logged = [e["step"] for e in events if e["kind"] == "metrics"]
    assert logged == [e["step"] for e in read_metrics(run)] and 4 in logged
    assert all("train/loss" in e["keys"] for e in events if e["kind"] == "metrics" and e["step"] == 1)

    bad = tmp_path / "bad"
    r = run_here(*tiny_overrides(corpus), "+logger.mine._target_=own_logger.NotALogger", f"hydra.run.dir={bad}",
                 env=FAULTY_ENV)
    assert_clean_error(r, "logger.mine (own_logger.NotALogger) built a NotALogger, which is not a "
                       "trainer.tracking.loggers.NullLogger: subclass it")
    assert not bad.exists()
