"""Our streamed safetensors writer and mapped reader speak exactly the safetensors format.

Checkpoints are written by `trainer.checkpoint.tensorfile` (hashing while writing) but must stay readable by
`safetensors` and Hugging Face, and anything the library writes must load back through our reader.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time

import pytest
import torch
from safetensors.torch import load_file, save, save_file

from trainer.checkpoint import tensorfile


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3, 5, generator=g).bfloat16(), "b": torch.randn(5, generator=g),
            "step": torch.tensor(7, dtype=torch.int64), "flags": torch.tensor([True, False, True]),
            "rng": torch.randint(0, 256, (9,), dtype=torch.uint8, generator=g), "empty": torch.empty(0, 4),
            "half": torch.randn(2, 2, generator=g).half()}


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k


def test_written_files_load_with_the_safetensors_library_and_hash_to_the_returned_digest(tmp_path):
    path = tmp_path / "x.safetensors"
    digest = tensorfile.write(path, _tensors(), {"format": "pt"})
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    _same(load_file(str(path)), _tensors())
    n = struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert json.loads(path.read_bytes()[8:8 + n])["__metadata__"] == {"format": "pt"}
    assert (8 + n) % 8 == 0  # tensor data starts aligned, as the format asks


def test_files_written_by_the_library_parse_to_the_same_tensors(tmp_path):
    path = tmp_path / "lib.safetensors"
    save_file(_tensors(), str(path), metadata={"format": "pt"})
    loaded = tensorfile.parse(tensorfile.map_file(path), path)
    _same(loaded, _tensors())
    loaded["w"].add_(1)  # tensors own their memory: the file is untouched
    _same(load_file(str(path)), _tensors())


@pytest.mark.parametrize("mangle, why", [
    (lambda b: b[:5], "shorter than its 8-byte header length"),
    (lambda b: struct.pack("<Q", len(b)) + b[8:], "runs past the end of the file"),
    (lambda b: b[:-1], r"header describes \d+: it is truncated"),
    (lambda b: b + b"\0", r"header describes \d+: bytes follow the data"),
    (lambda b: struct.pack("<Q", 200 << 20) + b[8:], "more than the 104857600 bytes a header may have"),
    (lambda b: b.replace(b'"F32"', b'"F99"'), "has no valid dtype"),
    (lambda b: b.replace(b'"BF16","shape":[3,5]', b'"BF16","shape":[3,6]'), r"bytes for shape \[3, 6\]"),
    (lambda b: struct.pack("<Q", 8) + b"not json" + b[16:], "header is not JSON"),
])
def test_malformed_files_are_refused_with_the_reason(tmp_path, mangle, why):
    data = mangle(save(_tensors()))
    with pytest.raises(ValueError, match=why) as e:
        tensorfile.parse(data, tmp_path / "bad.safetensors")
    assert "bad.safetensors" in str(e.value)


@pytest.mark.parametrize("damage", ["missing", "directory"])
def test_a_checkpoint_file_that_cannot_be_read_is_named_not_a_traceback(tmp_path, damage):
    from trainer.checkpoint.store import Checkpointer, read, verify
    from trainer.errors import CheckpointError

    path = Checkpointer(tmp_path).save(1, {"w": torch.ones(2)}, {"step": torch.tensor(1)})
    bad = path / "state.safetensors"
    bad.unlink()
    if damage == "directory":
        bad.mkdir()
    for read_ in (verify, read):
        with pytest.raises(CheckpointError, match="listed in the manifest") as e:
            read_(path)
        assert str(bad) in str(e.value)


def test_a_header_is_checked_against_the_size_before_anything_is_mapped_or_hashed(tmp_path):
    path = tmp_path / "x.safetensors"
    tensorfile.write(path, _tensors())
    buf, _, entries = tensorfile.map_safetensors(path)
    assert bytes(buf.read(0, len(buf)).numpy()) == path.read_bytes() and entries.keys() == _tensors().keys()
    os.truncate(path, 200 << 30)  # a 200 GiB sparse file: hashing it would take minutes, mapping it may fail
    started = time.monotonic()
    with pytest.raises(ValueError, match=rf"{path} is not a valid safetensors file: the file is {200 << 30} bytes"):
        tensorfile.map_safetensors(path)
    assert time.monotonic() - started < 1


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
def test_only_regular_files_are_read_and_a_fifo_never_blocks(tmp_path, kind):
    target = tmp_path / "real.safetensors"
    tensorfile.write(target, _tensors())
    path = tmp_path / "x.safetensors"
    {"fifo": os.mkfifo, "directory": os.mkdir, "symlink": lambda p: p.symlink_to(target)}[kind](path)
    what = {"fifo": "a FIFO", "directory": "a directory", "symlink": "a symbolic link"}[kind]
    with pytest.raises(tensorfile.NotRegularFile, match=f"{what}, not a regular file"):
        tensorfile.map_safetensors(path)  # links are not followed here
    with pytest.raises(tensorfile.NotRegularFile, match=f"{what}, not a regular file"):
        tensorfile.map_file(path, follow_links=False, max_size=1 << 20)
    if kind == "symlink":  # tools may follow them
        assert bytes(tensorfile.map_file(path)) == target.read_bytes()
    with pytest.raises(ValueError, match="more than the 10 such a file may have"):
        tensorfile.map_file(target, max_size=10)


@pytest.mark.parametrize("size", [0, 1, 4096, 3 * 4096 + 17])
def test_a_file_hashed_block_by_block_into_one_buffer_hashes_to_its_sha256(tmp_path, size):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(size))
    fd, n = tensorfile._open_regular(path, True)
    reader = tensorfile.FileReader(fd, n, path)
    assert reader.sha256(block=4096) == hashlib.sha256(path.read_bytes()).hexdigest()
    assert tensorfile.file_sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_file_truncated_while_it_is_hashed_is_an_error_not_a_digest_of_fewer_bytes(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(3 * 4096))
    fd, n = tensorfile._open_regular(path, True)
    reader = tensorfile.FileReader(fd, n, path)
    os.truncate(path, 4096 + 5)
    with pytest.raises(tensorfile.FileChanged, match="shorter than when it was opened"):
        reader.sha256(block=4096)


def test_files_and_buffers_hashed_together_give_each_its_sha256_with_fewer_cores_than_files(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 1)  # one worker for three files: it must not wait for three
    blobs = {f"f{i}": os.urandom(5000 * (i + 1)) for i in range(3)}
    buffers: dict = {"small": b"config: 1\n"}
    for name, blob in blobs.items():
        (tmp_path / name).write_bytes(blob)
        fd, n = tensorfile._open_regular(tmp_path / name, True)
        buffers[name] = tensorfile.FileReader(fd, n, tmp_path / name)
    digests = tensorfile.sha256_all(buffers)
    assert digests == {"small": hashlib.sha256(b"config: 1\n").hexdigest(),
                       **{k: hashlib.sha256(v).hexdigest() for k, v in blobs.items()}}
