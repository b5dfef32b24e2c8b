"""Byte-level corpora cached as uint8 memmaps, cut into fixed-length windows.

`stdlib_corpus` needs no network: it reads the running Python's standard library sources once.
`text_file` does the same for any file (`data=text data.path=FILE`). `text_stream` reads files as a stream, a
block at a time, whatever their size (`data=text_stream`; trainer/data/streaming.py). `hf_text` tokenises Hugging Face
`datasets` files once into a memmap of token ids (`data=hf_text`; trainer/data/hf_data.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
import zlib
from pathlib import Path

import torch
from torch.utils.data import Dataset, IterableDataset

from trainer import main_process_first
from trainer.errors import DataError
from trainer.io import atomic_write_bytes, atomic_write_json

FORMAT = 1  # bump when the cache layout changes


def already_batched(batch):
    """`collate_fn` for datasets whose __getitems__ returns a whole batch."""
    return batch


class TokenWindows(Dataset):
    """Windows of `seq_len + 1` tokens, each overlapping the next by one: sample i is (x, y) = (w[:-1], w[1:]).

    The tokens (bytes, or a tokenizer's ids as uint16/int32) stay in a memory-mapped file; only the path crosses
    into data-loader workers.
    """

    collate_fn = staticmethod(already_batched)
    fingerprint: str | None = None  # the sha256 of the tokens, where the cache recorded it (what a resume checks)
    random_draws = False  # (its samples draw no random numbers: a loader worker need not seed them)

    def __init__(self, path: str | os.PathLike, seq_len: int, dtype: str = "uint8"):
        self.path, self.seq_len, self.dtype = str(path), seq_len, getattr(torch, dtype)
        self.num_tokens = os.path.getsize(self.path) // self.dtype.itemsize
        self._tokens: torch.Tensor | None = None
        self._offsets = torch.arange(seq_len + 1)

    def __getstate__(self):
        return {**self.__dict__, "_tokens": None}

    @property
    def tokens(self) -> torch.Tensor:
        if self._tokens is None:
            self._tokens = torch.from_file(self.path, shared=False, size=self.num_tokens, dtype=self.dtype)
        return self._tokens

    def __len__(self) -> int:
        return max(0, (self.num_tokens - 1) // self.seq_len)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.tokens[i * self.seq_len : i * self.seq_len + self.seq_len + 1].long()
        return w[:-1], w[1:]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        # One gather for the whole batch instead of one slice and a stack per sample.
        starts = torch.tensor(indices) * self.seq_len
        w = self.tokens[starts[:, None] + self._offsets].long()
        return w[:, :-1], w[:, 1:]


def default_cache_dir() -> Path:
    return Path(os.environ.get("TRAINER_CACHE_DIR") or Path.home() / ".cache" / "trainer")


def _build(cache: Path, parts: dict[str, bytes], meta: dict) -> None:
    from trainer.data.files import writing_cache

    with writing_cache(cache):
        for name, data in parts.items():
            atomic_write_bytes(cache / f"{name}.bin", data)
        # The contents' digest: a resume checks that the run trains on the bytes its checkpoint was trained on (a
        # file edited in place, same size, other text, is other data), hashed once here, where the bytes are in memory.
        digests = {f"{name}_sha256": hashlib.sha256(data).hexdigest() for name, data in parts.items()}
        atomic_write_json(cache / "meta.json", {**meta, **digests})  # written last: marks the cache complete


def _splits(cache: Path, seq_len: int) -> tuple[TokenWindows, TokenWindows | None]:
    train = TokenWindows(cache / "train.bin", seq_len)
    val = TokenWindows(cache / "val.bin", seq_len)
    try:  # (a cache built before the digests were recorded has none: its resumes are checked as before)
        train.fingerprint = json.loads((cache / "meta.json").read_text()).get("train_sha256")
    except (OSError, ValueError, AttributeError):
        train.fingerprint = None
    return train, (val if len(val) > 0 else None)


def stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    files = [p for p in sorted(root.rglob("*.py")) if not skip & set(p.relative_to(root).parts)]
    return root, files


def stdlib_corpus(seq_len: int = 256, cache_dir: str | None = None, val_every: int = 20):
    """The Python standard library's .py sources (tests excluded), about 12 MB of bytes.

    Whole files go to the validation split when crc32(relative path) % val_every == 0, so the
    split is deterministic and val text is never seen in training.
    """
    if isinstance(val_every, bool) or not isinstance(val_every, int) or val_every < 2:
        raise DataError(f"data.val_every={val_every!r} must be an integer >= 2: one file in val_every goes to the "
                        "val split (20 is the default).")
    # Keyed on the interpreter and where its stdlib lives, not on a listing of ~2000 files: listing
    # them cost ~0.5 s at every start. An installed stdlib does not change under a given version.
    root = Path(sysconfig.get_paths()["stdlib"])
    key = hashlib.sha256(repr((FORMAT, val_every, sys.version, str(root.resolve()))).encode()).hexdigest()[:12]
    cache = Path(cache_dir or default_cache_dir()) / f"stdlib-{key}"
    with main_process_first():
        if not (cache / "meta.json").exists():
            root, files = stdlib_files()
            if not files:
                raise DataError(f"found no .py files under the standard library at {root}; "
                                "use data=text data.path=FILE.")
            train, val = bytearray(), bytearray()
            for p in files:
                rel = str(p.relative_to(root))
                (val if zlib.crc32(rel.encode()) % val_every == 0 else train).extend(p.read_bytes() + b"\n")
            if not val:  # (the run had no val split, and no eval, without a word)
                raise DataError(f"data.val_every={val_every} put none of the standard library's {len(files)} files in "
                                "the val split: use a smaller one (20 is the default).")
            _build(cache, {"train": bytes(train), "val": bytes(val)},
                   {"source": str(root), "files": len(files), "train_bytes": len(train), "val_bytes": len(val)})
    return _splits(cache, seq_len)


def text_files(path: str, key: str = "data.path") -> list[Path]:
    """The files `data.path` (or the setting `key`) names: a file, every regular file under a directory (hidden
    ones skipped), or the files a glob pattern matches (`~/books/*.txt`, `corpus/**/*.md`), in sorted order."""
    from trainer.data.files import local_files

    return local_files(path, f"Point {key} at a readable text file, a directory of them or a glob pattern, e.g. "
                             f"data=text {key}=/path/to/book.txt.", key=key)


def text_file(path: str, seq_len: int = 256, cache_dir: str | None = None, val_fraction: float = 0.1):
    """Text as bytes from `text_files(path)`, concatenated (a newline between files): the last `val_fraction`
    of it is the validation split."""
    return _text_splits(path, seq_len, cache_dir, val_fraction, "data.path")


def _text_splits(path: str, seq_len: int, cache_dir: str | None, val_fraction: float, setting: str):
    """text_file's work; `setting` is the key that named `path`, for the errors (data.path, data.val_path)."""
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"data.val_fraction={val_fraction} must be in [0, 1).")
    files = text_files(path, setting)
    hint = f"Point {setting} at a readable text file, e.g. data=text {setting}=/path/to/book.txt."
    try:
        stats = [f.stat() for f in files]
        for f in files:
            with open(f, "rb"):
                pass
    except OSError as e:
        raise DataError(f"{setting}={str(path)!r} cannot be read ({e.strerror}: {e.filename}). {hint}") from None
    size = sum(st.st_size for st in stats) + len(files) - 1
    if size <= 0:
        raise DataError(f"{setting}={str(path)!r} is empty. {hint}")
    if size < seq_len + 1:
        raise DataError(
            f"{setting}={str(path)!r} has {size} bytes, fewer than data.seq_len + 1 = {seq_len + 1}. "
            f"Use a longer file or a smaller data.seq_len."
        )
    key = hashlib.sha256(repr((FORMAT, [(str(f.resolve()), st.st_size, st.st_mtime_ns) for f, st in zip(files, stats)],
                               val_fraction)).encode())
    name = files[0].stem if len(files) == 1 else f"{len(files)}files"
    cache = Path(cache_dir or default_cache_dir()) / f"text-{name[:40]}-{key.hexdigest()[:12]}"
    with main_process_first():
        if not (cache / "meta.json").exists():
            data = b"\n".join(f.read_bytes() for f in files)
            n_val = int(len(data) * val_fraction)
            if len(data) - n_val < seq_len + 1:  # too short to split: train on all of it, no val
                n_val = 0
            _build(cache, {"train": data[: len(data) - n_val], "val": data[len(data) - n_val :]},
                   {"source": [str(f.resolve()) for f in files], "train_bytes": len(data) - n_val, "val_bytes": n_val})
    return _splits(cache, seq_len)


def sampled_digest(files: list[str], sizes: list[int], blocks: int = 16, block: int = 4096) -> str:
    """What a stream's corpus is, without reading all of it: each file's name relative to the files' common
    directory, its size, and the sha256 of `blocks` blocks spread over it (the whole file when that is less). A
    corpus copied elsewhere (node-local scratch at each start of a preempted job) or touched is the same data;
    a file that grew, shrank or changed in a sampled block is not. (Its modification time, which this replaced,
    refused both of the former; hashing every byte would cost a large corpus minutes at each start.)"""
    root = os.path.commonpath([os.path.dirname(f) for f in files]) if files else ""
    digest = hashlib.sha256(repr([(os.path.relpath(f, root), n) for f, n in zip(files, sizes)]).encode())
    for f, n in zip(files, sizes):
        with open(f, "rb", buffering=0) as fh:
            if n <= blocks * block:
                digest.update(fh.read())
                continue
            for i in range(blocks):
                digest.update(os.pread(fh.fileno(), block, (n - block) * i // (blocks - 1)))
    return digest.hexdigest()[:16]


class TextStream(IterableDataset):
    """Text files as a stream of windows, read a block at a time: memory stays flat whatever the corpus size.

    Sample k of a file is (x, y) = (w[:-1], w[1:]) of its bytes w = [k * seq_len, k * seq_len + seq_len + 1), as
    TokenWindows cuts a memmap; the files follow each other in sorted order. `state_dict()` is the position after
    the last sample yielded (a file and a window), so a resume reads on from there at once (trainer/data/streaming.py).
    """

    random_draws = False  # (its samples draw no random numbers: a loader worker need not seed them)

    def __init__(self, files: list[Path], seq_len: int, block_bytes: int = 1 << 20):
        self.files, self.seq_len = [str(f) for f in files], seq_len
        stats = [os.stat(f) for f in self.files]
        self.windows = [max(0, (st.st_size - 1) // seq_len) for st in stats]
        self.bytes = sum(st.st_size for st in stats)  # (what the windows leave out is told from it: text_stream)
        self.block = max(1, block_bytes // seq_len)  # windows per read
        # What a resume checks: the same files, unchanged, cut the same way.
        self.fingerprint = hashlib.sha256(repr((FORMAT, seq_len, sampled_digest(
            self.files, [st.st_size for st in stats]))).encode()).hexdigest()[:16]
        # (until 2026-11-28: paths, sizes and modification times; a checkpoint written then still resumes)
        self.earlier_fingerprints = [hashlib.sha256(repr((FORMAT, seq_len, [(f, st.st_size, st.st_mtime_ns) for f, st in
                                                                             zip(self.files, stats)])).encode()).hexdigest()[:16]]
        self.part = (0, 1)  # (index, count): which files this reader reads (TextFileParts)
        self._at = (0, 0)  # (file, window) after the last sample yielded
        self._resume: tuple[int, int] | None = None

    def __len__(self) -> int:
        return sum(self.windows)

    def state_dict(self) -> dict[str, int]:
        return {"file": self._at[0], "window": self._at[1]}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """The next iteration starts after the sample `state` was taken at (later ones start over)."""
        file, window = state["file"], state["window"]
        if not (0 <= file < len(self.files) and 0 <= window <= self.windows[file]):
            raise ValueError(f"position (file {file}, window {window}) is not in these {len(self.files)} files")
        self._resume = (file, window)

    def __iter__(self):
        start, self._resume = self._resume or (0, 0), None
        index, count = self.part
        n, L = self.seq_len, self.seq_len + 1
        for f in range(index, len(self.files), count):
            if f < start[0]:
                continue
            first = start[1] if f == start[0] else 0
            with open(self.files[f], "rb") as fh:
                for lo in range(first, self.windows[f], self.block):
                    hi = min(lo + self.block, self.windows[f])
                    fh.seek(lo * n)
                    t = torch.frombuffer(bytearray(fh.read((hi - lo) * n + 1)), dtype=torch.uint8)
                    for k in range(hi - lo):
                        w = t[k * n : k * n + L].long()
                        self._at = (f, lo + k + 1)
                        yield w[:-1], w[1:]


class TextFileParts(TextStream):
    """TextStream whose readers each read their own files (files index, index + count, ...): no reader reads
    another's bytes, but the batches depend on the number of readers (trainer/data/streaming.py, Parts)."""

    def read_part(self, index: int, count: int) -> None:
        self.part = (index, count)

    @property
    def num_parts(self) -> int:
        """How many readers can have a part (a file each at least): checked before anything runs."""
        return len(self.files)


_NOTED: set = set()  # (the corpora whose text_stream note this process printed)


def text_stream(path: str, seq_len: int = 256, by_file: bool = False, val_path: str | None = None,
                cache_dir: str | None = None):
    """The files `text_files(path)` names, as a stream of windows (TextStream; TextFileParts with `by_file`); the
    val split is `val_path`'s text, cached as a memmap (or none)."""
    files = text_files(path)
    hint = "Point data.path at readable text files, e.g. data=text_stream data.path='corpus/*.txt'."
    try:
        for f in files:
            with open(f, "rb"):
                pass
    except OSError as e:
        raise DataError(f"data.path={str(path)!r} cannot be read ({e.strerror}: {e.filename}). {hint}") from None
    train = (TextFileParts if by_file else TextStream)(files, seq_len)
    if len(train) == 0:
        raise DataError(f"data.path={str(path)!r}: no file has data.seq_len + 1 = {seq_len + 1} bytes, so the stream "
                        f"has no sample. Use longer files or a smaller data.seq_len. {hint}")
    if by_file and sum(w > 0 for w in train.windows) < len(files):
        short = next(f for f, w in zip(files, train.windows) if w == 0)
        raise DataError(f"data.by_file=true, but {short} has fewer than data.seq_len + 1 = {seq_len + 1} bytes: a "
                        "reader given only such files would get no sample. Remove it or set data.by_file=false.")
    from trainer.entry.worker import LAUNCHER_ENV
    from trainer.parallel.backend import is_main_process

    total = train.bytes
    unread = total - sum(w * seq_len + 1 for w in train.windows if w)
    # (two thirds of a corpus of short files was left out without a word; said once: by the launcher's checks, or
    # by the one process, once per corpus: torchrun's rank 0 builds it in its checks and again to train)
    noted = (tuple(map(str, files)), seq_len)
    if unread > 0.1 * total and is_main_process() and not os.environ.get(LAUNCHER_ENV) and noted not in _NOTED:
        _NOTED.add(noted)
        short = sum(w == 0 for w in train.windows)
        print(f"note: data=text_stream cuts its windows of data.seq_len + 1 = {seq_len + 1} bytes within each file, so "
              f"{unread:,} of the corpus's {total:,} bytes are in no sample ({short} of its {len(files)} files are "
              "shorter than a window, and each file's last part shorter than one is left out). data=text reads the "
              "files as one text; a smaller data.seq_len leaves less out.", flush=True)
    # (an empty string is a path given empty, not "none": the run had no validation without a word)
    val = _text_splits(val_path, seq_len, cache_dir, 0.0, "data.val_path")[0] if val_path is not None else None
    return train, val


def hf_text(path: str, tokenizer: str | None = None, text_column: str = "text", format: str | None = None,
            eos_token: str | None = None, seq_len: int = 256, val_fraction: float = 0.0, cache_dir: str | None = None,
            model_vocab_size: int | None = None, sample_tokens: int | None = None):
    """Hugging Face `datasets` files (json/jsonl, parquet, csv, text, or a save_to_disk directory) tokenised once with
    `tokenizer` (a tokenizer.json; null: UTF-8 bytes) into a memmap of token ids, cut into windows like the byte
    corpora (trainer/data/hf_data.py). The last `val_fraction` of the documents are the val split. `model_vocab_size` and
    `sample_tokens` are the model's and the task's, checked against the tokenizer before anything is tokenised (the
    config passes them)."""
    from trainer.data.hf_data import Encoder, sources, tokenize_corpus

    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"data.val_fraction={val_fraction} must be in [0, 1).")
    files, fmt = sources(path, format)
    encoder = Encoder(tokenizer, eos_token)
    vocab = encoder.vocab_size
    if model_vocab_size is not None and model_vocab_size < vocab:
        what = f"data.tokenizer={tokenizer!r} has {vocab} tokens" if tokenizer else "bytes have 256 values"
        raise DataError(f"{what}, but model.vocab_size={model_vocab_size}: the model would have no embedding for the "
                        f"higher ids. Set model.vocab_size={vocab}.")
    if tokenizer is not None and sample_tokens:
        raise DataError(f"task.sample_tokens={sample_tokens}, but the lm task decodes its samples as bytes, and "
                        f"data.tokenizer={tokenizer!r} gives token ids. Set task.sample_tokens=0 (val/loss and "
                        "val/bpb are still reported; val/bpb then counts bits per token, not per byte).")
    cache, meta = tokenize_corpus(path, files, fmt, encoder, Path(cache_dir or default_cache_dir()), text_column,
                                  val_fraction)
    train = TokenWindows(cache / "train.bin", seq_len, meta["dtype"])
    train.fingerprint = meta.get("train_sha256")  # (None in a cache built before it was recorded: checked as before)
    if len(train) == 0:
        raise DataError(f"data.path={str(path)!r} gives {meta['train_tokens']} training tokens, fewer than "
                        f"data.seq_len + 1 = {seq_len + 1}. Use more text or a smaller data.seq_len.")
    val = TokenWindows(cache / "val.bin", seq_len, meta["dtype"])
    if val_fraction > 0 and len(val) == 0:
        print(f"note: data.val_fraction={val_fraction} of the {meta['documents']} documents in {path} left "
              f"{meta['val_tokens']} val tokens, fewer than data.seq_len + 1 = {seq_len + 1}: the run has no val split "
              "(no val/loss). Use more documents, a larger data.val_fraction or a smaller data.seq_len.", flush=True)
    return train, (val if len(val) > 0 else None)
