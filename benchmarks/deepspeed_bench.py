"""i. DeepSpeed at 2 processes: what one rank holds under ZeRO-2 and ZeRO-3 next to DDP and FSDP, and what the
framework costs against a plain DeepSpeed script.

    a. bytes one rank holds under `world=deepspeed world.stage=2|3`, counted inside the Trainer the CLI builds, in
       the optimizer's step (its second: the state of every group exists by then): the module's parameters (under
       ZeRO-3 the rank's partition of each), DeepSpeed's fp32 master partition, the gradients alive then (the
       reduced partition the step consumes) and the AdamW state; next to world=ddp and world=fsdp counted as
       fsdp.py counts them;
    b. `python -m trainer world=deepspeed world.stage=2|3` (train/tokens_per_s) vs a plain DeepSpeed script: the
       same model, AdamW groups as the engine's client optimizer, batch shapes, gradient_clipping and schedule
       (the engine steps it), `engine(x)`, `engine.backward(loss)`, `engine.step()`, in alternating rounds.

fp32: DeepSpeed's bf16 keeps 16-bit weights, and the framework adds its autocast over them (the loss in fp32),
which a plain script need not; fp32 compares the engines alone. Needs the deepspeed extra (else one row says so).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .fsdp import NPROC, cli_overrides, cli_window_rates, measure_held, ratio, summarize
from .harness import (
    DEFAULT,
    TINY,
    Context,
    Item,
    alternate,
    compose,
    distributed_device,
    free_port,
    median,
    met_cell,
    spawn,
)
from .loop import PlainLoop

STAGES = (2, 3)


# -- a. bytes held per rank ---------------------------------------------------------------------------------
def ds_held_bytes(strategy) -> dict[str, int]:
    """Bytes of the tensors DeepSpeed keeps on this rank, each storage once: the module's parameters (ZeRO-3: the
    rank's partitions), the fp32 master partitions, the gradients alive now, the optimizer's state."""
    import torch

    engine, seen = strategy.engine, set()

    def nbytes(ts) -> int:
        total = 0
        for t in ts:
            if t is None or not isinstance(t, torch.Tensor) or t.numel() == 0:
                continue
            key = (t.untyped_storage().data_ptr(), t.storage_offset())
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
        return total

    params = [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]
    flats = [f for _, f in strategy._flats()]
    averaged = getattr(engine.optimizer, "averaged_gradients", {}) or {}
    pending = [g for v in averaged.values() if v is not None for g in (v if isinstance(v, list) else [v])]
    state = [v for s in engine.optimizer.optimizer.state.values() for v in s.values()]
    out = {"params": nbytes(params), "master": nbytes(flats)}
    out["grads"] = nbytes([f.grad for f in flats] + pending + [p.grad for p in engine.module.parameters()])
    out["optimizer"] = nbytes(state)
    return out


def _ds_held_worker(rank: int, nprocs: int, port: int, out: str, runs: list[tuple[str, list[str], int]]) -> None:
    res = {}
    for name, overrides, run_port in runs:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(run_port))
        res[name] = _held_in_second_step(overrides)
    Path(out, f"{rank}.json").write_text(json.dumps(res))


def _held_in_second_step(overrides: list[str]) -> dict[str, Any]:
    from trainer import build
    from trainer import compose as trainer_compose

    held: dict[str, int] = {}
    tmp = tempfile.mkdtemp(prefix="bench-ds-held-")
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            trainer = build(trainer_compose(overrides), tmp)
            try:
                def count(opt, args, kwargs) -> None:  # (called per parameter group: the first call of step 2)
                    if trainer.step == 1 and not held:
                        held.update(ds_held_bytes(trainer.strategy))

                trainer.optimizer.register_step_post_hook(count)
                trainer.cfg.max_steps = 2
                trainer.fit()
            finally:
                trainer.loggers.finish({})
                trainer.backend.teardown(wait_for_peers=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {**held, "total": sum(held.values())}


def measure_ds_held(overrides: list[str]) -> dict[str, Any]:
    """The larger rank's bytes per stage; each stage in processes of its own (DeepSpeed keeps its process groups
    in globals, which a second engine in the same process would find torn down)."""
    out = {}
    for s in STAGES:
        run = (f"zero{s}", [*overrides, "world=deepspeed", f"world.stage={s}", f"world.nproc_per_node={NPROC}"],
               free_port())
        out[run[0]] = max((r[run[0]] for r in spawn(_ds_held_worker, NPROC, [run])), key=lambda h: h["total"])
    return out


# -- b. throughput: a plain DeepSpeed script ----------------------------------------------------------------
def _plain_ds_worker(rank: int, nprocs: int, port: int, out: str, cfg: dict, stage: int, windows: int,
                     log_every: int, device_type: str) -> None:
    """The script a DeepSpeed user writes: deepspeed.initialize over the model, its AdamW and schedule, then
    engine(x), engine.backward(loss), engine.step()."""
    import time

    import torch
    import torch.nn.functional as F
    from omegaconf import OmegaConf

    from trainer import build_data

    cuda = device_type == "cuda"
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import warnings

    import deepspeed

    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated", category=FutureWarning)

    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    cfg = OmegaConf.create(cfg)
    train_data, _ = build_data(cfg.data)
    loop = PlainLoop(cfg, train_data, device, bf16=False)
    config = {"train_micro_batch_size_per_gpu": cfg.data.batch_size, "gradient_accumulation_steps": 1,
              "gradient_clipping": cfg.trainer.grad_clip or 0.0, "zero_optimization": {"stage": stage},
              "zero_force_ds_cpu_optimizer": False, "steps_per_print": 2**62}
    with contextlib.redirect_stdout(io.StringIO()):
        engine, _, _, _ = deepspeed.initialize(model=loop.model, optimizer=loop.opt, lr_scheduler=loop.sched,
                                               config=config)
    loop.pos = rank * loop.batch_size

    def run(n: int) -> float:
        t = time.perf_counter()
        for i in range(n):
            x, y = loop.batch()
            logits = engine(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
            engine.backward(loss)
            engine.step()
            if (i + 1) % log_every == 0:
                loss.item()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t

    tokens_per_step = nprocs * loop.batch_size * cfg.data.seq_len
    run(log_every)  # warm-up: the CLI's first window is left out too
    rates = [tokens_per_step * log_every / run(log_every) for _ in range(windows)]
    if rank == 0:
        Path(out, "0.json").write_text(json.dumps(rates))
    deepspeed.comm.barrier()
    import torch.distributed as dist

    dist.destroy_process_group()


def plain_ds_window_rates(cfg: dict, stage: int, windows: int, log_every: int, device: str) -> list[float]:
    return spawn(_plain_ds_worker, NPROC, cfg, stage, windows, log_every, device)[0]


# -- the item ---------------------------------------------------------------------------------------------
def measure(ctx: Context, sizes: dict) -> dict:
    from omegaconf import OmegaConf

    if importlib.util.find_spec("deepspeed") is None:
        return {"skipped": "DeepSpeed is not installed (pip install --no-build-isolation 'trainer[deepspeed]')"}
    rounds, model = sizes["deepspeed_rounds"], sizes["deepspeed_model"]
    windows, log_every = sizes["deepspeed_windows"], sizes["deepspeed_log_every"]
    device = distributed_device(NPROC)
    base = [*cli_overrides(ctx, model, windows, log_every, device), "precision=fp32"]
    held = {**measure_held(base), **measure_ds_held(base)}
    cfg = compose(base)
    plain_cfg = OmegaConf.to_container(cfg)
    world = ["world=deepspeed", f"world.nproc_per_node={NPROC}"]
    cases = {}
    for s in STAGES:
        cases[f"zero{s}"] = lambda s=s: cli_window_rates([*base, *world, f"world.stage={s}"])
        cases[f"plain_zero{s}"] = lambda s=s: plain_ds_window_rates(plain_cfg, s, windows, log_every, device)
    t = alternate(cases, rounds)
    per_round, fastest = summarize(t)
    ddp_total = held["ddp_bytes"]["total"]
    out = {"model": model[0].split("=")[1], "batch_per_process": f"{cfg.data.batch_size}x{cfg.data.seq_len}",
           "device": device, "processes": NPROC, "threads_per_process": 1, "precision": "fp32",
           "windows": windows, "log_every": log_every, "rounds": rounds,
           "ddp_bytes": held["ddp_bytes"], "fsdp_bytes": held["fsdp_bytes"],
           "per_round_tokens_per_s": per_round, "per_window_tokens_per_s": t, "fastest_window_tokens_per_s": fastest,
           "throughput_target": ">= 0.97x", "target": "tokens/s >= 0.97x of a plain DeepSpeed script, each stage"}
    for s in STAGES:
        name = f"zero{s}"
        vs = ratio(per_round, name, f"plain_{name}")
        out.update({f"{name}_bytes": held[name], f"{name}_bytes_vs_ddp": held[name]["total"] / ddp_total,
                    f"{name}_tokens_per_s": median(per_round[name]),
                    f"plain_{name}_tokens_per_s": median(per_round[f"plain_{name}"]), f"{name}_vs_plain": vs,
                    f"{name}_vs_plain_fastest_windows": fastest[name] / fastest[f"plain_{name}"],
                    f"{name}_met": bool(vs >= 0.97)})
    out["met"] = all(out[f"zero{s}_met"] for s in STAGES)
    return out


def rows(r: dict) -> list[str]:
    if "skipped" in r:
        return [f"| i. DeepSpeed (`world=deepspeed`) | skipped: {r['skipped']} | — | — | — | — |"]
    mib = 2**20
    d, f = r["ddp_bytes"]["total"], r["fsdp_bytes"]["total"]
    where = f"{r['processes']} proc x {r['threads_per_process']} thread" if r["device"] == "cpu" \
        else f"{r['processes']} GPUs"
    out = []
    for s in STAGES:
        b = r[f"zero{s}_bytes"]
        out.append(f"| i. DeepSpeed ZeRO-{s} bytes per rank: params + fp32 master + grads + AdamW state, {r['model']}, "
                   f"{r['processes']} proc | {b['total'] / mib:.2f} MiB ({b['params'] / mib:.2f} + "
                   f"{b['master'] / mib:.2f} + {b['grads'] / mib:.2f} + {b['optimizer'] / mib:.2f}) | world=ddp "
                   f"{d / mib:.2f} MiB, world=fsdp {f / mib:.2f} MiB | {r[f'zero{s}_bytes_vs_ddp']:.3f}x of ddp | — "
                   "| — |")
    for s in STAGES:
        n = f"zero{s}"
        out.append(f"| i. DeepSpeed ZeRO-{s} (`world=deepspeed world.stage={s}`), {where}, {r['model']} "
                   f"{r['batch_per_process']}/proc {r['precision']} | {r[f'{n}_tokens_per_s']:,.0f} tok/s | plain "
                   f"DeepSpeed script {r[f'plain_{n}_tokens_per_s']:,.0f} tok/s | {r[f'{n}_vs_plain']:.3f}x (fastest "
                   f"windows: {r[f'{n}_vs_plain_fastest_windows']:.3f}x) | {r['throughput_target']} | "
                   f"{met_cell(r[f'{n}_met'])} |")
    return out


# Sizes: rounds (each runs every case once), the model and batch, timed log windows per run, log_every.
DEEPSPEED = Item(measure, rows,
                 full={"deepspeed_rounds": 3, "deepspeed_model": tuple(DEFAULT), "deepspeed_windows": 6,
                       "deepspeed_log_every": 3},
                 quick={"deepspeed_rounds": 1, "deepspeed_model": tuple(TINY), "deepspeed_windows": 2,
                        "deepspeed_log_every": 1})
