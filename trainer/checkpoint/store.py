"""Checkpoints: atomic, verified, free of pickle, and written by every rank that holds a shard.

Layout of one checkpoint (a directory under `<run_dir>/checkpoints/`):

    step_00000100/
      model.safetensors          the model's state_dict (keys unchanged); under a sharded strategy, the
      model.rank00001.safetensors  chunks each rank holds (global shape and offset in the file's metadata)
      state.safetensors          every other tensor (optimizer moments, RNG states, EMA, ...), same scheme
      state.json                 everything that is not a tensor, with references into the tensor files
      config.yaml                the resolved config of the run (secrets redacted)
      manifest.json              format version + sha256 of every file; written last = the completion marker

A checkpoint is written into a temp directory beside its final place, fsynced, then renamed by the main
rank once every rank's files are complete, so a reader sees a complete checkpoint or none. With
`async_save` the state is copied to CPU memory at the step boundary (training waits for that only)
and written by a background thread; ranks that write shards agree on completion over a process group
of their own, never the training one (whose collectives the save would interleave with).

Loading parses only safetensors and JSON: nothing is ever unpickled, so a planted pickle payload cannot
run. The sha256 manifest proves integrity, not sanity (whoever can write a checkpoint can rewrite its
hashes), so nothing in a checkpoint is trusted: the manifest must name the checkpoint's own files (no
path elsewhere), a step number and this format; only regular files are opened (a FIFO never blocks, a
symbolic link is not followed); each safetensors header is checked against its file's size before
anything is mapped or hashed; JSON is depth-limited; and `snapshot` checks every tensor and value
against the live state before anything is applied. The main rank checks every sha256 once; then every
rank reads the chunks it needs.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import operator
import os
import re
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint import snapshot, tensorfile
from trainer.errors import CheckpointError, StorageError
from trainer.io import atomic_write_bytes, atomic_write_json, free_name, fsync_dir, unwritable

FORMAT_VERSION = 2  # 2: tensors may be chunks of a sharded tensor; optimizer state keyed by parameter name
MANIFEST = "manifest.json"
# In a dir of checkpoints a rollback set aside: {"after": the step after which they left the run's line}.
BRANCH = "branch.json"
# How a verdict that may pass (a file that could not be read, or shrank while it was read: not its contents) ends.
# A checkpoint skipped for it stays in place for the next run to try, where one skipped for its contents is set aside.
AGAIN = "read the checkpoint again once nothing writes to it (or it can be read)."
_STEP_DIR = re.compile(r"^step_([0-9]{8,})$")  # ASCII digits only: no sign, no other script's digits
_FILE = re.compile(r"^(model|state)(\.rank[0-9]{5})?\.safetensors$|^state\.json$|^config\.yaml$")
_REQUIRED = ("model.safetensors", "state.safetensors", "state.json", "config.yaml")  # every trainer checkpoint has them
_MAX_TEXT = 256 << 20  # manifest.json, state.json, config.yaml: far more than a trainer writes (~10 KB a rank)
CONFIG_MAX_BYTES = _MAX_TEXT
_MAX_STEP = 2**62


def tensor_file(kind: str, rank: int) -> str:
    return f"{kind}.safetensors" if rank == 0 else f"{kind}.rank{rank:05d}.safetensors"


def sha256(path: Path) -> str:
    """sha256 of a file (for tools and tests; saving and loading hash the bytes they move)."""
    return tensorfile.file_sha256(path)


def _write(path: Path, data: bytes) -> str:
    """Write and fsync `data`; return its sha256 (hashed from memory: no second read of the file)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()


def has_complete(checkpoints: Path) -> bool:
    """Whether `checkpoints` (a run's checkpoints/ dir) holds a checkpoint whose manifest was written: the last
    file of a save, so a complete one (read checks the rest). A cheap test, without reading anything."""
    return any((p / "manifest.json").is_file() for p in checkpoints.glob("step_*"))


def step_of(path: Path) -> int:
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else -1


def run_of_checkpoint(path: Path) -> Path | None:
    """The run dir whose checkpoint `path` is (`RUN/checkpoints/step_N` with its manifest), else None: a checkpoint
    holds a config.yaml too, and what reads or writes a run dir must not take one for a run."""
    path = Path(path).expanduser()
    if step_of(path) >= 0 and path.parent.name == "checkpoints" and os.path.lexists(path / MANIFEST):
        return path.parent.parent
    return None


def newest_complete(run_dir: Path) -> Path | None:
    """The run's newest complete checkpoint (RUN/checkpoints/step_N with its manifest), or None."""
    done = Checkpointer(Path(run_dir) / "checkpoints").complete()
    return done[-1] if done else None


class _Local:
    """The backend of a checkpointer used outside a run (tools, benchmarks): one process."""

    rank, world_size, is_main, distributed = 0, 1, True, False


class Checkpointer:
    """Writes, lists, verifies, reads and prunes the checkpoints of one run.

    Every rank calls `save` (the main rank only, unless `sharded`: then every rank writes its chunks)."""

    def __init__(self, directory: str | os.PathLike, every_n_steps: int = 0, keep_last: int | None = 2,
                 best_metric: str | None = None, best_mode: str = "min", save_final: bool = True,
                 async_save: bool = False, config_yaml: str = "", backend=None, sharded: bool = False):
        self.dir = Path(directory)
        self.every_n_steps, self.keep_last, self.save_final = every_n_steps, keep_last, save_final
        self.async_save, self._pool, self._pending = async_save, None, None
        self.best_metric, self.best_mode = best_metric, best_mode
        self._said_nan = False  # (a NaN best_metric, said once)
        self.best: tuple[float, str] | None = None  # (metric value, checkpoint name); in checkpoints too
        # (metric, mode, checkpoint) of a resumed best ranked by another best_metric or best_mode: set aside
        self.reranked: tuple[str | None, str, str] | None = None
        self.config_yaml = config_yaml
        self.backend = backend or _Local()
        self.sharded = sharded and self.backend.distributed
        self.writes = self.sharded or self.backend.is_main
        self.protected: set[str] = set()  # checkpoints this run could not read: never pruned or overwritten
        self.abandoned: list[str] = []  # what a rollback set aside (the main rank's): the run keeps its events too
        self.fell_back = False  # this run's resume skipped a newer checkpoint it could not load
        self.taken_back: list[str] = []  # a branch set aside that a resume went back to: its checkpoints returned here
        # Which tensors this rank writes (snapshot.Writer; None: the main rank's plain tensors and every rank's
        # DTensor shards). Set by the checkpoint manager from the strategy (pipeline stages each write theirs).
        self.writer: snapshot.Writer | None = None
        self._group, nonce = None, uuid.uuid4().hex[:8]
        if self.sharded:
            # The ranks' writes meet over a group of their own: a background save must never interleave its
            # collectives with the training group's (FSDP's all-gathers), which gloo would deadlock on.
            self._group = self.backend.side_group()
            nonce = self.backend.broadcast_object(nonce)
        self._nonce = nonce
        self._saves = 0  # every rank counts its save() calls alike: each save gets a temp directory of its own

    def due(self, step: int) -> bool:
        return self.every_n_steps > 0 and step % self.every_n_steps == 0

    def improves(self, metrics: dict[str, float] | None) -> bool:
        """Whether an eval's `metrics` beat the best checkpoint's by checkpoint.best_metric (the loop then saves
        this step, as Lightning's ModelCheckpoint does, whether or not a checkpoint was due). A ConfigError when the
        evals have no such metric."""
        if not self.best_metric or not metrics:
            return False
        if self.best_metric not in metrics:
            from trainer.errors import ConfigError

            raise ConfigError(f"checkpoint.best_metric={self.best_metric!r} is not among the metrics of this run's "
                              f"evals ({', '.join(sorted(metrics))}). Pick one of them, or null.")
        value = metrics[self.best_metric]
        # A NaN is never the best, and any number beats a NaN best (one recorded before this rule): every comparison
        # with a NaN is false, so a NaN first eval stayed "best" for the rest of the run.
        if math.isnan(value):
            if not self._said_nan and self.backend.is_main:  # (once: a run of NaN evals said nothing at all)
                self._said_nan = True
                print(f"note: checkpoint.best_metric={self.best_metric} is NaN in this eval, and a NaN is never the "
                      "best: no best checkpoint is kept for it (best.json) until an eval gives a number. A metric "
                      "undefined on this eval's samples (too few of them) stays NaN: pick another, or evaluate more "
                      "samples.", flush=True)
            return False
        if self.best is None or math.isnan(self.best[0]):
            return True
        return value < self.best[0] if self.best_mode == "min" else value > self.best[0]

    def consider(self, metrics: dict[str, float] | None, step: int) -> None:
        """Before saving step `step` with `metrics`: remember it as the best if it is (so the state it saves
        knows; best.json follows once the checkpoint is complete)."""
        if self.improves(metrics):
            self.best = (metrics[self.best_metric], f"step_{step:08d}")

    def state_dict(self) -> dict[str, Any]:
        return {"best": list(self.best) if self.best else None, "best_metric": self.best_metric,
                "best_mode": self.best_mode}

    def check_state(self, state: dict[str, Any], where: str) -> None:
        best = state.get("best")
        if best is None:
            return
        ok = (isinstance(best, (list, tuple)) and len(best) == 2 and isinstance(best[0], (int, float))
              and not isinstance(best[0], bool) and isinstance(best[1], str) and _STEP_DIR.match(best[1]))
        if not ok:
            raise CheckpointError(f"{where}.best={snapshot.shown(best)} is not a (metric value, step_NNNNNNNN) pair.")
        for key in ("best_metric", "best_mode"):
            if state.get(key) is not None and not isinstance(state[key], str):
                raise CheckpointError(f"{where}.{key}={snapshot.shown(state[key])} is not a string.")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The resumed best. One ranked by another checkpoint.best_metric or best_mode than this run's is set aside
        (`reranked`): compared with the new metric's values, it was never beaten (a val/loss of 3.5 against val/bpb's
        5), so checkpoint=best kept naming it. Checkpoints written before the metric was recorded here: best.json's."""
        best = state.get("best")
        self.best, self.reranked = ((float(best[0]), str(best[1])) if best else None), None
        if self.best is None:
            return
        if "best_metric" in state:
            metric, mode = state["best_metric"], state.get("best_mode") or "min"
        else:
            try:
                metric, mode = _read_json(self.dir / "best.json")["metric"], self.best_mode
            except (OSError, ValueError, KeyError, TypeError, RecursionError):
                return
        if (metric, mode) != (self.best_metric, self.best_mode):
            self.reranked, self.best = (metric, mode, self.best[1]), None

    def repair_best_file(self) -> None:
        """best.json (what `eval checkpoint=best` reads), where it cannot be read, as the resumed state says, if the
        best checkpoint is there: it was rewritten only at the next new best, so a damaged one stayed damaged for
        the rest of the run. (One that reads is left as it is.) On a resume only: an eval writes nothing."""
        if self.best is None or not self.writes or not self.backend.is_main \
                or not (self.dir / self.best[1] / MANIFEST).is_file():
            return
        try:
            if isinstance(_read_json(self.dir / "best.json"), dict):
                return
        except FileNotFoundError:
            return
        except (OSError, ValueError, TypeError, RecursionError):
            pass
        atomic_write_json(self.dir / "best.json", {"metric": self.best_metric, "value": self.best[0],
                                                  "checkpoint": self.best[1]})

    # -- writing -----------------------------------------------------------------------------
    def save(self, step: int, model_state: dict[str, torch.Tensor], state: dict[str, Any],
             metrics: dict[str, float] | None = None) -> Path:
        """Snapshot this rank's part of the state to CPU now; write `step_<step>` atomically (in the
        background with `async_save`), then prune old checkpoints. Returns the checkpoint's final path."""
        final = self.dir / f"step_{step:08d}"
        if not self.writes:
            return final
        self.wait()  # one save in flight at a time; an earlier failure surfaces here
        # A background write needs a snapshot: training goes on mutating the originals. A synchronous
        # one writes CPU tensors straight from their memory. Tied weights are written once per key.
        copy, writer = self.async_save, self.writer or snapshot.Writer(main=self.backend.is_main)
        model_chunks: dict[str, snapshot.Chunk] = {}
        for k, v in model_state.items():
            snapshot.flatten(v, model_chunks, writer, k, copy)
        state_chunks: dict[str, snapshot.Chunk] = {}
        tree = snapshot.flatten(state, state_chunks, writer, copy=copy)
        self._saves += 1
        args = (final, step, model_chunks, state_chunks, tree, metrics, self._saves)
        if self.async_save:
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

    def _write_checkpoint(self, final: Path, step: int, model_chunks: dict, state_chunks: dict, tree: Any,
                          metrics: dict[str, float] | None, number: int = 0) -> None:
        rank = self.backend.rank
        # Its own temp directory per save: a second save of the same step (a preemption right after a periodic
        # save) must not write into the directory the main rank is renaming into place.
        tmp = self.dir / f".tmp-{final.name}-{self._nonce}-{number}"
        files, error = {}, None
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            for kind, chunks in (("model", model_chunks), ("state", state_chunks)):
                if chunks or rank == 0:
                    name = tensor_file(kind, rank)
                    files[name] = tensorfile.write(tmp / name, {k: c.local for k, c in chunks.items()},
                                                   snapshot.chunk_metadata(chunks))
        except OSError as e:
            error = e
        merge = self.writer.merge if self.writer is not None else None
        if self.sharded:  # every rank's files are complete (or failed) once the main rank has heard from all
            gathered = self.backend.gather_object_to_main((files, str(error) if error else None,
                                                           tree if merge else None), self._group)
            if rank != 0:
                if error:
                    raise self._failed(final, error)
                return
            for other_files, other_error, _ in gathered[1:]:
                files.update(other_files)
                error = error or (OSError(other_error) if other_error else None)
            if merge:  # each pipeline stage's state (its parameters' optimizer moments) in one tree
                tree = merge([t for _, _, t in gathered])
        try:
            if error:
                raise error
            files["state.json"] = _write(tmp / "state.json", json.dumps(tree).encode())
            files["config.yaml"] = _write(tmp / "config.yaml", self.config_yaml.encode())
            # `written` orders checkpoints by completion, not by step: after a rollback (resume=PATH to an
            # earlier step) the new branch's checkpoints are the newest, and resume=auto follows them.
            manifest = {"format": FORMAT_VERSION, "step": step, "written": self._next_written(),
                        "world_size": self.backend.world_size, "files": dict(sorted(files.items()))}
            _write(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())  # last: marks it complete
            fsync_dir(tmp)
            # A re-run of the same step (after a resume) replaces a complete checkpoint of it. Anything else of that
            # name is never deleted: one this run could not read, or a step_N dir without a manifest (a copy that
            # stopped before its manifest arrived: our own saves are renamed into place with theirs).
            if final.exists() and (final.name in self.protected or _written(final) is None):
                os.replace(final, free_name(final, ".unreadable"))
            elif final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_dir(self.dir)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError):  # disk full, file too large, I/O error
                raise self._failed(final, e) from None
            raise
        if self.best and self.best[1] == final.name:
            atomic_write_json(self.dir / "best.json", {"metric": self.best_metric, "value": self.best[0],
                                                      "checkpoint": final.name})
        self._prune()

    def _failed(self, final: Path, e: BaseException) -> StorageError:
        kept = self.complete()
        full = getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, None)
        return StorageError(
            f"could not write checkpoint {final} ({getattr(e, 'strerror', None) or e}). "
            f"{'The previous checkpoint ' + kept[-1].name + ' is intact. ' if kept else ''}"
            + ("Free disk space (or point the run at a larger disk) and continue from the newest checkpoint (resume=auto; "
               "a loop of your own: rt.load_state)." if full else
               f"{self.dir} must be a directory this process can write: fix that and continue from the newest "
               "checkpoint (resume=auto; a loop of your own: rt.load_state).")
        )

    def check_writable(self) -> None:
        """Before training: the checkpoint directory is one this process can write, or can be made (a file in its
        place, or no permission, would otherwise surface at the first save, after the steps before it were
        trained). Creates nothing."""
        if not self.writes or not (self.every_n_steps > 0 or self.save_final):
            return
        why = unwritable(self.dir)
        if why:
            raise StorageError(f"checkpoints cannot be written to {self.dir} ({why}); nothing was trained. Move what is "
                               "in its place, fix its permissions or give the run another dir (hydra.run.dir=...), "
                               "then rerun.")

    def _prune(self) -> None:
        """Delete all but the `keep_last` most recently written complete checkpoints (None: none are deleted), never
        the best one (in memory or named by best.json)."""
        # (complete(): never one whose manifest cannot be read; resume=auto tries those first, and sets them aside
        # when another one loads instead)
        done = [p for p in self.complete() if p.name not in self.protected]
        keep = {p.name for p in (done if self.keep_last is None else done[-self.keep_last:])}
        if self.best:
            keep.add(self.best[1])
        try:
            keep.add(str(_read_json(self.dir / "best.json")["checkpoint"]))
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            pass
        for p in done:
            if p.name not in keep:
                # Out of sight first, in one rename: a reader of the live run's newest checkpoint (`eval RUN`) sees
                # a whole checkpoint or none, never one with files gone ("listed in the manifest is missing").
                gone = p.with_name(f".pruned-{p.name}-{self._nonce}-")
                try:
                    os.replace(p, gone)
                except OSError:
                    gone = p
                shutil.rmtree(gone, ignore_errors=True)
        for p in [*self.dir.glob(".tmp-step_*"), *self.dir.glob(".pruned-step_*")]:  # left by a process killed then
            if f"-{self._nonce}-" not in p.name:
                shutil.rmtree(p, ignore_errors=True)

    # -- reading -----------------------------------------------------------------------------
    def complete(self) -> list[Path]:
        """Checkpoints with a manifest (the completion marker) that can be read, in the order they were written
        (oldest first). Only directories of this run count: a symbolic link (to another run's checkpoint, say) is
        not one."""
        order = {p: _written(p) for p in self._step_dirs()}
        return sorted((p for p, w in order.items() if w is not None), key=lambda p: (order[p], step_of(p)))

    def branch_from(self, path: Path) -> tuple[Path | None, list[str], list[str]]:
        """A rollback (a resume from `path`, while this dir holds checkpoints written after it: `written_after`): those
        are the branch it abandons. They move together into a new dir beside this one (`checkpoints.prev/`, or the
        attempt's number: .prev-2, ...), with best.json where it names one of them (best.json is then written again
        for the resumed best, where that checkpoint is here), so that the new branch's saves of the same steps replace
        none of them (a save of an existing step replaces it: a resume replays the same steps), resume=auto follows the
        new branch at once, and keep_last prunes none of them. Returns (that dir, the names moved, the names that could
        not be moved: kept in place, protected, out of the new branch's way). The main rank's to call."""
        later = self.written_after(path)
        # (before the new dir exists: a set-aside dir after `path`'s without branch.json parts from the line at 0)
        after = self.branch_point(path)
        self.taken_back = []
        if not later:
            self._take_back(path, after)
            return None, [], []
        target, moved = free_name(self.dir, ".prev"), []
        try:
            target.mkdir()
            atomic_write_json(target / BRANCH, {"after": after})
            for p in later:
                os.replace(p, target / p.name)
                moved.append(p.name)
        except OSError:  # (a read-only dir, say)
            pass
        left = [p.name for p in later if p.name not in moved]
        if not left:
            self._take_back(path, after)
        if moved and self.taken_back:  # (this aside is the line left for `path`'s branch, which is the line now)
            try:
                atomic_write_json(target / BRANCH, {"after": after, "back_to": path.parent.name})
            except OSError:
                pass
        if left:  # never replaced or pruned by the new branch, and behind it for resume=auto
            self.protected.update(left)
            self.follow(self.dir / path.name)
        if moved:
            try:
                if str(_read_json(self.dir / "best.json")["checkpoint"]) in moved:
                    os.replace(self.dir / "best.json", target / "best.json")
                    if self.best is not None and (self.dir / self.best[1] / MANIFEST).is_file():
                        atomic_write_json(self.dir / "best.json", {"metric": self.best_metric, "value": self.best[0],
                                                                  "checkpoint": self.best[1]})
            except (OSError, ValueError, KeyError, TypeError, RecursionError):
                pass  # (no best.json, or one that cannot be read: repair_best_file's)
            fsync_dir(self.dir)
        elif target.is_dir() and not any(target.iterdir()):
            target.rmdir()
        return (target if moved else None), moved, left

    def _take_back(self, path: Path, after: int) -> None:
        """Going back to a branch set aside (`path` in checkpoints.prev-N/, parted from the line after step `after`):
        its checkpoints after `after` up to `path` return to this dir, the run's line again, so that resume=auto
        follows that branch even if the job stops before it saves (it resumed from the step it parted at: another
        line). Its later ones stay aside, parted at `path`'s step. Names in `taken_back`."""
        aside = path.parent
        if aside.resolve() == self.dir.resolve() or _aside_number(aside.name, self.dir.name) is None \
                or aside.parent.resolve() != self.dir.parent.resolve():
            return
        step = step_of(path)
        try:
            for p in Checkpointer(aside).complete():
                if after < step_of(p) <= step and not (self.dir / p.name).exists():
                    os.replace(p, self.dir / p.name)
                    self.taken_back.append(p.name)
            if self.taken_back:
                fsync_dir(self.dir)
                if any(step_of(p) > step for p in aside.iterdir()):
                    atomic_write_json(aside / BRANCH, {"after": step})
        except OSError:
            pass  # (what could not move stays aside; the resumed job's saves continue the line)
        if path.name in self.taken_back:
            self.follow(self.dir / path.name)  # the newest written here: resume=auto's pick

    def written_after(self, path: Path) -> list[Path]:
        """This dir's complete checkpoints after `path`: written after it where it is one of them; where it is not
        (a checkpoint of this run set aside by an earlier rollback, or a copy of this run's), those of a later step,
        which the run's saves from `path` would replace."""
        done = self.complete() if self.dir is not None and self.dir.is_dir() else []
        names = [p.name for p in done]
        if path.parent.resolve() == self.dir.resolve() and path.name in names:
            later = done[names.index(path.name) + 1:]
        else:
            later = [p for p in done if step_of(p) > self.branch_point(path)]
        return [p for p in later if p.name not in self.protected]

    def branch_point(self, path: Path) -> int:
        """The step after which a resume from `path` leaves this dir's line of checkpoints: `path`'s own, or, for one a
        rollback set aside beside this dir (checkpoints.prev/), the step its branch left the run's line at: this dir's
        checkpoints after that are another branch's (going back to step 50 of a branch that left at 30, this dir's
        steps 40 and 50 are not its)."""
        step = step_of(path)
        if path.parent.resolve() != self.dir.resolve() and path.parent.parent.resolve() == self.dir.parent.resolve():
            after = branch_step(path.parent)
            if after is None:
                return step
            # Each branch set aside after that one parted from the line there at its own step: the line shares with
            # `path`'s branch only what it kept through all of them (rolled back to 6, then to 2: up to step 2). A
            # later attempt set aside whole (a fresh start, no branch.json) shares nothing.
            number = _aside_number(path.parent.name, self.dir.name)
            for sibling in self.dir.parent.glob(self.dir.name + ".prev*"):
                later = _aside_number(sibling.name, self.dir.name)
                # (one set aside by going back to `path`'s own branch is the line that branch replaced: no bound)
                if _read_json_or_none(sibling / BRANCH).get("back_to") == path.parent.name:
                    continue
                if number is not None and later is not None and later > number and sibling.is_dir():
                    parted = branch_step(sibling)
                    after = min(after, parted if parted is not None else 0)
            return min(step, after)
        return step

    def follow(self, path: Path) -> bool:
        """A rollback whose later checkpoints could not be moved aside (`branch_from`'s fallback): make `path` the
        most recently written at once, so that resume=auto follows the new branch even when the job stops before
        that branch writes a checkpoint of its own (it went back to the abandoned one). Rewrites
        the manifest's `written` alone, atomically. False when there was nothing to do or it could not be written."""
        done = self.complete() if self.dir is not None else []
        if path not in done or path == done[-1]:
            return False
        try:
            manifest = _read_json(path / MANIFEST)
            manifest["written"] = self._next_written()
            atomic_write_bytes(path / MANIFEST, json.dumps(manifest, indent=1).encode())
        except (OSError, ValueError, TypeError, AttributeError):
            return False
        return True

    def _next_written(self) -> int:
        """The `written` of the checkpoint completed next: after every complete one's."""
        return 1 + max((_written(p) for p in self.complete()), default=0)

    def unreadable(self) -> list[Path]:
        """step_N dirs whose manifest cannot be read (damaged, copied half-way, or missing: a copy that stopped before
        it arrived), by step: nothing says when they were written. resume=auto tries them before the others (naming
        each, then setting it aside); nothing prunes them, and a save of the same step moves them aside."""
        return sorted((p for p in self._step_dirs() if _written(p) is None), key=step_of)

    def _step_dirs(self) -> list[Path]:
        if not self.dir.is_dir():
            return []
        return [p for p in self.dir.iterdir() if step_of(p) >= 0 and not p.is_symlink() and p.is_dir()]


def _aside_number(name: str, base: str) -> int | None:
    """The attempt number of a set-aside dir's name: checkpoints.prev 1, checkpoints.prev-3 3; None for another name."""
    m = re.fullmatch(re.escape(base) + r"\.prev(?:-([0-9]+))?", name)
    return (int(m.group(1)) if m.group(1) else 1) if m else None


def _read_json_or_none(path: Path) -> dict:
    try:
        found = _read_json(path)
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return {}
    return found if isinstance(found, dict) else {}


def branch_step(directory: Path) -> int | None:
    """The step a set-aside branch of checkpoints left the run's line at (its branch.json); None where not recorded."""
    after = _read_json_or_none(Path(directory) / BRANCH).get("after")
    return after if is_count(after) else None


def same_run(run_dir: Path, checkpoint: Path) -> bool:
    """Whether `checkpoint`, outside the run dir's checkpoints/, is still this run dir's run: one of its own set
    aside (checkpoints.prev/...), or one the dir holds a copy of (a copied run dir: the same manifest, byte for byte).
    Then the resume continues the run there, events and all; else the dir's earlier attempt (if any) is another run,
    kept aside rather than spliced into, and the job is a run of its own. Settings cannot tell: two runs may differ
    only in ones a resume may change (the learning rate), and a new dir holds this job's config.yaml alone."""
    try:
        where = checkpoint.resolve().parent
        if where.parent == run_dir.resolve() and where.name.startswith("checkpoints"):  # (checkpoints.prev-N/)
            return True
        copy = run_dir / "checkpoints" / checkpoint.name / MANIFEST
        return copy.is_file() and copy.read_bytes() == (checkpoint / MANIFEST).read_bytes()
    except OSError:
        return False


def taken_back(path: Path) -> Path | None:
    """Where a checkpoint named in a set-aside dir (RUN/checkpoints.prev-N/step_N) is now, if a resume that went back to
    its branch took it back into the run's line (Checkpointer.branch_from): RUN/checkpoints/step_N; else None."""
    path = Path(path)
    if path.exists() or _aside_number(path.parent.name, "checkpoints") is None:
        return None
    there = path.parent.parent / "checkpoints" / path.name
    return there if (there / MANIFEST).is_file() else None


def set_aside(directory: Path) -> Path | None:
    """Move a checkpoints directory out of the way (to `checkpoints.prev`, or `.prev-2`, ...): what a fresh
    start in a run dir does with an earlier attempt's checkpoints instead of pruning them."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    target = free_name(directory, ".prev")
    os.replace(directory, target)
    return target


def _read_json(path: Path) -> Any:
    """A small JSON file, read only if it is a regular file (a FIFO would block the reader forever)."""
    return json.loads(bytes(tensorfile.map_file(path, follow_links=False, max_size=_MAX_TEXT)))


def _written(path: Path) -> int | None:
    """A checkpoint's place in the order of completion (its manifest's `written`; 0 where it has none, as the first
    format 2 manifests); None if the manifest cannot be read (a damaged checkpoint, or one copied half-way)."""
    try:
        written = _read_json(path / MANIFEST).get("written", 0)
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return written if is_count(written) else 0


def is_count(n: Any) -> bool:
    """A step number: a whole number from 0 to 2**62 (numpy's and torch's integers too; not a bool, a float or a
    string)."""
    if isinstance(n, bool):
        return False
    try:
        return 0 <= operator.index(n) < _MAX_STEP
    except TypeError:
        return False


def _manifest(path: Path) -> dict:
    """The manifest of the checkpoint at `path`, checked: a format this trainer reads, a step number, and the
    files of a trainer checkpoint (names only: nothing outside the checkpoint can be named)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist (or is not a directory). "
                              "Pass resume=auto, resume=null or the path of a step_* directory.")
    where = path / MANIFEST
    try:
        raw = tensorfile.map_file(where, follow_links=False, max_size=_MAX_TEXT)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST}: it is incomplete (its save never finished) "
                              "or not a checkpoint.") from None
    except tensorfile.NotRegularFile as e:
        raise CheckpointError(f"{where} is {e.strerror}; the checkpoint is damaged.") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{where} cannot be read ({getattr(e, 'strerror', None) or e}).") from None
    manifest = snapshot.parse_tree(raw, where)
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{where} is {type(manifest).__name__}, not a JSON object; the checkpoint is damaged.")
    if "format" not in manifest:
        raise CheckpointError(f"{where} has no format version; the checkpoint is damaged.")
    fmt = manifest["format"]
    if not isinstance(fmt, int) or isinstance(fmt, bool) or fmt < 1:
        raise CheckpointError(f"{where}: format {fmt!r} is not a version number; the checkpoint is damaged.")
    if fmt > FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format version {fmt}, newer than this trainer's "
                              f"({FORMAT_VERSION}). Upgrade trainer to load it.")
    if fmt < FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format version {fmt}: it was written by an older trainer, whose "
                              "optimizer state (keyed by position) this one cannot map. Resume it with the trainer "
                              "version that wrote it, or start fresh with resume=null.")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise CheckpointError(f"{where}: 'files' is not a map of file names to sha256 digests; the checkpoint is damaged.")
    foreign = sorted(n for n in files if not _FILE.match(n))
    if foreign:
        raise CheckpointError(f"{where} lists {', '.join(repr(n) for n in foreign[:3])}: not the name of a file of a "
                              "trainer checkpoint (only its own model*.safetensors, state*.safetensors, state.json "
                              "and config.yaml are read, never a path elsewhere); the checkpoint is damaged.")
    missing = [n for n in _REQUIRED if n not in files]
    if missing:
        raise CheckpointError(f"{where} does not list {', '.join(missing)}, which every trainer checkpoint has; "
                              "the checkpoint is damaged.")
    step = manifest.get("step")
    if not is_count(step):
        raise CheckpointError(f"{where}: step {snapshot.shown(step)} is not a step number (an integer from 0 to 2**62); "
                              "the checkpoint is damaged.")
    return manifest


def _map_all(path: Path, files: dict[str, str]) -> tuple[dict[str, Any], dict[str, tuple]]:
    """Every listed file mapped (regular files only: no symbolic link, FIFO or directory), and the header of
    each safetensors file, checked against the file's size before anything is hashed."""
    data, headers = {}, {}
    for name in files:
        p = path / name
        try:
            if name.endswith(".safetensors"):
                data[name], metadata, entries = tensorfile.map_safetensors(p)
                headers[name] = (metadata, entries)
            else:
                data[name] = tensorfile.map_file(p, follow_links=False, max_size=_MAX_TEXT)
        except FileNotFoundError:
            raise CheckpointError(f"file {p} listed in the manifest is missing.") from None
        except tensorfile.NotRegularFile as e:
            raise CheckpointError(f"file {p} listed in the manifest is {e.strerror}: only regular files inside the "
                                  "checkpoint are read.") from None
        except OSError as e:  # no permission, an I/O error
            raise CheckpointError(f"file {p} listed in the manifest cannot be read ({e.strerror or e}); {AGAIN}") from None
        except ValueError as e:
            raise CheckpointError(f"checkpoint {path} cannot be read ({e}); it is not a valid trainer checkpoint.") from None
    return data, headers


def _check_digests(path: Path, files: dict[str, str], digests: dict[str, str]) -> None:
    for name, digest in digests.items():
        if digest != files[name]:
            raise CheckpointError(f"file {path / name} is corrupted or truncated (sha256 does not match the manifest).")


def verify(path: Path) -> dict:
    """Check the manifest, the files' kinds and sizes, and every file's sha256. Returns the manifest."""
    path = Path(path)
    manifest = _manifest(path)
    data, _ = _map_all(path, manifest["files"])
    _check_digests(path, manifest["files"], tensorfile.sha256_all(data))
    return manifest


@dataclass
class Loaded:
    """A checkpoint opened for reading: its tree and the stored chunks of every tensor (read on use)."""

    path: Path
    step: int
    tree: Any
    model: dict[str, list[snapshot.Stored]]
    state: dict[str, list[snapshot.Stored]]
    buffers: dict[str, Any]  # the open files the pending chunks read from


def read(path: Path, backend=None) -> Loaded:
    """Map a checkpoint and index its tensors. The manifest, the files' kinds and the safetensors headers
    against the files' sizes are checked first (cheap); then every sha256 is verified, in parallel with
    parsing, each file by one rank (`_share`: a sharded checkpoint's files spread over the ranks that read
    them, so verifying does not grow with the world size), and the ranks agree on one verdict. Nothing is
    returned unless every file matches the manifest."""
    backend = backend or _Local()
    path = Path(path)
    damaged, error, loaded = None, None, None
    try:
        manifest = _manifest(path)
        files = manifest["files"]
        data, headers = _map_all(path, files)
        mine = _share(data, backend.rank, backend.world_size)
        hashing = tensorfile.Hashing(mine)
        try:
            loaded = _index(path, manifest, data, headers)
        except CheckpointError as e:
            error = e
        except BaseException:
            hashing.close()
            raise
        try:
            _check_digests(path, files, hashing.result())
        except CheckpointError as e:
            damaged = e
        except OSError as e:  # a file that shrank or failed while hashed: a verdict like any other, so no rank hangs
            damaged = CheckpointError(f"{e.strerror or e}; {AGAIN}")
    except CheckpointError as e:
        error = e
    if backend.distributed:  # one verdict for all ranks: any rank's
        verdicts = backend.gather_object((str(damaged) if damaged else None, str(error) if error else None))
        damaged, error = (next((CheckpointError(v[i]) for v in verdicts if v[i]), None) for i in (0, 1))
    if damaged or error:
        raise damaged or error  # a damaged file is reported as such first
    return loaded


def _share(data: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """The files this rank hashes: the largest first, each to the rank with the fewest bytes so far (the same
    split on every rank: it depends on the sizes alone)."""
    load = [0] * world_size
    mine = {}
    for name in sorted(data, key=lambda n: (-len(data[n]), n)):
        r = min(range(world_size), key=lambda i: (load[i], i))
        load[r] += len(data[name])
        if r == rank:
            mine[name] = data[name]
    return mine


def _index(path: Path, manifest: dict, data: dict[str, Any], headers: dict[str, tuple]) -> Loaded:
    chunks: dict[str, dict[str, list[snapshot.Stored]]] = {"model": {}, "state": {}}
    for name, (metadata, entries) in headers.items():
        buf = data[name]
        views = {k: tensorfile.view(buf, e) for k, e in entries.items()}
        for k, stored in snapshot.stored_chunks(metadata, views, path / name).items():
            chunks[name.split(".", 1)[0]].setdefault(k, []).append(stored)
    tree = snapshot.parse_tree(data["state.json"], path / "state.json")
    if not isinstance(tree, dict):
        raise CheckpointError(f"{path / 'state.json'} is {type(tree).__name__}, not a JSON object; it is not a valid "
                              "trainer checkpoint.")
    _check_config(data["config.yaml"], path / "config.yaml")
    step, run = manifest["step"], tree.get("trainer")
    if isinstance(run, dict) and "step" in run and not (is_count(run["step"]) and run["step"] == step):
        raise CheckpointError(f"{path / 'state.json'}: trainer.step is {snapshot.shown(run['step'])} but {MANIFEST} says step "
                              f"{step}; the checkpoint is inconsistent.")
    return Loaded(path, step, tree, chunks["model"], chunks["state"], data)


def _check_config(data: Any, source: Path) -> None:
    """config.yaml is read again after a resume (to say which settings changed): it must be YAML without
    anchors or aliases (a chain of aliases expands exponentially: a "billion laughs") and nested at most
    MAX_DEPTH deep. Scanned token by token, without building anything."""
    import yaml

    opens = (yaml.BlockMappingStartToken, yaml.BlockSequenceStartToken, yaml.FlowMappingStartToken,
             yaml.FlowSequenceStartToken)
    closes = (yaml.BlockEndToken, yaml.FlowMappingEndToken, yaml.FlowSequenceEndToken)
    depth, why = 0, None
    try:
        for token in yaml.scan(bytes(data), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
            if isinstance(token, (yaml.AnchorToken, yaml.AliasToken)):
                why = "has a YAML anchor or alias, which no trainer writes (a chain of them expands exponentially)"
                break
            depth += isinstance(token, opens) - isinstance(token, closes)
            if depth > snapshot.MAX_DEPTH:
                why = f"nests more than {snapshot.MAX_DEPTH} levels deep"
                break
    except yaml.YAMLError as e:
        why = f"is not YAML ({str(e).splitlines()[0]})"
    if why:
        raise CheckpointError(f"{source} {why}; it is not a valid trainer checkpoint.")


check_config_yaml = _check_config  # (for other readers of a run's config.yaml: resume=auto's search)


def model_mismatches(loaded: Loaded, live: dict[str, torch.Tensor]) -> list[str]:
    """Every model tensor whose name, global shape or dtype differs between the checkpoint and the live model."""
    problems = []
    for k, v in live.items():
        found = loaded.model.get(k)
        if not found:
            problems.append(f"{k}: missing from the checkpoint")
        elif found[0].shape != tuple(v.shape):
            problems.append(f"{k}: checkpoint {found[0].shape} vs model {tuple(v.shape)}")
        elif found[0].data.dtype != v.dtype:
            problems.append(f"{k}: checkpoint {found[0].data.dtype} vs model {v.dtype}")
    problems += [f"{k}: not in the model" for k in loaded.model if k not in live]
    return problems


def listed(problems: list[str], n: int = 4) -> str:
    """The first `n` of `problems` and how many more: a changed model's list of tensors, at a readable length."""
    return "; ".join(problems[:n]) + (f"; and {len(problems) - n} more" if len(problems) > n else "")


class NullCheckpointer:
    """No checkpoints (a Trainer built by hand without a checkpointer)."""

    dir, save_final, every_n_steps, best, fell_back, reranked = None, False, 0, None, False, None

    def __init__(self):
        self.abandoned: list[str] = []
        self.taken_back: list[str] = []

    def due(self, step: int) -> bool:
        return False

    def improves(self, metrics) -> bool:
        return False

    def repair_best_file(self) -> None:
        pass

    def consider(self, metrics, step: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def save(self, *args, **kwargs) -> None:
        return None

    def wait(self) -> None:
        pass

    def close(self) -> None:
        pass

    def check_writable(self) -> None:
        pass

    def complete(self) -> list[Path]:
        return []

    def follow(self, path: Path) -> bool:
        return False

    def branch_from(self, path: Path) -> tuple[Path | None, list[str], list[str]]:
        return None, [], []

    def unreadable(self) -> list[Path]:
        return []
