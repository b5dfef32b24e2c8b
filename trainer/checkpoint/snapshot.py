"""A checkpoint's state between memory and files: nested state <-> (a JSON tree, named tensors).

Tensors leave the tree and go to safetensors files; the tree keeps a reference (`{"__tensor__": name}`).
A DTensor (a shard of a model under FSDP or tensor parallelism) is saved as its local chunk, with the
global shape and the chunk's offset in the file's metadata; only one rank of each group of replicas
writes it. Loading assembles, for each tensor the live objects hold, exactly the region this rank
needs from whichever chunks cover it, so a checkpoint resumes on any number of processes and under
any strategy. Before anything is applied, every tensor is checked against the live one (global
shape and dtype; its chunks must cover it exactly once) and every other value against the live one:
the same kind (an integer where an integer is, a finite number where a finite one is), the same
keys, tuples of the same length. Nothing in a checkpoint is trusted to be well-formed: whoever can
write one can also rewrite its sha256 manifest.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from trainer.errors import CheckpointError, UserError

TENSOR, ITEMS, TUPLE = "__tensor__", "__items__", "__tuple__"
MAX_DEPTH = 64  # nesting of a state tree; deeper is refused before parsing recurses


@dataclass(frozen=True)
class Chunk:
    """The region [offset, offset + local.shape) of a tensor whose whole shape is `shape`."""

    local: torch.Tensor
    shape: tuple[int, ...]
    offset: tuple[int, ...]

    @property
    def whole(self) -> bool:
        return tuple(self.local.shape) == self.shape


@dataclass(frozen=True)
class Writer:
    """Which tensors of a checkpoint this rank writes. `main`: it writes the plain (replicated) tensors;
    `root`: the rank whose sub-mesh writes the replicated pieces of DTensors (0: the one holding rank 0);
    `owns(path)`: whether this rank's group holds the tensor at `path` for the checkpoint (None: every tensor;
    pipeline stages each own theirs); `merge(trees)`: the checkpoint's state tree from every rank's, in rank
    order (None: rank 0's is the whole)."""

    main: bool = True
    root: int = 0
    owns: Any = None
    merge: Any = None


def chunk_of(t: torch.Tensor, is_main: bool, root: int = 0) -> Chunk | None:
    """What this rank writes of `t`: its shard of a DTensor (None for all but one copy of a replicated
    piece), or a plain tensor whole from the main rank (every rank holds the same one)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return Chunk(t, tuple(t.shape), (0,) * t.dim()) if is_main else None
    mesh = t.device_mesh
    # One copy of each replicated piece: from coordinate 0 of every replicated mesh dimension, and, for a
    # DTensor on a sub-mesh (FSDP's dp dimension beside tensor parallelism), from the sub-mesh holding `root`.
    if any(p.is_replicate() and mesh.get_local_rank(i) != 0 for i, p in enumerate(t.placements)):
        return None
    if not bool((mesh.mesh == root).any()):
        return None
    (meta,) = t.__create_chunk_list__()
    return Chunk(t.to_local(), tuple(t.shape), tuple(meta.offsets))


# -- nested state <-> (JSON tree, tensors) --------------------------------------------------------------
def flatten(obj: Any, tensors: dict[str, Chunk], writer: Writer | bool = True, path: str = "",
            copy: bool = True) -> Any:
    """A JSON-able copy of `obj` with tensors moved into `tensors` (as this rank's chunks: see `Writer`; a bool is
    `Writer(main=...)`) and replaced by references. With copy=False, CPU tensors go in as they are (for a write
    that happens before they change)."""
    if isinstance(writer, bool):
        writer = Writer(main=writer)
    if isinstance(obj, torch.Tensor):
        c = chunk_of(obj, writer.main, writer.root) if writer.owns is None or writer.owns(path) else None
        if c is not None:
            tensors[path] = Chunk(c.local.detach().to("cpu", copy=copy).contiguous(), c.shape, c.offset)
        return {TENSOR: path}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: flatten(v, tensors, writer, f"{path}/{k}", copy) for k, v in obj.items()}
        return {ITEMS: [[k, flatten(v, tensors, writer, f"{path}/{k}", copy)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {TUPLE: [flatten(v, tensors, writer, f"{path}/{i}", copy) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [flatten(v, tensors, writer, f"{path}/{i}", copy) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if type(obj).__module__ == "numpy" and getattr(obj, "ndim", None) == 0 and hasattr(obj, "item"):
        return flatten(obj.item(), tensors, writer, path, copy)  # a numpy scalar (a counter, a running mean): as Python's
    kind = "a numpy array" if type(obj).__module__ == "numpy" else f"a value of type {type(obj).__name__}"
    raise UserError(f"cannot checkpoint {kind} at '{path}': a state_dict holds tensors, numbers, strings, None, and "
                    "lists, tuples and dicts of them (no pickling). Return it as one of those from state_dict() ("
                    "torch.from_numpy(array) for an array) and convert it back in load_state_dict().")


def chunk_metadata(chunks: dict[str, Chunk]) -> dict[str, str]:
    """safetensors metadata recording which tensors of a file are chunks of a bigger one."""
    parts = {k: {"shape": list(c.shape), "offset": list(c.offset)} for k, c in chunks.items() if not c.whole}
    return {"format": "pt", **({"chunks": json.dumps(parts, separators=(",", ":"))} if parts else {})}


def parse_tree(data: bytes | memoryview, source) -> Any:
    """A JSON file of a checkpoint (state.json, manifest.json), refusing trees nested deeper than MAX_DEPTH:
    what reads them recurses. (json's own parser stops at the interpreter's recursion limit.)"""
    try:
        tree = json.loads(bytes(data))
    except (ValueError, RecursionError) as e:
        why = "it nests too deep" if isinstance(e, RecursionError) else e
        raise CheckpointError(f"{source} is not valid JSON ({why}); it is not a valid trainer checkpoint.") from None
    stack = [(tree, 1)]
    while stack:  # depth first, without recursion
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise CheckpointError(f"{source} nests more than {MAX_DEPTH} levels deep; it is not a valid trainer "
                                  "checkpoint.")
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return tree


# -- assembling tensors from chunks -----------------------------------------------------------------------
@dataclass(frozen=True)
class Stored:
    """One chunk as found in a file: its data (a tensor, or a `tensorfile.Pending` read from the file when it is
    used: a rank reads only the chunks it needs), and where it sits in the whole tensor."""

    data: Any
    shape: tuple[int, ...]
    offset: tuple[int, ...]

    def tensor(self) -> torch.Tensor:
        """The chunk's values (read from its file now, for a pending chunk)."""
        if isinstance(self.data, torch.Tensor):
            return self.data
        try:
            return self.data.load()
        except OSError as e:  # a file that shrank since it was checked: an error, never SIGBUS
            from trainer.checkpoint.store import AGAIN

            raise CheckpointError(f"{e.strerror or e}; {AGAIN}") from None


def stored_chunks(metadata: dict[str, str], views: dict[str, torch.Tensor], source) -> dict[str, Stored]:
    try:
        parts = json.loads(metadata.get("chunks", "{}"))
        out = {}
        for name, t in views.items():
            info = parts.get(name)
            shape = tuple(info["shape"]) if info else tuple(t.shape)
            offset = tuple(info["offset"]) if info else (0,) * t.dim()
            if len(shape) != t.dim() or len(offset) != t.dim() or any(
                    not isinstance(x, int) or x < 0 for x in (*shape, *offset)) or any(
                    o + n > s for o, n, s in zip(offset, t.shape, shape)):
                raise ValueError(f"chunk '{name}' does not fit its tensor")
            out[name] = Stored(t, shape, offset)
        return out
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
        why = "it nests too deep" if isinstance(e, RecursionError) else f"{type(e).__name__}: {e}"
        raise CheckpointError(f"{source}: invalid chunk metadata ({why}); it is not a valid trainer checkpoint.") from None


def assemble(name: str, chunks: list[Stored], like: torch.Tensor, where: str) -> torch.Tensor:
    """The part of tensor `name` that `like` holds on this rank (a DTensor's local shard, or a whole
    plain tensor), copied out of the stored chunks; a DTensor again if `like` is one. Refuses a global
    shape or dtype other than `like`'s, and chunks that leave a gap or overlap."""
    from torch.distributed.tensor import DTensor

    if not chunks:
        raise CheckpointError(f"{where}: '{name}' is missing from the checkpoint.")
    shape, dtype = tuple(like.shape), like.dtype
    if chunks[0].shape != shape or any(c.shape != shape for c in chunks):
        raise CheckpointError(f"{where}: '{name}' is {chunks[0].shape} in the checkpoint but {shape} here.")
    if any(c.data.dtype != dtype for c in chunks):
        raise CheckpointError(f"{where}: '{name}' is {chunks[0].data.dtype} in the checkpoint but {dtype} here.")
    if isinstance(like, DTensor):
        local = like.to_local()
        (meta,) = like.__create_chunk_list__()
        want_offset, want_shape = tuple(meta.offsets), tuple(local.shape)
    else:
        want_offset, want_shape = (0,) * len(shape), shape
    out = torch.empty(want_shape, dtype=dtype)
    boxes = []
    for c in chunks:
        box = [(max(o, wo), min(o + n, wo + wn)) for o, n, wo, wn in zip(c.offset, c.data.shape, want_offset, want_shape)]
        if any(lo >= hi for lo, hi in box):
            continue
        src, dst = c.tensor(), out
        for d, (lo, hi) in enumerate(box):
            src = src.narrow(d, lo - c.offset[d], hi - lo)
            dst = dst.narrow(d, lo - want_offset[d], hi - lo)
        dst.copy_(src)
        boxes.append([(lo - wo, hi - wo) for (lo, hi), wo in zip(box, want_offset)])
    why = _tiling_fault(boxes, want_shape)
    if why:
        raise CheckpointError(f"{where}: the chunks of '{name}' {why} here; it is not a valid trainer checkpoint.")
    if isinstance(like, DTensor):
        out = out.to(like.device)
        return DTensor.from_local(out, like.device_mesh, like.placements, shape=like.shape, stride=like.stride(),
                                  run_check=False)
    return out.to(like.device)


def _tiling_fault(boxes: list[list[tuple[int, int]]], shape: tuple[int, ...]) -> str | None:
    """Why the boxes (half-open ranges per dimension) do not cover `shape` exactly once, or None. Counted on
    the grid their edges cut the region into (one cell per chunk for the usual shardings), not per element."""
    if len(boxes) == 1 and all(box == (0, n) for box, n in zip(boxes[0], shape)):
        return None  # a whole tensor
    if math.prod(shape) == 0:
        return None
    if not boxes:
        return "leave it empty"
    cuts = [sorted({0, n, *(b[d][0] for b in boxes), *(b[d][1] for b in boxes)}) for d, n in enumerate(shape)]
    index = [{x: i for i, x in enumerate(c)} for c in cuts]
    covered = torch.zeros([len(c) - 1 for c in cuts], dtype=torch.bool)
    for b in boxes:
        cells = covered[tuple(slice(ix[lo], ix[hi]) for ix, (lo, hi) in zip(index, b))]
        if cells.any():
            return "overlap"
        cells.fill_(True)
    return None if bool(covered.all()) else "leave a gap"


# -- the tree against the live state ------------------------------------------------------------------------
def conform(tree: Any, like: Any, chunks: dict[str, list[Stored]], where: str, path: str = "",
            open_roots: frozenset[str] = frozenset()) -> Any:
    """`tree` (from state.json) turned back into live values shaped like `like` (the live state_dict):
    tensors assembled for this rank, containers and plain values checked against the live ones.

    Keys the live state has must be in the checkpoint; keys it lacks are ignored, but in a mapping of plain values
    inside a component's state (a registered object's counts by label: its keys are the data), or at the top of one
    of `open_roots` (a user's own object, whose whole state may be such a mapping). Where the live state has an empty container
    (lists whose length the checkpoint decides, such as one RNG state per rank) or None (a value not set yet: a
    best score), the checkpoint's values are taken after a check of their kind only."""
    label = path or "<root>"
    if like is None:  # (a tuple, a mapping with keys other than strings: rebuilt as saved, not left in their encoding)
        return _free(tree, chunks, where, path)
    if isinstance(tree, dict) and TENSOR in tree:
        ref = tree[TENSOR]
        if isinstance(like, torch.Tensor):
            return assemble(ref, chunks.get(ref, []) if isinstance(ref, str) else [], like, where)
        raise CheckpointError(f"{where}: '{label}' is a tensor in the checkpoint but {type(like).__name__} here.")
    if isinstance(like, torch.Tensor):
        raise CheckpointError(f"{where}: '{label}' is {type(tree).__name__} in the checkpoint but a tensor here.")
    if isinstance(like, dict):
        if not isinstance(tree, dict):
            raise CheckpointError(f"{where}: '{label}' is {type(tree).__name__} in the checkpoint but a mapping here.")
        items = dict(_items(tree, where, label))
        if not like:
            return {k: _free(v, chunks, where, f"{path}/{k}") for k, v in items.items()}
        missing = [str(k) for k in like if k not in items and str(k) not in items]
        if missing:
            raise CheckpointError(f"{where}: '{label}' lacks {', '.join(missing[:5])}.")
        out = {k: conform(items[k] if k in items else items[str(k)], v, chunks, where, f"{path}/{k}", open_roots)
               for k, v in like.items()}
        # Below a component's own state (its keys are its schema: one it dropped stays behind), a mapping of plain
        # values is data (counts by label), whose saved keys all come back.
        if (path.count("/") >= 2 or path in open_roots) and all(_plain_json(v) for v in like.values()):
            known = {str(k) for k in like}
            out.update({k: _free(v, chunks, where, f"{path}/{k}") for k, v in items.items()
                        if k not in like and str(k) not in known and _plain_json(v)})
        return out
    if isinstance(like, (list, tuple)):
        seq = tree.get(TUPLE) if isinstance(tree, dict) and TUPLE in tree else tree
        if not isinstance(seq, list):
            raise CheckpointError(f"{where}: '{label}' is {type(seq).__name__} in the checkpoint but a sequence here.")
        if isinstance(like, tuple) and like and len(seq) != len(like):  # a record (an RNG state, betas): fixed length
            raise CheckpointError(f"{where}: '{label}' has {len(seq)} items in the checkpoint but {len(like)} here.")
        if not like:
            out = [_free(v, chunks, where, f"{path}/{i}") for i, v in enumerate(seq)]
        else:
            # A list of like items (one per rank, one per parameter group): each checked against the first.
            out = [conform(v, like[i] if i < len(like) and len(like) == len(seq) else like[0], chunks, where,
                           f"{path}/{i}", open_roots) for i, v in enumerate(seq)]
        return tuple(out) if isinstance(like, tuple) else out
    return _plain(tree, like, where, label)


def _plain_json(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _items(tree: dict, where: str, label: str):
    if ITEMS in tree:
        items = tree[ITEMS]
        if not isinstance(items, list) or not all(isinstance(p, list) and len(p) == 2 and _is_key(p[0]) for p in items):
            raise CheckpointError(f"{where}: '{label}' has malformed items (pairs of a key and a value).")
        return [tuple(p) for p in items]
    return tree.items()


def _is_key(k: Any) -> bool:
    return k is None or isinstance(k, (str, int, float))


_KIND = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _plain(value: Any, like: Any, where: str, label: str) -> Any:
    """A JSON value where the live state has `like`: the same kind (an int where an int is), a finite
    number where a finite one is."""
    if like is None or value is None:
        return value
    if isinstance(like, bool):
        ok = isinstance(value, bool)
    elif isinstance(like, int):
        ok = isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**63
    elif isinstance(like, float):
        ok = (isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**1023) or (
            isinstance(value, float) and (math.isfinite(value) or not math.isfinite(like)))
    elif isinstance(like, str):
        ok = isinstance(value, str)
    else:
        ok = True
    if not ok:
        kind = _KIND.get(type(like), type(like).__name__)
        raise CheckpointError(f"{where}: '{label}' is {shown(value)} in the checkpoint; expected {kind}"
                              f"{' (finite)' if isinstance(like, float) else ''}.")
    return float(value) if isinstance(like, float) else value


def shown(value: Any) -> str:
    """`repr(value)`, cut short if long (a hostile checkpoint may hold a value of any size)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def _free(tree: Any, chunks: dict[str, list[Stored]], where: str, path: str) -> Any:
    """A value the live state gives no template for: rebuilt as saved (tensors whole)."""
    if isinstance(tree, dict):
        if TENSOR in tree:
            found = chunks.get(tree[TENSOR]) if isinstance(tree[TENSOR], str) else None
            if not found or len(found) != 1 or found[0].shape != tuple(found[0].data.shape):
                raise CheckpointError(f"{where}: tensor '{tree[TENSOR]}' is missing or not whole.")
            return found[0].tensor().clone()
        if TUPLE in tree:
            if not isinstance(tree[TUPLE], list):
                raise CheckpointError(f"{where}: '{path}' is a tuple whose items are not a list.")
            return tuple(_free(v, chunks, where, f"{path}/{i}") for i, v in enumerate(tree[TUPLE]))
        return {k: _free(v, chunks, where, f"{path}/{k}") for k, v in _items(tree, where, path)}
    if isinstance(tree, list):
        return [_free(v, chunks, where, f"{path}/{i}") for i, v in enumerate(tree)]
    return tree
