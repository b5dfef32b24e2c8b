"""m. Pipeline parallelism: `python -m trainer world=ddp world.nproc_per_node=2 world.pp=2` (two stages of the
lm model, 1F1B over 2 microbatches) against a hand-written `torch.distributed.pipelining` loop on the same
model, with the bubble each schedule leaves and the bytes each stage holds.

The hand-written loop is what a user writes from torch's pipelining tutorial: every rank builds the model
with the same seed and keeps its half (the embedding and the first blocks, or the last blocks, the final norm
and the head), `PipelineStage` and `Schedule1F1B` with a mean cross-entropy per microbatch (the schedule
divides the gradients by the number of microbatches), the tied embedding / head gradient summed between the
two stages, clipping over both stages' norms (the tied weight counted once), AdamW with the same groups,
schedule and autocast. It times log windows on rank 0 as the Trainer times train/tokens_per_s. It runs twice in
each round: the second run against the first (an A/A control) shows how far two runs of the same code spread here.

The bubble of a schedule is measured, not computed: 1 - T1 / (pp x Tpp), where Tpp is the time of a step of
`world.pp=2` under the schedule and T1 a step of one process on one thread (the same total compute, one
core): the share of each stage's time that is not its half of the work (idle time between microbatches,
the hand-offs' cost, and any imbalance between the stages). The textbook bubble of GPipe and 1F1B, (pp - 1)
/ (microbatches + pp - 1), is beside it.
"""

from __future__ import annotations

import json
from pathlib import Path

from .fsdp import (
    AGAIN,
    NPROC,
    cli_overrides,
    cli_window_rates,
    judged,
    judged_cell,
    new_optimizer,
    ratio,
    summarize,
)
from .harness import DEFAULT, Context, Item, Stopwatch, alternate, compose, median, met_cell, say, spawn
from .loop import PlainLoop

SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "ZBVZeroBubble")


def _plain_pp_worker(rank: int, nprocs: int, port: int, out: str, cfg: dict, windows: int, log_every: int,
                     microbatches: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from omegaconf import OmegaConf
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from trainer import build_data

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nprocs)
    try:
        cfg = OmegaConf.create(cfg)
        train_data, _ = build_data(cfg.data)
        loop = PlainLoop(cfg, train_data, torch.device("cpu"), bf16=cfg.precision._target_.endswith("BF16"))
        model, half = loop.model, len(loop.model.blocks) // 2
        first = rank == 0

        class Stage(nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = nn.ModuleList(list(model.blocks)[:half] if first else list(model.blocks)[half:])
                if first:
                    self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
                else:
                    self.ln_f, self.head = model.ln_f, model.head

            def forward(self, x):
                if first:
                    x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1]))
                for block in self.blocks:
                    x = block(x)
                return self.head(self.ln_f(x)) if not first else x

        stage = Stage()
        loop.model = stage
        new_optimizer(loop, cfg)
        tied = stage.tok_emb.weight if first else stage.head.weight  # the same tensor in the whole model

        def loss_fn(logits, y):
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))

        schedule = Schedule1F1B(PipelineStage(stage, rank, nprocs, torch.device("cpu")), microbatches,
                                loss_fn=loss_fn)
        params = list(stage.parameters())

        def step() -> None:
            x, y = loop.batch()  # windows cut from one buffer: contiguous copies, as torch 2.11's stages want
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=loop.bf16):
                if first:
                    schedule.step(x.contiguous())
                else:
                    schedule.step(target=y.contiguous())
            dist.all_reduce(tied.grad)  # the embedding's and the head's gradients: one weight's
            local = [p.grad for p in params if p.grad is not None and (first or p is not tied)]
            square = torch.nn.utils.get_total_norm(local) ** 2
            dist.all_reduce(square)
            coef = torch.clamp(loop.clip / (square.sqrt() + 1e-6), max=1.0)
            torch._foreach_mul_([p.grad for p in params if p.grad is not None], coef)
            loop.opt.step()
            loop.opt.zero_grad(set_to_none=True)
            loop.sched.step()

        def window() -> float:
            watch = Stopwatch(torch.device("cpu"))
            for _ in range(log_every):
                step()
            return watch.lap(log_every).wall

        tokens = loop.batch_size * cfg.data.seq_len
        window()  # warm-up: the CLI's first window is left out too
        rates = [tokens / window() for _ in range(windows)]
        if rank == 0:
            Path(out, "0.json").write_text(json.dumps(rates))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _held_worker(rank: int, nprocs: int, port: int, out: str, overrides: list[str]) -> None:
    """This stage's bytes (parameters, gradients, AdamW state) in the Trainer a pp 2 run builds."""
    import os

    from .fsdp import held_after_first_step

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    Path(out, f"{rank}.json").write_text(json.dumps(held_after_first_step(overrides)))


def failed_as_none(run):
    """`run()`, or None (its error printed) when it fails."""
    try:
        return run()
    except Exception as e:  # noqa: BLE001 - any failure of one schedule's run
        say(f"failed: {e}")
        return None


def measure(ctx: Context, sizes: dict) -> dict:
    from omegaconf import OmegaConf

    rounds, windows, log_every = sizes["pp_rounds"], sizes["pp_windows"], sizes["pp_log_every"]
    base = cli_overrides(ctx, tuple(sizes["pp_model"]), windows, log_every, "cpu")
    cfg = compose(base)
    microbatches = NPROC
    pp = ["world=ddp", f"world.nproc_per_node={NPROC}", f"world.pp={NPROC}"]
    plain_cfg = OmegaConf.to_container(cfg)
    def plain() -> list[float]:
        return spawn(_plain_pp_worker, NPROC, plain_cfg, windows, log_every, microbatches)[0]

    t = alternate({"pp": lambda: cli_window_rates([*base, *pp]), "plain_pp": plain,
                   "single": lambda: cli_window_rates(base), AGAIN: plain}, rounds)
    per_round, fastest = summarize(t)
    vs_plain = ratio(per_round, "pp", "plain_pp")
    # Each schedule once (4 microbatches, so that the looped and V schedules' 4 stages get one each), against
    # one process in the same round.
    # A schedule that fails (ZBVZeroBubble over gloo on torch 2.11) is reported as failed, not the whole item.
    sched = alternate({s: (lambda s=s: failed_as_none(lambda: cli_window_rates(
        [*base, *pp, f"world.pp_schedule={s}", "world.microbatches=4"]))) for s in SCHEDULES}
                      | {"single": lambda: cli_window_rates(base)}, 1)
    single = median(sched["single"][0])
    # 1 - T1 / (pp x Tpp) with T = tokens / rate: 1 - rate_pp / (pp x rate_1).
    bubbles = {s: None if sched[s][0] is None else 1 - median(sched[s][0]) / (NPROC * single) for s in SCHEDULES}
    held = spawn(_held_worker, NPROC, [*base, *pp])
    return {"batch": f"{cfg.data.batch_size}x{cfg.data.seq_len}", "model": sizes["pp_model"][0].split("=")[1],
            "microbatches": microbatches, "pp_tokens_per_s": median(per_round["pp"]),
            "plain_pp_tokens_per_s": median(per_round["plain_pp"]), "single_tokens_per_s": median(per_round["single"]),
            "pp_vs_plain_pp": vs_plain, "pp_vs_single": ratio(per_round, "pp", "single"),
            "pp_vs_plain_pp_fastest_windows": fastest["pp"] / fastest["plain_pp"],
            "pp_vs_plain_pp_judged": judged(per_round, fastest, "pp", "plain_pp"),
            "schedule_tokens_per_s": {s: sched[s][0] and median(sched[s][0]) for s in SCHEDULES}, "schedule_single_tokens_per_s": single,
            "bubble": bubbles, "textbook_bubble_1f1b": (NPROC - 1) / (4 + NPROC - 1),
            "held_bytes_per_stage": held, "per_round_tokens_per_s": per_round, "per_window_tokens_per_s": t,
            "rounds": rounds, "windows": windows, "log_every": log_every, "processes": NPROC,
            "target": ">= 0.97x", "met": bool(vs_plain >= 0.97)}


def rows(r: dict) -> list[str]:
    mib = 1 << 20
    held = r["held_bytes_per_stage"]
    stages = "; ".join(f"stage {i}: {h['total'] / mib:.2f} MiB ({h['params'] / mib:.2f} + {h['grads'] / mib:.2f} + "
                       f"{h['optimizer'] / mib:.2f})" for i, h in enumerate(held))
    bubbles = ", ".join(f"{s} {'failed' if b is None else f'{b:.0%}'}" for s, b in r["bubble"].items())
    return [
        f"| m. pipeline 2 stages (`world=ddp world.pp=2`, 1F1B, {r['microbatches']} microbatches), 2 proc x 1 thread, "
        f"{r['model']} {r['batch']} | {r['pp_tokens_per_s']:,.0f} tok/s | hand-written torch.distributed.pipelining "
        f"1F1B loop {r['plain_pp_tokens_per_s']:,.0f} tok/s | {judged_cell(r['pp_vs_plain_pp'], r['pp_vs_plain_pp_judged'])} "
        f"| {r['target']} | {met_cell(r['met'])} |",
        f"| m. pipeline 2 stages vs one process, {r['model']} {r['batch']} | {r['pp_tokens_per_s']:,.0f} tok/s | "
        f"world=single, 1 proc x 1 thread {r['single_tokens_per_s']:,.0f} tok/s | {r['pp_vs_single']:.2f}x | — | — |",
        f"| m. pipeline bubble by schedule (4 microbatches): 1 - T1 / (2 x Tpp) | {bubbles} | textbook GPipe/1F1B "
        f"(pp-1)/(m+pp-1) = {r['textbook_bubble_1f1b']:.0%} | — | — | — |",
        f"| m. pipeline bytes per stage: params + grads + AdamW state, 2 proc | {stages} | — | — | — | — |",
    ]


PP = Item(measure, rows,
          full={"pp_rounds": 5, "pp_model": DEFAULT, "pp_windows": 6, "pp_log_every": 5},
          quick={"pp_rounds": 1, "pp_model": ["model=gpt_small", "data.batch_size=4", "data.seq_len=32"],
                 "pp_windows": 2, "pp_log_every": 1})
