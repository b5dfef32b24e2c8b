"""The local files `data.path` names, for the datasets that read files (the lm recipe's text, `data=hf_text`)."""

from __future__ import annotations

import glob
import os
from pathlib import Path

from trainer.errors import DataError


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
