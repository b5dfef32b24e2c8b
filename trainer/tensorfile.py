"""safetensors files written and read at the speed of the disk, with their sha256 on the side.

The safetensors library serialises a state dict into one `bytes` object and parses a file into
another set of copies; a checkpoint also needs the sha256 of every byte. Doing all three in turn
cost a synchronous save 2.7x the time of a raw write, and a load 2x a raw read. Here a file is
written straight from the tensors' memory while a second thread hashes the same buffers (hashlib
releases the GIL), and read through `mmap` with the files hashed in parallel and the tensors
copied out once. The files are plain safetensors (the format is an 8-byte header length, a JSON
header, then the raw bytes: https://github.com/huggingface/safetensors#format) that
`safetensors.torch.load_file` and Hugging Face read; the tests hold us to that.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import struct
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


def map_file(path: str | os.PathLike) -> mmap.mmap | bytes:
    """The file's bytes, mapped rather than read (a private, copy-on-write mapping: writable, as
    `torch.frombuffer` wants, and never written back)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return b""
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)


def sha256_all(buffers: dict[str, mmap.mmap | bytes]) -> dict[str, str]:
    """sha256 of each buffer, the big ones hashed in parallel."""
    with ThreadPoolExecutor(max_workers=max(1, min(len(buffers), os.cpu_count() or 1))) as pool:
        return dict(zip(buffers, pool.map(lambda b: hashlib.sha256(b).hexdigest(), buffers.values())))


class Entry(NamedTuple):
    """One tensor of a safetensors file: where its bytes are and what they hold."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int


def read_header(buf: mmap.mmap | bytes, source: Path) -> tuple[dict[str, str], dict[str, Entry]]:
    """The metadata and the tensor entries of a safetensors file held in `buf`, nothing copied.

    Validates like the library does (header length, dtypes, shapes, offsets that tile the data
    exactly) and raises ValueError naming `source` otherwise."""
    def bad(why: str) -> ValueError:
        return ValueError(f"{source} is not a valid safetensors file: {why}")

    if len(buf) < 8:
        raise bad("shorter than its 8-byte header length")
    n = struct.unpack("<Q", buf[:8])[0]
    if n > min(_MAX_HEADER, len(buf) - 8):
        raise bad(f"header length {n} runs past the end of the file")
    try:
        header = json.loads(bytes(buf[8:8 + n]))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise bad("header is not JSON") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise bad("__metadata__ is not a map of strings")
    start, data_len = 8 + n, len(buf) - 8 - n
    spans = []
    for name, info in header.items():
        try:
            dtype, shape, (b, e) = _BY_NAME[info["dtype"]], info["shape"], info["data_offsets"]
            ok = isinstance(shape, list) and all(isinstance(x, int) and 0 <= x < 2**62 for x in (*shape, b, e))
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise bad(f"entry '{name}' has no valid dtype, shape and data_offsets")
        if e - b != math.prod(shape) * dtype.itemsize:
            raise bad(f"entry '{name}' has {e - b} bytes for shape {shape} of {info['dtype']}")
        spans.append((b, e, name, dtype, tuple(shape)))
    spans.sort(key=lambda x: x[:2])
    if [x[0] for x in spans] != [0, *(x[1] for x in spans[:-1])] or (spans[-1][1] if spans else 0) != data_len:
        raise bad("the tensors' data_offsets do not tile the data section")
    return metadata, {name: Entry(dtype, shape, start + b, start + e) for b, e, name, dtype, shape in spans}


def view(buf: mmap.mmap | bytes, entry: Entry) -> torch.Tensor:
    """The tensor of `entry`, as a view of `buf` (no copy: clone what must outlive the mapping)."""
    if entry.end == entry.begin:
        return torch.empty(entry.shape, dtype=entry.dtype)
    count = (entry.end - entry.begin) // entry.dtype.itemsize
    return torch.frombuffer(buf, dtype=entry.dtype, offset=entry.begin, count=count).reshape(entry.shape)


def parse(buf: mmap.mmap | bytes, source: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file held in `buf`, each copied out of it once."""
    _, entries = read_header(buf, source)
    return {name: view(buf, e).clone() for name, e in entries.items()}
