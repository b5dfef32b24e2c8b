"""The launch topology of a multi-node run from SLURM's environment (pure functions, no torch).

Under `srun` (one task per node), each node's `python -m trainer world=ddp ...` learns the node count,
its own node rank and node 0's address from the variables SLURM sets, so one command line serves every
node: SLURM_NNODES, SLURM_NODEID, and the first host of SLURM_JOB_NODELIST (SLURM's compressed form,
`node[01-03,07]`), with the port from MASTER_PORT (default 29500) and the host from MASTER_ADDR if set.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

DEFAULT_PORT = 29500


def split_top_level(text: str) -> list[str]:
    """`text` split at the commas outside brackets: "a[1,2],b" -> ["a[1,2]", "b"]."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0 or depth > 1:
            raise ValueError(f"unbalanced or nested brackets in SLURM node list {text!r}")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced brackets in SLURM node list {text!r}")
    parts.append(text[start:])
    return [p for p in parts if p]


def _numbers(group: str, nodelist: str) -> list[tuple[int, int, int]]:
    """The items of one bracket group as (low, high, zero-padded width): "01-03,7" -> [(1, 3, 2), (7, 7, 0)]."""
    items = []
    for spec in group.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", spec.strip())
        if not m:
            raise ValueError(f"cannot read [{group}] in SLURM node list {nodelist!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        items.append((int(lo), int(hi), len(lo) if lo.startswith("0") else 0))  # SLURM keeps the padding it wrote
    return items


def _combine(parts: list, prefix: str = "") -> Iterator[str]:
    """Every name the literal texts and number groups of one expression spell, in order, one at a time."""
    if not parts:
        yield prefix
        return
    head, rest = parts[0], parts[1:]
    if isinstance(head, str):
        yield from _combine(rest, prefix + head)
        return
    for lo, hi, width in head:
        for i in range(lo, hi + 1):
            yield from _combine(rest, prefix + str(i).zfill(width))


def expand_hosts(nodelist: str) -> Iterator[str]:
    """The host names of a SLURM node list, in order, lazily (a list may name thousands of nodes).

    "node[01-03,07]" -> node01, node02, node03, node07; "a,b" -> a, b;
    "rack[1-2]-gpu[1,3]" -> rack1-gpu1, rack1-gpu3, rack2-gpu1, rack2-gpu3; "10.0.0.1" -> 10.0.0.1.
    """
    for expr in split_top_level(nodelist.strip()):
        pieces = re.split(r"(\[[^\]]*\])", expr)  # literal text and [bracket] groups, alternating
        yield from _combine([_numbers(p[1:-1], nodelist) if p.startswith("[") else p for p in pieces if p])


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: "node[01-03,07]" -> "node01"."""
    host = next(expand_hosts(nodelist), None)
    if not host:
        raise ValueError(f"SLURM node list {nodelist!r} names no host")
    return host


def topology(env: Mapping[str, str]) -> tuple[int, int, str] | None:
    """(nnodes, node_rank, rdzv_endpoint) of the SLURM job this process runs in, or None outside
    SLURM (no SLURM_JOB_ID) or in a one-node job. Raises ValueError when the variables do not make sense."""
    if not env.get("SLURM_JOB_ID"):
        return None
    nnodes = int(env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES") or 1)
    if nnodes <= 1:
        return None
    node_rank = int(env.get("SLURM_NODEID", "0"))
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"SLURM_NODEID={node_rank} is not in [0, SLURM_NNODES={nnodes})")
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    host = env.get("MASTER_ADDR") or first_host(nodelist)
    port = int(env.get("MASTER_PORT") or DEFAULT_PORT)
    return nnodes, node_rank, f"{host}:{port}"
