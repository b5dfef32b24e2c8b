"""What a wandb run holds on this machine: the `run-<id>.wandb` transaction logs under `<dir>/wandb/*run-*-<id>/`.

A resume reads them to learn which steps the run it continues already has: offline, they are exactly what
`wandb sync` uploads; after a kill -9 they end where wandb's service stopped writing, often steps before the
process died (its records are buffered). wandb 0.31 ships no reader for them, so this is one.

A `.wandb` file is a LevelDB-style log (https://github.com/google/leveldb/blob/main/doc/log_format.md) of
protobuf `wandb_internal_pb2.Record`s, as written by wandb's own datastore:

    header := ident ":W&B" (4 bytes), magic 0xBEE1 (uint16 LE), version 0 (uint8)
    then 32 KiB blocks of records; a block's last < 7 bytes are zero padding
    record := checksum (uint32 LE), length (uint16 LE), type (uint8), data[length]
    type   := FULL=1 | FIRST=2 | MIDDLE=3 | LAST=4 (a Record split across blocks is FIRST MIDDLE* LAST)

The checksum is zlib's CRC-32 of the type byte followed by the data (not LevelDB's masked crc32c).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

HEADER = struct.Struct("<4sHB")
RECORD_HEADER = struct.Struct("<IHB")
IDENT, MAGIC, VERSION = b":W&B", 0xBEE1, 0
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str | Path, first_block: int = 0) -> Iterator[tuple[int, object]]:
    """(the byte offset just after it, `Record`) for each record of one `.wandb` file, from block `first_block` on
    (a record continued from an earlier block is skipped). A torn record at the end (a killed run) ends the file;
    a damaged one is a ValueError."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    if len(data) < HEADER.size:
        return  # not written yet
    ident, magic, version = HEADER.unpack_from(data, 0)
    if (ident, magic, version) != (IDENT, MAGIC, VERSION):
        raise ValueError(f"{path}: not a wandb log (header {ident!r}, {magic:#x}, {version})")
    pending, pos = None, max(HEADER.size, first_block * BLOCK)
    continued = first_block > 0  # (a block may open with the rest of a record begun before it)
    while pos + RECORD_HEADER.size <= len(data):
        if BLOCK - pos % BLOCK < RECORD_HEADER.size:  # trailer padding: the next record starts a block
            pos += BLOCK - pos % BLOCK
            continue
        checksum, length, kind = RECORD_HEADER.unpack_from(data, pos)
        payload = data[pos + RECORD_HEADER.size: pos + RECORD_HEADER.size + length]
        if len(payload) < length:
            return  # torn write at the end of the file
        if zlib.crc32(bytes([kind]) + payload) != checksum:
            raise ValueError(f"{path}: bad checksum at byte {pos}")
        pos += RECORD_HEADER.size + length
        if kind in (MIDDLE, LAST) and pending is None and continued:
            continue
        continued = False
        if kind == FULL:
            chunks = [payload]
        elif kind == FIRST:
            pending = [payload]
            continue
        elif kind in (MIDDLE, LAST) and pending is not None:
            pending.append(payload)
            if kind == MIDDLE:
                continue
            chunks, pending = pending, None
        else:
            raise ValueError(f"{path}: unexpected record type {kind} at byte {pos}")
        record = pb.Record()
        try:
            record.ParseFromString(b"".join(chunks))
        except DecodeError:
            raise ValueError(f"{path}: a record before byte {pos} is not wandb's") from None
        yield pos, record


def history_step(record) -> int | None:
    """The step of a `history` record; None for any other."""
    import json

    if record.WhichOneof("record_type") != "history":
        return None
    if record.history.HasField("step"):
        return record.history.step.num
    return next((int(json.loads(item.value_json)) for item in record.history.item if item.key == "_step"), None)


def last_step(path: str | Path) -> int | None:
    """The step of the last history row of one `.wandb` file (wandb's steps only increase within it), or None.
    Read from the end, block by block, back to the first block holding one: a resume of a long run reads KiBs."""
    blocks = (Path(path).stat().st_size + BLOCK - 1) // BLOCK
    for first in range(blocks - 1, -1, -1):
        steps = [s for _, r in records(path, first) if (s := history_step(r)) is not None]
        if steps:
            return steps[-1]
    return None


def files_of(wandb_dir: str | Path, run_id: str, offline: bool = False) -> list[Path]:
    """The `.wandb` files of run `run_id` under `wandb_dir` (one per wandb.init: each attempt that logged to it);
    `offline`: only those of attempts that logged offline (`offline-run-*`), which reach the server by `wandb sync`."""
    return sorted(Path(wandb_dir).glob(f"{'offline-' if offline else '*'}run-*-{run_id}*/run-{run_id}.wandb"))


def logged_up_to(wandb_dir: str | Path, run_id: str, offline: bool = False) -> int | None:
    """The last step run `run_id` holds in this machine's files (`files_of`): None without a file of it here, -1
    when they hold no step. A file that cannot be read counts as holding none: a resume then logs those steps
    again."""
    files = files_of(wandb_dir, run_id, offline)
    if not files:
        return None
    steps = [-1]
    for path in files:
        try:
            steps.append(last_step(path))
        except (OSError, ValueError):
            continue
    return max(s for s in steps if s is not None)
