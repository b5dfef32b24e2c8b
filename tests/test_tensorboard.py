"""The TensorBoard logger, read back with TensorBoard's own reader (EventAccumulator), as its UI reads it."""

from __future__ import annotations

import io
import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import DDP2, ROOT, compose_cfg, faulty, read_metrics, run_cli, run_here, tiny_overrides
from omegaconf import OmegaConf

from trainer.errors import ConfigError
from trainer.tracking.tensorboard_logger import TensorBoardLogger, as_code_block

pytest.importorskip("tensorboard")


def accumulator(log_dir: Path):
    """Everything TensorBoard would show for `log_dir` (no sampling: size_guidance 0 keeps every event)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    acc.Reload()
    return acc


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = accumulator(log_dir)
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def texts(log_dir: Path, tag: str) -> list[tuple[int, str]]:
    """(step, text) of a text tag, with the code-block indentation the logger adds taken off."""
    acc = accumulator(log_dir)
    out = []
    for e in acc.Tensors(f"{tag}/text_summary"):
        block = e.tensor_proto.string_val[0].decode()
        out.append((e.step, "\n".join(line[4:] for line in block.split("\n"))))
    return out


def expected_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl as TensorBoard stores it: one series per key, values as float32."""
    out: dict[str, list] = {}
    for event in read_metrics(run_dir):
        step = event.pop("step")
        for key, value in event.items():
            out.setdefault(key, []).append((step, float(np.float32(value))))
    return out


def test_logger_config_composes_alone_and_beside_wandb(tmp_path):
    from hydra.utils import instantiate

    for choice in ("logger=tensorboard", "logger=[tensorboard]", "logger=[wandb,tensorboard]"):
        cfg = compose_cfg([choice])
        assert OmegaConf.to_container(cfg.logger.tensorboard) == {
            "_target_": "trainer.tracking.tensorboard_logger.TensorBoardLogger", "dir": None}
    assert list(cfg.logger) == ["wandb", "tensorboard"]
    logger = instantiate(cfg.logger.tensorboard, run_dir=str(tmp_path))
    assert logger.dir == tmp_path / "tensorboard"
    assert list(tmp_path.iterdir()) == []  # building it writes nothing (the framework builds it before workers start)


def test_scalars_config_and_text_samples_mirror_the_run(corpus, tmp_path):
    from trainer import train
    from trainer.redaction import redact

    cfg = compose_cfg(tiny_overrides(corpus, "logger=tensorboard", "trainer.eval_every=10", "task.sample_tokens=24"))
    train(cfg, tmp_path)
    log_dir = tmp_path / "tensorboard"

    # Every metric of metrics.jsonl, at the same steps, with the same values (float32, as TensorBoard keeps them).
    assert scalars(log_dir) == expected_scalars(tmp_path)
    assert {"train/loss", "val/loss", "val/bpb", "train/lr"} <= set(scalars(log_dir))

    # The resolved config, as config.yaml writes it, at step 0.
    config_yaml = OmegaConf.to_yaml(OmegaConf.create(redact(OmegaConf.to_container(cfg, resolve=True))))
    assert texts(log_dir, "config") == [(0, config_yaml.rstrip("\n"))]

    # Eval samples: the text of samples.jsonl at the same steps, verbatim.
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [10, 20]
    assert texts(log_dir, "val/sample") == [(s["step"], s["text"]) for s in samples]


def test_config_is_redacted_and_text_kept_verbatim(tmp_path):
    logger = TensorBoardLogger(run_dir=tmp_path)
    logger.log_config({"lr": 0.001, "auth": {"api_key": "abcdef0123456789", "user": "me"}})
    sample = "# not a heading\n\n  *not emphasis*   and_under_scores\n\tend"
    logger.log_text("val/sample", sample, step=3)
    logger.finish({})
    assert texts(tmp_path / "tensorboard", "config") == [(0, "lr: 0.001\nauth:\n  api_key: <redacted>\n  user: me")]
    assert b"abcdef0123456789" not in b"".join(p.read_bytes() for p in (tmp_path / "tensorboard").iterdir())
    assert texts(tmp_path / "tensorboard", "val/sample") == [(3, sample)]
    assert as_code_block("") == "    "


def test_image_samples_are_images(corpus, tmp_path):
    from PIL import Image

    from trainer import train
    from trainer.tracking.images import to_hwc_uint8

    image_task = pytest.importorskip("image_task")  # tests/helpers/image_task.py
    train(compose_cfg(tiny_overrides(corpus, "logger=tensorboard", "trainer.eval_every=10",
                                     "task._target_=image_task.ImageSamples")), tmp_path)
    images = accumulator(tmp_path / "tensorboard").Images("val/image")
    assert [e.step for e in images] == [10, 20]
    expected = to_hwc_uint8(image_task.pattern()).numpy()  # [6, 8, 3] uint8
    for e in images:
        assert (e.height, e.width) == (6, 8)
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(e.encoded_image_string))), expected)
    assert (tmp_path / "samples" / "step_10.png").exists()  # metrics.jsonl's own record is still written


def ui_accumulator(log_dir: Path):
    """`log_dir` as TensorBoard's UI reads it (plugin_event_accumulator: the data provider of `tensorboard
    --load_fast=false`). Unlike the legacy EventAccumulator it ignores a run's first SessionLog.START, so a
    resume's START purges only if the first attempt's events began with one too."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return acc


def ui_steps(acc_or_dir, tag: str = "train/loss") -> list[int]:
    acc = ui_accumulator(acc_or_dir) if isinstance(acc_or_dir, Path) else acc_or_dir
    return [e.step for e in acc.Tensors(tag)]


def written_steps(log_dir: Path, tag: str = "train/loss") -> list[int]:
    """The steps of `tag` as the event files hold them, file by file, with no reader's purging."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    return [ev.step for f in sorted(log_dir.glob("events.out.tfevents.*")) for ev in EventFileLoader(str(f)).Load()
            if any(v.tag == tag for v in ev.summary.value)]


def test_a_resumed_run_shows_each_step_once(corpus, tmp_path):
    """The first run logs steps 1-6, then dies at step 7; it resumes from its checkpoint at step 4 and logs
    5-8 again. Every reader shows each step once, the resumed values: the event files are rewound to the
    checkpoint like metrics.jsonl, and each attempt's events start with a SessionLog.START, so a TensorBoard
    that read the dead attempt's events live purges them at the resume's START."""
    from trainer import train

    overrides = tiny_overrides(corpus, "logger=tensorboard", "trainer.max_steps=8", "checkpoint.every_n_steps=4",
                               *faulty("raise", at_call=7, rank=0))
    log_dir = tmp_path / "tensorboard"
    with pytest.raises(RuntimeError, match="boom"):
        train(compose_cfg(overrides), tmp_path)
    assert written_steps(log_dir) == [1, 2, 3, 4, 5, 6]  # steps 5 and 6 are logged again after the resume
    live = ui_accumulator(log_dir)  # a TensorBoard open during the crash: it has read steps 1-6 already
    train(compose_cfg([*overrides, "resume=auto"]), tmp_path)

    assert written_steps(log_dir) == [1, 2, 3, 4, 5, 6, 7, 8]
    shown = scalars(log_dir)
    assert [step for step, _ in shown["train/loss"]] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert shown == expected_scalars(tmp_path)  # metrics.jsonl (rewound on resume) and TensorBoard agree
    assert ui_steps(log_dir) == [1, 2, 3, 4, 5, 6, 7, 8]
    live.Reload()
    assert ui_steps(live) == [1, 2, 3, 4, 5, 6, 7, 8]


def test_a_tensorboard_open_across_a_resume_shows_each_step_once(tmp_path):
    """The logger alone, as in the issue: 60 steps, killed after 48, resumed from its checkpoint at 40, with
    TensorBoard's UI reader open on the directory throughout. It had read steps 1-48 before the resume, so
    only the resume's SessionLog.START can take 41-48 back, and it ignores a run's first START."""
    log_dir = tmp_path / "tensorboard"
    killed = TensorBoardLogger(run_dir=tmp_path)
    for step in range(1, 49):
        killed.log_metrics({"train/loss": 1.0 / step}, step)  # flushed as logged; the writer is never closed
    [events] = log_dir.glob("events.out.tfevents.*")
    with open(events, "ab") as f:
        f.write(b"\x40\x00\x00")  # killed while writing a record: a torn tail
    live = ui_accumulator(log_dir)
    assert ui_steps(live) == list(range(1, 49))

    resumed = TensorBoardLogger(run_dir=tmp_path)
    resumed.rewind(40)
    for step in range(41, 61):
        resumed.log_metrics({"train/loss": 2.0 / step}, step)
    resumed.finish({})
    live.Reload()
    assert ui_steps(live) == list(range(1, 61))
    assert [e.tensor_proto.float_val[0] for e in live.Tensors("train/loss")][40:] == [
        pytest.approx(2.0 / step) for step in range(41, 61)]  # the resumed values
    assert ui_steps(log_dir) == list(range(1, 61))  # a TensorBoard started afterwards
    assert written_steps(log_dir) == list(range(1, 61))  # the killed attempt's file ends at 40, untorn
    assert not events.read_bytes().endswith(b"\x40\x00\x00")
    killed.finish({})


@pytest.mark.parametrize("earlier_name", ["events.out.tfevents.9999999999.othernode.1.0",  # a clock ahead
                                          f"events.out.tfevents.{int(time.time()) + 60:010d}.node.42.9"],
                         ids=["clock-ahead", "next-minute-count-9"])  # (ids without the time: xdist compares them)
def test_a_resumed_attempt_s_events_sort_after_the_earlier_ones(tmp_path, earlier_name):
    """TensorBoard reads a folder's event files in name order and, reading live, never goes back before the
    file it is on. The earlier attempt's file here has a name that sorts after any this clock gives now (a
    node whose clock was ahead; the same second, count 9 then 10, as two train() calls in one process made
    in CI): the resumed attempt's file still sorts after it, and the open reader shows the resumed steps."""
    log_dir = tmp_path / "tensorboard"
    killed = TensorBoardLogger(run_dir=tmp_path)
    for step in range(1, 9):
        killed.log_metrics({"train/loss": 1.0 / step}, step)
    killed.finish({})
    [events] = log_dir.glob("events.out.tfevents.*")
    events.rename(log_dir / earlier_name)
    live = ui_accumulator(log_dir)

    resumed = TensorBoardLogger(run_dir=tmp_path)
    resumed.rewind(4)
    for step in range(5, 11):
        resumed.log_metrics({"train/loss": 2.0 / step}, step)
    resumed.finish({})
    assert sorted(p.name for p in log_dir.glob("events.out.tfevents.*"))[0] == earlier_name
    live.Reload()
    assert ui_steps(live) == list(range(1, 11))
    assert [e.tensor_proto.float_val[0] for e in live.Tensors("train/loss")][4:] == [
        pytest.approx(2.0 / step) for step in range(5, 11)]
    assert written_steps(log_dir) == list(range(1, 11))


def test_a_fresh_rerun_sets_the_earlier_events_aside(corpus, tmp_path):
    from trainer import train

    train(compose_cfg(tiny_overrides(corpus, "logger=tensorboard", "trainer.max_steps=3")), tmp_path)
    # The same run dir again, without resume=: a new run.
    train(compose_cfg(tiny_overrides(corpus, "logger=tensorboard", "trainer.max_steps=2")), tmp_path)
    assert [s for s, _ in scalars(tmp_path / "tensorboard")["train/loss"]] == [1, 2]
    assert [s for s, _ in scalars(tmp_path / "tensorboard.prev")["train/loss"]] == [1, 2, 3]
    assert scalars(tmp_path / "tensorboard") == expected_scalars(tmp_path)


@pytest.mark.parametrize("given", ["own", "."])
def test_a_fresh_rerun_into_a_tensorboard_dir_of_ones_own_moves_the_events_alone(corpus, tmp_path, given):
    """A dir holding files of one's own was renamed whole to <dir>.prev/ (the files with it); `.` (the current
    directory) was a ValueError traceback once the run dir's other records had been set aside (its checkpoints in
    checkpoints.prev/, its metrics emptied: eval then found no checkpoint)."""
    own = tmp_path / "own"
    own.mkdir()
    (own / "notes.txt").write_text("mine")
    where = own if given == "own" else tmp_path / "own"
    args = [*tiny_overrides(corpus, "logger=tensorboard", "trainer.max_steps=3"), f"logger.tensorboard.dir={given}",
            f"hydra.run.dir={tmp_path / 'run'}"]
    for _ in range(2):
        r = run_here(*args, cwd=own if given == "." else tmp_path)
        assert r.returncode == 0, r.stderr
    assert (own / "notes.txt").read_text() == "mine"
    assert [s for s, _ in scalars(where.parent / f"{where.name}.prev")["train/loss"]] == [1, 2, 3]
    assert [s for s, _ in scalars(where)["train/loss"]] == [1, 2, 3]
    assert [e["step"] for e in read_metrics(tmp_path / "run") if "train/loss" in e] == [1, 2, 3]  # (the rerun's)


def test_only_rank_0_writes(ddp_reference):
    """The shared 2-process run (tests/conftest.py) logs to TensorBoard: one event file, rank 0's."""
    run_dir = ddp_reference[0]
    assert [p.relative_to(run_dir).parent for p in run_dir.rglob("events.out.tfevents.*")] == [Path("tensorboard")]
    assert scalars(run_dir / "tensorboard") == expected_scalars(run_dir)


def test_wandb_and_tensorboard_together(corpus, tmp_path, monkeypatch):
    from wandb_reader import history

    from trainer import train

    monkeypatch.setenv("WANDB_MODE", "offline")
    train(compose_cfg(tiny_overrides(corpus, "logger=[wandb,tensorboard]", "trainer.max_steps=5")), tmp_path)
    assert [r["step"] for r in history(tmp_path)] == [1, 2, 3, 4, 5]
    assert [s for s, _ in scalars(tmp_path / "tensorboard")["train/loss"]] == [1, 2, 3, 4, 5]


def test_logger_dir_moves_the_event_files(corpus, tmp_path):
    from trainer import train

    train(compose_cfg(tiny_overrides(corpus, "logger=tensorboard", f"logger.tensorboard.dir={tmp_path / 'tb'}",
                                     "trainer.max_steps=2")), tmp_path / "run")
    assert not (tmp_path / "run" / "tensorboard").exists()
    assert [s for s, _ in scalars(tmp_path / "tb")["train/loss"]] == [1, 2]


def test_a_logger_dir_holding_another_runs_events_is_refused_before_anything_moves(corpus, tmp_path):
    """Two runs in one logger.tensorboard.dir would show as one run in TensorBoard, the second's START purging the
    first's curves, its rerun moving them to .prev: the second is refused, its own rerun is not."""
    from trainer import train
    from trainer.tracking.tensorboard_logger import OWNER

    tb = tmp_path / "tb"
    overrides = ("logger=tensorboard", f"logger.tensorboard.dir={tb}", "trainer.max_steps=2")
    train(compose_cfg(tiny_overrides(corpus, *overrides)), tmp_path / "a")
    events = sorted(tb.glob("events.out.tfevents.*"))
    assert (tb / OWNER).read_text().strip() == str((tmp_path / "a").resolve())

    with pytest.raises(ConfigError, match=f"logger.tensorboard.dir={tb} holds the run {tmp_path / 'a'}"):
        TensorBoardLogger(run_dir=tmp_path / "b", dir=str(tb))
    r = run_cli(*tiny_overrides(corpus, *overrides), f"hydra.run.dir={tmp_path / 'b'}")
    # (a dir beside it: one inside it, which the message proposed, moved with it at the first run's rerun)
    assert r.returncode == 2 and f"logger.tensorboard.dir={tmp_path}/NAME" in r.stderr, r.stderr
    assert sorted(tb.glob("events.out.tfevents.*")) == events and not (tmp_path / "tb.prev").exists()
    assert not (tmp_path / "b").exists()
    with pytest.raises(ConfigError, match=f"logger.tensorboard.dir={tb}/b is inside {tb}, the TensorBoard dir of the "
                                          f"run {tmp_path / 'a'}"):
        TensorBoardLogger(run_dir=tmp_path / "b", dir=str(tb / "b"))

    # Events nobody claims (another tool's, or written before the owner file): refused for a new run dir, taken by
    # a run dir with a history of its own (a run from before the owner file, resumed).
    (tb / OWNER).unlink()
    with pytest.raises(ConfigError, match="holds events this run did not write"):
        TensorBoardLogger(run_dir=tmp_path / "new", dir=str(tb))
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "metrics.jsonl").write_text("")  # (what the metrics logger, built first, leaves)
    r = run_cli(*tiny_overrides(corpus, *overrides), f"hydra.run.dir={tmp_path / 'new'}")
    assert r.returncode == 2 and "holds events this run did not write" in r.stderr, r.stderr
    TensorBoardLogger(run_dir=tmp_path / "a", dir=str(tb))
    (tb / OWNER).write_text(str((tmp_path / "a").resolve()))
    TensorBoardLogger(run_dir=tmp_path / "a", dir=str(tb))  # its own run: a rerun or resume goes on

    # Another run's own dir (no events in it yet) took this run's events and owner file beside that run's files.
    r = run_cli(*tiny_overrides(corpus, "logger=tensorboard", f"logger.tensorboard.dir={tmp_path / 'a'}"),
                f"hydra.run.dir={tmp_path / 'c'}")
    assert r.returncode == 2 and f"it is another run's dir ({tmp_path / 'a' / 'run_info.json'} is there)" in r.stderr
    assert not (tmp_path / "c").exists() and not list((tmp_path / "a").glob("events.out.tfevents.*"))


def test_without_tensorboard_the_error_says_how_to_install_it(corpus, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` now raises ImportError
    with pytest.raises(ConfigError) as e:
        TensorBoardLogger(run_dir=tmp_path)
    assert "pip install tensorboard" in str(e.value) and "\n" not in str(e.value)

    # Through the CLI, before any worker starts: one paragraph, exit code 2, no traceback, no run dir.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['tensorboard'] = None\n")
    run_dir = tmp_path / "run"
    r = run_cli(*tiny_overrides(corpus, *DDP2, "logger=tensorboard"), f"hydra.run.dir={run_dir}",
                env={"PYTHONPATH": f"{site}:{ROOT}"}, fresh=True)  # (sitecustomize runs at an interpreter's start)
    assert r.returncode == 2, r.stderr
    assert re.fullmatch(r"error: [^\n]*pip install tensorboard[^\n]*\n", r.stderr), r.stderr
    assert not run_dir.exists()


def test_describing_the_config_imports_neither_tensorboard_nor_torch():
    r = run_cli("--cfg", "job", "logger=tensorboard", env={"PYTHONPROFILEIMPORTTIME": "1"}, timeout=60)
    assert r.returncode == 0 and "TensorBoardLogger" in r.stdout
    assert not re.search(r"\|\s+(tensorboard|torch)\b", r.stderr)


def test_a_dir_given_as_a_number_is_that_directory_and_a_flag_is_refused(tmp_path):
    """logger.tensorboard.dir=123 on the command line arrives as the int 123: "expected str, bytes or os.PathLike
    object, not int" from inside the logger's build."""
    assert TensorBoardLogger(run_dir=tmp_path, dir=123).dir == Path("123")
    with pytest.raises(ConfigError, match="logger.tensorboard.dir=True is not a directory path"):
        TensorBoardLogger(run_dir=tmp_path, dir=True)


def test_a_sweeps_tensorboard_dir_is_one_per_point_by_hydras_job_number_and_one_for_all_is_refused_first(tmp_path):
    """`logger.tensorboard.dir=DIR/${hydra:job.num}`, Hydra's way to name each point's dir, was "HydraConfig was
    not set" (the config was checked outside Hydra's job), exit 2; and one fixed dir for every point let the first
    point run before the second was refused for the dir the first had written."""
    from conftest import run_here
    from test_errors import assert_clean_error

    sweep = ["-m", "debug=smoke", "logger=tensorboard", "optim.lr=1e-3,3e-3", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    r = run_here(*sweep, f"logger.tensorboard.dir={tmp_path / 'tb'}", cwd=tmp_path)
    assert_clean_error(r, f"logger.tensorboard.dir={tmp_path / 'tb'} is one dir for 2 points of this sweep",
                       f"'logger.tensorboard.dir={tmp_path / 'tb'}/${{hydra:job.num}}'. Nothing was run.")
    assert not (tmp_path / "sweep").exists() and not (tmp_path / "tb").exists()
    r = run_here(*sweep, f"logger.tensorboard.dir={tmp_path / 'tb'}/${{hydra:job.num}}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for point, lr in ((0, 1e-3), (1, 3e-3)):
        events = accumulator(tmp_path / "tb" / str(point))
        assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 21))
        assert OmegaConf.load(tmp_path / "sweep" / str(point) / "config.yaml").optim.lr == lr
