"""Iterable datasets (trainer/data/streaming.py): sharding by rank and loader worker, exact O(1) resume, passes, the rules.

The unit tests read test streams (tests/helpers/stream_data.py, sample = its stream position) as several ranks would, one
Data per simulated rank in this process, and check global batches against stream positions. The runs train the lm
recipe on data=text_stream: two ranks with loader workers equal one process, and a run SIGKILLed mid-step resumes
with resume=auto bit for bit.
"""

from __future__ import annotations

import json

import pytest
import stream_data as sd
import torch
from conftest import (
    FAULTY_ENV,
    assert_identical,
    assert_same_run,
    checkpoints,
    faulty,
    read_metrics,
    run_cli,
    run_here,
    train_in_process,
)

from trainer.data.sampling import Data
from trainer.errors import CheckpointError, DataError

CPU = torch.device("cpu")


def read(make, world: int, b: int, accum: int, steps: int, workers: int = 0, state: dict | None = None):
    """The global batches of `steps` steps (sample values in stream order) read by `world` simulated ranks, and the
    checkpoint state after them (`state`: a checkpoint's to resume from)."""
    start = state["samples_seen"] if state else 0
    datas = [Data(make(), None, b, False, workers) for _ in range(world)]
    notes = [d.load_position(state) for d in datas] if state else [None]
    its = [d.loader(d.sampler(accum, r, world, 0, start), CPU, 0) for r, d in enumerate(datas)]
    batches = []
    for _ in range(steps):
        per_rank = [[next(it) for _ in range(accum)] for it in its]
        batches.append([int(x) for m in range(accum) for r in range(world) for x in per_rank[r][m]])
    seen = start + steps * b * accum * world
    gather = lambda _: [d._reading.local_record() for d in datas]  # noqa: E731 (every rank's, as gather_object)
    at = datas[0].sampler(accum, 0, world, 0, seen)
    after = {"samples_seen": seen, "data_fingerprint": datas[0].fingerprint(at), **datas[0].position_state(at, gather)}
    return batches, after, notes[0], datas


def values(first: int, count: int, n: int = 50) -> list[int]:
    """Sample values at stream positions [first, first + count) of a stream of n samples a pass."""
    return [(p // n) * 1000 + p % n for p in range(first, first + count)]


@pytest.mark.parametrize(("world", "b", "accum", "workers"), [(1, 8, 1, 0), (2, 2, 2, 0), (2, 2, 2, 2), (4, 1, 2, 0)])
def test_any_split_reads_the_same_global_batches_each_sample_once_across_passes(world, b, accum, workers):
    batches, _, _, _ = read(sd.Stateful, world, b, accum, steps=8, workers=workers)  # 64 samples: into pass 1
    assert batches == [values(8 * s, 8) for s in range(8)]


def test_a_stream_that_splits_itself_among_loader_workers_is_read_whole():
    """A dataset that splits itself by torch's get_worker_info: each worker's reader kept its blocks of a part of the
    stream, and half the samples were never read (a sized one said so only after a whole pass had trained)."""
    batches, _, _, _ = read(sd.SplitByWorker, 2, 2, 2, steps=8, workers=2)
    assert batches == [values(8 * s, 8) for s in range(8)]


@pytest.mark.parametrize("make", [sd.Stateful, sd.UnsizedStateful])
def test_a_stateful_stream_resumes_at_once_on_another_world_size(make):
    whole, _, _, _ = read(make, 2, 2, 2, steps=10)
    first, state, _, _ = read(make, 2, 2, 2, steps=6)  # stops mid-pass 0 at sample 48 ...
    rec = json.loads(state["stream"])
    assert rec["position"] == 48 and json.loads(rec["state"]) == {"next": 48}
    # ... and continues on one rank (batch 8) or four (batch 1, 2 micro-steps): world size is a performance knob.
    for world, b, accum in ((1, 8, 1), (4, 1, 2)):
        rest, _, note, datas = read(make, world, b, accum, steps=4, state=state)
        assert first + rest == whole and note is None
        # O(1): no reader replayed the 48 samples before the position; each read at most up to its first block.
        assert all(d.train.produced <= 8 * 4 for d in datas), [d.train.produced for d in datas]


def test_a_stateless_stream_says_it_skips_and_skips_exactly():
    whole, _, _, _ = read(sd.Sized, 2, 2, 1, steps=20)  # 80 samples: pass 1 from step 13
    first, state, _, _ = read(sd.Sized, 2, 2, 1, steps=15)  # 60: position 10 of pass 1
    rest, _, note, datas = read(sd.Sized, 1, 4, 1, steps=5, state=state)
    assert first + rest == whole
    assert "has no state_dict/load_state_dict" in note and "read again from sample 50" in note
    assert "the 10 samples up to sample 60 are skipped" in note and "\n" not in note
    assert datas[0].train.produced == 10 + 20  # only pass 1's first 10 replayed (a sized stream skips whole passes)


def test_a_stateless_unsized_stream_skips_exactly_in_loader_workers_on_another_world_size():
    """The skip happens in each loader worker (its own copy of the dataset), and without __len__ from the start
    of the pass the run stopped in (where the 50 samples of pass 0 ended)."""
    whole, _, _, _ = read(sd.Numbers, 2, 2, 1, steps=20, workers=2)
    first, state, _, _ = read(sd.Numbers, 2, 2, 1, steps=15, workers=2)
    rest, _, note, _ = read(sd.Numbers, 1, 4, 1, steps=5, workers=2, state=state)
    assert first + rest == whole and whole == [values(4 * s, 4) for s in range(20)]
    assert "read again from sample 50 and the 10 samples up to sample 60 are skipped" in note and "\n" not in note


@pytest.mark.parametrize("make", [sd.Parts, sd.StatelessParts])
def test_parts_are_read_by_their_own_readers_and_resume_exactly(make):
    whole, _, _, _ = read(make, 2, 1, 1, steps=30, workers=2)  # 4 readers of parts i::4, 60 samples
    assert sorted(v for batch in whole for v in batch if v < 1000) == list(range(50))  # a pass: no duplicate, no gap
    first, state, _, _ = read(make, 2, 1, 1, steps=7, workers=2)  # odd: the next batch is each rank's worker 1's
    rest, _, note, _ = read(make, 2, 1, 1, steps=23, workers=2, state=state)
    assert first + rest == whole
    assert (note is None) == (make is sd.Parts)
    with pytest.raises(CheckpointError, match=r"2 data-parallel ranks x 2 loader workers .* this run has 1 x 2"):
        Data(make(), None, 1, False, 2).check_position(state, Data(make(), None, 1, False, 2).sampler(1, 0, 1, 0, 14),
                                                       "ckpt")


def _noisy(make, world: int, b: int, accum: int, steps: int, start: int = 0, state: dict | None = None,
           workers: int = 2):
    """`read`, for samples [value, draws...]: each step's global batch as rows, in the global batch's order."""
    datas = [Data(make(), None, b, False, workers) for _ in range(world)]
    for d in datas if state else ():
        d.load_position(state)
    its = [iter(d.loader(d.sampler(accum, r, world, 7, start), CPU, 7)) for r, d in enumerate(datas)]
    rows = []
    for _ in range(steps):
        per_rank = [[next(it) for _ in range(accum)] for it in its]
        rows += [row.tolist() for m in range(accum) for r in range(world) for row in per_rank[r][m]]
    seen = start + steps * b * accum * world
    gather = lambda _: [d._reading.local_record() for d in datas]  # noqa: E731
    at = datas[0].sampler(accum, 0, world, 7, seen)
    after = {"samples_seen": seen, "data_fingerprint": datas[0].fingerprint(at), **datas[0].position_state(at, gather)}
    return rows, after


@pytest.mark.parametrize("make", [sd.NoisyMap, sd.NoisyStateful])
def test_random_draws_in_loader_workers_follow_the_sample_on_any_split_and_across_a_resume(make):
    """A dataset's augmentation in a loader worker drew from the worker's generators, which torch seeds from one seed
    for every rank's loader and again at each resume: two ranks drew the same noise, and a resumed run replayed the
    first steps' noise (a loss off the uninterrupted run's from the first step after it)."""
    whole, _ = _noisy(make, 1, 4, 1, steps=6)  # 24 samples, 2 workers
    assert [int(r[0]) for r in whole] == list(range(24))
    draws = [tuple(r[1:]) for r in whole]
    assert len(set(draws)) == len(draws)  # every sample its own draws (the two workers' among them)
    # 2 ranks x 2 micro-steps of 1, resumed after 2 steps of the first run: each sample's draws are its own.
    first, state = _noisy(make, 1, 4, 1, steps=2)
    rest, _ = _noisy(make, 2, 1, 2, steps=4, start=8, state=state if make is not sd.NoisyMap else None)
    assert first + rest == whole
    if make is sd.NoisyMap:  # A dataset that says it draws nothing (random_draws = False) is not seeded: the workers'
        quiet, _ = _noisy(sd.QuietNoisyMap, 1, 4, 1, steps=6)  # own generators draw, and start over at a resume
        resumed, _ = _noisy(sd.QuietNoisyMap, 1, 4, 1, steps=4, start=8)
        assert resumed[:4] == [[8 + i, *quiet[i][1:]] for i in range(4)] != quiet[8:12]


@pytest.mark.parametrize("make,world", [(sd.NoisySized, 1), (sd.NoisyStatelessParts, 2)])
def test_a_stream_read_again_on_a_resume_leaves_the_restored_generators_as_the_checkpoint_had_them(make, world):
    """data.num_workers=0: a stream draws from the process's generators, which the checkpoint keeps. A stream
    without state_dict is read again from its pass's start on a resume, and those reads drew again from the
    restored generators: every later sample's noise (and the model's dropout after it) was off the uninterrupted
    run's. (Two ranks read parts here, one after the other in this process, as their own processes would.)"""
    import random

    import numpy as np

    from trainer.checkpoint.rng import rng_state, set_rng_state

    def seeded():
        torch.manual_seed(0), random.seed(0), np.random.seed(0)

    seeded()
    whole, _ = _noisy(make, world, 1, 1, steps=12, workers=0)
    seeded()
    first, state = _noisy(make, world, 1, 1, steps=4, workers=0)
    kept = rng_state()  # (what the checkpoint holds)
    seeded()  # (a fresh process, then the checkpoint's generators)
    set_rng_state(kept)
    rest, _ = _noisy(make, world, 1, 1, steps=8, start=4 * world, state=state, workers=0)
    assert [r[0] for r in first + rest] == [r[0] for r in whole]  # (the same samples: the skip itself is right)
    assert first + rest == whole


def test_random_draws_in_the_readers_of_parts_are_the_same_on_a_resume():
    whole, _ = _noisy(sd.NoisyParts, 2, 1, 1, steps=30)
    first, state = _noisy(sd.NoisyParts, 2, 1, 1, steps=7)
    rest, _ = _noisy(sd.NoisyParts, 2, 1, 1, steps=23, start=14, state=state)
    assert first + rest == whole
    assert len({tuple(r[1:]) for r in whole}) == len(whole)


@pytest.mark.parametrize(("make", "says"), [
    (sd.Lying, "yielded 40 samples in pass 0, but its __len__ says 50"),
    (lambda: sd.Numbers(0), "yielded no samples"),
    (sd.Unjsonable, "Unjsonable.state_dict() returned what JSON cannot hold"),
])
def test_a_stream_that_breaks_its_promises_is_one_paragraph_even_from_a_worker(make, says):
    with pytest.raises(DataError) as e:
        read(make, 1, 4, 1, steps=16, workers=1)
    assert says in str(e.value) and "Traceback" not in str(e.value)


@pytest.mark.parametrize(("target", "extra", "says"), [
    ("windows", ["data.shuffle=true"], "data.shuffle=true, but the training split"),
    ("unsized", ["data.shuffle=false", "trainer.max_epochs=2", "trainer.max_steps=null"],
     "trainer.max_epochs is set, but the training split built by data._target_='stream_data.unsized' is a stream"),
    ("unsized_val", ["data.shuffle=false"], "val split built by data._target_='stream_data.unsized_val' is an "
                                            "IterableDataset (_Unsized) without __len__"),
])
def test_what_a_stream_cannot_honour_is_refused_before_anything_runs(tmp_path, target, extra, says):
    from test_errors import assert_clean_error

    r = run_here("debug=smoke", f"data._target_=stream_data.{target}", *extra, f"hydra.run.dir={tmp_path / 'run'}",
                 cwd=tmp_path, env=FAULTY_ENV)
    assert_clean_error(r, says)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("target", "says"), [("dicts", "dicts with keys x, y"),
                                             ("inputs_only", "single torch.int64 tensors of shape (4, 32)")])
def test_samples_the_lm_task_does_not_take_are_one_paragraph_and_no_run_dir(tmp_path, target, says):
    """A stream of dicts was a KeyError in the lm task's num_targets, a stream of inputs alone an unpacking
    error in its loss: tracebacks, exit 1, the run dir left."""
    from test_errors import assert_clean_error

    r = run_here("debug=smoke", f"data._target_=stream_data.{target}", "data.shuffle=false", "trainer.max_steps=2",
                 f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, env=FAULTY_ENV)
    assert_clean_error(r, "the lm task takes batches (x, y) of token ids", f"this data's batches are {says}")
    assert not (tmp_path / "run").exists()


def test_int32_token_ids_train_as_int64_ones_do(tmp_path):
    """int32 ids (a numpy memmap's) passed the batch check, then were torch's traceback in cross_entropy."""
    args = ("debug=smoke", "data.shuffle=false", "trainer.max_steps=2", "trainer.eval_every=0")
    runs = {}
    for target in ("windows", "int32_ids"):
        r = run_here(*args, f"data._target_=stream_data.{target}", f"hydra.run.dir={tmp_path / target}", cwd=tmp_path,
                     env=FAULTY_ENV)
        assert r.returncode == 0, r.stderr
        runs[target] = [e["train/loss"] for e in read_metrics(tmp_path / target) if "train/loss" in e]
    assert runs["int32_ids"] == runs["windows"] and len(runs["windows"]) == 2


def test_epochs_of_a_stream_read_in_parts_by_several_readers_are_refused(tmp_path):
    """Each reader starts its own part over when it ends: with files of 3000 and 1000 bytes, "1 epoch" read the
    small file several times and the large one not to its end, and said "1.00 passes"."""
    from test_errors import assert_clean_error

    (tmp_path / "tx").mkdir()
    (tmp_path / "tx" / "a.txt").write_text("a" * 3000)
    (tmp_path / "tx" / "b.txt").write_text("b" * 1000)
    r = run_here("debug=smoke", "data=text_stream", f"data.path={tmp_path / 'tx'}", "data.by_file=true",
                 "data.num_workers=2", "trainer.max_epochs=1", "trainer.max_steps=null",
                 f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert_clean_error(r, "trainer.max_epochs is set, but", "read in parts (read_part) by up to 2 readers")
    assert not (tmp_path / "run").exists()
    # More readers than files: refused before anything runs (three steps trained first, then exit 2, a run dir left).
    r = run_here("debug=smoke", "data=text_stream", f"data.path={tmp_path / 'tx'}", "data.by_file=true",
                 "data.num_workers=3", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert_clean_error(r, "read in parts (read_part) by 3 readers", "but it has 2 parts (num_parts)")
    assert not (tmp_path / "run").exists()
    # The stream's checks read world.nproc_per_node=auto (ddp's default) as a count (a TypeError for every stream).
    from conftest import compose_cfg

    from trainer.config.instantiate import build_data

    for extra in ([], ["data.by_file=true", "trainer.max_epochs=1", "trainer.max_steps=null"]):
        cfg = compose_cfg(["debug=smoke", "data=text_stream", f"data.path={tmp_path / 'tx'}", "world=ddp", *extra])
        assert cfg.world.nproc_per_node == "auto"
        build_data(cfg.data)  # (one process here: one reader, so the epochs of parts are fine)


def test_a_sized_stream_has_epochs_and_a_val_stream_is_evaluated(tmp_path):
    r = run_here("debug=smoke", "data._target_=stream_data.windows_and_val", "data.shuffle=false", "data.batch_size=8",
                 "trainer.max_steps=null", "trainer.max_epochs=2", f"hydra.run.dir={tmp_path}", cwd=tmp_path,
                 env=FAULTY_ENV)
    assert r.returncode == 0, r.stderr
    assert "trainer.max_epochs=2: 16 steps of 8 samples (8 per epoch of 64)" in r.stdout
    assert [e["step"] for e in read_metrics(tmp_path) if "val/loss" in e] == [16]


# -- runs -------------------------------------------------------------------------------------------------------
STREAM = ("data=text_stream", "data.batch_size=4", "trainer.max_steps=12", "trainer.eval_every=6",
          "checkpoint.every_n_steps=4", "checkpoint.async_save=false", "ema.enabled=true", "ema.decay=0.9")


@pytest.fixture(scope="module")
def stream_reference(corpus, tmp_path_factory):
    """One process, batch 4, no workers, in-process: what the other splits and the resumed run must give."""
    run_dir = tmp_path_factory.mktemp("stream_reference")
    train_in_process(corpus, run_dir, *STREAM, f"data.val_path={corpus}")
    return run_dir


def test_a_stream_copied_elsewhere_resumes_and_one_edited_in_place_is_refused(corpus, tmp_path, stream_reference):
    """A preempted job that copies its corpus to node-local scratch at each start: the stream's fingerprint held
    the files' paths and modification times, so the same bytes elsewhere (or a file touched) were refused as
    "another dataset", with no way to follow the advice."""
    import os
    import shutil

    copy = tmp_path / "scratch" / corpus.name
    copy.parent.mkdir()
    shutil.copyfile(corpus, copy)  # (a new path and modification time)
    os.utime(copy, (1, 1))
    run = tmp_path / "run"
    shutil.copytree(stream_reference, run)
    step_8 = f"resume={stream_reference}/checkpoints/step_00000008"
    train_in_process(copy, run, *STREAM, f"data.val_path={corpus}", step_8)
    assert_identical(run, stream_reference)
    # One byte changed in place, same size: other data, refused (the file's first block is always sampled).
    data = bytearray(copy.read_bytes())
    data[0] ^= 1
    copy.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="trained on another dataset than this run's stream"):
        train_in_process(copy, tmp_path / "edited", *STREAM, f"data.val_path={corpus}", step_8)
    # A checkpoint written before (its fingerprint of paths, sizes and times) still resumes on those files.
    import hashlib

    from trainer.data import streaming
    from trainer.recipes.lm.data import TextStream

    stream, st = TextStream([corpus], 256), os.stat(corpus)
    # (the expression of the code before, FORMAT 1, written out here: a copy made wrongly would not match it)
    before = hashlib.sha256(repr((1, 256, [(str(corpus), st.st_size, st.st_mtime_ns)])).encode()).hexdigest()[:16]
    assert stream.earlier_fingerprints == [before]
    assert streaming.fingerprint(stream, before) in streaming.fingerprints(stream)


@pytest.mark.slow
def test_sigkill_then_resume_auto_is_bit_identical_with_loader_workers(corpus, tmp_path, stream_reference):
    from conftest import tiny_overrides

    args = (*STREAM, f"data.val_path={corpus}", "data.num_workers=2")
    r = run_cli(*tiny_overrides(corpus, *args), f"hydra.run.dir={tmp_path}", *faulty("sigkill", 11), env=FAULTY_ENV)
    assert r.returncode == -9 and checkpoints(tmp_path)[-1] == "step_00000008"
    train_in_process(corpus, tmp_path, *args, "resume=auto")
    assert_identical(tmp_path, stream_reference)


@pytest.mark.slow
def test_two_ranks_with_loader_workers_equal_one_process_and_leave_no_process(corpus, tmp_path, stream_reference):
    """Also: the loader's workers end with the job. (Workers forked from the launcher's forkserver inherit
    "forkserver" as the default start method; their loader workers then started through a forkserver of their
    own, which they kept alive after the job.)"""
    import uuid

    from conftest import tiny_overrides
    from test_distributed import _processes_with_marker

    key, value = "TRAINER_TEST_MARKER", uuid.uuid4().hex
    r = run_cli(*tiny_overrides(corpus, *STREAM, f"data.val_path={corpus}", "world=ddp", "world.nproc_per_node=2",
                                "data.batch_size=2", "data.num_workers=1"), f"hydra.run.dir={tmp_path}",
                env={key: value})
    assert r.returncode == 0, r.stderr
    assert_same_run(tmp_path, stream_reference)
    assert _processes_with_marker(f"{key}={value}") == []


def test_a_data_function_without_a_null_key_of_the_data_option_builds(tmp_path):
    """`cache_dir: null` of the stdlib data option, under a data._target_ that takes no cache_dir, was "not an option"
    with the advice ~data.cache_dir, which Hydra refuses for a null key: no command line could run it."""
    r = run_here("debug=smoke", "data._target_=stream_data.windows_without_a_cache", "data.shuffle=false",
                 "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, env=FAULTY_ENV)
    assert r.returncode == 0, r.stderr
    r = run_here("debug=smoke", "data._target_=stream_data.windows_without_a_cache", "data.shuffle=false",
                 "data.cache_dir=/tmp/x", f"hydra.run.dir={tmp_path / 'run2'}", cwd=tmp_path, env=FAULTY_ENV)
    assert r.returncode == 2 and "data.cache_dir is not an option" in r.stderr  # (a value is still refused)


def test_the_loader_workers_of_a_stream_end_when_train_returns(corpus, tmp_path):
    """trainer.train from Python (a notebook): the stream's loader workers lived on after train returned, until the
    garbage collector reached the Trainer that held them (and at interpreter exit a pytest worker was interrupted
    joining one)."""
    import multiprocessing

    before = {p.pid for p in multiprocessing.active_children()}
    train_in_process(corpus, tmp_path, *STREAM, "trainer.max_steps=4", "data.num_workers=1")
    assert {p.pid for p in multiprocessing.active_children()} - before == set()


def test_a_text_stream_that_leaves_much_of_its_corpus_out_says_so(tmp_path, capsys):
    """Windows are cut within each file: a corpus of files shorter than a window trained on a third of its bytes
    without a word (data=text reads the files as one text). Said once, with the numbers; a corpus read whole is not."""
    from trainer.recipes.lm.data import text_stream

    text = bytes(range(32, 127)) * 40
    for i in range(30):
        (tmp_path / f"short{i:02}.txt").write_bytes(text[:190])
    (tmp_path / "long.txt").write_bytes(text[:3000])
    for _ in range(2):  # (torchrun's rank 0 builds it twice: in its checks, then to train)
        train, _ = text_stream(str(tmp_path / "*.txt"), seq_len=256)
    assert len(train) == 11  # (the long file's windows alone)
    said = capsys.readouterr().out
    assert said.count("note: data=text_stream cuts its windows") == 1, said
    assert "5,883 of the corpus's 8,700 bytes are in no sample (30 of its 31 files are shorter than a window" in said
    (tmp_path / "whole").mkdir()
    (tmp_path / "whole" / "a.txt").write_bytes(text[: 256 * 10 + 1])
    text_stream(str(tmp_path / "whole" / "a.txt"), seq_len=256)
    assert capsys.readouterr().out == ""
