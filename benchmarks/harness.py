"""What every benchmark item shares: the run's context and the `Item` shape, alternating rounds and
medians, clocks and paired figures, the CLI runner, hand-written multi-process jobs, the machine's
description and load."""

from __future__ import annotations

import atexit
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]  # the checkout: subprocesses run its `trainer`, git reads its commit

TINY = ["model=gpt_tiny", "data.batch_size=4", "data.seq_len=32"]
DEFAULT = ["model=gpt_small", "data.batch_size=8", "data.seq_len=256"]  # the lm recipe's own sizes
QUICK_DEFAULT = ["model=gpt_small", "data.batch_size=2", "data.seq_len=32"]
# What every benchmark run shares: the lm recipe in bf16, no display, no text sampling at eval.
COMMON = ["recipe=lm", "precision=bf16", "trainer.progress=off", "task.sample_tokens=0"]
# In-process items run with a fixed number of CPU threads (--threads, default 1). On a shared machine an
# OpenMP worker that loses its core stalls every op: gpt_tiny measured 60-90 ms/step with 2 threads and
# 8-10 ms/step with 1 at load average 2-3 on 2 cores. The loop's overhead is Python work per step, which
# the thread count does not change.
THREADS = 1


@dataclass(frozen=True)
class Context:
    """What one `python -m benchmarks` run gives every item."""

    quick: bool
    data: tuple[str, ...]  # overrides choosing the corpus (quick: a small text file; full: the recipe's own)
    threads: int  # CPU threads of the in-process items
    default_model: tuple[str, ...]  # the model and batch of loop_default, bf16_vs_fp32 and checkpoint


@dataclass(frozen=True)
class Item:
    """One benchmark: `measure(ctx, sizes)` returns its JSON (with `target` and `met` where it has a target)
    and `rows(result)` its lines of the report table. `full` and `quick` are its sizes in each kind of run
    (the keys of `meta.sizes` in the JSON); `measure` gets one of them."""

    measure: Callable[[Context, dict], dict]
    rows: Callable[[dict], list[str]]
    full: dict
    quick: dict


def say(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def alternate(cases: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[Any]]:
    """Each case once per round, the order reversed every other round so drift hits both alike."""
    out: dict[str, list[Any]] = {k: [] for k in cases}
    names = list(cases)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            out[name].append(cases[name]())
    return out


def compose(overrides: list[str]):
    """The checked, resolved config of `python -m trainer OVERRIDES`."""
    from trainer import compose as trainer_compose

    return trainer_compose(overrides)


def no_checkpoints(cfg) -> list[str]:
    """Overrides that switch off end-of-run checkpoints, where this version of the trainer has them."""
    from omegaconf import OmegaConf

    return ["checkpoint.save_final=false"] if OmegaConf.select(cfg, "checkpoint.save_final") is not None else []


# -- clocks ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Lap:
    """Seconds per step by the wall clock and in CPU time of this process.

    With one thread on the CPU, CPU time counts this process's own work: another job taking the
    core for a while lengthens the wall time of whichever side was running, not its CPU time. (It
    still feels shared caches and hypervisor steal, so it is less noisy, not noise-free.)
    """

    wall: float
    cpu: float


class Stopwatch:
    def __init__(self, device):
        self.sync = _synchronizer(device)
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def lap(self, steps: int) -> Lap:
        self.sync()
        n = max(steps, 1)
        return Lap((time.perf_counter() - self.wall) / n, (time.process_time() - self.cpu) / n)


def _synchronizer(device) -> Callable[[], None]:
    import torch

    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def judging_clock(device, threads: int) -> str:
    """CPU time where it measures exactly the loop's own work (CPU device, one thread), else the wall clock."""
    return "cpu" if device.type == "cpu" and threads == 1 else "wall"


def paired(a: list[Lap], b: list[Lap], clock: str, group: int = 1) -> dict:
    """Medians of a and b, and of the per-round difference a - b and throughput ratio b / a (in ms/step).

    With `group` > 1 the differences and ratios are taken over consecutive groups of that many rounds
    (each round still paired with its own plain turn): a group of one log period holds exactly one log
    step, so the median cannot leave the log steps' cost out."""
    a_ms, b_ms = [1000 * getattr(x, clock) for x in a], [1000 * getattr(x, clock) for x in b]
    n = len(a_ms) - len(a_ms) % group
    a_g = [statistics.fmean(a_ms[i : i + group]) for i in range(0, n, group)]
    b_g = [statistics.fmean(b_ms[i : i + group]) for i in range(0, n, group)]
    return {"trainer_ms_per_step": median(a_ms), "plain_ms_per_step": median(b_ms), "rounds_per_group": group,
            "overhead_ms_per_step": median([x - y for x, y in zip(a_g, b_g)]),
            "overhead_ms_per_step_mean": statistics.fmean([x - y for x, y in zip(a_ms, b_ms)]),
            "throughput_ratio": median([y / x for x, y in zip(a_g, b_g)]),
            # Noise only ever adds time, so the fastest rounds are a second estimate of the intrinsic cost.
            "overhead_ms_per_step_of_fastest_rounds": min(a_ms) - min(b_ms),
            "per_round_ms": {"trainer": a_ms, "plain": b_ms}}


# -- running the real CLI ----------------------------------------------------------------------------
def cli_env() -> dict[str, str]:
    """The environment of a subprocess: this checkout's `trainer` first on the path."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def cli(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m trainer ARGS`, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "trainer", *args], cwd=ROOT, env={**cli_env(), "PYTHONUNBUFFERED": "1"},
                          capture_output=True, text=True, timeout=timeout)


def check(r: subprocess.CompletedProcess, what: str) -> None:
    if r.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {r.returncode}):\n{r.stderr[-3000:]}")


def cli_events(args: list[str]) -> list[dict]:
    """The metrics.jsonl events of a `python -m trainer ARGS` run in a scratch run dir (removed afterwards)."""
    import json

    tmp = Path(tempfile.mkdtemp(prefix="bench-cli-"))
    try:
        r = cli([*args, f"hydra.run.dir={tmp}"])
        check(r, "python -m trainer " + " ".join(args))
        return [json.loads(ln) for ln in (tmp / "metrics.jsonl").read_text().splitlines()]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# -- hand-written multi-process baselines -----------------------------------------------------------
def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(worker: Callable[..., None], nprocs: int, *args: Any) -> list[Any]:
    """`worker(rank, nprocs, port, out_dir, *args)` in `nprocs` fresh processes (torch.multiprocessing, as a
    user starts a hand-written job), `port` free for its rendezvous on 127.0.0.1. Each rank may write its
    result as JSON to `out_dir/RANK.json`; returns those results in rank order."""
    import json

    import torch.multiprocessing as mp

    out = Path(tempfile.mkdtemp(prefix="bench-spawn-"))
    try:
        mp.spawn(worker, args=(nprocs, free_port(), str(out), *args), nprocs=nprocs)
        return [json.loads((out / f"{r}.json").read_text()) for r in range(nprocs) if (out / f"{r}.json").exists()]
    finally:
        shutil.rmtree(out, ignore_errors=True)


def distributed_device(nprocs: int) -> str:
    """Where an item's `nprocs` processes run: one GPU each where there are enough (what world.device=auto
    picks), else the CPU (then the CLI gets world.device=cpu, which a machine with fewer GPUs needs)."""
    import torch

    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs else "cpu"


def python_seconds(args: list[str]) -> float:
    """Wall seconds of `python ARGS` from launch to exit."""
    t = time.perf_counter()
    r = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
    check(r, "python " + " ".join(args))
    return time.perf_counter() - t


def python_first_line_seconds(args: list[str]) -> float:
    """Wall seconds of `python ARGS` from launch to its first line on stdout (the program flushes it): a twin of a
    run timed to an event, not to its exit, which adds the interpreter's and torch's shutdown (0.3-0.45 s here)."""
    t = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True)
        first = p.stdout.readline()
        seconds = time.perf_counter() - t
        p.stdout.read()
        p.wait()
        err.seek(0)
        check(subprocess.CompletedProcess(p.args, p.returncode, first, err.read()), "python " + " ".join(args))
    if not first:
        raise RuntimeError(f"python {' '.join(args)} printed nothing: it must print a line where it is timed to")
    return seconds


# -- the machine -------------------------------------------------------------------------------------
class OtherJobs:
    """How many cores other processes kept busy meanwhile: machine-wide busy time minus our own."""

    def __init__(self):
        self.start = self._now()

    @staticmethod
    def _now() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                ticks = [int(v) for v in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None  # not Linux
        t = os.times()  # children: waited-for subprocesses, their own children included
        busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
        return time.perf_counter(), busy, t.user + t.system + t.children_user + t.children_system

    def cores(self) -> float | None:
        end = self._now()
        if self.start is None or end is None or end[0] <= self.start[0]:
            return None
        return max(0.0, ((end[1] - self.start[1]) - (end[2] - self.start[2])) / (end[0] - self.start[0]))


def meta(quick: bool) -> dict:
    import torch

    cpu = platform.processor()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                    capture_output=True, text=True).stdout.strip())
    except OSError:
        commit, dirty = "", False
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "quick": quick, "python": platform.python_version(),
            "torch": torch.__version__, "cpu": cpu, "cores": len(os.sched_getaffinity(0)),
            "torch_threads": torch.get_num_threads(), "git_commit": commit, "worktree_dirty": dirty,
            "load_avg_start": os.getloadavg()[0]}


def quick_corpus() -> list[str]:
    """A ~120 KB text file (a few stdlib modules): `data=text` builds in milliseconds."""
    import argparse
    import textwrap

    path = Path(tempfile.mkdtemp(prefix="bench-corpus-")) / "corpus.txt"
    atexit.register(shutil.rmtree, path.parent, True)  # (the benchmark's runs read it until this process ends)
    path.write_bytes(Path(argparse.__file__).read_bytes() + Path(textwrap.__file__).read_bytes())
    return ["data=text", f"data.path={path}"]


def met_cell(met: bool | None) -> str:
    """The table's `met` column."""
    return "—" if met is None else ("yes" if met else "**no**")
