"""The run dir's lock: one job per run dir (trainer/entry/rundir.py finds and names the run dirs).

* Lock: `<run dir>/.lock`, held (flock) by the job's launching process for the whole run, with a line
  naming it (PID, host and job). The OS releases it when that process dies, so a SIGKILLed run never
  blocks its own resume; a second job in the same run dir stops with one paragraph naming the holder. The
  CLI takes it (trainer/entry/cli.py); so do `trainer.train(cfg, run_dir)` from Python and a script's own
  `trainer.Runtime(run_dir=...)` (`hold`), sharing it with whatever of the same process holds it already.
* Workers: every worker process of the job holds a shared flock on the run dir itself for its whole life
  (`hold_as_worker`), and workers die with their launcher (`parallel.backend.die_with_parent`). A job only starts where no
  earlier job's worker still holds it, so "the launcher is gone" never means "nobody writes here".
* Several nodes: each node runs its own launcher, and they share the run dir. The launcher of node 0 takes
  the lock for the job (naming the job's rendezvous endpoint); the other nodes take no lock but refuse a run
  dir whose lock a different job holds.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
from pathlib import Path

from trainer.errors import ConfigError

LOCK = ".lock"
LINKED_BY = "linked_by.json"  # in the directory a run dir's checkpoints/ link leads to: which run dir links it


class RunDirLock:
    """The job's exclusive lock on a run dir. `job` names the job (several nodes share one run dir: their
    launchers pass the same rendezvous endpoint); without it the holder's PID is the job."""

    def __init__(self, run_dir: Path, job: str | None = None, chosen_by: str = "hydra.run.dir"):
        self.path = Path(run_dir) / LOCK
        self.job = job
        self.chosen_by = chosen_by  # (what names the run dir, for the refusal's way out)
        self._fd: int | None = None
        self._dir_fd: int | None = None  # the run dir's own shared flock, beside .lock's
        self._linked_fd: int | None = None  # the directory a linked checkpoints/ resolves to (`_hold_linked`)

    def _record(self) -> str:
        return f"{os.getpid()} {socket.gethostname()} {self.job or ''}".strip()

    def holder(self) -> tuple[str, str | None] | None:
        """(who, job) of the job holding the lock, or None when nobody does."""
        if not self.path.is_file():
            return None
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:  # (a link in its place: no lock of a job's)
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return None  # nobody holds it exclusively
            except BlockingIOError:
                parts = os.read(fd, 512).decode(errors="replace").split()
                return (f"process {parts[0]} on {parts[1]}" if len(parts) >= 2 else "another process",
                        parts[2] if len(parts) >= 3 else None)
        finally:
            os.close(fd)

    def acquire(self) -> RunDirLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            # A link in .lock's place: followed, the job's record was written over the file it names (truncated,
            # whatever it was). The link goes; what it names is never opened.
            self.path.unlink()
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            parts = os.read(fd, 512).decode(errors="replace").split()
            os.close(fd)
            raise ConfigError(_in_use(self.path.parent, f"process {parts[0]}" if parts else "another process",
                                      self.chosen_by)) from None
        lingering = workers_alive(self.path.parent)
        if lingering:
            os.close(fd)
            raise ConfigError(
                f"run dir {self.path.parent} is still written by the processes of another job ({lingering}), although "
                f"its {LOCK} is free (their launcher is gone, or the file was deleted). Stop them (kill PID), or wait "
                "for them to end, then rerun; two jobs in one run dir would interleave their metrics and checkpoints.")
        try:
            self._hold_linked()
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.write(fd, self._record().encode())
        self._fd = fd
        # The holder holds the run dir itself too, as every worker does (`hold_as_worker`): with .lock deleted (a
        # "stale lock" cleanup) a second job was let into the run dir of a live single-process job, and moved its
        # checkpoints aside under it.
        self._dir_fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(self._dir_fd, fcntl.LOCK_SH)
        _HELD[_key(self.path.parent)] = [self, 1]
        return self

    def _hold_linked(self) -> None:
        """The directory `checkpoints/` resolves to is the job's too, held (an exclusive flock) for as long as the run
        dir's lock: two run dirs whose checkpoints/ led to one directory (a link to a big scratch disk, twice; or a
        link to a running job's own checkpoints/), each with a lock of its own, pruned and replaced each other's
        checkpoints, and both runs' work was lost. A link is also refused where the run dir holding its target
        directory is another job's."""
        link = self.path.parent / "checkpoints"
        try:
            target = link.resolve(strict=True)
        except (OSError, RuntimeError):  # (none yet, or a loop of links: the checkpointer says so)
            return
        if not target.is_dir():
            return
        held = RunDirLock(target.parent).holder() if link.is_symlink() and target.name == "checkpoints" and \
            target.parent.resolve() != self.path.parent.resolve() else None
        fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
        try:
            if held is not None:
                raise BlockingIOError
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                f"{link} leads to {target}, whose checkpoints another job is writing now: two jobs in one checkpoints "
                "dir would prune and replace each other's checkpoints. Give each run dir a checkpoints dir of its own "
                f"(link {link} to a directory of its own, e.g. under {target.parent}), or wait for the other job to "
                "end. Nothing in the run dir was changed.") from None
        except OSError:  # (a file system without flock on directories, NFS or Lustre: two jobs at once go unguarded;
            os.close(fd)  # one after the other, the record below still tells a copy)
            if link.is_symlink():
                self._claim_linked(link, target)
            return
        try:
            if link.is_symlink():
                self._claim_linked(link, target)
        except BaseException:
            os.close(fd)
            raise
        self._linked_fd = fd

    def _claim_linked(self, link: Path, target: Path) -> None:
        """A directory a linked checkpoints/ leads to is one run dir's, one job after another too: `cp -r RUN COPY`
        copies the link, and the copy's run pruned the original's checkpoints, then the original's resume took the
        copy's newer one as its own and replaced its export with the copy's weights. The target records the run dir
        that links it (LINKED_BY); another run dir that still links there is refused. A run dir moved or renamed (the
        one recorded no longer leads there) takes it over."""
        from trainer.io import atomic_write_json, same_dir

        here = self.path.parent.resolve()
        owner = target.parent if target.name == "checkpoints" and (target.parent / "config.yaml").is_file() else None
        if owner is None:
            try:
                recorded = json.loads((target / LINKED_BY).read_text())["run_dir"]
                owner = Path(recorded) if isinstance(recorded, str) else None
            except (OSError, ValueError, KeyError, TypeError):
                owner = None
            if owner is not None:
                try:
                    owner = owner if (owner / "checkpoints").resolve(strict=True) == target else None
                except (OSError, RuntimeError):
                    owner = None  # (moved or renamed: the recorded run dir no longer leads there)
        if owner is not None and not same_dir(owner, here):  # (by identity: a path through a link, a bind mount)
            raise ConfigError(
                f"{link} leads to {target}, which holds the checkpoints of the run dir {owner} too (a copy of a run dir "
                "with cp -r keeps its links): a run in either would prune the other's checkpoints, and the other's "
                "resume would take them as its own and replace its export. Give this run dir a checkpoints dir of its "
                f"own: rm {link} && cp -r {target} NEW_DIR && ln -s NEW_DIR {link} (or copy run dirs with cp -rL, "
                "which copies what a link leads to). Nothing in either run dir was changed.")
        if owner is None:
            try:
                atomic_write_json(target / LINKED_BY, {"run_dir": str(here)})
            except OSError:  # (a read-only store of checkpoints: no record, as before there was one)
                pass

    def check_same_job(self) -> None:
        """For the launchers of nodes other than 0, which share node 0's lock: refuse a run dir that another job
        holds (or whose workers outlived their launcher); a free lock is fine (node 0 has not started yet)."""
        held = self.holder()
        if held is not None and held[1] != self.job:
            raise ConfigError(_in_use(self.path.parent, held[0]))
        lingering = workers_alive(self.path.parent) if held is None else None
        if lingering:
            raise ConfigError(f"run dir {self.path.parent} is still written by worker processes of an earlier job "
                              f"({lingering}). Stop them (kill PID), or wait for them to end, then rerun.")

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            if _HELD.get(_key(self.path.parent), [None])[0] is self:
                del _HELD[_key(self.path.parent)]
            os.close(self._fd)  # closing releases the lock; the file stays (harmless, hidden)
            os.close(self._dir_fd)
            if self._linked_fd is not None:
                os.close(self._linked_fd)
            self._fd = self._dir_fd = self._linked_fd = None


# The run dirs this process holds the lock of: a second holder in the same process (the CLI's job calling
# trainer.train, two Runtimes of one notebook) shares it, where a second flock of its own would refuse the first.
_HELD: dict[str, list] = {}  # resolved run dir -> [its RunDirLock, how many hold it]


def _key(run_dir: Path) -> str:
    return str(Path(run_dir).resolve())


class Hold:
    """One holder's share of this process's lock on a run dir (`hold`); the lock goes when the last share does."""

    def __init__(self, run_dir: Path):
        self.key, self._released = _key(run_dir), False

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        entry = _HELD.get(self.key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                entry[0].release()


def hold(run_dir: Path, chosen_by: str) -> Hold:
    """The run dir's lock for a job this process runs without the CLI (trainer.train, a script's own
    trainer.Runtime(run_dir=...)): shared with this process's holders, else taken (ConfigError naming the holder
    when another process has it)."""
    if Path(run_dir).exists() and not Path(run_dir).is_dir():  # (the lock's mkdir raised FileExistsError)
        raise ConfigError(f"{run_dir} is a file, not a directory: a run dir holds the run's metrics.jsonl, "
                          f"checkpoints and trackers' files. Pass a directory, new or existing, as {chosen_by}.")
    entry = _HELD.get(_key(run_dir))
    if entry is not None and entry[0].held:
        entry[1] += 1
    else:
        RunDirLock(run_dir, chosen_by=chosen_by).acquire()
    return Hold(run_dir)


def remove_if_unused(run_dir: Path, records: set[str]) -> None:
    """Remove a run dir that holds nothing but `records` (the files of a start that went no further) and empty
    metrics files: a job refused or failed before it trained leaves no dir behind, and never an earlier result."""
    import shutil

    if not Path(run_dir).is_dir():
        return
    for p in Path(run_dir).iterdir():
        if p.name in records or (p.name in ("metrics.jsonl", "samples.jsonl") and p.stat().st_size == 0):
            continue
        return
    shutil.rmtree(run_dir, ignore_errors=True)


def _in_use(run_dir: Path, holder: str, chosen_by: str = "hydra.run.dir") -> str:
    return (f"run dir {run_dir} is in use by {holder}: two jobs in one run dir would interleave their metrics and "
            f"checkpoints. Wait for it to end (or stop it), or give this job its own {chosen_by}. Nothing in the "
            "run dir was changed.")


# -- the workers' hold on the run dir ---------------------------------------------------------------------
_worker_fd: int | None = None


def hold_as_worker(run_dir: Path) -> None:
    """Take a shared flock on the run dir for the rest of this process's life (released by the OS at exit).
    A launcher starting a new job in this run dir sees it and refuses (`workers_alive`)."""
    global _worker_fd
    if _worker_fd is None and Path(run_dir).is_dir():
        _worker_fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(_worker_fd, fcntl.LOCK_SH)


def workers_alive(run_dir: Path) -> str | None:
    """Whether worker processes hold the run dir (`hold_as_worker`): a short description (with PIDs where
    /proc tells them), or None."""
    if not Path(run_dir).is_dir():
        return None
    fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except BlockingIOError:
        pids = _pids_holding(Path(run_dir))
        return f"PID {', '.join(pids)}" if pids else "see `fuser -v` on the run dir"
    finally:
        os.close(fd)


def _pids_holding(run_dir: Path) -> list[str]:
    """PIDs of this machine's processes with the run dir open (Linux /proc; empty where it cannot tell)."""
    target, found = str(run_dir.resolve()), []
    for proc in Path("/proc").glob("[0-9]*"):
        if proc.name == str(os.getpid()):  # (this process has it open to probe the lock)
            continue
        try:
            if any(os.readlink(fd) == target for fd in (proc / "fd").iterdir()):
                found.append(proc.name)
        except OSError:
            continue
    return found[:8]
