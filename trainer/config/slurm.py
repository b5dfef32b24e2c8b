"""The launch topology of a multi-node run from SLURM's environment (pure functions, no torch).

Under `srun` (one task per node), each node's `python -m trainer world=ddp ...` learns the node count,
its own node rank and node 0's address from the variables SLURM sets, so one command line serves every
node: SLURM_NNODES, SLURM_NODEID, and the first host of SLURM_JOB_NODELIST (SLURM's compressed form,
`node[01-03,07]`), with the port from MASTER_PORT (default 29500) and the host from MASTER_ADDR if set.
Values no SLURM job has (a backwards range, a million nodes, port 99999) are refused at once, in one
paragraph naming the variable: nothing here expands a range, so no value can make it spin.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

from trainer.errors import ConfigError

DEFAULT_PORT = 29500
# More nodes than any machine has: a node count, node list or range beyond this is garbage, not a job.
MAX_NODES = 1_000_000
_MAX_DIGITS = 18  # of one number in a node list (SLURM pads to a few)


def split_top_level(text: str) -> list[str]:
    """`text` split at the commas outside brackets: "a[1,2],b" -> ["a[1,2]", "b"]."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0 or depth > 1:
            raise ValueError("unbalanced or nested brackets")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError("unbalanced brackets")
    parts.append(text[start:])
    return [p for p in parts if p]


def _numbers(group: str) -> list[tuple[int, int, int]]:
    """The items of one bracket group as (low, high, zero-padded width): "01-03,7" -> [(1, 3, 2), (7, 7, 0)]."""
    items = []
    for spec in group.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", spec.strip())
        if not m:
            raise ValueError(f"cannot read [{group[:40]}]")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if max(len(lo), len(hi)) > _MAX_DIGITS:
            raise ValueError(f"a number of more than {_MAX_DIGITS} digits in [{group[:40]}...]")
        if int(lo) > int(hi):
            raise ValueError(f"the range {lo}-{hi} runs backwards")
        items.append((int(lo), int(hi), len(lo) if lo.startswith("0") else 0))  # SLURM keeps the padding it wrote
    return items


def _parse(expr: str) -> list:
    """One expression of a node list as its literal texts and number groups, checked: no group is empty
    (so its first host is found without a search) and together they name at most MAX_NODES hosts."""
    pieces = re.split(r"(\[[^\]]*\])", expr)  # literal text and [bracket] groups, alternating
    parts = [_numbers(p[1:-1]) if p.startswith("[") else p for p in pieces if p]
    count = 1
    for part in parts:
        if not isinstance(part, str):
            count *= sum(hi - lo + 1 for lo, hi, _ in part)
            if count > MAX_NODES:
                raise ValueError(f"{expr[:40]!r} names more hosts than any machine has (over {MAX_NODES:,})")
    return parts


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
    Raises ValueError for a list SLURM does not write (a backwards range, over MAX_NODES hosts).
    """
    for parts in [_parse(expr) for expr in split_top_level(nodelist.strip())]:  # all checked before the first
        yield from _combine(parts)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: "node[01-03,07]" -> "node01". Nothing is expanded: the first
    number of each group spells it."""
    exprs = [_parse(expr) for expr in split_top_level(nodelist.strip())]
    if not exprs:
        raise ValueError("names no host")
    return "".join(p if isinstance(p, str) else str(p[0][0]).zfill(p[0][2]) for p in exprs[0])


def port_number(text: str) -> int | None:
    """The TCP port `text` names (1..65535), or None."""
    text = text.strip()
    return int(text) if re.fullmatch(r"\d{1,5}", text) and 1 <= int(text) <= 65535 else None


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """HOST:PORT -> (host, port), as torch's rendezvous reads it ("[::1]:29500" for IPv6). Raises ValueError."""
    host, sep, port = endpoint.strip().rpartition(":")
    if not sep or not host:
        raise ValueError("no port")
    if port_number(port) is None:
        raise ValueError(f"{port[:20]!r} is not a port (1..65535)")
    if not re.fullmatch(r"[\w.:-]+|\[[\w.:-]+\]", host):
        raise ValueError(f"{host[:40]!r} is not a host name or IP address")
    return host.strip("[]"), int(port)


def leaves_topology_to_slurm(nnodes: int, node_rank: int, rdzv_endpoint: str | None) -> bool:
    """Whether world.nnodes, world.node_rank and world.rdzv_endpoint are at their defaults, so that SLURM's
    variables (if any) fill them. Setting any one of them yourself makes the three yours."""
    return (nnodes, node_rank, rdzv_endpoint) == (1, 0, None)


def _shown(value: str) -> str:
    return repr(value if len(value) <= 80 else value[:80] + "...")


def topology(env: Mapping[str, str]) -> tuple[int, int, str] | None:
    """(nnodes, node_rank, rdzv_endpoint) of the SLURM job this process runs in, or None outside
    SLURM (no SLURM_JOB_ID) or in a one-node job. Raises ConfigError, naming the variable, when the variables
    do not make sense."""
    job = env.get("SLURM_JOB_ID")
    if not job:
        return None

    def refuse(name: str, problem: str):
        value = _shown(env.get(name, ""))
        return ConfigError(f"cannot read the nodes of SLURM job {job}: {name}={value} {problem}. Fix the variable, or "
                           "set world.nnodes, world.node_rank and world.rdzv_endpoint=HOST:PORT yourself.")

    def integer(name: str, low: int, high: int, what: str) -> int:
        text = env[name].strip()
        if not (re.fullmatch(r"-?\d{1,12}", text) and low <= int(text) <= high):
            raise refuse(name, f"is not {what} (an integer in [{low}, {high}])")
        return int(text)

    count_var = next((k for k in ("SLURM_NNODES", "SLURM_JOB_NUM_NODES") if env.get(k)), None)
    nnodes = integer(count_var, 1, MAX_NODES, "a node count") if count_var else 1
    if nnodes == 1:
        return None
    node_rank = integer("SLURM_NODEID", 0, nnodes - 1, f"a node id of {count_var}={nnodes} nodes") \
        if env.get("SLURM_NODEID") else 0
    port = integer("MASTER_PORT", 1, 65535, "a port") if env.get("MASTER_PORT") else DEFAULT_PORT
    host_var = "MASTER_ADDR" if env.get("MASTER_ADDR") else next(
        (k for k in ("SLURM_JOB_NODELIST", "SLURM_NODELIST") if env.get(k)), "SLURM_JOB_NODELIST")
    try:
        host = env[host_var].strip() if host_var == "MASTER_ADDR" else first_host(env.get(host_var, ""))
    except ValueError as e:
        raise refuse(host_var, f"is not a SLURM node list: {e}") from None
    try:
        split_endpoint(f"{host}:{port}")
    except ValueError:
        raise refuse(host_var, "does not give a host name or IP address") from None
    return nnodes, node_rank, f"{host}:{port}"
