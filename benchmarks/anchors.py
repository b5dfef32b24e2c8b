"""j. The anchors themselves: the same training loop written on trainer.Runtime, on Accelerate's Accelerator and on
Lightning Fabric, beside the hand-written PyTorch loop, on one process, 2 DDP processes and 2 FSDP processes.

Every side runs the same steps: the lm model of the run (gpt_tiny quick, gpt_small full), AdamW with the
decay / no-decay groups and the optim config's `fused`, the same batches (each rank its own), fp32 (the CPUs
this runs on compute bf16 natively or not: fp32 is the same work everywhere), cross-entropy, clipping to
trainer.grad_clip, the LR schedule, zero_grad. What each framework adds is its own step machinery:

    plain       model(x); loss.backward(); clip_grad_norm_; opt.step(); sched.step(); opt.zero_grad()
                (DDP: DistributedDataParallel; FSDP: fully_shard on each Block, then the root)
    runtime     rt.setup(model, opt); rt.backward(loss); rt.clip_grad_norm_(model, c); rt.step(opt, sched)
    accelerate  accelerator.prepare(model, opt); accelerator.backward(loss); accelerator.clip_grad_norm_(...);
                opt.step(); sched.step(); opt.zero_grad()  (FSDP: its FSDP2 plugin, Block as the layer to wrap)
    fabric      fabric.setup(model, opt); fabric.backward(loss); fabric.clip_gradients(...); opt.step(); ...
                (strategy="ddp" / "fsdp" with Block as the auto-wrap policy)

Processes are started alike for every side (torch.multiprocessing, gloo, 1 thread each, the rendezvous in the
environment as torchrun sets it); rank 0 times `steps` steps after `warmup`, between barriers. The sides take
turns in alternating rounds; the table has medians and per-round ratios. Accelerate and Lightning are
benchmark-only dependencies (`pip install -e '.[bench]'`); without them their columns say so.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from .harness import COMMON, DEFAULT, TINY, Context, Item, alternate, compose, median, spawn

SIDES = ("plain", "runtime", "accelerate", "fabric")
WORLDS = {"single": 1, "ddp": 2, "fsdp": 2}


def available(side: str) -> bool:
    import importlib.util

    return side in ("plain", "runtime") or importlib.util.find_spec(
        {"accelerate": "accelerate", "fabric": "lightning"}[side]) is not None


def measure(ctx: Context, sizes: dict) -> dict:
    import torch
    from omegaconf import OmegaConf

    cfg = compose([*COMMON, *ctx.data, *sizes["anchors_model"], "precision=fp32"])
    plain_cfg = OmegaConf.to_container(cfg, resolve=True)
    out: dict = {"model": sizes["anchors_model"][0].split("=")[1],
                 "batch_per_process": f"{cfg.data.batch_size}x{cfg.data.seq_len}", "rounds": sizes["anchors_rounds"],
                 "steps": sizes["anchors_steps"], "missing": [s for s in SIDES if not available(s)], "worlds": {}}
    # With a GPU, the one-process row runs on it, with ten times the steps (a step takes milliseconds there); the
    # multi-process rows are the CPU machine's (NCCL cannot put two ranks on one GPU, and gloo on a GPU host's CPUs
    # says nothing new), so they are left out.
    cuda = torch.cuda.is_available()
    out["device"] = torch.cuda.get_device_name(0) if cuda else "cpu"
    warmup, steps = (10 * sizes["anchors_warmup"], 10 * sizes["anchors_steps"]) if cuda else \
        (sizes["anchors_warmup"], sizes["anchors_steps"])
    out["warmup"], out["steps"] = warmup, steps
    for world, nprocs in WORLDS.items():
        if cuda and nprocs > 1:
            continue
        cases = {side: _case(side, world, nprocs, plain_cfg, warmup, steps) for side in SIDES if available(side)}
        t = alternate(cases, sizes["anchors_rounds"])
        rates = {side: [r for r in runs if isinstance(r, float)] for side, runs in t.items()}
        r: dict = {"tokens_per_s": {s: median(v) for s, v in rates.items() if v},
                   "failed": {s: next((e for e in t[s] if isinstance(e, str)), None) for s in t if not rates[s]}}
        for anchor in ("plain", "accelerate", "fabric"):
            if rates.get(anchor) and rates.get("runtime"):
                r[f"runtime_vs_{anchor}"] = median([a / b for a, b in zip(rates["runtime"], rates[anchor])])
        for anchor in ("accelerate", "fabric"):
            if rates.get(anchor) and rates.get("plain"):
                r[f"{anchor}_vs_plain"] = median([a / b for a, b in zip(rates[anchor], rates["plain"])])
        vs = [r[k] for k in ("runtime_vs_accelerate", "runtime_vs_fabric") if k in r]
        r["met"] = bool(vs) and all(v >= 1.0 for v in vs)
        out["worlds"][world] = r
    out["target"] = ">= 1.0x each anchor"
    return out


def _case(side: str, world: str, nprocs: int, cfg: dict, warmup: int, steps: int):
    def go():
        try:
            results = spawn(_worker, nprocs, side, world, cfg, warmup, steps)
        except Exception as e:  # noqa: BLE001 - an anchor that cannot run this setup here: said in the table
            return f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:160] if str(e).strip() else ''}"
        return results[0] if results else None
    return go


def _worker(rank: int, nprocs: int, port: int, out_dir: str, side: str, world: str, cfg: dict, warmup: int,
            steps: int) -> None:
    import torch
    import torch.nn.functional as F

    from trainer import build_data
    from trainer.recipes.lm.model import GPT

    from .loop import _cosine

    torch.set_num_threads(1)
    cuda = nprocs == 1 and torch.cuda.is_available()  # (measure() runs only this row on a GPU machine)
    device = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # Accelerate's state sets torch's threads to the cores per process when OMP_NUM_THREADS is unset (2 here): every
    # side runs 1 thread, so say so to it as well.
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(nprocs),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nprocs))
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(cfg)
    data, _ = build_data(cfg.data)
    torch.manual_seed(cfg.trainer.seed)
    model = GPT(**{k: v for k, v in cfg.model.items() if k != "_target_"})
    o, clip = cfg.optim, cfg.trainer.grad_clip

    def optimizer(m):
        params = [p for p in m.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2]},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                                 fused=o.get("fused"))

    def schedule(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _cosine(s, 2, warmup + steps))

    step, barrier = _side(side, world, nprocs, model, optimizer, schedule, clip, F, device)
    b = cfg.data.batch_size
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(cfg.trainer.seed)).tolist()
    pos = rank * b

    def batches(n):
        nonlocal pos
        for _ in range(n):
            if pos + b > len(perm):
                pos = rank * b
            x, y = data.__getitems__(perm[pos : pos + b])
            yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            pos += nprocs * b

    for x, y in batches(warmup):
        step(x, y)
    sync()
    barrier()
    t = time.perf_counter()
    for x, y in batches(steps):
        step(x, y)
    sync()
    barrier()
    if rank == 0:
        rate = nprocs * steps * b * cfg.data.seq_len / (time.perf_counter() - t)
        Path(out_dir, "0.json").write_text(json.dumps(rate))


def _side(side, world, nprocs, model, optimizer, schedule, clip, F, device):
    """(step(x, y), barrier()) of one side: the loop as a user of it writes it (on `device`: the CPU, or one GPU
    for the one-process row)."""
    import torch

    cuda = device.type == "cuda"

    def loss_of(m, x, y):
        logits = m(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))

    if side == "plain":
        import torch.distributed as dist

        if nprocs > 1:
            dist.init_process_group("gloo")
            if world == "fsdp":
                from torch.distributed.fsdp import fully_shard

                for block in model.blocks:
                    fully_shard(block)
                fully_shard(model)
            else:
                model = torch.nn.parallel.DistributedDataParallel(model)
        model = model.to(device)
        opt = optimizer(model)
        sched = schedule(opt)

        def step(x, y):
            loss_of(model, x, y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        return step, (dist.barrier if nprocs > 1 else lambda: None)

    if side == "runtime":
        import trainer

        rt = trainer.Runtime(world, "fp32", threads=1, device=device.type)
        model, opt = rt.setup(model, optimizer(model))
        sched = schedule(opt)

        def step(x, y):
            rt.backward(loss_of(model, x, y))
            rt.clip_grad_norm_(model, clip)
            rt.step(opt, sched)
        return step, rt.wait_for_everyone

    if side == "accelerate":
        from accelerate import Accelerator

        kwargs = {}
        if world == "fsdp":
            from accelerate.utils import FullyShardedDataParallelPlugin

            kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(
                fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"])
        acc = Accelerator(cpu=not cuda, mixed_precision="no", **kwargs)
        if world == "fsdp" and nprocs > 1 and acc.state.distributed_type.name != "FSDP":
            # (with cpu=True Accelerate 1.15 prepares DistributedDataParallel and ignores the plugin: no FSDP row)
            raise RuntimeError(f"Accelerate's FSDP plugin does not run on the CPU (it prepared "
                               f"{acc.state.distributed_type.name}, i.e. DDP)")
        if world == "fsdp":
            model = acc.prepare(model)
            opt = acc.prepare(optimizer(model))
        else:
            model, opt = acc.prepare(model, optimizer(model))
        sched = schedule(opt)

        def step(x, y):
            acc.backward(loss_of(model, x, y))
            acc.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        return step, acc.wait_for_everyone

    if side == "fabric":
        import lightning as L

        strategy = "auto"
        if world == "ddp":
            strategy = "ddp"
        elif world == "fsdp":
            from lightning.fabric.strategies import FSDPStrategy

            from trainer.recipes.lm.model import Block

            strategy = FSDPStrategy(auto_wrap_policy={Block})
        fabric = L.Fabric(accelerator=device.type, devices=nprocs, strategy=strategy, precision="32-true")
        fabric.launch()
        if world == "fsdp":
            model = fabric.setup_module(model)
            opt = fabric.setup_optimizers(optimizer(model))
        else:
            model, opt = fabric.setup(model, optimizer(model))
        sched = schedule(opt)

        def step(x, y):
            fabric.backward(loss_of(model, x, y))
            fabric.clip_gradients(model, opt, max_norm=clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        return step, fabric.barrier
    raise ValueError(side)


def rows(r: dict) -> list[str]:
    out = []
    labels = {"single": "1 process" + (f" on {r['device']}" if r.get("device", "cpu") != "cpu" else ""),
              "ddp": "DDP 2 proc x 1 thread", "fsdp": "FSDP 2 proc x 1 thread"}
    for world, w in r["worlds"].items():
        rates = w["tokens_per_s"]
        cells = ", ".join(f"{s} {rates[s]:,.0f}" for s in SIDES if s in rates)
        failed = "; ".join(f"{s} failed ({why})" for s, why in w["failed"].items())
        missing = "; ".join(f"{s} not installed" for s in r["missing"])
        ratios = ", ".join(f"{k.replace('runtime_vs_', 'vs ')} {w[k]:.3f}x" for k in
                           ("runtime_vs_plain", "runtime_vs_accelerate", "runtime_vs_fabric") if k in w)
        anchors = ", ".join(f"{a} {w[f'{a}_vs_plain']:.3f}x plain" for a in ("accelerate", "fabric")
                            if f"{a}_vs_plain" in w)
        note = "; ".join(x for x in (anchors, failed, missing) if x)
        out.append(f"| j. anchors, {labels[world]}, {r['model']} {r['batch_per_process']}/proc, fp32: tok/s {cells} | "
                   f"{rates.get('runtime', float('nan')):,.0f} tok/s (trainer.Runtime) | "
                   f"{rates.get('plain', float('nan')):,.0f} tok/s (plain) | {ratios}{'; ' + note if note else ''} | "
                   f"{r['target']} | {'yes' if w['met'] else '**no**'} |")
    return out


ANCHORS = Item(measure, rows,
               full={"anchors_model": tuple(DEFAULT), "anchors_rounds": 3, "anchors_warmup": 3, "anchors_steps": 15},
               quick={"anchors_model": tuple(TINY), "anchors_rounds": 1, "anchors_warmup": 1, "anchors_steps": 3})
