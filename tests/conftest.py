"""Shared fixtures: a tiny corpus, composing configs without the CLI, and running the real CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Test-only modules (tasks that misbehave, small recipes, readers of what loggers wrote) live in tests/helpers and
# are imported by their names, here and in every process a test starts (FAULTY_ENV).
HELPERS = ROOT / "tests" / "helpers"
sys.path.insert(0, str(HELPERS))
# Dataset caches of the whole session go to one throwaway place (inherited by subprocesses), and this machine's
# defaults (python -m trainer config), which would change what every test composes, to an empty one. Made by each
# pytest process (the controller, each xdist worker) and removed at its session's end (pytest_sessionfinish); a
# process a test starts imports this module too (unpickling a function of a test module) and keeps its session's.
_SESSION = os.environ.get("PYTEST_XDIST_WORKER", "controller")
SCRATCH: list[str] = []
if os.environ.get("TRAINER_TEST_SCRATCH_OF") != _SESSION:
    os.environ["TRAINER_CACHE_DIR"] = tempfile.mkdtemp(prefix="trainer-test-cache-")
    os.environ["TRAINER_CONFIG_HOME"] = tempfile.mkdtemp(prefix="trainer-test-config-")
    os.environ["TRAINER_TEST_SCRATCH_OF"] = _SESSION
    SCRATCH += [os.environ["TRAINER_CACHE_DIR"], os.environ["TRAINER_CONFIG_HOME"]]
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.pop("WANDB_API_KEY", None)
# Every process the tests start writes its Python stacks on SIGABRT: what a test that gives up on a hung process
# sends it (start_cli.wait, tests/helpers/hung.py).
os.environ.setdefault("PYTHONFAULTHANDLER", "1")

# Lets subprocesses import tests/helpers/faulty.py (task._target_=faulty.Faulty).
FAULTY_ENV = {"PYTHONPATH": f"{ROOT}:{HELPERS}"}

def pytest_sessionfinish(session, exitstatus) -> None:
    """The session's throwaway directories go with it (each xdist worker, and the controller, made its own):
    a suite run left a dozen in the temp dir for good."""
    for path in SCRATCH:
        shutil.rmtree(path, ignore_errors=True)


def pytest_xdist_auto_num_workers(config) -> int | None:
    """`make test`'s `-n auto`: one worker more than the cores. Tests wait on the processes they start (a launch's
    rendezvous and its workers' exit, a signalled job); with one worker per core the 2 cores sat idle 12% of the
    suite, and a third worker took it from 271 s to 241 s (Intel Xeon, 2 cores, same window). The same total
    CPU: nothing runs twice. PYTEST_XDIST_AUTO_NUM_WORKERS still decides where it is set."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    return len(os.sched_getaffinity(0)) + 1


# A run of a second or two on a CPU (conf/debug/smoke.yaml: gpt_tiny, fp32, 20 steps of 4 x 32 bytes).
TINY = ["debug=smoke"]


@pytest.fixture(scope="session")
def corpus() -> Path:
    """~120 KB of real text (a few stdlib modules), fixed across runs."""
    import argparse
    import textwrap

    path = Path(tempfile.mkdtemp(prefix="trainer-corpus-")) / "corpus.txt"
    path.write_bytes(Path(argparse.__file__).read_bytes() + Path(textwrap.__file__).read_bytes())
    SCRATCH.append(str(path.parent))
    return path


@pytest.fixture(scope="session")
def small_corpus(corpus) -> Path:
    """The corpus's first 4 KB: 115 training samples of 32 bytes, so a test of whole epochs trains tens of steps
    (the corpus has 3357 samples: 840 steps an epoch at the smoke batch of 4). 115 is no multiple of 16."""
    path = corpus.parent / "small_corpus.txt"
    path.write_bytes(corpus.read_bytes()[:4096])
    return path


@pytest.fixture
def scratch_tmpdir():
    """An empty directory for a process's TMPDIR, with a short path: multiprocessing's forkserver puts a socket
    there, and a socket's path has at most 107 bytes (tmp_path under an xdist worker's directory has more)."""
    path = Path(tempfile.mkdtemp(prefix="t-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def tiny_overrides(corpus: Path, *extra: str) -> list[str]:
    return [*TINY, "data=text", f"data.path={corpus}", *extra]


def compose_cfg(overrides: list[str]):
    from trainer import compose

    return compose(overrides)


def train_in_process(corpus: Path, run_dir: Path, *extra: str) -> list[dict]:
    """Train through `trainer.train` (no subprocess) and return the metrics.jsonl events."""
    from trainer import train

    cfg = compose_cfg(tiny_overrides(corpus, *extra))
    train(cfg, run_dir)
    return read_metrics(run_dir)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def series(events: list[dict], key: str) -> list[float]:
    return [e[key] for e in events if key in e]


def load_weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 180,
            module: str = "trainer", fresh: bool = False, preexec=None) -> subprocess.CompletedProcess:
    """`python -m trainer ARGS` in a subprocess, as a user would run it: a process of its own with this argv,
    cwd, environment and sys.path, its exit code and output. It is forked from a forkserver that imported
    torch, Hydra and the trainer once (tests/helpers/forked_cli.py), not started as a fresh interpreter, which
    `fresh=True` asks for (and any PYTHON* interpreter flag in `env` gets): what only an interpreter's start
    reads, such as sitecustomize or PYTHONPROFILEIMPORTTIME. `preexec`: as subprocess's preexec_fn (a function
    of a module, run in the child before the command)."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})}
    flags = {k for k in (env or {}) if k.startswith("PYTHON")} - {"PYTHONPATH", "PYTHONUNBUFFERED"}
    if fresh or flags:
        return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd or ROOT, env=full_env,
                              capture_output=True, text=True, timeout=timeout, preexec_fn=preexec)
    with start_cli(*args, cwd=cwd, env=env, module=module, preexec=preexec) as cli:
        return cli.wait(timeout)


def _interpreter_path(cwd: Path, pythonpath: str) -> list[str]:
    """The sys.path of `python -m ...` started in `cwd` with PYTHONPATH=`pythonpath`."""
    global _SITE_PATH
    if _SITE_PATH is None:
        bare = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        _SITE_PATH = json.loads(subprocess.run([sys.executable, "-c", "import sys, json; print(json.dumps(sys.path[1:]))"],
                                               env=bare, capture_output=True, text=True, check=True).stdout)
    return [str(cwd), *(p for p in pythonpath.split(os.pathsep) if p), *_SITE_PATH]


_SITE_PATH: list[str] | None = None


def start_processes(fn, args: tuple, nprocs: int) -> None:
    """`torch.multiprocessing.start_processes(fn, args, nprocs)`, the processes forked from run_cli's forkserver:
    as fresh as spawn's (forked from a process that has only imported modules, not from this pytest worker,
    which may hold other threads' locks by now: wandb's, tqdm's monitor), without each importing torch again
    (~2.5 s of CPU a process)."""
    import multiprocessing

    import forked_cli
    import torch.multiprocessing as mp

    multiprocessing.get_context("forkserver").set_forkserver_preload(forked_cli.PRELOAD)
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


class Hung(subprocess.TimeoutExpired):
    """A process a test started did not end in time: the message holds what each process of its tree was doing
    (tests/helpers/hung.py) and the ends of its output, where TimeoutExpired's says only how long it waited."""

    def __init__(self, cmd, timeout, output, stderr, described: str):
        super().__init__(cmd, timeout, output, stderr)
        self.described = described

    def __str__(self) -> str:
        return (f"{super().__str__()}\n--- its processes when it was stopped ---\n{self.described}\n"
                f"--- end of its stdout ---\n{(self.output or '')[-2000:]}\n"
                f"--- end of its stderr (with each process's Python stacks) ---\n{(self.stderr or '')[-12000:]}")


class start_cli:
    """`run_cli`'s process, started and not waited for (several "nodes" at once): `wait(timeout)` gives its
    CompletedProcess (and kills it past the timeout, raising subprocess.TimeoutExpired, as subprocess.run does).
    Used as a context manager, the process is killed if the block leaves before waiting for it."""

    def __init__(self, *args: str, cwd: Path | None = None, env: dict | None = None, module: str = "trainer",
                 preexec=None):
        import multiprocessing

        import forked_cli

        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})}
        cwd = Path(cwd or ROOT)
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(forked_cli.PRELOAD)
        self._tmp = tempfile.TemporaryDirectory(prefix="trainer-cli-")
        self.out, self.err = Path(self._tmp.name) / "stdout", Path(self._tmp.name) / "stderr"
        self.out.touch()
        self.err.touch()
        self.command = [sys.executable, "-m", module, *args]
        self.child = context.Process(target=forked_cli.main, args=(
            module, list(args), str(cwd), env, _interpreter_path(cwd, env.get("PYTHONPATH", "")), str(self.out),
            str(self.err), preexec))
        self.child.start()
        self.pid = self.child.pid

    def wait(self, timeout: float) -> subprocess.CompletedProcess:
        self.child.join(timeout)
        if self.child.exitcode is None:
            import hung

            described = hung.stop(self.child.pid)  # (each process writes its Python stacks to the err file)
            if self.child.exitcode is None:
                self.child.kill()
            self.child.join()
            raise Hung(self.command, timeout, self.out.read_text(), self.err.read_text(), described)
        return subprocess.CompletedProcess(self.command, self.child.exitcode, self.out.read_text(),
                                           self.err.read_text())

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.child.exitcode is None:
            self.child.kill()
            self.child.join()
        self._tmp.cleanup()


def run_main(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m trainer ARGS` for a command that ends before Hydra runs a job (a config mistake, --help,
    --cfg job): `run_here` with Hydra's job refused, so a test that means "nothing ran" fails if something
    did. Use `run_here` or `run_cli` for commands that get as far as Hydra."""
    import hydra

    def refuse(*a, **k):
        raise AssertionError(f"python -m trainer {' '.join(args)} reached Hydra's job: run it with run_cli")

    old_main, hydra.main = hydra.main, refuse
    try:
        return run_here(*args, cwd=cwd, env=env)
    finally:
        hydra.main = old_main


def run_here(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m trainer ARGS` through `trainer.entry.cli.main`, Hydra and all, in this process: `run_cli`'s exit
    code and output without an interpreter's start-up (~3 s with torch's imports). For single-process runs
    that end by themselves; a run that is killed or signalled, or launches workers, needs `run_cli`. What a
    run changes in the process (argv, cwd, environment, signal handlers, torch's thread count) is put back."""
    import contextlib
    import io
    import signal

    import torch

    from trainer.entry.cli import main

    out, err, code = io.StringIO(), io.StringIO(), 0
    saved = (list(sys.argv), os.getcwd(), dict(os.environ), torch.get_num_threads(),
             {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)})
    os.chdir(cwd or ROOT)
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main(list(args))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv[:] = saved[0]
        os.chdir(saved[1])
        os.environ.clear()
        os.environ.update(saved[2])
        torch.set_num_threads(saved[3])
        for s, handler in saved[4].items():
            signal.signal(s, handler)
    return subprocess.CompletedProcess(["python", "-m", "trainer", *args], code, out.getvalue(), err.getvalue())


# One schedule shared by the distributed and checkpoint tests, so their reference runs are shared too.
# Odd eval size: 2 ranks get 19 and 18 samples; padding or duplicates would change the mean.
SHARED = ("trainer.max_steps=12", "trainer.eval_every=6", "trainer.eval_samples=37",
          "checkpoint.every_n_steps=4", "checkpoint.keep_last=2", "ema.enabled=true", "ema.decay=0.9")
DDP2 = ("world=ddp", "world.nproc_per_node=2", "data.batch_size=4")


@pytest.fixture(scope="session")
def reference(corpus, tmp_path_factory) -> Path:
    """One process, batch 8, in-process: what every other split of the same global batch must reproduce."""
    run_dir = tmp_path_factory.mktemp("reference")
    train_in_process(corpus, run_dir, "data.batch_size=8", *SHARED)
    return run_dir


def once_per_run(tmp_path_factory, name: str, build) -> Path:
    """A directory that `build(dir)` fills once per test run, shared by every pytest-xdist worker.

    `make test` runs the suite in several worker processes, each with its own session fixtures; an
    expensive reference run is built by whichever worker needs it first (under a file lock) and
    reused by the others."""
    import fcntl
    import shutil

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        path = tmp_path_factory.mktemp(name)
        build(path)
        return path
    root = tmp_path_factory.getbasetemp().parent  # this run's temp dir, common to its workers
    path, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            build(path)
            done.touch()
    return path


@pytest.fixture(scope="session")
def ddp_reference(corpus, tmp_path_factory) -> tuple[Path, str]:
    """Two processes x batch 4 through the real CLI (self-launched workers): (run dir, its stdout). It also
    logs to TensorBoard, which tests/test_tensorboard.py reads (only rank 0 may write events)."""
    def build(run_dir: Path) -> None:
        r = run_cli(*tiny_overrides(corpus, *SHARED, *DDP2, "logger=tensorboard"), "trainer.progress=lines",
                    f"hydra.run.dir={run_dir}")
        assert r.returncode == 0, r.stderr
        (run_dir.parent / "ddp_reference.stdout").write_text(r.stdout)

    run_dir = once_per_run(tmp_path_factory, "ddp_reference", build)
    return run_dir, (run_dir.parent / "ddp_reference.stdout").read_text()


def assert_same_run(run_dir: Path, ref_dir: Path, weights_atol: float = 1e-5) -> None:
    """Same losses (train and val, EMA's too) and final weights, to float tolerance (reduction order differs)."""
    import torch

    events, ref_events = read_metrics(run_dir), read_metrics(ref_dir)
    assert [e["step"] for e in events] == [e["step"] for e in ref_events]
    for key in ("train/loss", "val/loss", "val_ema/loss"):
        assert series(events, key) == pytest.approx(series(ref_events, key), rel=1e-5, abs=1e-5), key
    for name in ("model.safetensors", "model_ema.safetensors"):
        if (ref_dir / name).exists():
            wa, wb = load_weights(run_dir / name), load_weights(ref_dir / name)
            assert wa.keys() == wb.keys()
            for k in wb:
                torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=weights_atol)


def assert_identical(run_dir: Path, ref_dir: Path) -> None:
    """Bitwise: the same loss stream (every step logged once) and the same final weights."""
    import torch

    got, ref = read_metrics(run_dir), read_metrics(ref_dir)
    assert [e["step"] for e in got] == [e["step"] for e in ref]
    for key in ("train/loss", "val/loss", "val_ema/loss"):
        assert series(got, key) == series(ref, key), key
    for name in ("model.safetensors", "model_ema.safetensors"):
        wa, wb = load_weights(run_dir / name), load_weights(ref_dir / name)
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (Path(run_dir) / "checkpoints").glob("step_*"))


def faulty(action: str, at_call: int, rank: int = 0, first_attempt_only: bool = False) -> list[str]:
    """Overrides that make tests/helpers/faulty.py misbehave on `rank` at training loss call `at_call`."""
    return ["task._target_=faulty.Faulty", f"+task.action={action}", f"+task.at_call={at_call}",
            f"+task.rank={rank}", f"+task.first_attempt_only={first_attempt_only}"]


# 12 steps of the diffusion smoke sizes (8 channels, 8 samples of 4 Euler steps); EMA on (the recipe's default).
DIFFUSION = ("recipe=diffusion", "debug=smoke", "trainer.max_steps=12", "trainer.eval_every=6",
             "checkpoint.every_n_steps=4", "ema.decay=0.9", "trainer.log_every=2")


@pytest.fixture(scope="session")
def diffusion_reference(tmp_path_factory) -> Path:
    """The diffusion recipe on one process, batch 16, through the CLI (in this process, as `reference`)."""
    def build(run_dir: Path) -> None:
        r = run_here(*DIFFUSION, "data.batch_size=16", f"hydra.run.dir={run_dir}")
        assert r.returncode == 0, r.stderr

    return once_per_run(tmp_path_factory, "diffusion_reference", build)
