"""safetensors files written and read at the speed of the disk, with their sha256 on the side.

The safetensors library serialises a state dict into one `bytes` object and parses a file into
another set of copies; a checkpoint also needs the sha256 of every byte. Doing all three in turn
cost a synchronous save 2.7x the time of a raw write, and a load 2x a raw read. Here a file is
written straight from the tensors' memory while a second thread hashes the same buffers (hashlib
releases the GIL), and read with `pread`, only the byte ranges a rank uses, with the files hashed in
parallel (never mapped: a mapped file truncated under the reader is a SIGBUS, a short read an error). The files are plain safetensors (the format is an 8-byte header length, a JSON
header, then the raw bytes: https://github.com/huggingface/safetensors#format) that
`safetensors.torch.load_file` and Hugging Face read; the tests hold us to that.

Reading trusts nothing in a file: only regular files are opened (never waiting on a FIFO), and a
header is checked against the file's size before its bytes are mapped or hashed, so a file that
claims more (or less) than it holds is refused at once, however large it is.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import stat
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import torch

# The safetensors names of the dtypes a training state holds.
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.complex64: "C64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
          torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64"}
_BY_NAME = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 << 20  # the safetensors library's own limit


class Entry(NamedTuple):
    """One tensor of a safetensors file: where its bytes are and what they hold."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int


def _byte_view(t: torch.Tensor):
    """The tensor's bytes as a buffer, without a copy (numpy has no bfloat16; a uint8 view works for all)."""
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""


def write(path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> str:
    """Write `tensors` (CPU, contiguous) as a safetensors file and fsync it; return its sha256.

    Tensors go in descending element size, as the library orders them, so each stays aligned."""
    names = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for k in names:
        t = tensors[k]
        if t.dtype not in DTYPES:
            raise TypeError(f"cannot save tensor '{k}' of dtype {t.dtype} in a safetensors file")
        n = t.numel() * t.element_size()
        header[k] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    chunks = [struct.pack("<Q", len(head)), head, *(_byte_view(tensors[k]) for k in names)]

    digest = hashlib.sha256()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256") as pool, open(path, "wb") as f:
        hashed = pool.submit(lambda: [digest.update(c) for c in chunks])
        for c in chunks:
            f.write(c)
        f.flush()
        os.fsync(f.fileno())
        hashed.result()
    return digest.hexdigest()


class NotRegularFile(OSError):
    """A path that is a FIFO, a directory, a device, a socket, or (where links are not followed) a link."""


_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFDIR: "a directory", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}


def _open_regular(path: str | os.PathLike, follow_links: bool) -> tuple[int, int]:
    """(fd, size) of the regular file at `path`; OSError saying what it is otherwise. Opened non-blocking:
    a plain open of a FIFO would wait for a writer forever."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow_links:
            raise NotRegularFile(errno.ELOOP, "a symbolic link, not a regular file", str(path)) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
        raise NotRegularFile(errno.EINVAL, f"{kind}, not a regular file", str(path))
    return fd, st.st_size


class FileChanged(OSError):
    """A file was shorter than when it was opened: truncated or replaced while it was read."""


class FileReader:
    """A regular file read by byte range with `pread`, never mapped. A mapped file that is truncated under the
    reader kills the process with SIGBUS at the next touch of a vanished page; a read just comes back short,
    which is an error with a message (FileChanged). Each rank reads only the byte ranges it uses."""

    def __init__(self, fd: int, size: int, path):
        self._file = os.fdopen(fd, "rb", buffering=0)  # owns the descriptor: closed with this object
        self.size, self.path = size, path

    def __len__(self) -> int:
        return self.size

    def close(self) -> None:
        self._file.close()

    def __del__(self) -> None:  # (a reader a load holds for its lazy tensors goes with the load: closed, not left to
        file = getattr(self, "_file", None)  # the file object's own finaliser, which warns of an unclosed file)
        if file is not None:
            file.close()

    def __enter__(self) -> FileReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def read(self, begin: int, end: int) -> torch.Tensor:
        """Bytes [begin, end) as a new uint8 tensor."""
        out = torch.empty(end - begin, dtype=torch.uint8)
        self._read_into(memoryview(out.numpy()), begin)
        return out

    def _read_into(self, view: memoryview, begin: int) -> None:
        got = 0
        while got < len(view):
            n = os.preadv(self._file.fileno(), [view[got:]], begin + got)
            if n == 0:
                raise FileChanged(errno.EIO, f"{self.path} is shorter than when it was opened (truncated or replaced "
                                             "while it was read)")
            got += n

    def sha256(self, block: int = 256 << 10) -> str:
        """sha256 of the whole file, read a block at a time into one buffer (hashlib releases the GIL: files hash
        in parallel). The block is small so that it is hashed from the core's own cache, just as the read left
        it: 16 MiB blocks, a fresh allocation each, hashed 10 MB in 11.8 ms, 256 KiB in 9.2 (Intel Xeon, 2026-11-27)."""
        digest = hashlib.sha256()
        buf = memoryview(bytearray(min(block, self.size)))
        for begin in range(0, self.size, block):
            view = buf[:min(block, self.size - begin)]
            self._read_into(view, begin)
            digest.update(view)
        return digest.hexdigest()

    def tensor(self, entry: Entry) -> torch.Tensor:
        """A new tensor holding `entry`'s bytes."""
        if entry.end == entry.begin:
            return torch.empty(entry.shape, dtype=entry.dtype)
        return self.read(entry.begin, entry.end).view(entry.dtype).reshape(entry.shape)


class Pending:
    """A tensor of a file, not read yet: its dtype and shape, and `load()`, which reads it (anew at each call)."""

    __slots__ = ("reader", "entry")

    def __init__(self, reader: FileReader, entry: Entry):
        self.reader, self.entry = reader, entry

    @property
    def dtype(self) -> torch.dtype:
        return self.entry.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.entry.shape

    def dim(self) -> int:
        return len(self.entry.shape)

    def load(self) -> torch.Tensor:
        return self.reader.tensor(self.entry)


def map_file(path: str | os.PathLike, follow_links: bool = True, max_size: int | None = None) -> bytearray:
    """The bytes of the regular file at `path` (read, not mapped: see FileReader). Anything else (a FIFO, a
    directory, a device; a symbolic link with follow_links=False) raises OSError without blocking; a file
    larger than `max_size` raises ValueError before it is read."""
    fd, size = _open_regular(path, follow_links)
    try:
        if max_size is not None and size > max_size:
            raise ValueError(f"{path} is {size} bytes, more than the {max_size} such a file may have")
        if not size:
            return bytearray()
        with FileReader(os.dup(fd), size, path) as reader:  # (closed here, not by the collector: a ResourceWarning)
            return bytearray(reader.read(0, size).numpy())
    finally:
        os.close(fd)


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of the regular file at `path`, read a block at a time."""
    fd, size = _open_regular(path, True)
    with FileReader(fd, size, path) as reader:
        return reader.sha256()


def map_safetensors(path: str | os.PathLike, follow_links: bool = False
                    ) -> tuple[FileReader, dict[str, str], dict[str, Entry]]:
    """A safetensors file opened for reading (a FileReader), with its metadata and entries (as `read_header`
    gives them). The header is read and checked against the file's size first: a file whose size differs from
    what its header describes (truncated, padded, or a 200 GiB sparse file) is refused before anything is read
    or hashed."""
    fd, size = _open_regular(path, follow_links)
    try:
        n = struct.unpack("<Q", os.pread(fd, 8, 0))[0] if size >= 8 else None
        head = os.pread(fd, n, 8) if n is not None and n <= min(_MAX_HEADER, size - 8) else b""
        metadata, entries = _parse_header(n, head, size, path)
    except BaseException:
        os.close(fd)
        raise
    return FileReader(fd, size, path), metadata, entries


class Hashing:
    """sha256 of each file (a FileReader) or buffer, the files hashed on threads of their own while the caller
    goes on; `result()` waits for the digests. The threads are running when the constructor returns: a caller
    that then parses headers in Python would otherwise hold the GIL until it is done, and the hashing would
    start only after it (2.5 ms later on a 15 ms checkpoint load)."""

    def __init__(self, buffers: dict[str, FileReader | bytes]):
        self._small = {k: b for k, b in buffers.items() if not isinstance(b, FileReader)}
        files = {k: b for k, b in buffers.items() if isinstance(b, FileReader)}
        workers = min(len(files), os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sha256") if files else None
        started, running = threading.Condition(), [0]

        def digest(reader: FileReader) -> str:
            with started:
                running[0] += 1
                started.notify()
            return reader.sha256()

        self._files = {k: self._pool.submit(digest, b) for k, b in files.items()} if files else {}
        with started:
            started.wait_for(lambda: running[0] >= workers)

    def result(self) -> dict[str, str]:
        try:
            digests = {k: hashlib.sha256(b).hexdigest() for k, b in self._small.items()}
            return {**digests, **{k: f.result() for k, f in self._files.items()}}
        finally:
            self.close()

    def close(self) -> None:
        """Wait for the threads (and drop what they found)."""
        if self._pool is not None:
            self._pool.shutdown()


def sha256_all(buffers: dict[str, FileReader | bytes]) -> dict[str, str]:
    """sha256 of each file (a FileReader) or buffer, the files hashed in parallel."""
    return Hashing(buffers).result()


def read_header(buf: bytes, source: Path) -> tuple[dict[str, str], dict[str, Entry]]:
    """The metadata and the tensor entries of a safetensors file held in `buf`, nothing copied.

    Validates like the library does (header length, dtypes, shapes, offsets that tile the data
    exactly, up to the file's last byte) and raises ValueError naming `source` otherwise."""
    n = struct.unpack("<Q", buf[:8])[0] if len(buf) >= 8 else None
    head = bytes(buf[8:8 + n]) if n is not None and n <= min(_MAX_HEADER, len(buf) - 8) else b""
    return _parse_header(n, head, len(buf), source)


def _parse_header(n: int | None, head: bytes, size: int, source) -> tuple[dict[str, str], dict[str, Entry]]:
    """The header `head` (`n` bytes, as the file's first 8 bytes say) of a safetensors file of `size` bytes."""
    def bad(why: str) -> ValueError:
        return ValueError(f"{source} is not a valid safetensors file: {why}")

    if n is None:
        raise bad("shorter than its 8-byte header length")
    if n > _MAX_HEADER:
        raise bad(f"header length {n} is more than the {_MAX_HEADER} bytes a header may have")
    if n > size - 8:
        raise bad(f"header length {n} runs past the end of the file ({size} bytes)")
    try:
        header = json.loads(head)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise bad("header is not JSON") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise bad("__metadata__ is not a map of strings")
    start = 8 + n
    spans = []
    for name, info in header.items():
        try:
            dtype, shape, (b, e) = _BY_NAME[info["dtype"]], info["shape"], info["data_offsets"]
            ok = isinstance(shape, list) and all(type(x) is int and 0 <= x < 2**62 for x in (*shape, b, e))
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise bad(f"entry '{name}' has no valid dtype, shape and data_offsets")
        if e - b != math.prod(shape) * dtype.itemsize:
            raise bad(f"entry '{name}' has {e - b} bytes for shape {shape} of {info['dtype']}")
        spans.append((b, e, name, dtype, tuple(shape)))
    spans.sort(key=lambda x: x[:2])
    end = 0
    for b, e, name, _, _ in spans:  # the tensors' bytes follow one another, each once
        if b != end:
            raise bad(f"the data_offsets of '{name}' " + ("overlap the tensor before it" if b < end else
                                                          f"leave a gap of {b - end} bytes before it"))
        end = e
    if start + end != size:
        raise bad(f"the file is {size} bytes but its header describes {start + end}: "
                  + ("it is truncated" if size < start + end else "bytes follow the data"))
    return metadata, {name: Entry(dtype, shape, start + b, start + e) for b, e, name, dtype, shape in spans}


def view(buf: FileReader | bytes, entry: Entry) -> torch.Tensor | Pending:
    """The tensor of `entry`: in a file, a Pending read (see FileReader); in a buffer, a view of it (no copy:
    clone what must outlive the buffer)."""
    if isinstance(buf, FileReader):
        return Pending(buf, entry)
    if entry.end == entry.begin:
        return torch.empty(entry.shape, dtype=entry.dtype)
    count = (entry.end - entry.begin) // entry.dtype.itemsize
    return torch.frombuffer(buf, dtype=entry.dtype, offset=entry.begin, count=count).reshape(entry.shape)


def load(buf: FileReader | bytes, entry: Entry) -> torch.Tensor:
    """A new tensor holding `entry`'s bytes, from a file or a buffer."""
    return buf.tensor(entry) if isinstance(buf, FileReader) else view(buf, entry).clone()


def parse(buf: bytes, source: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file held in `buf`, each copied out of it once."""
    _, entries = read_header(buf, source)
    return {name: view(buf, e).clone() for name, e in entries.items()}
