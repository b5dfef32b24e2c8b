"""d. Checkpoints: safetensors and trainer.checkpoint save/read against writing/reading the same bytes raw."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .harness import COMMON, Context, Item, alternate, compose, median, met_cell
from .loop import PlainLoop


def _state(cfg):
    """A model and optimizer after one step (so the AdamW moments exist), as (model_state, other state)."""
    import torch

    from trainer import build_data

    train_data, _ = build_data(cfg.data)
    loop = PlainLoop(cfg, train_data, torch.device("cpu"), bf16=True)
    loop.run(1)
    return loop.model.state_dict(), {"optimizer": loop.opt.state_dict(), "scheduler": loop.sched.state_dict()}


def _flat(model_state, state) -> dict:
    """Every tensor a checkpoint of (model_state, state) holds, by name: what one safetensors file would. Read
    back from a checkpoint written through the public Checkpointer (its files are plain safetensors)."""
    from safetensors.torch import load_file

    from trainer.checkpoint.store import Checkpointer

    tmp = Path(tempfile.mkdtemp(prefix="bench-flat-"))
    try:
        path = Checkpointer(tmp).save(1, model_state, state)
        return {**{f"model/{k}": v for k, v in load_file(str(path / "model.safetensors")).items()},
                **load_file(str(path / "state.safetensors"))}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _raw_bytes(tensors: dict) -> bytes:
    import torch

    return b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors.values())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """The raw twin of a checkpoint write: a temp file, fsynced, renamed into place, the directory fsynced."""
    import os

    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def materialize(obj: Any) -> Any:
    """A copy of every tensor in `obj`: safetensors maps files lazily, a raw read copies every byte."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: materialize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [materialize(v) for v in obj]
    return obj


def real_checkpoint_cases(model_state, state, tmp: Path, raw: bytes) -> tuple[dict, str]:
    """Save/read through trainer.checkpoint (the API the Trainer uses), with raw-bytes twins that fsync alike.

    Returns ({} , why) where that module is missing or its API differs from what this was written for;
    adapt the calls below when the API changes.
    """
    try:
        from trainer.checkpoint import store as ckpt

        def read(path: Path) -> list:
            """checkpoint.read maps the files and verifies every sha256; a resume then copies each tensor out
            of the mapping, so that is timed too (as a raw read copies every byte)."""
            loaded = ckpt.read(path)
            return [s.tensor() for part in (loaded.model, loaded.state) for chunks in part.values() for s in chunks]

        checkpointer = ckpt.Checkpointer(tmp / "checkpoints", keep_last=1)
        path = checkpointer.save(1, model_state, state)
        read(path)
    except (ImportError, AttributeError, TypeError) as e:
        return {}, f"trainer.checkpoint unusable here ({type(e).__name__}: {e})"
    raw_path = tmp / "raw-durable.bin"
    background = ckpt.Checkpointer(tmp / "async", keep_last=1, async_save=True)

    def save_blocking() -> float:
        """Seconds training waits for with checkpoint.async_save (the CPU snapshot); the write is not timed."""
        background.wait()
        t = time.perf_counter()
        background.save(1, model_state, state)
        blocked = time.perf_counter() - t
        background.wait()
        return blocked

    save_blocking.self_timed = True
    return {
        "save": lambda: checkpointer.save(1, model_state, state),
        "save_blocking": save_blocking,
        "raw_write_fsync": lambda: atomic_write_bytes(raw_path, raw),
        "load": lambda: read(path),
        "raw_read": lambda: raw_path.read_bytes(),
    }, "trainer.checkpoint.store.Checkpointer.save / trainer.checkpoint.store.read + a copy of every tensor (sha256 manifest, fsync, atomic rename)"


def measure(ctx: Context, sizes: dict) -> dict:
    from safetensors.torch import load_file, save_file

    cfg = compose([*COMMON, *ctx.data, *ctx.default_model])
    model_state, state = _state(cfg)
    tensors = _flat(model_state, state)
    raw = _raw_bytes(tensors)
    tmp = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    rounds = sizes["checkpoint_rounds"]
    try:
        st_path, raw_path = tmp / "state.safetensors", tmp / "raw.bin"
        fmt = {
            "safetensors_save": lambda: save_file(tensors, str(st_path)),
            "raw_write": lambda: raw_path.write_bytes(raw),
            "safetensors_load": lambda: materialize(load_file(str(st_path))),
            "raw_read": lambda: raw_path.read_bytes(),
            "sha256_of_the_bytes": lambda: hashlib.sha256(raw).digest(),  # what a verified checkpoint adds per pass
        }
        for fn in fmt.values():  # warm the page cache and the files' first allocation
            fn()
        t = alternate({k: (lambda fn=fn: _timed(fn)) for k, fn in fmt.items()}, rounds)
        real, api = real_checkpoint_cases(model_state, state, tmp, raw)
        rt = alternate({k: (fn if getattr(fn, "self_timed", False) else (lambda fn=fn: _timed(fn)))
                        for k, fn in real.items()}, rounds) if real else {}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ms = {k: 1000 * median(v) for k, v in {**t, **{f"checkpoint_{k}": v for k, v in rt.items()}}.items()}
    out = {
        "bytes": len(raw), "tensors": len(tensors), "rounds": rounds, "api": api, "ms": ms,
        "format_save_ratio": median([a / b for a, b in zip(t["safetensors_save"], t["raw_write"])]),
        "format_load_ratio": median([a / b for a, b in zip(t["safetensors_load"], t["raw_read"])]),
    }
    if rt:
        out["save_ratio"] = median([a / b for a, b in zip(rt["save"], rt["raw_write_fsync"])])
        out["save_blocking_ratio"] = median([a / b for a, b in zip(rt["save_blocking"], rt["raw_write_fsync"])])
        out["load_ratio"] = median([a / b for a, b in zip(rt["load"], rt["raw_read"])])
    return out


def rows(r: dict) -> list[str]:
    ms, mb = r["ms"], r["bytes"] / 2**20
    out = [f"| d. safetensors save_file, {mb:.1f} MiB model+optimizer | {ms['safetensors_save']:.1f} ms | "
           f"raw write {ms['raw_write']:.1f} ms | {r['format_save_ratio']:.2f}x | — | — |",
           f"| d. safetensors load_file + touch every tensor | {ms['safetensors_load']:.1f} ms | raw read "
           f"{ms['raw_read']:.1f} ms | {r['format_load_ratio']:.2f}x (sha256 of the bytes: "
           f"{ms['sha256_of_the_bytes']:.1f} ms) | — | — |"]
    if "save_ratio" in r:
        # The target is on speed (raw time / our time >= 0.8), i.e. our time at most 1.25x raw.
        for label, key, ratio in (("checkpoint save, synchronous (Checkpointer.save)", "checkpoint_save", "save_ratio"),
                                  ("checkpoint save: time training is blocked (async_save, the default)",
                                   "checkpoint_save_blocking", "save_blocking_ratio")):
            out.append(f"| d. {label} | {ms[key]:.1f} ms | raw write + fsync {ms['checkpoint_raw_write_fsync']:.1f} ms "
                       f"| {1 / r[ratio]:.2f}x raw speed | >= 0.8x | {met_cell(1 / r[ratio] >= 0.8)} |")
        out.append(f"| d. checkpoint load (checkpoint.read: map, verify sha256, copy every tensor out) | "
                   f"{ms['checkpoint_load']:.1f} ms | raw read {ms['checkpoint_raw_read']:.1f} ms | "
                   f"{1 / r['load_ratio']:.2f}x raw speed | >= 0.8x | {met_cell(1 / r['load_ratio'] >= 0.8)} |")
    return out


CHECKPOINT = Item(measure, rows, full={"checkpoint_rounds": 5}, quick={"checkpoint_rounds": 2})
