"""Checkpoints: atomic, verified, and free of pickle.

Layout of one checkpoint (a directory under `<run_dir>/checkpoints/`):

    step_000100/
      model.safetensors   the unwrapped model's state_dict (keys unchanged)
      state.safetensors   every other tensor (optimizer moments, RNG states, EMA, ...)
      state.json          everything that is not a tensor, with references into state.safetensors
      config.yaml         the resolved config of the run (secrets redacted)
      manifest.json       format version + sha256 of every file; written last = the completion marker

A checkpoint is written into a temp directory beside its final place, fsynced, then renamed, so
a reader sees a complete checkpoint or none. With `async_save` the state is copied to CPU memory at
the step boundary (training waits for that only) and written by a background thread. Loading
parses only safetensors and JSON: nothing is ever unpickled, so a planted pickle payload cannot run.
`tensorfile` writes and reads the safetensors files with their sha256 computed alongside.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from . import tensorfile
from .errors import CheckpointError
from .io import atomic_write_json, fsync_dir

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


# -- nested state <-> (JSON tree, flat tensors) --------------------------------------------------
def on_cpu(t: torch.Tensor, copy: bool = True) -> torch.Tensor:
    return t.detach().to("cpu", copy=copy).contiguous()


def flatten(obj: Any, tensors: dict[str, torch.Tensor], path: str = "", copy: bool = True) -> Any:
    """A JSON-able copy of `obj` with tensors moved into `tensors` and replaced by references.
    With copy=False, CPU tensors go in as they are (for a write that happens before they change)."""
    if isinstance(obj, torch.Tensor):
        tensors[path] = on_cpu(obj, copy)
        return {"__tensor__": path}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: flatten(v, tensors, f"{path}/{k}", copy) for k, v in obj.items()}
        return {"__items__": [[k, flatten(v, tensors, f"{path}/{k}", copy)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [flatten(v, tensors, f"{path}/{i}", copy) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [flatten(v, tensors, f"{path}/{i}", copy) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot checkpoint a value of type {type(obj).__name__} at '{path}'")


def unflatten(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(tree, dict):
        if "__tensor__" in tree:
            return tensors[tree["__tensor__"]]
        if "__items__" in tree:
            return {k: unflatten(v, tensors) for k, v in tree["__items__"]}
        if "__tuple__" in tree:
            return tuple(unflatten(v, tensors) for v in tree["__tuple__"])
        return {k: unflatten(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [unflatten(v, tensors) for v in tree]
    return tree


def sha256(path: Path) -> str:
    """sha256 of a file (for tools and tests; saving and loading hash the bytes they move)."""
    return hashlib.sha256(tensorfile.map_file(path)).hexdigest()


def _write(path: Path, data: bytes) -> str:
    """Write and fsync `data`; return its sha256 (hashed from memory: no second read of the file)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()


def step_of(path: Path) -> int:
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else -1


class Checkpointer:
    """Writes, lists, verifies and prunes the checkpoints of one run (main process only writes)."""

    def __init__(self, directory: str | os.PathLike, every_n_steps: int = 0, keep_last: int = 2,
                 best_metric: str | None = None, best_mode: str = "min", save_final: bool = True,
                 async_save: bool = False):
        self.dir = Path(directory)
        self.every_n_steps, self.keep_last, self.save_final = every_n_steps, keep_last, save_final
        self.async_save, self._pool, self._pending = async_save, None, None
        self.best_metric, self.best_mode = best_metric, best_mode
        self.best: tuple[float, str] | None = None  # (metric value, checkpoint name)

    def due(self, step: int) -> bool:
        return self.every_n_steps > 0 and step % self.every_n_steps == 0

    # -- writing -----------------------------------------------------------------------------
    def save(self, step: int, model_state: dict[str, torch.Tensor], state: dict[str, Any],
             config_yaml: str = "", metrics: dict[str, float] | None = None) -> Path:
        """Snapshot the state to CPU now; write `step_<step>` atomically (in the background with
        `async_save`), then prune old checkpoints. Returns the checkpoint's final path."""
        self.wait()  # one save in flight at a time; an earlier failure surfaces here
        # A background write needs a snapshot: training goes on mutating the originals. A synchronous
        # one writes CPU tensors straight from their memory. Tied weights are written once per key.
        copy = self.async_save
        model_tensors = {k: on_cpu(v, copy) for k, v in model_state.items()}
        tensors: dict[str, torch.Tensor] = {}
        tree = flatten(state, tensors, copy=copy)
        final = self.dir / f"step_{step:08d}"
        args = (final, step, model_tensors, tensors, tree, config_yaml, metrics)
        if self.async_save:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = self._pool or ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
            self._pending = self._pool.submit(self._write_checkpoint, *args)
        else:
            self._write_checkpoint(*args)
        return final

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete; re-raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        self.wait()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def _write_checkpoint(self, final: Path, step: int, model_tensors: dict, tensors: dict, tree: Any,
                          config_yaml: str, metrics: dict[str, float] | None) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=self.dir, prefix=f".tmp-{final.name}-"))
        try:
            files = {
                "model.safetensors": tensorfile.write(tmp / "model.safetensors", model_tensors, {"format": "pt"}),
                "state.safetensors": tensorfile.write(tmp / "state.safetensors", tensors, {"format": "pt"}),
                "state.json": _write(tmp / "state.json", json.dumps(tree).encode()),
                "config.yaml": _write(tmp / "config.yaml", config_yaml.encode()),
            }
            manifest = {"format": FORMAT_VERSION, "step": step, "files": files}
            _write(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())  # last: marks it complete
            fsync_dir(tmp)
            if final.exists():  # a re-run of the same step (after a resume): replace it
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_dir(self.dir)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError):  # disk full, file too large, I/O error
                kept = self.complete()
                raise CheckpointError(
                    f"could not write checkpoint {final} ({getattr(e, 'strerror', None) or e}). "
                    f"{'The previous checkpoint ' + kept[-1].name + ' is intact. ' if kept else ''}"
                    "Free disk space (or point hydra.run.dir at a larger disk) and rerun with resume=auto."
                ) from None
            raise
        if metrics:
            self.update_best(metrics, final)
        self._prune()

    def update_best(self, metrics: dict[str, float], path: Path) -> None:
        if not self.best_metric or self.best_metric not in metrics:
            return
        value = metrics[self.best_metric]
        better = self.best is None or (value < self.best[0] if self.best_mode == "min" else value > self.best[0])
        if better:
            self.best = (value, path.name)
            atomic_write_json(self.dir / "best.json", {"metric": self.best_metric, "value": value, "checkpoint": path.name})

    def _prune(self) -> None:
        """Delete all but the newest `keep_last` complete checkpoints (and the best one)."""
        if self.keep_last <= 0:
            return
        keep = {p.name for p in self.complete()[-self.keep_last:]}
        if self.best:
            keep.add(self.best[1])
        for p in self.complete():
            if p.name not in keep:
                shutil.rmtree(p, ignore_errors=True)
        for p in self.dir.glob(".tmp-step_*"):  # left by a process killed mid-save
            shutil.rmtree(p, ignore_errors=True)

    # -- reading -----------------------------------------------------------------------------
    def complete(self) -> list[Path]:
        """Checkpoints with a manifest (the completion marker), oldest first."""
        if not self.dir.is_dir():
            return []
        return sorted((p for p in self.dir.iterdir() if step_of(p) >= 0 and (p / MANIFEST).exists()), key=step_of)

    def latest_valid(self, warn=print) -> Path | None:
        """The newest checkpoint that verifies; each one skipped is reported through `warn`."""
        for path in reversed(self.complete()):
            try:
                verify(path)
                return path
            except CheckpointError as e:
                warn(f"warning: skipping checkpoint {path}: {e} Falling back to the previous one.")
        return None


def _manifest(path: Path) -> dict:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist (or is not a directory). "
                              "Pass resume=auto, resume=null or the path of a step_* directory.")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        fmt = manifest["format"]
        manifest["files"].items()
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointError(f"{path / MANIFEST} is missing or unreadable: the checkpoint is incomplete.") from None
    if not isinstance(fmt, int) or fmt > FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format version {fmt}, newer than this trainer's "
                              f"({FORMAT_VERSION}). Upgrade trainer to load it.")
    return manifest


def _map_all(path: Path, files: dict[str, str]) -> dict[str, Any]:
    try:
        return {name: tensorfile.map_file(path / name) for name in files}
    except FileNotFoundError as e:
        raise CheckpointError(f"file {e.filename} listed in the manifest is missing.") from None
    except OSError as e:  # a directory in its place, no permission, an I/O error
        raise CheckpointError(f"file {e.filename} listed in the manifest cannot be read ({e.strerror}).") from None


def _check_digests(path: Path, files: dict[str, str], digests: dict[str, str]) -> None:
    for name, digest in digests.items():
        if digest != files[name]:
            raise CheckpointError(f"file {path / name} is corrupted or truncated (sha256 does not match the manifest).")


def verify(path: Path) -> dict:
    """Check the manifest's format version and every file's sha256. Returns the manifest."""
    path = Path(path)
    manifest = _manifest(path)
    _check_digests(path, manifest["files"], tensorfile.sha256_all(_map_all(path, manifest["files"])))
    return manifest


def load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Map each file once; hash them in the background while parsing (only safetensors and JSON are
    parsed, and nothing is returned unless every sha256 matches the manifest)."""
    from concurrent.futures import ThreadPoolExecutor

    path = Path(path)
    files = _manifest(path)["files"]
    data = _map_all(path, files)
    with ThreadPoolExecutor(max_workers=1) as pool:
        digests = pool.submit(tensorfile.sha256_all, data)
        try:
            model_state = tensorfile.parse(data["model.safetensors"], path / "model.safetensors")
            tensors = tensorfile.parse(data["state.safetensors"], path / "state.safetensors")
            tree, error = json.loads(bytes(data["state.json"])), None
        except (ValueError, KeyError) as e:
            error = e
        _check_digests(path, files, digests.result())  # a damaged file is reported as such first
    if error is not None:
        raise CheckpointError(f"checkpoint {path} cannot be read ({error}); it is not a valid trainer checkpoint.")
    return model_state, unflatten(tree, tensors)


def load_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor], source: Path) -> None:
    """`load_state_dict` with an error listing every missing, unexpected and mis-shaped tensor."""
    own = model.state_dict()
    problems = [f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}"
                for k, v in state.items() if k in own and own[k].shape != v.shape]
    problems += [f"{k}: missing from the checkpoint" for k in own if k not in state]
    problems += [f"{k}: not in the model" for k in state if k not in own]
    if problems:
        raise CheckpointError(f"checkpoint {source} does not match the model ({len(problems)} tensors): "
                              + "; ".join(problems) + ". Use the model config the checkpoint was trained with "
                              "(see its config.yaml), or resume=null to start fresh.")
    model.load_state_dict(state)
