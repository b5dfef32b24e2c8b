"""A watchdog for hangs: when no rank makes progress for `world.hang_timeout` seconds, every rank's stack is
collected, one paragraph names the rank the others wait for and where each rank waits, and the job exits with
`HangDetected.exit_code` (70).

Progress is a `beat()`: the loop calls it after each optimizer step, each eval batch and each checkpoint save,
and `trainer.entry.run` when the run is built (the watch starts) and resumed. A beat is an integer increment, nothing
more; a daemon thread per process (`Watchdog`) looks at the count every `interval` seconds (a tenth of the
timeout, at most 1 s) and notices when it stops changing.

The ranks of one machine share a directory their launcher made (`$TRAINER_HANG_DIR`, trainer/entry/launcher.py).
Each rank's watch touches its beat file there when its count changed, so a rank that waits while another works
(rank 0 writing the export while the others wait at the final barrier) does not fire; once one rank fires,
the others find its stack file and write theirs at once, so the launcher finds every rank's stack and says it
in one paragraph (`report`). Without that directory (one process, or a job started by torchrun) a process
watches itself alone and prints its own paragraph.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
import threading
import time
import traceback
from pathlib import Path
from typing import Any, NamedTuple

from trainer.errors import HangDetected

HANG_DIR_ENV = "TRAINER_HANG_DIR"  # set by the launcher for its workers: where their stacks go
STACKS_FILE = "hang_stacks.txt"  # in the run dir: every rank's full stacks, after a hang
FIX = ("If a phase legitimately takes that long (torch.compile's first steps, saving a huge checkpoint or export), "
       "raise world.hang_timeout; 0 or null switches the watch off.")

_beats = 0
# A loop of the user's own under `launch` (trainer.Runtime): a watch armed by the launch and started at the loop's
# first progress, so what the script does before its first step (building data, downloading) is never timed.
_armed: tuple[float, str | os.PathLike | None] | None = None


def beat() -> None:
    """This process made progress. Cheap enough for every step: the watch thread reads the count."""
    global _beats
    _beats += 1


def progress() -> None:
    """A beat from trainer.Runtime (a forward of a set-up model, an optimizer step, a save or load); the first
    starts the watch `arm` left for it, on the calling thread: the loop's."""
    global _beats, _armed
    _beats += 1
    if _armed is not None:
        timeout, run_dir = _armed
        _armed = None
        start(timeout, run_dir).resumes = False


def arm(timeout: float | None, run_dir: str | os.PathLike | None) -> None:
    """Watch a launched script of the user's own from its loop's first `progress()` on (0 or None: never)."""
    global _armed
    _armed = (timeout, run_dir) if timeout else None


def disarm() -> None:
    """The script ended: stop its watch, or forget the one armed for it."""
    global _armed
    _armed = None
    if _current is not None and _current.running:
        _current.ended()
        _current.stop()


class Frame(NamedTuple):
    file: str
    line: int
    func: str
    module: str  # the frame's __name__ ("torch.distributed.distributed_c10d", "trainer.loop.trainer", "__main__")


class Place(NamedTuple):
    """Where a rank waits: in a collective (`what` names it) or elsewhere (`what` is the line it is stuck on);
    `caller` is where that was called from in the user's or the framework's code."""

    collective: bool
    what: str
    caller: str


# -- where a stack waits ---------------------------------------------------------------------------------
_STDLIB = tuple({sysconfig.get_paths()[k] + os.sep for k in ("stdlib", "platstdlib")})
_ROOT = str(Path(__file__).resolve().parents[1]) + os.sep


def _library(f: Frame) -> bool:
    """torch's, the standard library's or another installed package's code: not where a user looks first."""
    if f.file.startswith("<"):
        return True
    top = f.module.split(".")[0]
    if top == "trainer":
        return False
    if top == "torch" or top in sys.stdlib_module_names:
        return True
    parts = Path(f.file).parts
    return "site-packages" in parts or "dist-packages" in parts or f.file.startswith(_STDLIB)


def _framework(f: Frame) -> bool:
    """A frame of this package's code (a launch worker's `__main__` is its entry/worker.py)."""
    return f.module.split(".")[0] == "trainer" or os.path.abspath(f.file).startswith(_ROOT)


def _short(path: str) -> str:
    """A path as a user reads it: relative to the current directory, to site-packages, or to the stdlib."""
    if path.startswith("<"):
        return path
    full, cwd = os.path.abspath(path), os.getcwd() + os.sep
    for marker in ("site-packages", "dist-packages"):  # (first: a virtual environment may be under the cwd)
        k = full.rfind(f"{os.sep}{marker}{os.sep}")
        if k >= 0:
            return full[k + len(marker) + 2:]
    for root in (cwd, _ROOT):  # (the directory that holds the trainer package: its repository)
        if full.startswith(root):
            return full[len(root):]
    for stdlib in _STDLIB:
        if full.startswith(stdlib):
            return full[len(stdlib):]
    return full


def _at(f: Frame) -> str:
    return f"{_short(f.file)}:{f.line} in {f.func}"


def where(frames: list, distributed: bool = True) -> Place:
    """Classify one thread's stack (outermost frame first). In a collective: a frame in torch.distributed (named
    by the outermost distributed_c10d function, the one the caller called: all_reduce, broadcast_object_list,
    barrier, ...), in DistributedDataParallel's own code, or, when `distributed`, in backward (where DDP and FSDP
    all-reduce the gradients, in C++ without a Python frame). Otherwise the rank is stuck at its innermost frame
    outside library code, named with the library function it called there."""
    frames = [Frame(*f) for f in frames]
    own = [i for i, f in enumerate(frames) if not _library(f)]

    def caller(i: int, n: int = 2) -> str:
        # The n innermost frames of the user's or the framework's code, and the user's innermost line where those
        # are all the framework's (a loop of one's own waiting inside rt.step: the script's line says which call).
        shown = [j for j in reversed(own) if j < i][:n]
        users = [j for j in reversed(own) if j < i and not _framework(frames[j])][:1]
        return ", from ".join(_at(frames[j]) for j in shown + [j for j in users if j not in shown])

    c10d = [i for i, f in enumerate(frames) if f.module == "torch.distributed.distributed_c10d"]
    if c10d:
        return Place(True, f"torch.distributed {frames[c10d[0]].func}", caller(c10d[0]))
    dist = [i for i, f in enumerate(frames)
            if f.module.startswith("torch.distributed.") and not f.module.startswith("torch.distributed.elastic")]
    if dist:
        return Place(True, f"torch.distributed ({_at(frames[dist[-1]])})", caller(dist[0]))
    ddp = [i for i, f in enumerate(frames) if f.module == "torch.nn.parallel.distributed"]
    if ddp:
        return Place(True, f"DistributedDataParallel ({_at(frames[ddp[-1]])})", caller(ddp[0]))
    autograd = [i for i, f in enumerate(frames) if f.module.startswith("torch.autograd")]
    if distributed and autograd:
        return Place(True, "backward's gradient all-reduce", caller(autograd[0]))
    if not own:
        return Place(False, _at(frames[-1]) if frames else "a stack that could not be read", "")
    j = own[-1]
    what = _at(frames[j]) + (f", calling {_at(frames[j + 1])}" if j + 1 < len(frames) else "")
    return Place(False, what, caller(j, 1))


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def paragraph(records: list[dict], ranks: list[int], timeout: float, stacks: str | None, alone: bool = False,
              resumes: bool = True, finished: list[int] = ()) -> str:
    """The one paragraph ("error: ...") for the stacks in `records` (one per rank that wrote one; `ranks` are
    all the ranks that were watched together). `alone`: a process that watched only itself. `finished`: ranks of this
    machine that ended without an error while the others hung (their loop ended, their watch with it)."""
    by_rank = {r["rank"]: r for r in records}
    world = max((r.get("world_size", 1) for r in records), default=1)
    places = {r: where(rec["frames"], distributed=rec.get("world_size", 1) > 1) for r, rec in sorted(by_rank.items())}
    seconds = f"{timeout:g} s (world.hang_timeout={timeout:g})"
    if alone or world == 1:
        rank, place = next(iter(places.items()))
        subject = "the process" if world == 1 else f"rank {rank}"
        verb = "waits in" if place.collective else "is stuck in"
        text = (f"no progress for {seconds}, so the run was stopped: {subject} {verb} {place.what}"
                + (f" (called from {place.caller})" if place.caller else ""))
        if stacks:
            text += f". Its stack: {stacks}"
        resume = " To continue from the newest checkpoint, rerun the same command with resume=auto." if resumes else ""
        return f"error: {text}. {FIX}{resume}"
    stuck = [f"rank {r} is stuck in {p.what} (not in a collective{'; called from ' + p.caller if p.caller else ''})"
             for r, p in places.items() if not p.collective]
    groups: dict[tuple[str, str], list[int]] = {}
    for r, p in places.items():
        if p.collective:
            groups.setdefault((p.what, p.caller), []).append(r)
    waiting = [f"{_ranks(rs)} {'waits' if len(rs) == 1 else 'wait'} in {what}" + (f" called from {c}" if c else "")
               for (what, c), rs in groups.items()]
    absent = [r for r in sorted(set(ranks)) if r not in by_rank and r not in finished]
    lead = f"no rank made progress for {seconds}, so the job was stopped"
    if len(stuck) > 1:
        lead += ("; more than one rank is outside a collective (on GPUs, a rank that reads the result of an NCCL "
                 "collective, e.g. with .item(), waits on that line rather than in the collective)")
    elif not stuck and len(groups) > 1:
        lead += "; the ranks wait in different collectives (a rank took another code path)"
    elif finished:
        lead += (f"; {_ranks(finished)} of this machine ended {'its' if len(finished) == 1 else 'their'} loop while "
                 "the others wait for it in a collective: a rank took another code path (a `break` or `return` on "
                 "some ranks only, or a different number of batches)")
    elif not stuck and groups and not absent:
        lead += ("; every rank of this machine waits in the same collective, so the rank they wait for is on "
                 "another machine (its launcher names it)" if world > len(places) else
                 "; every rank waits in the same collective, which does not complete (the network, or NCCL: "
                 "NCCL_DEBUG=INFO says more)")
    parts = stuck + waiting
    if absent:
        parts.append(f"{_ranks(absent)} left no stack (its Python threads did not run: native code holding the "
                     "GIL, or it died)")
    text = f"error: {lead}: {'; '.join(parts)}."
    if stacks:
        text += f" Every rank's stack: {stacks}."
    return f"{text} {FIX}"


# -- the watch ---------------------------------------------------------------------------------------------
class Watchdog:
    """Watches the thread that starts it: fires when no beat came for `timeout` seconds (from this process, or
    from a process that shares `directory`), or when another process of `directory` fired."""

    def __init__(self, timeout: float | None, run_dir: str | os.PathLike | None = None,
                 directory: str | os.PathLike | None = None, rank: int = 0, world_size: int = 1,
                 local_world_size: int = 1, attempt: int = 0, exit=os._exit, err=None):
        self.timeout = float(timeout or 0)
        self.interval = min(1.0, max(0.05, self.timeout / 10))
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.directory = Path(directory) if directory is not None else None
        self.rank, self.world_size, self.local_world_size = rank, world_size, local_world_size
        self.prefix = f"A{attempt}."  # an elastic restart's watches do not see the failed attempt's files
        self._exit, self._err = exit, err
        self.resumes = True  # the paragraph says how to resume (not for a script of the user's own: it knows how)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watched: int | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> Watchdog:
        if self.timeout > 0:
            self._watched = threading.get_ident()
            self._thread = threading.Thread(target=self._watch, name="trainer-watchdog", daemon=True)
            self._thread.start()
        return self

    def ended(self) -> None:
        """This rank's loop ended (its script called rt.end): a peer still waiting for it is told so, not sent to
        look for it on another machine."""
        if self.directory is not None:
            try:
                (self.directory / f"{self.prefix}ended.{self.rank}").touch()
            except OSError:
                pass

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    # The thread.
    def _watch(self) -> None:
        seen, changed = _beats, time.monotonic()
        self._touch()
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            if _beats != seen:
                seen, changed = _beats, now
                self._touch()
            idle = now - changed
            if self._peer_fired() or self._idle(idle) >= self.timeout:
                self._fire(idle)
                return

    def _names(self) -> list[str]:
        try:
            return [n for n in os.listdir(self.directory) if n.startswith(self.prefix)]
        except OSError:
            return []

    def _touch(self) -> None:
        if self.directory is not None:
            try:
                (self.directory / f"{self.prefix}beat.{self.rank}").touch()
            except OSError:
                pass

    def _idle(self, own: float) -> float:
        """Seconds since any process watched here made progress."""
        if self.directory is None:
            return own
        newest = 0.0
        for name in self._names():
            if ".beat." in name:
                try:
                    newest = max(newest, (self.directory / name).stat().st_mtime)
                except OSError:
                    pass
        return min(own, time.time() - newest) if newest else own

    def _stack_files(self) -> list[str]:
        return [n for n in self._names() if ".stack." in n and n.endswith(".json")]

    def _accounted(self) -> set[str]:
        """The ranks that wrote their stack, or whose loop ended (and never will)."""
        return {n.rsplit(".", 2)[1] if n.endswith(".json") else n.rsplit(".", 1)[1]
                for n in self._names() if ".stack." in n and n.endswith(".json") or ".ended." in n}

    def _peer_fired(self) -> bool:
        return self.directory is not None and any(n != f"{self.prefix}stack.{self.rank}.json"
                                                  for n in self._stack_files())

    def _fire(self, idle: float) -> None:
        try:
            record = self._record(idle)
            if self.directory is None:
                stacks = write_stacks(self.run_dir, [record], self.timeout) if self.run_dir is not None else None
                err = self._err or sys.stderr
                print(paragraph([record], [self.rank], self.timeout, stacks, alone=True, resumes=self.resumes),
                      file=err, flush=True)
            else:
                from trainer.io import atomic_write_text

                atomic_write_text(self.directory / f"{self.prefix}stack.{self.rank}.json", json.dumps(record))
                # The other ranks of this machine see it within their interval and write theirs: wait for them
                # (bounded: a rank whose Python threads cannot run never writes), but not for a rank whose loop
                # ended (its watch is gone, and it would cost every such hang the whole bound).
                deadline = time.monotonic() + max(5.0, 3 * self.interval)
                while len(self._accounted()) < self.local_world_size and time.monotonic() < deadline:
                    time.sleep(0.05)
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            self._exit(HangDetected.exit_code)

    def _record(self, idle: float) -> dict[str, Any]:
        current = sys._current_frames()
        frames, f = [], current.get(self._watched)
        while f is not None:
            frames.append([f.f_code.co_filename, f.f_lineno, f.f_code.co_name, str(f.f_globals.get("__name__", ""))])
            f = f.f_back
        names = {t.ident: t.name for t in threading.enumerate()}
        texts = []
        for ident in sorted(current, key=lambda i: i != self._watched):
            if ident != threading.get_ident():  # not this watch itself
                label = f"thread {names.get(ident, ident)}" + (" (the watched one)" if ident == self._watched else "")
                texts.append(f"{label}:\n{''.join(traceback.format_stack(current[ident]))}")
        return {"rank": self.rank, "world_size": self.world_size, "pid": os.getpid(), "idle_s": round(idle, 1),
                "frames": frames[::-1], "stacks": "\n".join(texts)}


def start(timeout: float | None, run_dir: str | os.PathLike | None, info=None) -> Watchdog:
    """Watch the calling thread of this process (`world.hang_timeout` seconds; 0 or None: a watch that never
    fires). While a watch runs, another start returns one that does nothing. Stop it with `.stop()`."""
    global _current
    if not timeout or (_current is not None and _current.running):
        return Watchdog(None)
    if info is None:
        from trainer.parallel.backend import world_info

        info = world_info()
    directory = os.environ.get(HANG_DIR_ENV)
    _current = Watchdog(timeout, run_dir, directory if directory and os.path.isdir(directory) else None, info.rank,
                        info.world_size, info.local_world_size, info.restart_count).start()
    return _current


_current: Watchdog | None = None


# -- the launcher's side -------------------------------------------------------------------------------
def read_stacks(directory: str | os.PathLike) -> list[dict]:
    """The stack files of the newest attempt in `directory`, by rank."""
    found: dict[int, list[tuple[int, Path]]] = {}
    for path in Path(directory).glob("A*.stack.*.json"):
        try:
            found.setdefault(int(path.name[1:path.name.index(".")]), []).append(path)
        except ValueError:
            continue
    records = []
    for path in found[max(found)] if found else []:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("rank"), int) and isinstance(record.get("frames"), list):
            records.append(record)
    return sorted(records, key=lambda r: r["rank"])


def write_stacks(run_dir: str | os.PathLike | None, records: list[dict], timeout: float) -> str | None:
    """Every rank's full stacks in RUN_DIR/hang_stacks.txt; returns the path, or None when it could not be written."""
    from trainer.io import atomic_write_text

    if run_dir is None:
        return None
    path = Path(run_dir) / STACKS_FILE
    text = "".join(f"== rank {r['rank']} (pid {r.get('pid')}): no progress for {r.get('idle_s')} s "
                   f"(world.hang_timeout={timeout:g}) ==\n{r.get('stacks', '')}\n" for r in records)
    try:
        atomic_write_text(path, text)
    except OSError:
        return None
    return str(path)


def report(directory: str | os.PathLike | None, failures: dict, timeout: float | None,
           run_dir: str | os.PathLike, lost_connection: bool = False, ranks: list[int] = ()) -> str | None:
    """The paragraph for a job the watchdog stopped (a worker exited with HangDetected.exit_code): every stack
    its workers left in `directory` (the newest attempt's), also written to RUN_DIR/hang_stacks.txt. None when
    the failure is another one. `failures`: torchelastic's {global rank: ProcessFailure} of this machine.
    `lost_connection`: every failure torch reports is a worker's lost connection (a peer the watch stopped, found
    dead first, leaves no record of its own). `ranks`: every rank of this machine, where the launcher knows them (one
    machine): one that left no stack (stopped, or in native code holding the GIL) is named as such, not sought on
    another machine (torch lists only the rank that exited)."""
    if directory is None:
        return None
    records = read_stacks(directory)
    if not records:
        return None
    # The ranks whose loop ended (their watch said so at rt.end) in the attempt the stacks are of, and left none.
    attempt = max(int(p.name[1:p.name.index(".")]) for p in Path(directory).glob("A*.stack.*.json"))
    ended = {int(p.name.rsplit(".", 1)[1]) for p in Path(directory).glob(f"A{attempt}.ended.*")
             if p.name.rsplit(".", 1)[1].isdigit()}
    finished = sorted(ended - {x["rank"] for x in records})
    # A watch fired (exit 70), or torch found first the rank whose loop had ended, failing on the connection the
    # watched rank's exit closed.
    if not (any(f.exitcode == HangDetected.exit_code for f in failures.values()) or (lost_connection and finished)):
        return None
    stacks = write_stacks(run_dir, records, timeout or 0)
    return paragraph(records, sorted(set(failures) | {r["rank"] for r in records} | set(ranks)), timeout or 0, stacks,
                     finished=finished)
