"""What a process tree was doing when a test gave up waiting for it (conftest's start_cli.wait): a table of its
processes and threads (state and kernel wait channel, from /proc), and every Python thread's stack, which each
process writes to its stderr on SIGABRT (the suite sets PYTHONFAULTHANDLER, and forked processes keep the
handler). A hang seen once on CI said only "timed out after 180 seconds"; this says where it waited. Linux only:
elsewhere the tree is the top process and the table is empty."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

PROC = Path("/proc")


def _stat(pid: int | str) -> tuple[int, str] | None:
    """(parent pid, state letter) of a process or thread, None when it is gone."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # (the command name, in parentheses, may hold spaces)
    return int(fields[1]), fields[0]


def _read(path: Path, limit: int = 160) -> str:
    try:
        return path.read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:limit]
    except OSError:
        return "?"


def tree(pid: int) -> list[int]:
    """`pid` and its descendants, parents before children."""
    children: dict[int, list[int]] = {}
    for entry in PROC.glob("[0-9]*"):
        found = _stat(entry.name)
        if found is not None:
            children.setdefault(found[0], []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(sorted(children.get(p, [])))
    return out


def table(pids: list[int]) -> str:
    lines = []
    for pid in pids:
        found = _stat(pid)
        if found is None:
            continue
        threads = []
        for task in sorted((PROC / str(pid) / "task").glob("[0-9]*"), key=lambda t: int(t.name)):
            state = _stat(f"{pid}/task/{task.name}")
            threads.append(f"{_read(task / 'comm')}:{state[1] if state else '?'}:{_read(task / 'wchan')}")
        lines.append(f"pid {pid} ppid {found[0]} {found[1]} {_read(PROC / str(pid) / 'cmdline')}\n"
                     f"    threads (name:state:wait) {' '.join(threads)}")
    return "\n".join(lines)


def _gone(pid: int) -> bool:
    found = _stat(pid)
    return found is None or found[1] in "ZX"


def stop(pid: int, grace: float = 5.0) -> str:
    """Describe `pid`'s tree and have each process write its Python stacks; returns the table. The tree is frozen
    first (SIGSTOP), so that no process reacts to another's end (a launcher tearing down its workers); then each,
    children first, gets SIGABRT and SIGCONT, and is waited for up to `grace` seconds before the next (their stacks
    would interleave in the one stderr file); SIGKILL for what is left."""
    pids = tree(pid)
    described = table(pids)
    _signal(pids, signal.SIGSTOP)
    for p in reversed(pids):
        _signal([p], signal.SIGABRT)
        _signal([p], signal.SIGCONT)
        deadline = time.monotonic() + grace
        while not _gone(p) and time.monotonic() < deadline:
            time.sleep(0.02)  # (polling its end, bounded: not a synchronisation of the test)
    _signal([p for p in pids if not _gone(p)], signal.SIGKILL)
    return described


def _signal(pids: list[int], signum: int) -> None:
    for p in pids:
        try:
            os.kill(p, signum)
        except OSError:
            pass
