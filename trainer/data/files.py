"""The local files `data.path` names, for the datasets that read files (the lm recipe's text, `data=hf_text`)."""

from __future__ import annotations

import contextlib
import errno
import glob
import os
from pathlib import Path

from trainer.errors import DataError, StorageError

# What a write into a data cache fails with when the place is full or cannot be written (a read-only HOME).
_CANNOT_WRITE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO,
                 errno.ENOTDIR, errno.EEXIST)  # (the last two: a file where the cache dir goes)


@contextlib.contextmanager
def writing_cache(cache: Path):
    """Building a data cache (the token files every run reads): a full disk or a place that cannot be written is
    StorageError (exit 74) naming the cache and where else to put it, not 'could not build data' pointing at the
    recipe's code. Only errors of files under the cache's parent count: an input that cannot be read is the data's."""
    try:
        yield
    except OSError as e:
        where = Path(e.filename) if e.filename else None
        ours = where is None or Path(cache).parent in (where, *where.parents)
        if e.errno not in _CANNOT_WRITE or not ours:
            raise
        raise StorageError(f"could not write the data cache {cache} ({e.strerror}): the token files are built there "
                           "once and read by every run. Free space there, or put the cache elsewhere: "
                           "data.cache_dir=DIR (or TRAINER_CACHE_DIR=DIR for every run).") from None


def local_files(path: str, hint: str, suffixes=None, key: str = "data.path") -> list[Path]:
    """The regular files `path` names, sorted: a file, every file under a directory (hidden ones skipped; with
    `suffixes`, only those), or the files a glob pattern matches (`~/books/*.txt`, `corpus/**/*.md`). A path that
    names none is one paragraph naming it as the setting `key`, ending with `hint` (what to point it at)."""
    if path is None:  # (str(None) was looked for as a file named 'None')
        raise DataError(f"{key} is not set (null). {hint}")
    raw = os.path.expanduser(str(path))
    if not raw.strip():  # (Path("") is the current directory: every file under it read as the corpus)
        raise DataError(f"{key}={str(path)!r} is empty. {hint}")
    if glob.has_magic(raw):
        files = sorted(Path(f) for f in glob.glob(raw, recursive=True) if Path(f).is_file())
        if not files:
            raise DataError(f"{key}={str(path)!r} matches no file. {hint}")
        return files
    p = Path(raw)
    if not p.exists():
        raise DataError(f"{key}={str(path)!r} does not exist. {hint}")
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and (suffixes is None or f.suffix.lower() in suffixes)
                       and not any(part.startswith(".") for part in f.relative_to(p).parts))
        if not files:
            kind = "files" if suffixes is None else f"{', '.join(sorted(suffixes))} file"
            raise DataError(f"{key}={str(path)!r} is a directory with no {kind} in it. {hint}")
        return files
    if not p.is_file():  # a FIFO or a device would block the read forever
        raise DataError(f"{key}={str(path)!r} is not a regular file (a pipe or a device?). {hint}")
    return [p]
