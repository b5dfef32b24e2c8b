"""c. DDP through the real CLI: `python -m trainer world=ddp` 2 processes x 1 thread vs 1 x 1
(train/tokens_per_s), and the same pair for a hand-written DDP loop (what the machine allows)."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from .harness import (
    COMMON,
    DEFAULT,
    TINY,
    Context,
    Item,
    alternate,
    cli_events,
    compose,
    median,
    met_cell,
    no_checkpoints,
)
from .loop import PlainLoop


def cli_tokens_per_s(args: list[str]) -> tuple[float, int]:
    """Median train/tokens_per_s of a CLI run, the first log window (warm-up) left out."""
    rates = [e["train/tokens_per_s"] for e in cli_events(args) if "train/tokens_per_s" in e][1:]
    return median(rates), len(rates)


def measure(ctx: Context, sizes: dict) -> dict:
    from omegaconf import OmegaConf

    rounds, model, steps, log_every = sizes["ddp_rounds"], sizes["ddp_model"], sizes["ddp_steps"], sizes["ddp_log_every"]
    base = [*COMMON, *ctx.data, *model, f"trainer.max_steps={steps}", f"trainer.log_every={log_every}",
            "trainer.eval_every=0", "trainer.eval_samples=4", "world.threads=1"]
    base += no_checkpoints(compose(base))
    windows: dict[str, int] = {}

    def run(kind: str, extra: list[str]) -> Callable[[], float]:
        def go() -> float:
            rate, n = cli_tokens_per_s([*base, *extra])
            windows[kind] = n
            return rate
        return go

    cfg = compose(base)
    plain_cfg = OmegaConf.to_container(cfg)
    warmup, timed = log_every, steps - log_every
    t = alternate({"single": run("single", []), "ddp": run("ddp", ["world=ddp", "world.nproc_per_node=2"]),
                   "plain_single": lambda: plain_ddp_tokens_per_s(1, plain_cfg, warmup, timed),
                   "plain_ddp": lambda: plain_ddp_tokens_per_s(2, plain_cfg, warmup, timed)},
                  rounds)
    ratio = median([d / s for s, d in zip(t["single"], t["ddp"])])
    plain_ratio = median([d / s for s, d in zip(t["plain_single"], t["plain_ddp"])])
    return {
        "model": model[0].split("=")[1], "batch_per_process": f"{cfg.data.batch_size}x{cfg.data.seq_len}",
        "steps": steps, "log_every": log_every, "rounds": rounds,
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

    from trainer import build_data

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


def rows(r: dict) -> list[str]:
    return [f"| c. DDP 2 proc x 1 thread vs 1 x 1, {r['model']} {r['batch_per_process']}/proc | "
            f"{r['ddp_tokens_per_s']:,.0f} tok/s | {r['single_tokens_per_s']:,.0f} tok/s (1 proc) | "
            f"{r['ratio']:.2f}x | {r['target']} | {met_cell(r['met'])} |",
            f"| c. the same scaling for a hand-written DDP loop (this machine's ceiling) | "
            f"{r['plain_ddp_tokens_per_s']:,.0f} tok/s | {r['plain_single_tokens_per_s']:,.0f} tok/s (1 proc) | "
            f"{r['plain_ratio']:.2f}x; framework DDP at {r['ddp_vs_plain_ddp']:.2f}x the plain DDP loop's "
            f"tokens/s | — | — |"]


DDP = Item(measure, rows,
           full={"ddp_rounds": 3, "ddp_model": tuple(DEFAULT), "ddp_steps": 12, "ddp_log_every": 3},
           quick={"ddp_rounds": 1, "ddp_model": tuple(TINY), "ddp_steps": 3, "ddp_log_every": 1})
