"""Hostile and inconsistent checkpoints whose sha256s match (issue 19, items 4 and 6).

The sha256 manifest proves integrity, not sanity: whoever can write a checkpoint can rewrite its hashes
too. Each case copies one good run, damages its newest checkpoint (step 12), rewrites the manifest's
sha256s to match, and holds the framework to three things, in one built Trainer per case:

(b) `resume=<that checkpoint>` is one CheckpointError paragraph naming the checkpoint, the file or key,
    and the reason;
(c) that refusal applied nothing: the live weights, optimizer, components, RNGs and counters are as built;
(a) `resume=auto` then skips it with the same reason and falls back to step 8, ending in exactly the state
    a clean load of step 8 gives. Training from equal states is bit-identical, and a sample of the cases
    also trains on to the end and is compared with the uninterrupted run, losses and weights, bit for bit.

Everything runs in-process (a case is ~0.15 s) but one end-to-end FIFO case through the CLI.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import (
    SHARED,
    assert_identical,
    compose_cfg,
    once_per_run,
    run_here,
    tiny_overrides,
    train_in_process,
)
from safetensors.torch import load_file, save_file

from trainer.checkpoint.snapshot import Stored, assemble
from trainer.checkpoint.store import Checkpointer, sha256, step_of
from trainer.errors import CheckpointError

SINGLE = ("data.batch_size=8", *SHARED)
NEWEST, FALLBACK = "step_00000012", "step_00000008"


@pytest.fixture(scope="module")
def good(corpus, tmp_path_factory) -> Path:
    """One uninterrupted run (checkpoints at steps 8 and 12): the source of every case and the reference
    every fallback must reproduce."""
    return once_per_run(tmp_path_factory, "hostile_good",
                        lambda run_dir: train_in_process(corpus, run_dir, *SINGLE))


class Hung(Exception):
    """Not an OSError: code that catches those (and would carry on after a blocked read) lets this through."""


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail instead of hanging (a FIFO opened for reading blocks until a writer comes)."""
    def expire(*_):
        raise Hung(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# -- what an attacker can do to a checkpoint ---------------------------------------------------------------
def manifest(ckpt: Path) -> dict:
    return json.loads((ckpt / "manifest.json").read_text())


def write_manifest(ckpt: Path, m: dict) -> None:
    (ckpt / "manifest.json").write_text(json.dumps(m))


def rehash(ckpt: Path) -> None:
    """The attacker's last move: every listed regular file's sha256 rewritten to match (a symlink's target's)."""
    m = manifest(ckpt)
    for name in m["files"]:
        p = ckpt / name
        if p.is_file() and p.stat().st_size < 1 << 30:
            m["files"][name] = sha256(p)
    write_manifest(ckpt, m)


def split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def join(header, data: bytes) -> bytes:
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + data


def edit_header(name: str, change: Callable[[dict], object]) -> Callable[[Path], None]:
    """A safetensors file whose header is `change(header)` and whose data is untouched."""
    def damage(ckpt: Path) -> None:
        header, data = split(ckpt / name)
        (ckpt / name).write_bytes(join(change(header), data))
    return damage


def entry(key: str, **fields) -> Callable[[dict], dict]:
    def change(header: dict) -> dict:
        header[key].update(fields)
        return header
    return change


def edit_tensors(name: str, change: Callable[[dict], None]) -> Callable[[Path], None]:
    """A well-formed safetensors file holding other tensors (written by the library itself)."""
    def damage(ckpt: Path) -> None:
        tensors = load_file(str(ckpt / name))
        change(tensors)
        save_file(tensors, str(ckpt / name), metadata={"format": "pt"})
    return damage


def edit_tree(change: Callable[[dict], object]) -> Callable[[Path], None]:
    def damage(ckpt: Path) -> None:
        tree = json.loads((ckpt / "state.json").read_text())
        out = change(tree)
        (ckpt / "state.json").write_text(out if isinstance(out, str) else json.dumps(tree))
    return damage


def edit_manifest(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def damage(ckpt: Path) -> None:
        m = manifest(ckpt)
        change(m)
        write_manifest(ckpt, m)
    return damage


def replace(name: str, make: Callable[[Path], None]) -> Callable[[Path], None]:
    def damage(ckpt: Path) -> None:
        (ckpt / name).unlink()
        make(ckpt / name)
    return damage


def deep(tree: dict) -> str:
    tree["nonfinite"]["consecutive_skips"] = "DEEP"
    return json.dumps(tree).replace('"DEEP"', "[" * 10_000 + "]" * 10_000)


def sparse(name: str, size: int = 200 << 30) -> Callable[[Path], None]:
    """A 200 GiB sparse file (its sha256 would take minutes); the hash left as the attacker claims it."""
    def damage(ckpt: Path) -> None:
        os.truncate(ckpt / name, size)
    return damage


def overlapping_chunks(ckpt: Path) -> None:
    """pos_emb.weight (32 x 64) as two chunks that both hold rows 0-15: as many elements as the tensor, but
    rows 16-31 in neither."""
    meta = {"format": "pt", "chunks": json.dumps({"pos_emb.weight": {"shape": [32, 64], "offset": [0, 0]}})}
    tensors = load_file(str(ckpt / "model.safetensors"))
    save_file({"pos_emb.weight": tensors["pos_emb.weight"][:16].clone()}, str(ckpt / "model.rank00001.safetensors"),
              metadata=meta)
    tensors["pos_emb.weight"] = tensors["pos_emb.weight"][:16].clone()
    save_file(tensors, str(ckpt / "model.safetensors"), metadata=meta)
    m = manifest(ckpt)
    m["files"]["model.rank00001.safetensors"] = ""
    write_manifest(ckpt, m)


def set_python_rng(change: Callable[[list], None]) -> Callable[[Path], None]:
    def edit(tree: dict) -> None:
        change(tree["rng"][0]["python"]["__tuple__"][1]["__tuple__"])
    return edit_tree(edit)


@dataclass
class Case:
    id: str
    damage: Callable[[Path], None]
    needles: tuple[str, ...]  # in the message, besides the checkpoint's path
    rehash: bool = True


S, M = "state.safetensors", "model.safetensors"
STEP = "/optimizer/state/blocks.0.mlp.0.weight/step"
EXP_AVG = "/optimizer/state/blocks.0.mlp.0.weight/exp_avg"  # 256 x 64: its transpose has the same numel


CASES = [
    # The manifest: rewritten as valid JSON.
    Case("manifest-files-empty", edit_manifest(lambda m: m.update(files={})), ("manifest.json", "model.safetensors")),
    Case("manifest-not-an-object", lambda c: (c / "manifest.json").write_text("[2, 12]"), ("manifest.json", "not a JSON object"),
         rehash=False),
    Case("manifest-no-format", edit_manifest(lambda m: m.pop("format")), ("manifest.json", "format")),
    Case("listed-file-missing", lambda c: (c / S).unlink(), (S, "missing")),
    Case("file-not-listed", edit_manifest(lambda m: m["files"].pop(S)), ("manifest.json", S)),
    Case("config-yaml-not-listed-and-a-fifo", lambda c: (edit_manifest(lambda m: m["files"].pop("config.yaml"))(c),
                                                         replace("config.yaml", os.mkfifo)(c)), ("config.yaml",)),
    Case("config-yaml-alias-bomb", lambda c: (c / "config.yaml").write_text(
        "a0: &a0 {x: 1, y: 2}\n" + "".join(f"a{i}: &a{i} {{p: *a{i - 1}, q: *a{i - 1}}}\n" for i in range(1, 40))),
         ("config.yaml", "alias")),
    Case("config-yaml-3000-deep", lambda c: (c / "config.yaml").write_text("a: " + "{b: " * 3000 + "1" + "}" * 3000),
         ("config.yaml", "nests more than 64")),
    Case("config-yaml-not-yaml", lambda c: (c / "config.yaml").write_text("a: [1, 2\n\tb: }"), ("config.yaml", "not YAML")),
    Case("dotdot-file-name", edit_manifest(lambda m: m["files"].update({f"../{FALLBACK}/{M}": m["files"].pop(M)})),
         (f"../{FALLBACK}/{M}",)),
    Case("absolute-file-name", edit_manifest(lambda m: m["files"].update({"/etc/passwd": m["files"]["state.json"]})),
         ("/etc/passwd",)),
    Case("symlink-out-of-the-checkpoint", replace(M, lambda p: p.symlink_to(Path("..") / FALLBACK / M)),
         (M, "symbolic link")),
    Case("fifo", replace(M, os.mkfifo), (M, "FIFO"), rehash=False),
    Case("directory", replace(S, os.mkdir), (S, "directory"), rehash=False),
    # (a step_N dir whose manifest is not a regular file is tried too: named and set aside, never passed over
    # silently and deleted by a later save of that step)
    Case("manifest-is-a-fifo", replace("manifest.json", os.mkfifo), ("manifest.json", "is a FIFO"), rehash=False),
    # safetensors headers.
    Case("header-length-past-the-end", lambda c: (c / M).write_bytes(struct.pack("<Q", 10**9) + (c / M).read_bytes()[8:]),
         (M, "header length")),
    Case("header-length-huge", lambda c: (c / M).write_bytes(struct.pack("<Q", 2**63) + (c / M).read_bytes()[8:]),
         (M, "header length")),
    Case("shape-2**40", edit_header(M, entry("pos_emb.weight", shape=[2**40, 64])), (M, "pos_emb.weight")),
    Case("shape-and-offsets-2**40", edit_header(M, lambda h: h | {"pos_emb.weight": {
        "dtype": "F32", "shape": [2**40], "data_offsets": [0, 2**42]}}), (M,)),
    Case("shape-negative", edit_header(M, entry("pos_emb.weight", shape=[-32, -64])), (M, "pos_emb.weight")),
    Case("offsets-overlap", edit_header(M, lambda h: h | {"ln_f.weight": {**h["ln_f.weight"],
                                                                         "data_offsets": h["blocks.0.ln1.weight"]["data_offsets"]}}),
         (M, "overlap")),
    Case("offsets-past-the-end", edit_header(M, lambda h: h | {"tok_emb.weight": {
        **h["tok_emb.weight"], "data_offsets": [h["tok_emb.weight"]["data_offsets"][0] + 4,
                                                h["tok_emb.weight"]["data_offsets"][1] + 4]}}), (M,)),
    Case("dtype-unknown", edit_header(M, entry("pos_emb.weight", dtype="F99")), (M, "pos_emb.weight")),
    Case("header-a-json-list", edit_header(M, lambda h: list(h)), (M, "not a JSON object")),
    Case("chunk-metadata-nested", edit_header(M, lambda h: h | {"__metadata__": {"chunks": "[" * 100_000}}), (M, "chunk")),
    Case("chunks-overlap-and-leave-a-gap", overlapping_chunks, ("pos_emb.weight",)),
    Case("sparse-200GiB-state.safetensors", sparse(S), (S, "bytes"), rehash=False),
    Case("sparse-200GiB-state.json", sparse("state.json"), ("state.json", "bytes"), rehash=False),
    # state.json.
    Case("nesting-10000-deep", edit_tree(deep), ("state.json", "nests")),
    Case("nesting-100-deep", edit_tree(lambda t: json.dumps(t).replace('"consecutive_skips": 0', '"consecutive_skips": '
                                                                       + "[" * 100 + "]" * 100)),
         ("state.json", "nests more than 64 levels")),
    Case("samples_seen-1e30", edit_tree(lambda t: t["trainer"].update(samples_seen=1e30)), ("samples_seen", "1e+30")),
    Case("samples_seen-10**400", edit_tree(lambda t: json.dumps(t).replace('"samples_seen": 96', '"samples_seen": 1' + "0" * 400)),
         ("samples_seen",)),
    Case("schedule-position-negative", edit_tree(lambda t: t["scheduler"].update(last_epoch=-5)), ("last_epoch",)),
    Case("samples_seen-negative", edit_tree(lambda t: t["trainer"].update(samples_seen=-5)), ("samples_seen", "-5")),
    Case("trained-seconds-nan", edit_tree(lambda t: t["trainer"]["trained"].update(seconds=float("nan"))),
         ("trainer/trained/seconds", "nan")),
    Case("trained-steps-negative", edit_tree(lambda t: t["trainer"]["trained"].update(steps=-3)),
         ("trainer.trained", "'steps': -3")),
    Case("step-a-string", edit_tree(lambda t: t["trainer"].update(step="5")), ("step", "'5'")),
    Case("step-negative", edit_tree(lambda t: t["trainer"].update(step=-5)), ("step", "-5")),
    Case("step-1e30", edit_tree(lambda t: t["trainer"].update(step=1e30)), ("step",)),
    Case("step-differs-from-the-manifest", edit_tree(lambda t: t["trainer"].update(step=8)), ("step", "8", "12")),
    Case("lr-nan", edit_tree(lambda t: json.dumps(t).replace('"_last_lr": [0.0005', '"_last_lr": [NaN')), ("_last_lr", "nan")),
    Case("missing-trainer", edit_tree(lambda t: t.pop("trainer")), ("trainer",)),
    Case("missing-rng", edit_tree(lambda t: t.pop("rng")), ("rng",)),
    Case("missing-optimizer-state", edit_tree(lambda t: t["optimizer"].pop("state")), ("optimizer", "state")),
    Case("trainer-a-list", edit_tree(lambda t: t.update(trainer=[1, 2])), ("trainer", "list")),
    Case("tree-a-list", lambda c: (c / "state.json").write_text("[1, 2]"), ("state.json",)),
    Case("optimizer-state-a-list", edit_tree(lambda t: t["optimizer"].update(state=[1])), ("optimizer", "list")),
    Case("param-group-a-string", edit_tree(lambda t: t["optimizer"]["param_groups"].__setitem__(0, "x")),
         ("param_groups/0",)),
    Case("items-with-a-list-key", edit_tree(lambda t: t.update(nonfinite={"__items__": [[[1], 0]]})), ("nonfinite",)),
    Case("tuple-not-a-list", edit_tree(lambda t: t["loggers"].update(JsonlLogger={"__tuple__": 5})), ("JsonlLogger",)),
    Case("rng-torch-int8", edit_tensors(S, lambda d: d.update({"/rng/0/torch": d["/rng/0/torch"].view(torch.int8)})),
         ("/rng/0/torch", "int8")),
    Case("rng-torch-short", edit_tensors(S, lambda d: d.update({"/rng/0/torch": d["/rng/0/torch"][:-16].clone()})),
         ("/rng/0/torch", "5040")),
    Case("rng-python-short", set_python_rng(lambda s: s.pop()), ("rng", "python")),
    Case("rng-python-bad-position", set_python_rng(lambda s: s.__setitem__(624, 700)), ("RNG state",)),
    Case("rng-torch-invalid-bytes", edit_tensors(S, lambda d: d["/rng/0/torch"].fill_(255)), ("RNG state",)),
    # Format and step in the manifest.
    Case("format-a-string", edit_manifest(lambda m: m.update(format="1")), ("'1'", "not a version number")),
    Case("format-99", edit_manifest(lambda m: m.update(format=99)), ("format version 99", "newer", "Upgrade")),
    Case("format-1", edit_manifest(lambda m: m.update(format=1)), ("format version 1", "older trainer")),
    *(Case(f"manifest-step-{v!r}", edit_manifest(lambda m, v=v: m.update(step=v)), ("manifest.json", "step"))
      for v in (-5, 12.0, "12", 2**62, True, None)),
    # Values that used to load silently wrong.
    Case("pos_emb-as-int32", edit_header(M, entry("pos_emb.weight", dtype="I32")), ("pos_emb.weight", "int32")),
    Case("exp_avg-transposed", edit_header(S, entry(EXP_AVG, shape=[64, 256])), (EXP_AVG, "(64, 256)")),
    Case("exp_avg-float64", edit_tensors(S, lambda d: d.update({EXP_AVG: d[EXP_AVG].double()})), (EXP_AVG, "float64")),
    Case("optimizer-step-int64", edit_tensors(S, lambda d: d.update({STEP: d[STEP].long()})), (STEP, "int64")),
    Case("ema-shadow-missing", edit_tensors(S, lambda d: d.pop("/ema/shadow/ln_f.weight")), ("/ema/shadow/ln_f.weight",)),
    Case("model-key-extra", edit_tensors(M, lambda d: d.update(extra=torch.zeros(3))), ("extra", "not in the model")),
    Case("model-key-missing", edit_tensors(M, lambda d: d.pop("ln_f.weight")), ("ln_f.weight", "missing")),
]
PARAMS = [pytest.param(c, id=c.id) for c in CASES]


def damaged(good: Path, to: Path, case: Case) -> Path:
    """A copy of the good run whose newest checkpoint `case` damaged (hashes rewritten to match). Returns it."""
    shutil.copytree(good, to, symlinks=True)
    ckpt = to / "checkpoints" / NEWEST
    case.damage(ckpt)
    if case.rehash:
        rehash(ckpt)
    return ckpt


def live_state(trainer) -> dict:
    """Everything a load could change: weights, optimizer, every component's state, the RNGs, the counters.
    Training from equal states is bit-identical (the end-to-end runs below show it), so a fallback that ends
    in the state of a clean load of step 8 continues the reference run exactly."""
    return {"model": {k: v.clone() for k, v in trainer.strategy.model_state_dict(trainer.model).items()},
            "state": trainer.checkpoints.state(), "python_rng": random.getstate(),  # optimizer state by name
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in trainer.optimizer.param_groups]}


def assert_same(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}/{i}")
    else:
        assert a == b, where


@pytest.fixture(scope="module")
def cfg(corpus):
    # Composed once (~0.1 s a time); a given peak skips the CPU's 50 ms matmul probe (it only scales train/mfu).
    return compose_cfg(tiny_overrides(corpus, *SINGLE, "trainer.peak_tflops=1"))


@contextlib.contextmanager
def built(cfg, run_dir: Path, resume: str):
    """A Trainer as `train` builds it, and its config with `resume` set; torn down afterwards."""
    from omegaconf import OmegaConf

    from trainer.entry.run import build

    cfg = OmegaConf.merge(cfg, {"resume": resume})
    trainer = build(cfg, run_dir)
    try:
        yield trainer, cfg
    finally:
        trainer.backend.teardown()


@pytest.fixture(scope="module")
def state_at_8(good, cfg, tmp_path_factory) -> dict:
    """The live state right after a clean load of the good step 8."""
    from trainer.checkpoint.manager import resume

    with built(cfg, tmp_path_factory.mktemp("clean"), str(good / "checkpoints" / FALLBACK)) as (trainer, cfg):
        resume(trainer, cfg, say=lambda *a: None)
        return live_state(trainer)


@pytest.mark.parametrize("case", PARAMS)
def test_refused_on_its_path_and_skipped_by_auto_with_the_reason(case, good, state_at_8, cfg, tmp_path):
    from omegaconf import OmegaConf

    from trainer.checkpoint.manager import resume

    run_dir = tmp_path / "run"
    ckpt = damaged(good, run_dir, case)
    with built(cfg, run_dir, str(ckpt)) as (trainer, cfg):
        # (b) resume=<that checkpoint>: one paragraph naming the checkpoint, the file or key, and the reason;
        before = live_state(trainer)
        with deadline(15), pytest.raises(CheckpointError) as e:
            resume(trainer, cfg, say=print)
        message = str(e.value)
        assert "\n" not in message and str(ckpt) in message, message
        for needle in case.needles:
            assert needle in message, message
        # (c) and nothing of it applied: a fresh optimizer stays fresh (the load's template is undone).
        assert not trainer.optimizer.state
        assert_same(live_state(trainer), before)
        # (a) resume=auto skips it, saying why, and ends in the state of a clean load of step 8.
        said: list[str] = []
        started = time.monotonic()
        with deadline(15):
            source = resume(trainer, OmegaConf.merge(cfg, {"resume": "auto"}), say=said.append)
        assert time.monotonic() - started < 10  # nothing hashed, parsed or waited on for long
        assert source == run_dir / "checkpoints" / FALLBACK
        skipped = [line for line in said if line.startswith(f"warning: skipping checkpoint {ckpt}: ")]
        assert len(skipped) == 1, said
        for needle in case.needles:
            assert needle in skipped[0], skipped[0]
        assert_same(live_state(trainer), state_at_8)


END_TO_END = ("fifo", "sparse-200GiB-state.safetensors", "chunks-overlap-and-leave-a-gap", "rng-python-short",
              "step-differs-from-the-manifest", "exp_avg-transposed")  # one of each kind


@pytest.mark.parametrize("case", [c for c in CASES if c.id in END_TO_END], ids=lambda c: c.id)
def test_resume_auto_falls_back_and_continues_bit_identically(case, good, corpus, tmp_path, capsys):
    run_dir = tmp_path / "run"
    ckpt = damaged(good, run_dir, case)
    capsys.readouterr()
    with deadline(30):
        train_in_process(corpus, run_dir, *SINGLE, "resume=auto")
    out = capsys.readouterr().out
    assert f"warning: skipping checkpoint {ckpt}: " in out
    assert f"resumed from {run_dir / 'checkpoints' / FALLBACK} at step 8" in out
    assert_identical(run_dir, good)


@pytest.mark.slow
def test_end_to_end_a_fifo_in_a_checkpoint_exits_2_with_one_paragraph(good, corpus, tmp_path):
    from test_errors import assert_clean_error

    case = next(c for c in CASES if c.id == "fifo")
    ckpt = damaged(good, tmp_path / "copy", case)
    r = run_here(*tiny_overrides(corpus, *SINGLE), f"hydra.run.dir={tmp_path / 'run'}", f"resume={ckpt}")
    assert_clean_error(r, str(ckpt), *case.needles)
    assert not (tmp_path / "run" / "checkpoints").exists()  # it trained nothing


def test_step_directories_with_a_sign_or_other_digits_are_not_checkpoints(good, tmp_path):
    root = tmp_path / "checkpoints"
    shutil.copytree(good / "checkpoints", root)
    for name, step in (("step_-0000005", -5), ("step_٠٠٠٠٠٠١٦", 16), ("step_+0000020", 20)):
        shutil.copytree(root / NEWEST, root / name)
        edit_manifest(lambda m, step=step: m.update(step=step, written=99))(root / name)
        assert step_of(root / name) == -1
    assert [p.name for p in Checkpointer(root).complete()] == [FALLBACK, NEWEST]
    Checkpointer(root, keep_last=1)._prune()  # prunes the checkpoints it knows, leaves other names alone
    assert sorted(p.name for p in root.iterdir()) == sorted([NEWEST, "step_-0000005", "step_٠٠٠٠٠٠١٦", "step_+0000020"])


@pytest.mark.parametrize(("parts", "why"), [
    ([((0, 0), (4, 6))], None),  # whole
    ([((0, 0), (1, 6)), ((1, 0), (3, 6))], None),  # uneven FSDP rows
    ([((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 3)), ((2, 3), (2, 3))], None),  # dp x tp
    ([((0, 0), (2, 6)), ((0, 0), (2, 6))], "overlap"),  # the same rows twice: as many elements as the whole
    ([((0, 0), (2, 6)), ((1, 0), (2, 6)), ((3, 0), (1, 6))], "overlap"),
    ([((0, 0), (2, 6)), ((3, 0), (1, 6))], "leave a gap"),
    ([((0, 0), (3, 6)), ((0, 0), (1, 6))], "overlap"),
])
def test_chunks_must_tile_a_tensor_exactly_once(parts, why):
    whole = torch.arange(24.0).reshape(4, 6)
    chunks = [Stored(whole[o[0]:o[0] + n[0], o[1]:o[1] + n[1]].clone(), (4, 6), o) for o, n in parts]
    if why is None:
        assert torch.equal(assemble("w", chunks, torch.empty(4, 6), "here"), whole)
    else:
        with pytest.raises(CheckpointError, match=f"the chunks of 'w' {why} here"):
            assemble("w", chunks, torch.empty(4, 6), "here")


def test_a_file_truncated_while_it_is_hashed_is_a_checkpoint_error_not_an_oserror(good, tmp_path, monkeypatch):
    """The headers were checked against the sizes; then the file shrinks before its hash is read. Every rank must
    reach the common verdict (an OSError would skip it and leave the other ranks waiting), and the user reads one
    sentence, not a traceback."""
    from trainer.checkpoint import store

    shutil.copytree(good, tmp_path / "copy")
    ckpt = tmp_path / "copy" / "checkpoints" / NEWEST
    checked = store._map_all

    def then_truncated(path, files):
        out = checked(path, files)
        os.truncate(ckpt / "state.safetensors", 100)
        return out

    monkeypatch.setattr(store, "_map_all", then_truncated)
    with pytest.raises(CheckpointError, match="state.safetensors is shorter than when it was opened"):
        store.read(ckpt)
