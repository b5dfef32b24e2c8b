"""f. FSDP at 2 processes: what one rank holds, and what the sharding costs in speed.

    a. bytes of parameters + gradients + AdamW state on one rank under `world=fsdp` vs `world=ddp`,
       counted inside the Trainer the CLI builds, right after its first optimizer step;
    b. `python -m trainer world=fsdp world.nproc_per_node=2` (train/tokens_per_s) vs a hand-written
       FSDP2 loop over the same model, and vs the framework's `world=ddp`, in alternating rounds.

Both sides time log windows of a few steps on rank 0, the first (warm-up) left out; a round's figure is
the median window. The hand-written loop runs twice in each round: the second run against the first (an A/A
control) shows how far two runs of the same code spread on this machine, beside the framework's ratio. The
CLI runs, the hand-written multi-process loop (`plain_parallel_window_rates`), the summary of rounds and the
A/A control are shared with tp.py and pp.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .harness import (
    COMMON,
    DEFAULT,
    TINY,
    Context,
    Item,
    alternate,
    cli_events,
    compose,
    distributed_device,
    free_port,
    median,
    met_cell,
    no_checkpoints,
    spawn,
)
from .loop import PlainLoop, _cosine

NPROC = 2


def cli_overrides(ctx: Context, model: tuple[str, ...], windows: int, log_every: int, device: str) -> list[str]:
    """A CLI run of `windows` + 1 log windows (the first, warm-up, is left out), 1 thread per process."""
    base = [*COMMON, *ctx.data, *model, f"trainer.max_steps={(windows + 1) * log_every}",
            f"trainer.log_every={log_every}", "trainer.eval_every=0", "trainer.eval_samples=4",
            "world.threads=1", f"world.device={device}"]
    return base + no_checkpoints(compose(base))


def cli_window_rates(args: list[str]) -> list[float]:
    """train/tokens_per_s of each log window of a CLI run, the first (warm-up) left out."""
    return [e["train/tokens_per_s"] for e in cli_events(args) if "train/tokens_per_s" in e][1:]


def summarize(t: dict[str, list[list[float]]]) -> tuple[dict[str, list[float]], dict[str, float]]:
    """From each case's window rates per round: its median window per round, and its fastest window of all
    rounds (noise only ever slows a window down, so the fastest are a second estimate on a busy machine)."""
    return ({k: [median(w) for w in rounds] for k, rounds in t.items()},
            {k: max(x for w in rounds for x in w) for k, rounds in t.items()})


def round_ratios(per_round: dict[str, list[float]], a: str, b: str) -> list[float]:
    """a's tokens/s over b's, round by round."""
    return [x / y for x, y in zip(per_round[a], per_round[b])]


def ratio(per_round: dict[str, list[float]], a: str, b: str) -> float:
    """The median over rounds of a's tokens/s over b's in the same round."""
    return median(round_ratios(per_round, a, b))


# The hand-written loop runs a second time in each round under this name: an A/A control. Its ratio to the first
# run is this machine's noise between rounds, the scale on which the framework's ratio can be read.
AGAIN = "plain_again"


def judged(per_round: dict[str, list[float]], fastest: dict[str, float], ours: str, plain: str) -> dict:
    """What a framework-vs-hand-written ratio can be read against: its rounds, its fastest windows' ratio, and
    the A/A control's ratio and rounds."""
    return {"per_round": round_ratios(per_round, ours, plain), "fastest_windows": fastest[ours] / fastest[plain],
            "control": ratio(per_round, AGAIN, plain), "control_per_round": round_ratios(per_round, AGAIN, plain)}


def judged_cell(value: float, j: dict) -> str:
    rounds, control = (", ".join(f"{x:.2f}" for x in j[k]) for k in ("per_round", "control_per_round"))
    return (f"{value:.3f}x (rounds {rounds}; fastest windows: {j['fastest_windows']:.3f}x; A/A control, hand-written "
            f"vs hand-written: {j['control']:.3f}x, rounds {control})")


# -- a. bytes held per rank ----------------------------------------------------------------------------
def held_bytes(model, optimizer) -> dict[str, int]:
    """Bytes this rank holds in parameters, their gradients and the optimizer's state (DTensors: the local
    shard). A tied weight counts once; AdamW's per-parameter `step` counters are included."""
    import torch
    from torch.distributed.tensor import DTensor

    def nbytes(t) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = list(model.parameters())  # deduplicated: a tied weight once
    return {"params": sum(nbytes(p) for p in params),
            "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(nbytes(v) for s in optimizer.state.values() for v in s.values()
                             if isinstance(v, torch.Tensor))}


def _held_bytes_worker(rank: int, nprocs: int, port: int, out: str, runs: list[tuple[str, list[str], int]]) -> None:
    """One rank of each run in turn, started as the launcher starts it (its environment variables)."""
    res = {}
    for name, overrides, run_port in runs:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(run_port))
        res[name] = held_after_first_step(overrides)
    Path(out, f"{rank}.json").write_text(json.dumps(res))


def held_after_first_step(overrides: list[str]) -> dict[str, Any]:
    """The Trainer a CLI run of `overrides` builds on this rank, one step taken; its bytes counted in an
    optimizer post-step hook, where the gradients still exist (the Trainer zeroes them next) and the AdamW
    moments do already."""
    from trainer import build
    from trainer import compose as trainer_compose

    held: dict[str, int] = {}
    tmp = tempfile.mkdtemp(prefix="bench-held-")
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            trainer = build(trainer_compose(overrides), tmp)
            try:
                trainer.optimizer.register_step_post_hook(
                    lambda opt, args, kwargs: held.update(held_bytes(trainer.model, opt)))
                trainer.cfg.max_steps = 1
                trainer.fit()
            finally:
                trainer.loggers.finish({})
                trainer.backend.teardown(wait_for_peers=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {**held, "total": sum(held.values()), "model_class": type(trainer.model).__name__}


def measure_held(overrides: list[str]) -> dict[str, Any]:
    """Per-rank bytes under world=ddp and world=fsdp (2 processes each, one after the other)."""
    runs = [(w, [*overrides, f"world={w}", f"world.nproc_per_node={NPROC}"], free_port()) for w in ("ddp", "fsdp")]
    per_rank = spawn(_held_bytes_worker, NPROC, runs)
    # The rank holding the most (FSDP pads a dimension that does not split evenly on the last ranks).
    worst = {w: max((r[w] for r in per_rank), key=lambda h: h["total"]) for w, _, _ in runs}
    return {"ddp_bytes": worst["ddp"], "fsdp_bytes": worst["fsdp"],
            "bytes_ratio": worst["fsdp"]["total"] / worst["ddp"]["total"],
            "per_rank_bytes": {w: [r[w]["total"] for r in per_rank] for w, _, _ in runs}}


# -- b. throughput: a hand-written multi-process loop ---------------------------------------------------
def new_optimizer(loop: PlainLoop, cfg, **kernels: Any) -> None:
    """PlainLoop's AdamW (decay / no-decay groups) and schedule again, over the model's parameters now that
    fully_shard or parallelize_module has replaced them. `kernels`: fused / foreach where they differ."""
    import torch

    o = cfg.optim
    params = [p for p in loop.model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    kw = {"foreach": o.get("foreach"), "fused": o.get("fused"), **kernels}
    loop.opt = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, **kw)
    warmup, total = cfg.scheduler.get("warmup_steps", 0), cfg.trainer.max_steps
    loop.sched = torch.optim.lr_scheduler.LambdaLR(loop.opt, lambda s: _cosine(s, warmup, total))


def fully_shard_loop(loop: PlainLoop, cfg, mesh) -> int:
    """FSDP2 as its documentation writes it: each Block, then the root (embeddings, tied head, final norm);
    bf16 compute with fp32 gradient reduction, as world=fsdp under precision=bf16. Returns the number of
    data-parallel ranks."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if loop.bf16 \
        else MixedPrecisionPolicy()
    for block in loop.model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(loop.model, mesh=mesh, mp_policy=policy)
    new_optimizer(loop, cfg)
    loop.pos = mesh.get_local_rank() * loop.batch_size  # each rank its own batches
    return mesh.size()


def plain_parallel_window_rates(prepare: Callable[[PlainLoop, Any, Any], int], cfg: dict, windows: int,
                                log_every: int, device: str, nprocs: int = NPROC) -> list[float]:
    """tokens/s of PlainLoop in `nprocs` processes started with torch.multiprocessing (gloo and 1 thread per
    process on the CPU, nccl and one GPU each on CUDA), the model parallelised by `prepare(loop, cfg, mesh)`
    on a 1-D mesh over them: `windows` windows of `log_every` steps after one warm-up window, timed on
    rank 0 as the Trainer times its train/tokens_per_s windows."""
    return spawn(_plain_parallel_worker, nprocs, prepare, cfg, windows, log_every, device)[0]


def _plain_parallel_worker(rank: int, nprocs: int, port: int, out: str, prepare, cfg: dict, windows: int,
                           log_every: int, device_type: str) -> None:
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh

    from trainer import build_data

    cuda = device_type == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=nprocs, device_id=device if cuda else None)
    try:
        cfg = OmegaConf.create(cfg)
        train_data, _ = build_data(cfg.data)
        loop = PlainLoop(cfg, train_data, device, bf16=cfg.precision._target_.endswith("BF16"))
        dp = prepare(loop, cfg, init_device_mesh(device_type, (nprocs,)))
        tokens_per_step = dp * loop.batch_size * cfg.data.seq_len
        loop.run(log_every)  # warm-up: the CLI's first window is left out too
        rates = [tokens_per_step / loop.run(log_every).wall for _ in range(windows)]
        if rank == 0:
            Path(out, "0.json").write_text(json.dumps(rates))
        dist.barrier()
    finally:
        dist.destroy_process_group()


# -- the item ----------------------------------------------------------------------------------------------
def measure(ctx: Context, sizes: dict) -> dict:
    from omegaconf import OmegaConf

    rounds, model = sizes["fsdp_rounds"], sizes["fsdp_model"]
    windows, log_every = sizes["fsdp_windows"], sizes["fsdp_log_every"]
    device = distributed_device(NPROC)
    base = cli_overrides(ctx, model, windows, log_every, device)
    held = measure_held(base)
    cfg = compose(base)
    plain_cfg = OmegaConf.to_container(cfg)
    world = [f"world.nproc_per_node={NPROC}"]
    def plain() -> list[float]:
        return plain_parallel_window_rates(fully_shard_loop, plain_cfg, windows, log_every, device)

    t = alternate({"fsdp": lambda: cli_window_rates([*base, "world=fsdp", *world]), "plain_fsdp": plain,
                   "ddp": lambda: cli_window_rates([*base, "world=ddp", *world]), AGAIN: plain}, rounds)
    per_round, fastest = summarize(t)
    vs_plain = ratio(per_round, "fsdp", "plain_fsdp")
    return {
        "model": model[0].split("=")[1], "batch_per_process": f"{cfg.data.batch_size}x{cfg.data.seq_len}",
        "device": device, "processes": NPROC, "threads_per_process": 1, "precision": "bf16",
        "windows": windows, "log_every": log_every, "rounds": rounds,
        **held, "bytes_target": "<= 0.55x", "bytes_met": bool(held["bytes_ratio"] <= 0.55),
        "fsdp_tokens_per_s": median(per_round["fsdp"]), "plain_fsdp_tokens_per_s": median(per_round["plain_fsdp"]),
        "ddp_tokens_per_s": median(per_round["ddp"]), "fsdp_vs_plain_fsdp": vs_plain,
        "fsdp_vs_ddp": ratio(per_round, "fsdp", "ddp"),
        "fastest_window_tokens_per_s": fastest,
        "fsdp_vs_plain_fsdp_fastest_windows": fastest["fsdp"] / fastest["plain_fsdp"],
        "fsdp_vs_plain_fsdp_judged": judged(per_round, fastest, "fsdp", "plain_fsdp"),
        "per_round_tokens_per_s": per_round, "per_window_tokens_per_s": t,
        "throughput_target": ">= 0.97x", "throughput_met": bool(vs_plain >= 0.97),
        "target": "bytes <= 0.55x of ddp; tokens/s >= 0.97x of the hand-written FSDP2 loop",
        "met": bool(held["bytes_ratio"] <= 0.55 and vs_plain >= 0.97),
    }


def rows(r: dict) -> list[str]:
    mib = 2**20
    f, d = r["fsdp_bytes"], r["ddp_bytes"]
    where = f"{r['processes']} proc x {r['threads_per_process']} thread" if r["device"] == "cpu" \
        else f"{r['processes']} GPUs"
    return [f"| f. FSDP bytes per rank: params + grads + AdamW state, {r['model']}, {r['processes']} proc | "
            f"{f['total'] / mib:.2f} MiB ({f['params'] / mib:.2f} + {f['grads'] / mib:.2f} + "
            f"{f['optimizer'] / mib:.2f}) | world=ddp {d['total'] / mib:.2f} MiB | {r['bytes_ratio']:.3f}x | "
            f"{r['bytes_target']} | {met_cell(r['bytes_met'])} |",
            f"| f. FSDP (`world=fsdp`), {where}, {r['model']} {r['batch_per_process']}/proc | "
            f"{r['fsdp_tokens_per_s']:,.0f} tok/s | hand-written fully_shard loop "
            f"{r['plain_fsdp_tokens_per_s']:,.0f} tok/s | "
            f"{judged_cell(r['fsdp_vs_plain_fsdp'], r['fsdp_vs_plain_fsdp_judged'])} | "
            f"{r['throughput_target']} | {met_cell(r['throughput_met'])} |",
            f"| f. FSDP vs the framework's DDP, same processes and batches | {r['fsdp_tokens_per_s']:,.0f} tok/s | "
            f"world=ddp {r['ddp_tokens_per_s']:,.0f} tok/s | {r['fsdp_vs_ddp']:.3f}x | — | — |"]


# Sizes: rounds (each runs the four cases once), the model and batch, timed log windows per run, log_every.
FSDP = Item(measure, rows,
            full={"fsdp_rounds": 3, "fsdp_model": tuple(DEFAULT), "fsdp_windows": 6, "fsdp_log_every": 3},
            quick={"fsdp_rounds": 1, "fsdp_model": tuple(TINY), "fsdp_windows": 2, "fsdp_log_every": 1})
