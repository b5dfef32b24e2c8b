"""Benchmarks where every figure is a ratio against plain PyTorch, measured side by side in one run.

    make bench                                          # the full suite, writes BENCHMARKS.md (~5 min, 2 cores)
    python -m trainer.benchmark --quick --out /tmp/B.md # tiny sizes in seconds (the smoke test)
    python -m trainer.benchmark --only loop_tiny,startup

A shared machine drifts, so nothing is compared with a number from another run: each item runs
the framework and its plain-PyTorch baseline in alternating rounds (A B, then B A, ...) and
reports the median of the per-round figures (differences and ratios are taken per round, then
the median). In-process loops are timed by the wall clock and in process CPU time; on the CPU
with one thread the CPU time decides, as it is the less disturbed by other jobs.

    loop_tiny, loop_default  Trainer.fit() vs a hand-written loop: same model, AdamW groups, batches,
                             clipping, autocast and LR schedule (gpt_tiny 4x32, gpt_small 8x256, bf16);
                             the plain loop runs in turns between windows of the Trainer's steps
    bf16_vs_fp32             tokens/s of the plain loop on the default lm model in each precision
    ddp                      `python -m trainer world=ddp` 2 processes x 1 thread vs 1 x 1 (train/tokens_per_s),
                             and the same pair for a hand-written DDP loop (what the machine allows)
    checkpoint               safetensors and trainer.checkpoint save/load vs writing/reading the same bytes raw
    startup                  `python -m trainer` to its first optimizer step vs `python -c "import torch"`, vs
                             `import torch, torch._dynamo` (every torch.optim optimizer imports it) and vs
                             a plain script doing the same step; whether --help / --cfg job import torch
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ITEMS = ("loop_tiny", "loop_default", "bf16_vs_fp32", "ddp", "checkpoint", "startup")

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
class Sizes:
    """How long each item runs. (rounds, steps per round, warm-up steps) for the in-process loops; for the
    loop items a round is one window of Trainer steps with the plain loops' turn just before it."""

    loop_tiny: tuple[int, int, int]
    loop_default: tuple[int, int, int]
    precision: tuple[int, int, int]
    default_model: tuple[str, ...]
    ddp_rounds: int
    ddp_model: tuple[str, ...]
    ddp_steps: int
    ddp_log_every: int
    checkpoint_rounds: int
    startup_rounds: int
    startup_warmup: bool = True  # one untimed run first (dataset cache, .pyc files, page cache)


FULL = Sizes(loop_tiny=(600, 5, 100), loop_default=(20, 1, 2), precision=(4, 3, 1), default_model=tuple(DEFAULT),
             ddp_rounds=3, ddp_model=tuple(DEFAULT), ddp_steps=12, ddp_log_every=3, checkpoint_rounds=5,
             startup_rounds=5)
QUICK = Sizes(loop_tiny=(3, 5, 3), loop_default=(2, 2, 1), precision=(2, 3, 1), default_model=tuple(QUICK_DEFAULT),
              ddp_rounds=1, ddp_model=tuple(TINY), ddp_steps=3, ddp_log_every=1, checkpoint_rounds=2,
              startup_rounds=1, startup_warmup=False)


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
    from trainer.cli import compose as hydra_compose
    from trainer.cli import resolve

    return resolve(hydra_compose(overrides))


def no_checkpoints(cfg) -> list[str]:
    """Overrides that switch off end-of-run checkpoints, where this version of the trainer has them."""
    from omegaconf import OmegaConf

    return ["checkpoint.save_final=false"] if OmegaConf.select(cfg, "checkpoint.save_final") is not None else []


# -- a. the Trainer loop vs a plain loop -----------------------------------------------------------
def with_trainer(cfg, run_dir: Path, body: Callable[[Any], Any]) -> Any:
    """`body(trainer)` in place of `trainer.fit()` inside `trainer.run.train(cfg, run_dir)`.

    So the Trainer is exactly the one `train` builds (loggers, data, precision, checkpointer ...),
    and whatever `train` does around fit() happens once, outside the timed rounds. `body` may call
    the real `trainer.fit()` as often as it likes.
    """
    from trainer.run import train
    from trainer.trainer import Trainer

    original, result = Trainer.fit, []

    def instead(self):
        Trainer.fit = original
        result.append(body(self))
        return {}

    Trainer.fit = instead
    try:
        train(cfg, run_dir)
    finally:
        Trainer.fit = original
    if not result:
        raise RuntimeError("trainer.run.train returned without calling Trainer.fit")
    return result[0]


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


def fit_steps(trainer, n: int) -> Lap:
    """Time per step of `trainer.fit()` continued for `n` more steps (its end-of-run summary line muted)."""
    trainer.cfg.max_steps = trainer.step + n
    with contextlib.redirect_stdout(io.StringIO()):
        watch = Stopwatch(trainer.backend.device)
        trainer.fit()
        return watch.lap(n)


def _synchronizer(device) -> Callable[[], None]:
    import torch

    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


class PlainLoop:
    """The loop a user writes by hand: the same work as the Trainer's step, nothing else.

    Same model class and init, AdamW with the same decay / no-decay groups, the same batches cut
    from the same dataset, autocast, grad clipping, LR schedule, and `loss.item()` every log_every.
    """

    def __init__(self, cfg, dataset, device, bf16: bool):
        import torch

        from trainer.recipes.lm.model import GPT

        torch.manual_seed(cfg.trainer.seed)
        self.device, self.bf16, self.data = device, bf16, dataset
        self.model = GPT(**{k: v for k, v in cfg.model.items() if k != "_target_"}).to(device).train()
        o = cfg.optim
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2]},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                                     foreach=o.get("foreach"), fused=o.get("fused"))
        warmup, total = cfg.scheduler.get("warmup_steps", 0), cfg.trainer.max_steps
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: _cosine(s, warmup, total))
        self.clip, self.log_every, self.batch_size = cfg.trainer.grad_clip, cfg.trainer.log_every, cfg.data.batch_size
        self.perm = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(cfg.trainer.seed))
        self.pos, self.step, self.losses = 0, 0, []

    def batch(self):
        if self.pos + self.batch_size > len(self.perm):
            self.pos = 0
        idx = self.perm[self.pos : self.pos + self.batch_size].tolist()
        self.pos += self.batch_size
        x, y = self.data.__getitems__(idx)
        return x.to(self.device), y.to(self.device)

    def run(self, n: int) -> Lap:
        """Time per step over `n` steps."""
        import torch
        import torch.nn.functional as F

        model, opt = self.model, self.opt
        watch = Stopwatch(self.device)
        for _ in range(n):
            x, y = self.batch()
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                logits = model(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
            loss.backward()
            if self.clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), self.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            self.sched.step()
            self.step += 1
            if self.step % self.log_every == 0:
                self.losses.append(loss.item())
        return watch.lap(n)


def _cosine(step: int, warmup: int, total: int) -> float:
    import math

    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


class Interleaved:
    """The training set, with `turn()` called before every `every`-th batch is cut from it.

    That is where the plain loops take their turn: between two of the Trainer's steps, inside one
    `fit()` call. So each window of `every` Trainer steps sits right beside `every` plain steps
    (milliseconds apart, where rounds of separate fit() calls were seconds apart), and no per-call
    setup of fit() is counted. The wrapper's own call per batch is counted against the Trainer.
    """

    def __init__(self, dataset, every: int, turn: Callable[[], None]):
        self.dataset, self.every, self.turn, self.batches = dataset, every, turn, 0
        if hasattr(dataset, "collate_fn"):
            self.collate_fn = dataset.collate_fn

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, indices: list[int]):
        if self.batches % self.every == 0:
            self.turn()
        self.batches += 1
        return self.dataset.__getitems__(indices)


def bench_loop(overrides: list[str], sizes: tuple[int, int, int], target: dict) -> dict:
    windows, steps, warmup = sizes
    base = compose([*COMMON, *overrides])
    cfg = compose([*COMMON, *overrides, f"trainer.max_steps={warmup + (windows + 1) * steps + 1}",
                   f"world.threads={THREADS}", *no_checkpoints(base)])

    def measure(trainer) -> tuple[dict, float, Any]:
        trainer.val_data = None  # eval is not per-step work
        device = trainer.backend.device
        bf16 = cfg.precision._target_.endswith("BF16")
        plain = PlainLoop(cfg, trainer.train_data, device, bf16)
        # An A/A control: a second, identical plain loop. Its "overhead" over the first is pure noise.
        control = PlainLoop(cfg, trainer.train_data, device, bf16)
        fit_steps(trainer, warmup)
        plain.run(warmup)
        control.run(warmup)
        # What one fit() call costs besides its steps (loader, progress, end-of-run work): paid once per run.
        fixed = median([fit_steps(trainer, 0).wall for _ in range(5)])
        laps: dict[str, list[Lap]] = {"trainer": [], "plain": [], "control": []}
        watch: list[Stopwatch] = []

        def turn() -> None:
            if watch:
                laps["trainer"].append(watch.pop().lap(steps))
            loops = [("plain", plain), ("control", control)]
            for name, loop in loops if len(laps["plain"]) % 2 == 0 else loops[::-1]:
                laps[name].append(loop.run(steps))
            watch.append(Stopwatch(device))

        dataset = trainer.train_data
        trainer.train_data = Interleaved(dataset, steps, turn)
        try:
            fit_steps(trainer, (windows + 1) * steps)  # turns before windows 0..windows; windows are timed
        finally:
            trainer.train_data = dataset
        # Window i of the Trainer is paired with the plain turn just before it.
        return {k: v[:windows] for k, v in laps.items()}, fixed, device

    tmp = Path(tempfile.mkdtemp(prefix="bench-loop-"))
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # train's own messages
            t, fixed, device = with_trainer(cfg, tmp, measure)
        logged = sum(1 for _ in open(tmp / "metrics.jsonl"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    tokens = cfg.data.batch_size * cfg.data.seq_len
    # Judge over whole log periods where there are enough of them (gpt_tiny: 5 windows of 5 steps hold one
    # log step); for the default model a log step is noise next to a step of hundreds of milliseconds.
    per_log = cfg.trainer.log_every // steps if cfg.trainer.log_every % steps == 0 else 1
    group = per_log if windows >= 20 * per_log else 1
    both = {c: paired(t["trainer"], t["plain"], c, group) for c in ("wall", "cpu")}
    clock = judging_clock(device)
    aa = paired(t["control"], t["plain"], clock, group)
    out = {
        "model": f"GPT n_layer={cfg.model.n_layer} d_model={cfg.model.d_model}",
        "batch": f"{cfg.data.batch_size}x{cfg.data.seq_len}", "precision": "bf16", "threads": THREADS,
        "log_every": cfg.trainer.log_every, "rounds": windows, "steps_per_round": steps, "clock": clock,
        **both[clock],
        "trainer_tokens_per_s": tokens / both[clock]["trainer_ms_per_step"] * 1000,
        "plain_tokens_per_s": tokens / both[clock]["plain_ms_per_step"] * 1000,
        "fit_call_fixed_ms": 1000 * fixed, "metrics_lines_written": logged,
        "control_overhead_ms_per_step": aa["overhead_ms_per_step"], "control_throughput_ratio": aa["throughput_ratio"],
        "control_per_round_ms": aa["per_round_ms"]["trainer"], **both,
    }
    value = out[target["key"]]
    out["target"] = target["text"]
    out["met"] = bool(value <= target["max"]) if "max" in target else bool(value >= target["min"])
    return out


def judging_clock(device) -> str:
    """CPU time where it measures exactly the loop's own work (CPU device, one thread), else the wall clock."""
    return "cpu" if device.type == "cpu" and THREADS == 1 else "wall"


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


# -- b. bf16 vs fp32 ---------------------------------------------------------------------------------
def bench_precision(sizes: Sizes, data: list[str]) -> dict:
    from trainer.run import build_data

    rounds, steps, warmup = sizes.precision
    cfg = compose([*COMMON, *data, *sizes.default_model])
    train_data, _ = build_data(cfg.data)
    import torch

    device = torch.device("cpu")
    loops = {"bf16": PlainLoop(cfg, train_data, device, bf16=True), "fp32": PlainLoop(cfg, train_data, device, bf16=False)}
    for lp in loops.values():
        lp.run(warmup)
    t = alternate({k: (lambda lp=lp: lp.run(steps)) for k, lp in loops.items()}, rounds)
    tokens = cfg.data.batch_size * cfg.data.seq_len
    clock = judging_clock(device)
    by_clock = {}
    for c in ("wall", "cpu"):
        bf, fp = [getattr(x, c) for x in t["bf16"]], [getattr(x, c) for x in t["fp32"]]
        by_clock[c] = {"bf16_tokens_per_s": tokens / median(bf), "fp32_tokens_per_s": tokens / median(fp),
                       "ratio": median([f / b for b, f in zip(bf, fp)]),  # bf16 tokens/s over fp32 tokens/s
                       "per_round_ms": {"bf16": [1000 * x for x in bf], "fp32": [1000 * x for x in fp]}}
    return {"batch": f"{cfg.data.batch_size}x{cfg.data.seq_len}", "threads": torch.get_num_threads(),
            "rounds": rounds, "steps_per_round": steps, "clock": clock, **by_clock[clock], **by_clock}


# -- c. DDP through the real CLI ---------------------------------------------------------------------
def cli(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "trainer", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _check(r: subprocess.CompletedProcess, what: str) -> None:
    if r.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {r.returncode}):\n{r.stderr[-3000:]}")


def cli_tokens_per_s(args: list[str]) -> tuple[float, int]:
    """Median train/tokens_per_s of a CLI run, the first log window (warm-up) left out."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-cli-"))
    try:
        r = cli([*args, f"hydra.run.dir={tmp}"])
        _check(r, "python -m trainer " + " ".join(args))
        events = [json.loads(ln) for ln in (tmp / "metrics.jsonl").read_text().splitlines()]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rates = [e["train/tokens_per_s"] for e in events if "train/tokens_per_s" in e][1:]
    return median(rates), len(rates)


def bench_ddp(sizes: Sizes, data: list[str]) -> dict:
    base = [*COMMON, *data, *sizes.ddp_model, f"trainer.max_steps={sizes.ddp_steps}",
            f"trainer.log_every={sizes.ddp_log_every}", "trainer.eval_every=0", "trainer.eval_samples=4",
            "world.threads=1"]
    base += no_checkpoints(compose(base))
    windows: dict[str, int] = {}

    def run(kind: str, extra: list[str]) -> Callable[[], float]:
        def go() -> float:
            rate, n = cli_tokens_per_s([*base, *extra])
            windows[kind] = n
            return rate
        return go

    from omegaconf import OmegaConf

    cfg = compose(base)
    plain_cfg = OmegaConf.to_container(cfg)
    warmup, timed = sizes.ddp_log_every, sizes.ddp_steps - sizes.ddp_log_every
    t = alternate({"single": run("single", []), "ddp": run("ddp", ["world=ddp", "world.nproc_per_node=2"]),
                   "plain_single": lambda: plain_ddp_tokens_per_s(1, plain_cfg, warmup, timed),
                   "plain_ddp": lambda: plain_ddp_tokens_per_s(2, plain_cfg, warmup, timed)},
                  sizes.ddp_rounds)
    ratio = median([d / s for s, d in zip(t["single"], t["ddp"])])
    plain_ratio = median([d / s for s, d in zip(t["plain_single"], t["plain_ddp"])])
    return {
        "model": sizes.ddp_model[0].split("=")[1], "batch_per_process": f"{cfg.data.batch_size}x{cfg.data.seq_len}",
        "steps": sizes.ddp_steps, "log_every": sizes.ddp_log_every, "rounds": sizes.ddp_rounds,
        "windows_used": windows, "single_tokens_per_s": median(t["single"]), "ddp_tokens_per_s": median(t["ddp"]),
        "ratio": ratio, "per_round_tokens_per_s": t, "target": ">= 1.8x", "met": bool(ratio >= 1.8),
        "plain_single_tokens_per_s": median(t["plain_single"]), "plain_ddp_tokens_per_s": median(t["plain_ddp"]),
        "plain_ratio": plain_ratio,
        "ddp_vs_plain_ddp": median([d / p for d, p in zip(t["ddp"], t["plain_ddp"])]),
    }


def plain_ddp_tokens_per_s(world: int, cfg: dict, warmup: int, steps: int) -> float:
    """The same DDP job written by hand (PlainLoop wrapped in DDP, gloo, 1 thread per process), started
    with torch.multiprocessing: how far 2 processes scale on this machine without any framework."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = Path(tempfile.mkdtemp(prefix="bench-plain-ddp-")) / "rate.json"
    try:
        mp.spawn(_plain_ddp_worker, args=(world, port, cfg, warmup, steps, str(out)), nprocs=world)
        return json.loads(out.read_text())
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)


def _plain_ddp_worker(rank: int, world: int, port: int, cfg: dict, warmup: int, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torch.nn.parallel import DistributedDataParallel

    from trainer.run import build_data

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    cfg = OmegaConf.create(cfg)
    train_data, _ = build_data(cfg.data)
    loop = PlainLoop(cfg, train_data, torch.device("cpu"), bf16=cfg.precision._target_.endswith("BF16"))
    if world > 1:
        loop.model = DistributedDataParallel(loop.model)
    loop.pos = rank * loop.batch_size  # each rank its own batches
    loop.run(warmup)
    dist.barrier()
    t = time.perf_counter()
    loop.run(steps)
    dist.barrier()
    if rank == 0:
        tokens = world * steps * loop.batch_size * cfg.data.seq_len
        Path(out).write_text(json.dumps(tokens / (time.perf_counter() - t)))
    dist.destroy_process_group()


# -- d. checkpoints ----------------------------------------------------------------------------------
def _state(cfg):
    """A model and optimizer after one step (so the AdamW moments exist), as (model_state, other state)."""
    import torch

    from trainer.run import build_data

    train_data, _ = build_data(cfg.data)
    loop = PlainLoop(cfg, train_data, torch.device("cpu"), bf16=True)
    loop.run(1)
    return loop.model.state_dict(), {"optimizer": loop.opt.state_dict(), "scheduler": loop.sched.state_dict()}


def _flat(model_state, state) -> dict:
    from trainer.checkpoint import flatten

    tensors: dict = {}
    flatten(state, tensors)
    return {**{f"model/{k}": v.detach().clone().contiguous() for k, v in model_state.items()}, **tensors}


def _flat_fallback(model_state, state) -> dict:
    out = {f"model/{k}": v.detach().clone().contiguous() for k, v in model_state.items()}
    for pid, s in state["optimizer"]["state"].items():
        out.update({f"optimizer/{pid}/{k}": v.detach().clone().reshape(v.shape) for k, v in s.items() if hasattr(v, "dim")})
    return out


def _raw_bytes(tensors: dict) -> bytes:
    import torch

    return b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors.values())


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def materialize(obj: Any) -> Any:
    """A copy of every tensor in `obj`: safetensors maps files lazily, a raw read copies every byte."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: materialize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [materialize(v) for v in obj]
    return obj


def real_checkpoint_cases(model_state, state, tmp: Path, raw: bytes) -> tuple[dict, str]:
    """Save/load through trainer.checkpoint (the API the Trainer uses), with raw-bytes twins that fsync alike.

    Returns ({} , why) where that module is missing or its API differs from what this was written for;
    adapt the two calls below when the API changes.
    """
    try:
        from trainer import checkpoint as ckpt

        checkpointer = ckpt.Checkpointer(tmp / "checkpoints", keep_last=1)
        path = checkpointer.save(1, model_state, state)
        ckpt.load(path)
    except (ImportError, AttributeError, TypeError) as e:
        return {}, f"trainer.checkpoint unusable here ({type(e).__name__}: {e})"
    from trainer.io import atomic_write_bytes

    raw_path = tmp / "raw-durable.bin"
    background = ckpt.Checkpointer(tmp / "async", keep_last=1, async_save=True)

    def save_blocking() -> float:
        """Seconds training waits for with checkpoint.async_save (the CPU snapshot); the write is not timed."""
        background.wait()
        t = time.perf_counter()
        background.save(1, model_state, state)
        blocked = time.perf_counter() - t
        background.wait()
        return blocked

    save_blocking.self_timed = True
    return {
        "save": lambda: checkpointer.save(1, model_state, state),
        "save_blocking": save_blocking,
        "raw_write_fsync": lambda: atomic_write_bytes(raw_path, raw),
        # No materialize(): checkpoint.load returns tensors already copied out of the file, not lazy views.
        "load": lambda: ckpt.load(path),
        "raw_read": lambda: raw_path.read_bytes(),
    }, "trainer.checkpoint.Checkpointer.save / trainer.checkpoint.load (sha256 manifest, fsync, atomic rename)"


def bench_checkpoint(sizes: Sizes, data: list[str]) -> dict:
    from safetensors.torch import load_file, save_file

    cfg = compose([*COMMON, *data, *sizes.default_model])
    model_state, state = _state(cfg)
    try:
        tensors = _flat(model_state, state)
    except ImportError:
        tensors = _flat_fallback(model_state, state)
    raw = _raw_bytes(tensors)
    tmp = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    rounds = sizes.checkpoint_rounds
    try:
        st_path, raw_path = tmp / "state.safetensors", tmp / "raw.bin"
        fmt = {
            "safetensors_save": lambda: save_file(tensors, str(st_path)),
            "raw_write": lambda: raw_path.write_bytes(raw),
            "safetensors_load": lambda: materialize(load_file(str(st_path))),
            "raw_read": lambda: raw_path.read_bytes(),
            "sha256_of_the_bytes": lambda: hashlib.sha256(raw).digest(),  # what a verified checkpoint adds per pass
        }
        for fn in fmt.values():  # warm the page cache and the files' first allocation
            fn()
        t = alternate({k: (lambda fn=fn: _timed(fn)) for k, fn in fmt.items()}, rounds)
        real, api = real_checkpoint_cases(model_state, state, tmp, raw)
        rt = alternate({k: (fn if getattr(fn, "self_timed", False) else (lambda fn=fn: _timed(fn)))
                        for k, fn in real.items()}, rounds) if real else {}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ms = {k: 1000 * median(v) for k, v in {**t, **{f"checkpoint_{k}": v for k, v in rt.items()}}.items()}
    out = {
        "bytes": len(raw), "tensors": len(tensors), "rounds": rounds, "api": api, "ms": ms,
        "format_save_ratio": median([a / b for a, b in zip(t["safetensors_save"], t["raw_write"])]),
        "format_load_ratio": median([a / b for a, b in zip(t["safetensors_load"], t["raw_read"])]),
    }
    if rt:
        out["save_ratio"] = median([a / b for a, b in zip(rt["save"], rt["raw_write_fsync"])])
        out["save_blocking_ratio"] = median([a / b for a, b in zip(rt["save_blocking"], rt["raw_write_fsync"])])
        out["load_ratio"] = median([a / b for a, b in zip(rt["load"], rt["raw_read"])])
    return out


# -- e. start-up -------------------------------------------------------------------------------------
def _python(args: list[str]) -> float:
    t = time.perf_counter()
    r = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
    _check(r, "python " + " ".join(args))
    return time.perf_counter() - t


def first_step(args: list[str]) -> tuple[float, float]:
    """(seconds to the first metrics.jsonl line, i.e. the first optimizer step with log_every=1; seconds to exit)."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-start-"))
    metrics = tmp / "metrics.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        with open(tmp / "stderr.txt", "w+") as err:
            t0 = time.perf_counter()
            p = subprocess.Popen([sys.executable, "-m", "trainer", *args, f"hydra.run.dir={tmp}"], cwd=ROOT, env=env,
                                 stdout=subprocess.DEVNULL, stderr=err)
            first = None
            while p.poll() is None:
                if first is None and metrics.exists() and metrics.stat().st_size > 0:
                    first = time.perf_counter() - t0
                time.sleep(0.002)
            done = time.perf_counter() - t0
            if p.returncode != 0:
                err.seek(0)
                raise RuntimeError(f"python -m trainer {' '.join(args)} failed:\n{err.read()[-3000:]}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return (first if first is not None else done), done


def imports_torch(args: list[str]) -> bool:
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "trainer", *args], cwd=ROOT, capture_output=True,
                       text=True)
    _check(r, "python -X importtime -m trainer " + " ".join(args))
    return any(line.rsplit("|", 1)[-1].strip() == "torch" for line in r.stderr.splitlines())


# The plain-PyTorch twin of a start-up run: the same model, optimizer groups and one bf16 step, by hand.
# Building any torch.optim optimizer imports torch._dynamo (1-2 s here), so a plain script pays it too.
PLAIN_FIRST_STEP = """
import torch, torch.nn.functional as F
from trainer.recipes.lm.model import GPT
torch.manual_seed(0)
model = GPT(vocab_size=256, seq_len=32, n_layer=1, n_head=2, d_model=64)
params = list(model.parameters())
opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2]},
                         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=2e-3)
x, y = torch.randint(256, (4, 32)), torch.randint(256, (4, 32))
with torch.autocast("cpu", dtype=torch.bfloat16):
    loss = F.cross_entropy(model(x).reshape(-1, 256).float(), y.reshape(-1))
loss.backward()
torch.nn.utils.clip_grad_norm_(params, 1.0)
opt.step()
print(loss.item())
"""


def bench_startup(sizes: Sizes, data: list[str]) -> dict:
    run = [*COMMON, *data, *TINY, "trainer.max_steps=1", "trainer.log_every=1", "trainer.eval_samples=1"]
    run += no_checkpoints(compose(run))
    if sizes.startup_warmup:
        first_step(run)
    firsts, exits = [], []

    def trainer_run() -> float:
        f, d = first_step(run)
        firsts.append(f)
        exits.append(d)
        return f

    t = alternate({"import_torch": lambda: _python(["-c", "import torch"]), "trainer": trainer_run,
                   "import_torch_dynamo": lambda: _python(["-c", "import torch, torch._dynamo"]),
                   "plain_script": lambda: _python(["-c", PLAIN_FIRST_STEP]),
                   "help": lambda: _python(["-m", "trainer", "--help"]),
                   "cfg_job": lambda: _python(["-m", "trainer", "--cfg", "job"]),
                   "python": lambda: _python(["-c", "pass"])}, sizes.startup_rounds)
    extra = median([f - b for f, b in zip(firsts, t["import_torch"])])
    return {
        "command": "python -m trainer " + " ".join(run), "rounds": sizes.startup_rounds,
        "python_s": median(t["python"]), "import_torch_s": median(t["import_torch"]),
        "plain_script_first_step_s": median(t["plain_script"]),
        "first_step_s": median(firsts), "exit_s": median(exits), "first_step_minus_import_torch_s": extra,
        "first_step_minus_plain_script_s": median([f - b for f, b in zip(firsts, t["plain_script"])]),
        "import_torch_dynamo_s": median(t["import_torch_dynamo"]),
        "first_step_minus_import_torch_dynamo_s": median([f - b for f, b in zip(firsts, t["import_torch_dynamo"])]),
        "help_s": median(t["help"]), "cfg_job_s": median(t["cfg_job"]),
        "help_imports_torch": imports_torch(["--help"]), "cfg_job_imports_torch": imports_torch(["--cfg", "job"]),
        "target": "<= 1 s", "met": bool(extra <= 1.0),
    }


# -- the report --------------------------------------------------------------------------------------
def _yes(met: bool | None) -> str:
    return "—" if met is None else ("yes" if met else "**no**")


def table(res: dict) -> list[str]:
    rows = ["| item | framework | plain PyTorch baseline | ratio / difference | target | met |",
            "|---|---|---|---|---|---|"]
    for key, label in (("loop_tiny", "a. loop overhead, gpt_tiny"), ("loop_default", "a. loop overhead, gpt_small")):
        if key in res:
            r = res[key]
            w = r["wall"]
            rows.append(f"| {label} {r['batch']} bf16, {r['threads']} thread(s), {r['clock']} time | "
                        f"{r['trainer_ms_per_step']:.3f} ms/step | {r['plain_ms_per_step']:.3f} ms/step | "
                        f"{r['overhead_ms_per_step']:+.3f} ms/step, {r['throughput_ratio']:.3f}x throughput "
                        f"(mean {r['overhead_ms_per_step_mean']:+.3f}; "
                        f"wall clock: {w['overhead_ms_per_step']:+.3f}, {w['throughput_ratio']:.3f}x; A/A control, "
                        f"plain vs plain: {r['control_overhead_ms_per_step']:+.3f}, "
                        f"{r['control_throughput_ratio']:.3f}x) | "
                        f"{r['target']} | {_yes(r['met'])} |")
    if "bf16_vs_fp32" in res:
        r = res["bf16_vs_fp32"]
        rows.append(f"| b. bf16 vs fp32, plain loop {r['batch']}, {r['threads']} thread(s), {r['clock']} time | "
                    f"bf16 {r['bf16_tokens_per_s']:,.0f} tok/s | fp32 {r['fp32_tokens_per_s']:,.0f} tok/s | "
                    f"{r['ratio']:.2f}x | — | — |")
    if "ddp" in res:
        r = res["ddp"]
        rows.append(f"| c. DDP 2 proc x 1 thread vs 1 x 1, {r['model']} {r['batch_per_process']}/proc | "
                    f"{r['ddp_tokens_per_s']:,.0f} tok/s | {r['single_tokens_per_s']:,.0f} tok/s (1 proc) | "
                    f"{r['ratio']:.2f}x | {r['target']} | {_yes(r['met'])} |")
        rows.append(f"| c. the same scaling for a hand-written DDP loop (this machine's ceiling) | "
                    f"{r['plain_ddp_tokens_per_s']:,.0f} tok/s | {r['plain_single_tokens_per_s']:,.0f} tok/s (1 proc) | "
                    f"{r['plain_ratio']:.2f}x; framework DDP at {r['ddp_vs_plain_ddp']:.2f}x the plain DDP loop's "
                    f"tokens/s | — | — |")
    if "checkpoint" in res:
        r, ms, mb = res["checkpoint"], res["checkpoint"]["ms"], res["checkpoint"]["bytes"] / 2**20
        rows.append(f"| d. safetensors save_file, {mb:.1f} MiB model+optimizer | {ms['safetensors_save']:.1f} ms | "
                    f"raw write {ms['raw_write']:.1f} ms | {r['format_save_ratio']:.2f}x | — | — |")
        rows.append(f"| d. safetensors load_file + touch every tensor | {ms['safetensors_load']:.1f} ms | raw read "
                    f"{ms['raw_read']:.1f} ms | {r['format_load_ratio']:.2f}x (sha256 of the bytes: "
                    f"{ms['sha256_of_the_bytes']:.1f} ms) | — | — |")
        if "save_ratio" in r:
            # The target is on speed (raw time / our time >= 0.8), i.e. our time at most 1.25x raw.
            for label, key, ratio in (("checkpoint save, synchronous (Checkpointer.save)", "checkpoint_save", "save_ratio"),
                                      ("checkpoint save: time training is blocked (async_save, the default)",
                                       "checkpoint_save_blocking", "save_blocking_ratio")):
                rows.append(f"| d. {label} | {ms[key]:.1f} ms | raw write + fsync {ms['checkpoint_raw_write_fsync']:.1f} ms "
                            f"| {1 / r[ratio]:.2f}x raw speed | >= 0.8x | {_yes(1 / r[ratio] >= 0.8)} |")
            rows.append(f"| d. checkpoint load (checkpoint.load: map, verify sha256, copy every tensor out) | "
                        f"{ms['checkpoint_load']:.1f} ms | raw read {ms['checkpoint_raw_read']:.1f} ms | "
                        f"{1 / r['load_ratio']:.2f}x raw speed | >= 0.8x | {_yes(1 / r['load_ratio'] >= 0.8)} |")
    if "startup" in res:
        r = res["startup"]
        rows.append(f"| e. start-up to first step, gpt_tiny | {r['first_step_s']:.2f} s | `import torch` "
                    f"{r['import_torch_s']:.2f} s | {r['first_step_minus_import_torch_s']:+.2f} s | {r['target']} | "
                    f"{_yes(r['met'])} |")
        rows.append(f"| e. start-up to first step vs the floor of any torch.optim user | {r['first_step_s']:.2f} s | "
                    f"`import torch, torch._dynamo` {r['import_torch_dynamo_s']:.2f} s | "
                    f"{r['first_step_minus_import_torch_dynamo_s']:+.2f} s | — | — |")
        rows.append(f"| e. start-up to first step vs a plain script doing the same step | {r['first_step_s']:.2f} s | "
                    f"plain script {r['plain_script_first_step_s']:.2f} s | {r['first_step_minus_plain_script_s']:+.2f} s "
                    f"| — | — |")
        for k, flag in (("help", "--help"), ("cfg_job", "--cfg job")):
            imports = "imports torch" if r[f"{k}_imports_torch"] else "no torch import"
            rows.append(f"| e. `python -m trainer {flag}` | {r[f'{k}_s']:.2f} s | `import torch` "
                        f"{r['import_torch_s']:.2f} s | {r[f'{k}_s'] - r['import_torch_s']:+.2f} s, {imports} | "
                        f"no torch import | {_yes(not r[f'{k}_imports_torch'])} |")
    return rows


def set_threads(n: int) -> None:
    global THREADS
    import torch

    THREADS = n
    torch.set_num_threads(n)


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


CURVE_HEADING = "## Quality per second: `make train`"


def curve_section(run_dir: Path) -> list[str]:
    """Markdown for the val bits-per-byte curve of a finished `make train` run (its metrics.jsonl)."""
    events = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    info = json.loads((Path(run_dir) / "run_info.json").read_text()) if (Path(run_dir) / "run_info.json").exists() else {}
    last_step, seconds, tokens, rows = 0, 0.0, 0.0, []
    for e in events:
        if "train/step_time_ms" in e:  # one window of (step - last_step) steps
            window = e["step"] - last_step
            seconds += window * e["train/step_time_ms"] / 1000
            tokens += window * e["train/step_time_ms"] / 1000 * e["train/tokens_per_s"]
            last_step = e["step"]
        if "val/bpb" in e:
            rows.append(f"| {e['step']} | {tokens / 1e6:.2f} M | {seconds:.0f} s | {e['val/loss']:.4f} | {e['val/bpb']:.4f} |")
    cfg = Path(run_dir) / "config.yaml"
    return [
        CURVE_HEADING,
        "",
        f"Validation bits per byte of the default `recipe=lm` run (`make train`: {info.get('device', 'cpu')}, "
        f"commit {str(info.get('git_commit'))[:7]}), against training time (eval and start-up excluded). "
        "Refresh with `python -m trainer.benchmark --curve RUN_DIR` after `make train`.",
        "",
        "| step | tokens | train time | val/loss | val/bpb |",
        "|---|---|---|---|---|",
        *rows,
        "",
        f"Settings: {_settings(cfg)}",
        "",
    ]


def _settings(cfg: Path) -> str:
    if not cfg.exists():
        return "(config.yaml not found)"
    import yaml

    c = yaml.safe_load(cfg.read_text())
    m, d, t, o = c["model"], c["data"], c["trainer"], c["optim"]
    return (f"model {m['n_layer']} layers x {m['d_model']} ({m['n_head']} heads), batch {d['batch_size']} x "
            f"{d['seq_len']} bytes, {t['max_steps']} steps, AdamW lr {o['lr']} with {c['scheduler']['warmup_steps']} "
            f"warmup steps then cosine to {c['scheduler'].get('min_lr_ratio', 1)} x lr, "
            f"precision {c['precision']['_target_'].rsplit('.', 1)[-1]}.")


def kept_curve(path: Path) -> list[str]:
    """The quality section of an existing report: `make bench` regenerates the rest, not this."""
    if not path.exists() or CURVE_HEADING not in path.read_text():
        return []
    text = path.read_text()
    return text[text.index(CURVE_HEADING):].rstrip("\n").split("\n") + [""]


def write_report(path: Path, res: dict) -> None:
    m = res["meta"]
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `{'python -m trainer.benchmark --quick' if m['quick'] else 'make bench'}` on {m['date']}: "
        f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}, Python {m['python']}, commit {m['git_commit']}"
        f"{' (with uncommitted changes)' if m['worktree_dirty'] else ''}; load average {m['load_avg_start']:.2f} at "
        f"start, {m['load_avg_end']:.2f} at the end; {m['wall_s']:.0f} s in all."
        + (" **Quick sizes: these numbers show that the suite runs, not how fast anything is.**" if m["quick"] else ""),
        "",
        "Each figure is a ratio against a plain PyTorch baseline measured in the same run, in alternating "
        "rounds (A B, B A, ...), reported as the median of per-round figures. See `trainer/benchmark.py` for "
        "what each baseline does; re-run with `make bench`.",
        "",
        *table(res),
        "",
        "Notes: the loop rows time `Trainer.fit()` as built by `trainer.run.train` (data loader, metrics.jsonl every "
        "`log_every` steps, no progress display, no eval, no checkpoints) against a hand-written loop doing the same "
        "math on the same batches, in one process with a fixed thread count. Inside one fit() call, the plain loop "
        "and an identical A/A control take turns between windows of the Trainer's steps (short windows, many of them: "
        "this host's noise is per window, not per step, so the median's error shrinks with the number of windows). "
        "Differences and ratios are per window, summed over each log period (`log_every` steps, so every group "
        "holds one log step) where a run has enough periods (gpt_tiny), then the median; the JSON also has the "
        "mean over all windows and `overhead_ms_per_step_of_fastest_rounds`. DDP reads "
        "`train/tokens_per_s` from metrics.jsonl, first window left out. Start-up is the wall time from launching "
        "`python -m trainer` (log_every=1) until metrics.jsonl gets its first line; the plain script builds the same "
        "model and optimizer and takes one step (building any `torch.optim` optimizer imports `torch._dynamo`).",
        "",
        *busy_warning(res),
        "```json",
        compact_json(res),
        "```",
        "",
        *kept_curve(path),
    ]
    path.write_text("\n".join(lines))


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


def compact_json(obj: Any) -> str:
    """Indented JSON with floats to 6 significant digits and lists of numbers on one line."""

    def rounded(o):
        if isinstance(o, float):
            return float(f"{o:.6g}")
        if isinstance(o, dict):
            return {k: rounded(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [rounded(v) for v in o]
        return o

    text = json.dumps(rounded(obj), indent=1)
    return re.sub(r"\[\s+([-+\d.eE,\s]+?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)


def busy_warning(res: dict) -> list[str]:
    busy = {k: v["other_jobs_cores"] for k, v in res.items() if isinstance(v, dict) and v.get("other_jobs_cores")}
    if not busy or max(busy.values()) < 0.15:
        return []
    worst = ", ".join(f"{k} {v:.2f}" for k, v in busy.items())
    return [f"**The machine was not idle.** Cores kept busy by other processes while each item ran: {worst} "
            f"(of {res['meta']['cores']}). Paired rounds cancel slow drift, not bursts, and DDP, which needs every "
            "core, suffers most. Re-run `make bench` on an idle machine for figures to quote.", ""]


def quick_corpus() -> list[str]:
    """A ~120 KB text file (a few stdlib modules): `data=text` builds in milliseconds."""
    import argparse as _argparse
    import textwrap

    path = Path(tempfile.mkdtemp(prefix="bench-corpus-")) / "corpus.txt"
    path.write_bytes(Path(_argparse.__file__).read_bytes() + Path(textwrap.__file__).read_bytes())
    return ["data=text", f"data.path={path}"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.benchmark", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes and a small text corpus: seconds, not minutes")
    p.add_argument("--out", default="BENCHMARKS.md", help="markdown report to write (default: BENCHMARKS.md)")
    p.add_argument("--only", default=",".join(ITEMS), help=f"comma-separated subset of {','.join(ITEMS)}")
    p.add_argument("--threads", type=int, default=THREADS, help="CPU threads of the in-process items (default: 1)")
    p.add_argument("--curve", metavar="RUN_DIR", help="only (re)write the quality-per-second section from a run dir")
    args = p.parse_args(argv)
    if args.curve:
        out = Path(args.out)
        kept = out.read_text() if out.exists() else "# Benchmarks\n\n"
        kept = kept[: kept.index(CURVE_HEADING)] if CURVE_HEADING in kept else kept
        out.write_text(kept.rstrip("\n") + "\n\n" + "\n".join(curve_section(Path(args.curve))))
        print(f"wrote the quality-per-second section of {out} from {args.curve}")
        return 0
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(only) - set(ITEMS)
    if unknown:
        p.error(f"unknown item(s) {', '.join(sorted(unknown))}; choose from {', '.join(ITEMS)}")
    sizes = QUICK if args.quick else FULL
    set_threads(args.threads)
    data = quick_corpus() if args.quick else []  # full runs use the recipe's own corpus (stdlib)
    start = time.perf_counter()
    res: dict[str, Any] = {"meta": {**meta(args.quick), "sizes": asdict(sizes)}}
    items: dict[str, Callable[[], dict]] = {
        "loop_tiny": lambda: bench_loop([*data, *TINY], sizes.loop_tiny,
                                        {"key": "overhead_ms_per_step", "max": 0.1, "text": "<= 0.1 ms/step"}),
        "loop_default": lambda: bench_loop([*data, *sizes.default_model], sizes.loop_default,
                                           {"key": "throughput_ratio", "min": 0.98, "text": ">= 0.98x"}),
        "bf16_vs_fp32": lambda: bench_precision(sizes, data),
        "ddp": lambda: bench_ddp(sizes, data),
        "checkpoint": lambda: bench_checkpoint(sizes, data),
        "startup": lambda: bench_startup(sizes, data),
    }
    for name in only:
        load = os.getloadavg()[0]
        say(f"{name} (load average {load:.2f})")
        t, others = time.perf_counter(), OtherJobs()
        res[name] = {**items[name](), "load_avg_at_start": load}
        res[name].update(wall_s=time.perf_counter() - t, other_jobs_cores=others.cores())
        say(f"{name} done in {res[name]['wall_s']:.0f} s")
    res["meta"].update(load_avg_end=os.getloadavg()[0], wall_s=time.perf_counter() - start)
    out = Path(args.out)
    write_report(out, res)
    print("\n".join(table(res)))
    say(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
