"""a. The Trainer's loop against the loop a user writes by hand; b. bf16 against fp32 in that plain loop.

    loop_tiny, loop_default  Trainer.fit() vs a hand-written loop: same model, AdamW groups, batches,
                             clipping, autocast and LR schedule (gpt_tiny, then the lm default, bf16);
                             the plain loop runs in turns between windows of the Trainer's steps
    bf16_vs_fp32             tokens/s of the plain loop on the default lm model in each precision
"""

from __future__ import annotations

import contextlib
import io
import shutil
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from .harness import (
    COMMON,
    TINY,
    Context,
    Item,
    Lap,
    Stopwatch,
    alternate,
    compose,
    judging_clock,
    median,
    met_cell,
    no_checkpoints,
    paired,
)


class PlainLoop:
    """The loop a user writes by hand: the same work as the Trainer's step, nothing else.

    Same model class and init, AdamW with the same decay / no-decay groups, the same batches cut
    from the same dataset, autocast, grad clipping, LR schedule, and `loss.item()` every log_every.
    """

    def __init__(self, cfg, dataset, device, bf16: bool, compile: str | None = None):
        """`compile`: None (eager), "model" (`torch.compile(model)`, the cross-entropy eager) or "loss" (the model
        and the cross-entropy compiled as one function, as nanoGPT's model computes its own loss)."""
        import torch
        import torch.nn.functional as F

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
        backend = cfg.trainer.get("compile_backend", "inductor")
        compiled: dict = {}  # the model last compiled -> its compiled form (compile="model")

        def loss(x, y):
            # self.model as it is now: the DDP baseline wraps it after this (a model captured here would be the bare
            # one, whose backward syncs nothing: that "DDP" loop ran without its all-reduce). Compiled likewise.
            model = self.model
            if compile == "model":
                if compiled.get("of") is not model:
                    compiled.update(of=model, fn=torch.compile(model, backend=backend))
                model = compiled["fn"]
            logits = model(x)
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))

        self.loss = torch.compile(loss, backend=backend) if compile == "loss" else loss

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

        model, opt = self.model, self.opt
        watch = Stopwatch(self.device)
        for _ in range(n):
            x, y = self.batch()
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                loss = self.loss(x, y)
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


# -- a. the Trainer loop vs a plain loop -----------------------------------------------------------
def fit_steps(trainer, n: int) -> Lap:
    """Time per step of `trainer.fit()` continued for `n` more steps (its end-of-run summary line muted)."""
    trainer.cfg.max_steps = trainer.step + n
    with contextlib.redirect_stdout(io.StringIO()):
        watch = Stopwatch(trainer.backend.device)
        trainer.fit()
        return watch.lap(n)


@contextlib.contextmanager
def beside_plain(cfg, prefix: str):
    """(trainer, plain): the Trainer `trainer.build` makes of `cfg` in a scratch run dir (no eval), and the
    hand-written loop over its training set; both torn down, and the run dir removed, after the block. For the
    profiling tools (profile_steps, step_parts)."""
    from trainer import build

    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            trainer = build(cfg, tmp)
        try:
            trainer.data.val = None
            yield trainer, PlainLoop(cfg, trainer.data.train, trainer.backend.device,
                                     cfg.precision._target_.endswith("BF16"))
        finally:
            trainer.loggers.finish({})
            trainer.backend.teardown()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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


def bench_loop(ctx: Context, overrides: list[str], sizes: tuple[int, int, int], target: dict) -> dict:
    windows, steps, warmup = sizes
    base = compose([*COMMON, *overrides])
    cfg = compose([*COMMON, *overrides, f"trainer.max_steps={warmup + (windows + 1) * steps + 1}",
                   f"world.threads={ctx.threads}", *no_checkpoints(base)])

    def measure(trainer) -> tuple[dict, float, Any]:
        data = trainer.data
        data.val = None  # eval is not per-step work
        device = trainer.backend.device
        bf16 = cfg.precision._target_.endswith("BF16")
        plain = PlainLoop(cfg, data.train, device, bf16)
        # An A/A control: a second, identical plain loop. Its "overhead" over the first is pure noise.
        control = PlainLoop(cfg, data.train, device, bf16)
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

        dataset = data.train
        data.train = Interleaved(dataset, steps, turn)
        try:
            fit_steps(trainer, (windows + 1) * steps)  # turns before windows 0..windows; windows are timed
        finally:
            data.train = dataset
        # Window i of the Trainer is paired with the plain turn just before it.
        return {k: v[:windows] for k, v in laps.items()}, fixed, device

    tmp = Path(tempfile.mkdtemp(prefix="bench-loop-"))
    try:
        # The Trainer a run builds (loggers, data, precision, checkpointer ...); what `trainer.train` does
        # around fit() (resume, run_info.json, export) is not per-step work and is left out.
        from trainer import build

        with contextlib.redirect_stdout(io.StringIO()):
            trainer = build(cfg, tmp)
            try:
                t, fixed, device = measure(trainer)
            finally:
                trainer.loggers.finish({})
                trainer.backend.teardown()
        logged = sum(1 for _ in open(tmp / "metrics.jsonl"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    tokens = cfg.data.batch_size * cfg.data.seq_len
    # Judge over whole log periods where there are enough of them (gpt_tiny: 5 windows of 5 steps hold one
    # log step); for the default model a log step is noise next to a step of hundreds of milliseconds.
    per_log = cfg.trainer.log_every // steps if cfg.trainer.log_every % steps == 0 else 1
    group = per_log if windows >= 20 * per_log else 1
    both = {c: paired(t["trainer"], t["plain"], c, group) for c in ("wall", "cpu")}
    clock = judging_clock(device, ctx.threads)
    aa = paired(t["control"], t["plain"], clock, group)
    out = {
        "model": f"GPT n_layer={cfg.model.n_layer} d_model={cfg.model.d_model}",
        "batch": f"{cfg.data.batch_size}x{cfg.data.seq_len}", "precision": "bf16", "threads": ctx.threads,
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


def measure_tiny(ctx: Context, sizes: dict) -> dict:
    return bench_loop(ctx, [*ctx.data, *TINY], sizes["loop_tiny"],
                      {"key": "overhead_ms_per_step", "max": 0.1, "text": "<= 0.1 ms/step"})


def measure_default(ctx: Context, sizes: dict) -> dict:
    return bench_loop(ctx, [*ctx.data, *ctx.default_model], sizes["loop_default"],
                      {"key": "throughput_ratio", "min": 0.98, "text": ">= 0.98x"})


def loop_rows(label: str, r: dict) -> list[str]:
    w = r["wall"]
    return [f"| {label} {r['batch']} bf16, {r['threads']} thread(s), {r['clock']} time | "
            f"{r['trainer_ms_per_step']:.3f} ms/step | {r['plain_ms_per_step']:.3f} ms/step | "
            f"{r['overhead_ms_per_step']:+.3f} ms/step, {r['throughput_ratio']:.3f}x throughput "
            f"(mean {r['overhead_ms_per_step_mean']:+.3f}; "
            f"wall clock: {w['overhead_ms_per_step']:+.3f}, {w['throughput_ratio']:.3f}x; A/A control, "
            f"plain vs plain: {r['control_overhead_ms_per_step']:+.3f}, "
            f"{r['control_throughput_ratio']:.3f}x) | "
            f"{r['target']} | {met_cell(r['met'])} |"]


# -- b. bf16 vs fp32 ---------------------------------------------------------------------------------
def measure_precision(ctx: Context, sizes: dict) -> dict:
    import torch

    from trainer import build_data

    rounds, steps, warmup = sizes["precision"]
    cfg = compose([*COMMON, *ctx.data, *ctx.default_model])
    train_data, _ = build_data(cfg.data)
    device = torch.device("cpu")
    loops = {"bf16": PlainLoop(cfg, train_data, device, bf16=True), "fp32": PlainLoop(cfg, train_data, device, bf16=False)}
    for lp in loops.values():
        lp.run(warmup)
    t = alternate({k: (lambda lp=lp: lp.run(steps)) for k, lp in loops.items()}, rounds)
    tokens = cfg.data.batch_size * cfg.data.seq_len
    clock = judging_clock(device, ctx.threads)
    by_clock = {}
    for c in ("wall", "cpu"):
        bf, fp = [getattr(x, c) for x in t["bf16"]], [getattr(x, c) for x in t["fp32"]]
        by_clock[c] = {"bf16_tokens_per_s": tokens / median(bf), "fp32_tokens_per_s": tokens / median(fp),
                       "ratio": median([f / b for b, f in zip(bf, fp)]),  # bf16 tokens/s over fp32 tokens/s
                       "per_round_ms": {"bf16": [1000 * x for x in bf], "fp32": [1000 * x for x in fp]}}
    return {"batch": f"{cfg.data.batch_size}x{cfg.data.seq_len}", "threads": torch.get_num_threads(),
            "rounds": rounds, "steps_per_round": steps, "clock": clock, **by_clock[clock], **by_clock}


def precision_rows(r: dict) -> list[str]:
    return [f"| b. bf16 vs fp32, plain loop {r['batch']}, {r['threads']} thread(s), {r['clock']} time | "
            f"bf16 {r['bf16_tokens_per_s']:,.0f} tok/s | fp32 {r['fp32_tokens_per_s']:,.0f} tok/s | "
            f"{r['ratio']:.2f}x | — | — |"]


# Sizes: (rounds, steps per round, warm-up steps); for the loop items a round is one window of Trainer
# steps with the plain loops' turn just before it.
LOOP_TINY = Item(measure_tiny, partial(loop_rows, "a. loop overhead, gpt_tiny"),
                 full={"loop_tiny": (600, 5, 100)}, quick={"loop_tiny": (3, 5, 3)})
LOOP_DEFAULT = Item(measure_default, partial(loop_rows, "a. loop overhead, gpt_small"),
                    full={"loop_default": (20, 1, 2)}, quick={"loop_default": (2, 2, 1)})
BF16_VS_FP32 = Item(measure_precision, precision_rows, full={"precision": (4, 3, 1)}, quick={"precision": (2, 3, 1)})
