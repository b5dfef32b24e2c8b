"""Read back what wandb wrote offline: the `run-<id>.wandb` files under `<dir>/wandb/*run-*/`, read with the
framework's own reader of them (trainer/tracking/wandb_files.py, which says their format)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from trainer.tracking.wandb_files import records as _records


def read_records(path: str | Path) -> list:
    """Every `Record` in one `.wandb` file, in order. A torn record at the end (a killed run) is dropped."""
    return [record for _, record in _records(path)]


def wandb_files(run_dir: str | Path) -> list[Path]:
    """The `.wandb` files under `run_dir` (one per wandb.init), oldest first.

    Their folders are `[offline-]run-YYYYMMDD_HHMMSS-ID[-N]`: sort by the time, then by the suffix
    wandb adds when the same id starts twice in one second.
    """
    def started(path: Path) -> tuple:
        m = re.search(r"run-(\d{8}_\d{6})-", path.parent.name)
        return (m.group(1) if m else "", len(path.parent.name), path.parent.name)

    return sorted(Path(run_dir).rglob("run-*.wandb"), key=started)


def finished_records(path: str | Path, timeout: float = 10.0) -> list:
    """`read_records`, once the file holds its run's `exit` record (or after `timeout` s: a killed run).

    wandb's service buffers a run's records and closes the file shortly *after* `run.finish()`
    returns, so a test reading right after training may otherwise see an empty file.
    """
    deadline = time.monotonic() + timeout
    while True:
        found = read_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in found) or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def run_records(run_dir: str | Path, killed: tuple[Path, ...] = ()) -> list[list]:
    """The finished records of each `.wandb` file under `run_dir`, oldest file first; `killed`: files of a killed
    run, which will never hold an `exit` record (read as they are)."""
    files = wandb_files(run_dir)
    if not files:
        raise FileNotFoundError(f"no run-*.wandb file under {run_dir}")
    return [read_records(f) if f in killed else finished_records(f) for f in files]


def records(run_dir: str | Path, kind: str, killed: tuple[Path, ...] = ()) -> list:
    """The records of one kind ("history", "summary", "environment", "stats", ...) of every file."""
    return [r for found in run_records(run_dir, killed) for r in found if r.WhichOneof("record_type") == kind]


def _decode(items) -> dict[str, Any]:
    """Items (`key`, or a `nested_key` path) -> a dict of JSON-decoded values, nested along the path."""
    out: dict[str, Any] = {}
    for item in items:
        *parents, leaf = [item.key] if item.key else list(item.nested_key)
        node = out
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = json.loads(item.value_json)
    return out


def _public(values: dict[str, Any]) -> dict[str, Any]:
    """Without wandb's own entries (`_step`, `_runtime`, `_timestamp`, `_wandb`)."""
    return {k: v for k, v in values.items() if not k.startswith("_")}


def history(run_dir: str | Path, killed: tuple[Path, ...] = ()) -> list[dict[str, Any]]:
    """One dict per history row, in order: {"step": N, metric: value, ...}.

    Values logged at the same step (several `run.log(..., step=N)` calls) share one row; media
    such as `wandb.Html` appear as their file reference ({"_type": "html-file", "path": ...}).
    """
    rows = []
    for r in records(run_dir, "history", killed):
        values = _decode(r.history.item)
        step = r.history.step.num if r.history.HasField("step") else values.get("_step")
        rows.append({"step": step, **_public(values)})
    return rows


def config(run_dir: str | Path) -> dict[str, Any]:
    """The run config: the one given to `wandb.init`, then later `run.config` updates."""
    out: dict[str, Any] = {}
    for found in run_records(run_dir):
        for r in found:
            kind = r.WhichOneof("record_type")
            if kind in ("run", "config"):
                cfg = r.run.config if kind == "run" else r.config
                out.update(_decode(cfg.update))
                for item in cfg.remove:
                    out.pop(item.key or item.nested_key[0], None)
    return _public(out)


def summary(run_dir: str | Path) -> dict[str, Any]:
    """The run summary: later updates win (per top-level key), removed keys are dropped."""
    out: dict[str, Any] = {}
    for r in records(run_dir, "summary"):
        out.update(_decode(r.summary.update))
        for item in r.summary.remove:
            out.pop(item.key or item.nested_key[0], None)
    return _public(out)


def media_path(run_dir: str | Path, ref: dict[str, Any]) -> Path:
    """The file of a logged media value (e.g. a `wandb.Html`), given its reference from `history`."""
    matches = [f.parent / "files" / ref["path"] for f in wandb_files(run_dir)
               if (f.parent / "files" / ref["path"]).exists()]
    if not matches:
        raise FileNotFoundError(f"{ref['path']} under {run_dir}")
    return matches[-1]


def run_ids(run_dir: str | Path) -> list[str]:
    """The run id of each `.wandb` file under `run_dir` (a resumed run appears once per wandb.init)."""
    return [next(r.run.run_id for r in found if r.WhichOneof("record_type") == "run")
            for found in run_records(run_dir)]


def run_id(run_dir: str | Path) -> str:
    """The single run id under `run_dir`; an error if several wandb.init calls made different runs."""
    ids = set(run_ids(run_dir))
    if len(ids) != 1:
        raise ValueError(f"expected one wandb run under {run_dir}, found {sorted(ids)}")
    return ids.pop()
