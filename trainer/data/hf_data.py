"""Local Hugging Face `datasets` files, tokenised once into a memmap of token ids (the `hf-data` extra).

`tokenize_corpus` reads json / jsonl / parquet / csv / text files or a `save_to_disk` directory (local only: nothing
is fetched from the Hub), encodes one text column with a `tokenizers` tokenizer.json (or as UTF-8 bytes), and
concatenates the documents (an optional end-of-document token after each) into `train.bin` and `val.bin`: the
packed token stream that a recipe cuts into fixed-length windows (recipes/lm/data.py). It runs once, on the main
process of each machine while the others wait (`main_process_first`); the cache is keyed by the fingerprints of
the data (each file's path, size and modification time; a save_to_disk directory's own fingerprint) and of the
tokenizer (the sha256 of its file), so a changed file or tokenizer builds a new one. Files are read and written a
batch of documents at a time: memory stays flat whatever the corpus size. The cache appears whole or not at all: it
is built in a temporary directory that is renamed into place with its meta.json inside. A cache already built is
read without `datasets`.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib
import json
import logging
import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from trainer.data.files import local_files, writing_cache
from trainer.errors import DataError, a_

FORMAT = 3  # bump when the cache layout or the encoding changes (2: text files keep their line breaks; 3: a val fraction of 2+ documents is at least one)
FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text", ".text": "text",
           ".md": "text"}
INSTALL = "pip install 'trainer[hf-data]' (or: pip install datasets tokenizers)"
BATCH = 1000  # documents encoded and written at a time
OFFLINE = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def require(module: str, why: str) -> Any:
    """Import an optional library of the hf-data extra, or stop with one paragraph saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"{why} needs the '{module}' package, which is not installed. Install the hf-data extra: "
                        f"{INSTALL}. Or use data=text / data=text_stream, which read bytes with no extra "
                        "package.") from None


@contextlib.contextmanager
def offline_datasets(why: str) -> Iterator[Any]:
    """`datasets`, imported and used with the Hub switched off: it only converts local files here, and a run must
    never reach the network for them. The environment and an already imported `datasets`'s settings are restored
    after; a `datasets` first imported here stays offline (it read the environment then), as the framework wants."""
    saved = {k: os.environ.get(k) for k in OFFLINE}
    os.environ.update(dict.fromkeys(OFFLINE, "1"))  # read when datasets and huggingface_hub are first imported
    try:
        datasets = require("datasets", why)
        config = datasets.config
        was = {k: getattr(config, k) for k in OFFLINE if hasattr(config, k)}
        for k in was:  # already imported before us: its settings were read then
            setattr(config, k, True)
        was_quiet = datasets.utils.are_progress_bars_disabled()
        datasets.disable_progress_bars()  # the run's own output stays readable
        try:
            yield datasets
        finally:
            for k, v in was.items():
                setattr(config, k, v)
            if not was_quiet:
                datasets.enable_progress_bars()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _is_saved(p: Path) -> bool:
    """A directory written by Dataset.save_to_disk (state.json) or DatasetDict.save_to_disk (dataset_dict.json)."""
    return p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file())


def sources(path: str, fmt: str | None) -> tuple[list[Path], str]:
    """The files `data.path` names (a file, a directory, a glob) and their format, or a save_to_disk directory
    ([dir], "saved"). Missing or mixed files are one paragraph naming them."""
    raw = os.path.expanduser(str(path))
    hint = ("Point data.path at local json/jsonl, parquet, csv or text files (a file, a directory or a glob such "
            "as 'corpus/*.jsonl'), or at a directory written by Dataset.save_to_disk.")
    if not glob.has_magic(raw) and _is_saved(Path(raw)):
        return [Path(raw)], "saved"
    files = local_files(path, hint, suffixes=FORMATS)
    if fmt is not None:
        if fmt not in set(FORMATS.values()):
            raise DataError(f"data.format={fmt!r} is not one of json, parquet, csv, text (or null: from the files' "
                            "extensions).")
        return files, fmt
    kinds = {f: FORMATS.get(f.suffix.lower()) for f in files}
    unknown = [f for f, k in kinds.items() if k is None]
    if unknown:
        raise DataError(f"data.path={str(path)!r}: {unknown[0]} has no known extension "
                        f"({', '.join(sorted(FORMATS))}). Set data.format=json|parquet|csv|text. {hint}")
    if len(set(kinds.values())) > 1:
        a, b = (next(f for f, k in kinds.items() if k == kind) for kind in sorted(set(kinds.values()))[:2])
        raise DataError(f"data.path={str(path)!r} mixes formats ({a} and {b}): point it at files of one format.")
    return files, next(iter(kinds.values()))


def data_fingerprint(files: list[Path], fmt: str, text_column: str) -> str:
    """What the cache depends on in the data: each file's resolved path, size and modification time (a
    save_to_disk directory: its files', and its own fingerprint)."""
    listed, saved = files, None
    try:
        if fmt == "saved":
            listed = sorted(f for f in files[0].rglob("*") if f.is_file())
            state = files[0] / "state.json"
            saved = json.loads(state.read_text()).get("_fingerprint") if state.is_file() else None
        stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in listed]
    except OSError as e:
        raise DataError(f"{e.filename} cannot be read ({e.strerror}).") from None
    except ValueError as e:
        raise DataError(f"{files[0] / 'state.json'} is not JSON ({e}): is {files[0]} a save_to_disk directory?") from None
    return hashlib.sha256(repr((fmt, text_column, saved, stats)).encode()).hexdigest()[:16]


class Encoder:
    """Text -> token ids: a tokenizer.json (Hugging Face `tokenizers`), or UTF-8 bytes when `path` is None."""

    def __init__(self, path: str | None, eos_token: str | None):
        self.path = path
        if path is None:
            self.tokenizer, self.vocab_size, self.fingerprint = None, 256, "bytes"
            self.eos = None if eos_token is None else self._byte_eos(eos_token)
            return
        tokenizers = require("tokenizers", f"data.tokenizer={path!r}")
        p = Path(os.path.expanduser(path))
        if not p.is_file():
            raise DataError(f"data.tokenizer={path!r}: {p} is not a file. Give the path of a tokenizer.json (a "
                            "Hugging Face `tokenizers` file: tokenizer.save(PATH)), or null for bytes.")
        data = p.read_bytes()
        try:
            self.tokenizer = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # noqa: BLE001 (tokenizers raises plain Exceptions)
            raise DataError(f"data.tokenizer={path!r}: {p} is not a tokenizer.json that the tokenizers library can "
                            f"read ({str(e).splitlines()[0] if str(e) else type(e).__name__}).") from None
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.fingerprint = hashlib.sha256(data).hexdigest()[:16]
        self.eos = None
        if eos_token is not None:
            self.eos = self.tokenizer.token_to_id(eos_token)
            if self.eos is None:
                raise DataError(f"data.eos_token={eos_token!r} is not a token of {p}. Give one of its special tokens "
                                "(its added_tokens), or null for none.")

    @staticmethod
    def _byte_eos(token: str) -> int:
        raw = token.encode("utf-8").decode("unicode_escape").encode("latin-1")
        if len(raw) != 1:
            raise DataError(f"data.eos_token={token!r}: without a tokenizer the tokens are bytes, so the "
                            "end-of-document token must be one byte (such as '\\n'), or null for none.")
        return raw[0]

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint8 if self.vocab_size <= 256 else np.uint16 if self.vocab_size <= 65536 else np.int32)

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's ids, the end-of-document token appended where there is one."""
        tail = () if self.eos is None else (self.eos,)
        if self.tokenizer is None:
            return [np.frombuffer(t.encode("utf-8") + bytes(tail), dtype=np.uint8) for t in texts]
        return [np.array([*e.ids, *tail], dtype=self.dtype)
                for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]


def _load(datasets, f: Path, fmt: str, cache: Path):
    """One file (or a save_to_disk directory) as a Dataset, converted to Arrow under `cache`; a malformed jsonl
    line is named by file and line."""
    try:
        if fmt == "saved":
            out = datasets.load_from_disk(str(f))
            if isinstance(out, datasets.DatasetDict):
                if "train" not in out:
                    raise DataError(f"data.path={str(f)!r} is a DatasetDict without a 'train' split (it has "
                                    f"{', '.join(out)}): point data.path at one split's directory.")
                out = out["train"]
            return out
        if fmt == "text":  # a document per line, its line break kept: the bytes of the file, as data=text reads it
            return datasets.Dataset.from_text(str(f), cache_dir=str(cache), keep_linebreaks=True)
        reader = {"json": datasets.Dataset.from_json, "parquet": datasets.Dataset.from_parquet,
                  "csv": datasets.Dataset.from_csv}[fmt]
        with _quiet_errors():
            return reader(str(f), cache_dir=str(cache))
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 (datasets and pyarrow raise many kinds)
        if fmt == "json":
            bad = _bad_json_line(f)
            if bad:
                raise DataError(f"{f} line {bad[0]} is not valid JSON ({bad[1]}): each line of a jsonl file must be "
                                "one JSON object. Fix or remove that line.") from None
        if fmt != "saved" and Path(f).is_file() and Path(f).stat().st_size == 0:  # (datasets: SchemaInferenceError)
            raise DataError(f"{f} is empty: give data.path files with text in them, or leave this one out.") from None
        cause = e.__cause__ or e.__context__ or e
        raise DataError(f"{f} cannot be read as {fmt} ({type(cause).__name__}: "
                        f"{(str(cause).strip().splitlines() or [''])[0][:300]}).") from None


@contextlib.contextmanager
def _quiet_errors():
    """datasets' ERROR records while it reads one file: its "Failed to load JSON ..." (twice, through Hydra's handler
    too) came before the framework's own paragraph for the same mistake (_load), which says it once. Its warnings
    and everything outside the read pass as the user's verbosity has them."""
    library_log = logging.getLogger("datasets")
    was = library_log.level
    library_log.setLevel(max(was, logging.ERROR + 1))
    try:
        yield
    finally:
        library_log.setLevel(was)


def _bad_json_line(f: Path) -> tuple[int, str] | None:
    """(line number, why) of the first line of a jsonl file that is not a JSON object, or None."""
    try:
        with open(f, "rb") as fh:
            first = fh.read(1)
            fh.seek(0)
            if first == b"[":  # one JSON document (a list of records), not jsonl
                try:
                    json.load(fh)
                except ValueError as e:
                    return getattr(e, "lineno", 1), str(e)
                return None
            for n, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except ValueError as e:
                    return n, str(e)
                if not isinstance(value, dict):
                    return n, f"{a_(type(value).__name__)}, not an object"
    except OSError:
        return None
    return None


def _line_of_row(f: Path, row: int) -> str:
    """Where row `row` of a jsonl file is ("line N"), counting non-blank lines as the reader does."""
    try:
        with open(f, "rb") as fh:
            k = -1
            for n, line in enumerate(fh, start=1):
                if line.strip():
                    k += 1
                    if k == row:
                        return f"line {n}"
    except OSError:
        pass
    return f"row {row}"


def _texts(ds, f: Path, fmt: str, column: str) -> Iterator[list[str]]:
    """The text column of one file, a batch of documents at a time; a missing column or a row without text is one
    paragraph naming the file and the line (or row)."""
    if column not in ds.column_names:
        raise DataError(f"{f} has no column {column!r} (its columns: {', '.join(ds.column_names) or 'none'}). Set "
                        "data.text_column to the column that holds the text.")
    ds = ds.select_columns([column])  # the other columns are never decoded
    for first in range(0, len(ds), BATCH):
        texts = ds[first : first + BATCH][column]
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                where = _line_of_row(f, first + i) if fmt == "json" else f"row {first + i}"
                what = "has no" if t is None else f"has a {type(t).__name__} in"
                raise DataError(f"{f} {where} {what} {column!r} (a string is needed in every row). Fix the row, or "
                                "set data.text_column to the column that holds the text.")
        yield texts


def tokenize_corpus(path: str, files: list[Path], fmt: str, encoder: Encoder, cache_root: Path,
                    text_column: str = "text", val_fraction: float = 0.0, say=print) -> tuple[Path, dict]:
    """The cache directory holding train.bin and val.bin (token ids, `meta["dtype"]`) for the documents of `files`
    (`sources(path, ...)`); the last `val_fraction` of the documents are val. Built once (main process first), then
    read from the cache."""
    from trainer.parallel.backend import is_main_process, main_process_first

    key = hashlib.sha256(repr((FORMAT, data_fingerprint(files, fmt, text_column), encoder.fingerprint,
                               encoder.eos, val_fraction)).encode()).hexdigest()[:12]
    name = files[0].stem if len(files) == 1 else f"{len(files)}files"
    cache = Path(cache_root) / f"hf-{name[:40]}-{key}"
    with main_process_first():
        if not (cache / "meta.json").exists():
            if is_main_process():
                say(f"data: tokenising {str(path)!r} once into {cache}")
            with offline_datasets(f"data.path={str(path)!r} (Hugging Face datasets files)") as datasets, \
                    writing_cache(cache):
                _build(datasets, files, fmt, text_column, encoder, val_fraction, cache)
        elif is_main_process():
            _record_digests(cache)
    return cache, json.loads((cache / "meta.json").read_text())


def _record_digests(cache: Path) -> None:
    """The tokens' sha256 in the meta.json of a cache built before it was recorded there (once, by reading the
    tokens), so that its runs are checked as a new cache's are without tokenising the corpus again. A cache this
    process cannot write (a read-only shared one) is left as it is: its runs are not checked, as before."""
    from trainer.io import atomic_write_json

    meta = json.loads((cache / "meta.json").read_text())
    if "train_sha256" in meta:
        return
    digests = {}
    for split in ("train", "val"):
        digest = hashlib.sha256()
        with open(cache / f"{split}.bin", "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
        digests[f"{split}_sha256"] = digest.hexdigest()
    try:
        atomic_write_json(cache / "meta.json", {**meta, **digests})
    except OSError:
        pass


def _build(datasets, files: list[Path], fmt: str, column: str, encoder: Encoder, val_fraction: float,
           cache: Path) -> None:
    """Build the cache in a temporary directory beside it and rename it into place: whole or not at all."""
    from trainer.io import atomic_write_json, fsync_dir

    cache.parent.mkdir(parents=True, exist_ok=True)
    host = socket.gethostname().replace(".", "_")
    for stale in cache.parent.glob(f".{cache.name}.{host}.*.tmp"):
        _remove_if_orphaned(stale)
    tmp = cache.parent / f".{cache.name}.{host}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        loaded = [(f, _load(datasets, f, fmt, tmp / "arrow")) for f in files]
        meta = _write(loaded, fmt, column, encoder, val_fraction, tmp)
        del loaded  # the Arrow files are memory-mapped: unmap them before removing them
        shutil.rmtree(tmp / "arrow", ignore_errors=True)
        meta.update({"source": [str(f.resolve()) for f in files], "format": fmt, "text_column": column,
                     "tokenizer": None if encoder.path is None else str(Path(encoder.path).expanduser().resolve()),
                     "tokenizer_sha256_16": encoder.fingerprint, "vocab_size": encoder.vocab_size,
                     "eos": encoder.eos, "dtype": encoder.dtype.name})
        atomic_write_json(tmp / "meta.json", meta)  # inside: the directory appears complete or not at all
        if (cache / "meta.json").exists():  # another machine sharing this disk finished first: keep its copy
            return
        shutil.rmtree(cache, ignore_errors=True)  # an incomplete one (no meta.json) left by a killed build
        os.replace(tmp, cache)
        fsync_dir(cache.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _remove_if_orphaned(tmp: Path) -> None:
    """Remove `tmp` (.<cache>.<host>.<pid>.tmp, this host's) when its process is gone: a SIGKILLed build leaves it
    (an Arrow copy of the corpus), and no later build, under its own pid, would reuse or remove it. A cache dir may
    be shared by several machines: only this host's are judged, by their pid."""
    try:
        pid = int(tmp.name.rsplit(".", 2)[-2])
        os.kill(pid, 0)
    except ProcessLookupError:
        shutil.rmtree(tmp, ignore_errors=True)
    except (ValueError, PermissionError):  # (not a name of ours; or a process of another user's: alive)
        pass


def _write(loaded: list, fmt: str, column: str, encoder: Encoder, val_fraction: float, out: Path) -> dict:
    """Encode every document in order into out/train.bin, then the last val_fraction of them into out/val.bin."""
    docs = sum(len(ds) for _, ds in loaded)
    # At least one document where there is a val fraction and two to split (5% of 10 documents rounded down to none,
    # and the run had no val split, without a word).
    n_val = max(int(docs * val_fraction), 1 if val_fraction > 0 and docs > 1 else 0)
    if docs - n_val < 1:
        raise DataError(f"the data has {docs} documents: none left for training after "
                        f"data.val_fraction={val_fraction}.")
    counts = {"train": 0, "val": 0}
    # The tokens' digest, as the byte corpora record theirs: what a resume and an eval check the data against (a
    # file edited in place builds a new cache, whose other tokens are then refused; the same text elsewhere is not).
    digests = {"train": hashlib.sha256(), "val": hashlib.sha256()}
    seen = 0
    with open(out / "train.bin", "wb") as train, open(out / "val.bin", "wb") as val:
        for f, ds in loaded:
            for texts in _texts(ds, f, fmt, column):
                encoded = encoder.encode(texts)
                cut = min(len(encoded), max(0, docs - n_val - seen))  # the batch's documents before val begins
                for split, fh, part in (("train", train, encoded[:cut]), ("val", val, encoded[cut:])):
                    if part:
                        flat = np.concatenate(part)
                        data = flat.tobytes()
                        fh.write(data)
                        digests[split].update(data)
                        counts[split] += len(flat)
                seen += len(encoded)
        for fh in (train, val):
            fh.flush()
            os.fsync(fh.fileno())
    return {"documents": docs, "val_documents": n_val, "train_tokens": counts["train"], "val_tokens": counts["val"],
            **{f"{split}_sha256": d.hexdigest() for split, d in digests.items()}}
