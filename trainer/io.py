"""Atomic file writes: temp file in the same directory, fsync, rename. Readers never see half a file."""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _mkstemp(path: Path) -> tuple[int, str]:
    """A temp file beside `path` (same filesystem, so the rename is atomic), with normal permissions."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.fchmod(fd, 0o666 & ~_umask())
    return fd, tmp


def fsync_dir(path: str | os.PathLike) -> None:
    """Persist a rename: the directory entry itself must reach the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _mkstemp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def atomic_save_safetensors(path: str | os.PathLike, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    """`safetensors.torch.save_file`, streamed to a temp file and renamed into place."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _mkstemp(path)
    os.close(fd)
    try:
        try:
            save_file(tensors, tmp, metadata=metadata)
        except Exception as e:  # safetensors' own error type for what is an OSError (a full disk: "os error 28")
            code = re.search(r"os error (\d+)", str(e))
            if code is None or isinstance(e, OSError):
                raise
            raise OSError(int(code.group(1)), f"{os.strerror(int(code.group(1)))} (writing {path})") from e
        os.chmod(tmp, 0o666 & ~_umask())
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


_ATTEMPT: dict[Path, int] = {}  # run dir -> the number the files set aside there take (inside `one_attempt`)


def free_name(path: Path, tag: str, before_suffix: bool = False) -> Path:
    """`path` with `tag` added (`checkpoints.prev`; `metrics.prev.jsonl` with `before_suffix`), or the tag and -2, -3,
    ...: a name nothing has yet. What an earlier attempt's files move to, so that no later attempt overwrites them.
    Inside `one_attempt(dir)`, a `.prev` of that dir's files starts at the attempt's number."""
    stem, ext = (path.stem, path.suffix) if before_suffix else (path.name, "")
    n = _ATTEMPT.get(Path(path).absolute().parent, 1) if tag == ".prev" else 1
    candidate = path.with_name(f"{stem}{tag}{'' if n == 1 else f'-{n}'}{ext}")
    while candidate.exists() or candidate.is_symlink():
        n += 1
        candidate = path.with_name(f"{stem}{tag}-{n}{ext}")
    return candidate


@contextlib.contextmanager
def one_attempt(run_dir: str | os.PathLike, number: int | None = None) -> Iterator[int]:
    """Within the block, what a fresh start sets aside in `run_dir` (config.yaml, metrics.jsonl, export/,
    checkpoints/, ...) takes one number, the one after every `.prev` there: config.prev-3.yaml goes with
    metrics.prev-3.jsonl, whichever of the earlier attempts left which files. Yields the number; `number`: that
    of an earlier block, for what one attempt sets aside at two moments (a loop's rollback: its events at the
    load, its checkpoints at the next save)."""
    run_dir = Path(run_dir).absolute()
    numbers = [int(m.group(1) or 1) for p in (run_dir.iterdir() if run_dir.is_dir() else ())
               if (m := re.search(r"\.prev(?:-([0-9]+))?(?:\.|$)", p.name))]
    _ATTEMPT[run_dir] = number if number is not None else max(numbers, default=0) + 1
    try:
        yield _ATTEMPT[run_dir]
    finally:
        _ATTEMPT.pop(run_dir, None)


def output_file_problem(path: str | os.PathLike) -> str | None:
    """Why a file cannot be written at `path` (checked before the work that makes it, not after): it is a directory,
    or its directory cannot be made or written; None when it can."""
    path = Path(path).expanduser()
    if path.is_dir():
        return f"{path} is a directory; give a file name in it"
    return unwritable(path.absolute().parent)


def same_dir(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths are one directory (through links or a bind mount); False where either cannot be reached."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def first_existing(path: Path) -> Path:
    """`path` or its nearest ancestor that exists (a dangling link counts: it is in the way)."""
    path = Path(path).expanduser().absolute()
    while not path.exists() and not path.is_symlink() and path != path.parent:
        path = path.parent
    return path


def unwritable(path: Path) -> str | None:
    """Why `path` (a directory, made with its parents where missing) cannot be written by this process: its first
    part that exists is not a directory, or not writable; None when it can. Leaves nothing behind."""
    given = Path(path).expanduser().absolute()
    path = first_existing(given)  # (where the missing directories would be made)
    missing = path != given
    if not path.is_dir():
        return f"{path} is not a directory"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{path} is not writable by this process"
    # Permission bits are not the whole story (root in /sys or /proc, a read-only mount): try it.
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".trainer-probe-", dir=path))
    except OSError as e:
        return f"no {'directory' if missing else 'file'} can be made in {path} ({e.strerror or e})"
    return None
