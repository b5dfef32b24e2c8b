"""g. Tensor parallelism: `python -m trainer world=ddp world.nproc_per_node=2 world.tp=2` (one data-parallel
rank, the model split over 2) against a hand-written tensor-parallel loop, and against one process.

On the CPU (gloo, 1 thread per process) it runs the default lm model; where there is a GPU per process,
on CUDA (nccl: the framework picks it, and so does the hand-written loop), the default and the medium
model. On 2 CPU cores tensor parallelism does not pay off: the figure against one process says what it costs.
"""

from __future__ import annotations

from typing import Any

from .fsdp import (
    AGAIN,
    NPROC,
    cli_overrides,
    cli_window_rates,
    judged,
    judged_cell,
    new_optimizer,
    plain_parallel_window_rates,
    ratio,
    summarize,
)
from .harness import DEFAULT, TINY, Context, Item, alternate, compose, distributed_device, median, met_cell
from .loop import PlainLoop

MEDIUM = ["model=gpt_medium", "data.batch_size=8", "data.seq_len=1024"]  # GPU only: 12 x 768, ~85M parameters


def tensor_parallel_loop(loop: PlainLoop, cfg, mesh) -> int:
    """The model's own `_tp_plan` applied with torch's parallelize_module on a 1-D mesh. Returns the number
    of data-parallel ranks: 1, both ranks see the same batches."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(loop.model, mesh, {k: styles[v]() for k, v in type(loop.model)._tp_plan.items()})
    # The layers the plan splits hold DTensor shards, the rest (embeddings, norms) plain tensors: torch's
    # fused and foreach AdamW kernels refuse the mix, so the per-parameter loop, as the framework falls back to.
    new_optimizer(loop, cfg, fused=False, foreach=False)
    if loop.clip is not None:
        # torch's clip_grad_norm_ refuses the mix too: clip by hand, right before each step.
        params, max_norm, loop.clip = list(loop.model.parameters()), loop.clip, None
        loop.opt.register_step_pre_hook(lambda opt, args, kwargs: clip_mixed_(params, max_norm))
    return 1


def clip_mixed_(params: list, max_norm: float) -> None:
    """Clip to `max_norm` the gradients of DTensor and plain parameters together: each kind's norm, combined."""
    import torch
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    shards = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    norms = [torch.nn.utils.get_total_norm(shards).full_tensor(), torch.nn.utils.get_total_norm(plain)]
    coef = torch.clamp(max_norm / (torch.stack(norms).norm() + 1e-6), max=1.0)
    torch._foreach_mul_([g.to_local() for g in shards] + plain, coef)


def measure_model(ctx: Context, model: tuple[str, ...], rounds: int, windows: int, log_every: int,
                  device: str) -> dict[str, Any]:
    from omegaconf import OmegaConf

    base = cli_overrides(ctx, model, windows, log_every, device)
    cfg = compose(base)
    plain_cfg = OmegaConf.to_container(cfg)
    def plain() -> list[float]:
        return plain_parallel_window_rates(tensor_parallel_loop, plain_cfg, windows, log_every, device)

    t = alternate({"tp": lambda: cli_window_rates([*base, "world=ddp", f"world.nproc_per_node={NPROC}",
                                                   f"world.tp={NPROC}"]),
                   "plain_tp": plain, "single": lambda: cli_window_rates(base), AGAIN: plain},
                  rounds)
    per_round, fastest = summarize(t)
    vs_plain = ratio(per_round, "tp", "plain_tp")
    return {"batch": f"{cfg.data.batch_size}x{cfg.data.seq_len}", "tp_tokens_per_s": median(per_round["tp"]),
            "plain_tp_tokens_per_s": median(per_round["plain_tp"]), "single_tokens_per_s": median(per_round["single"]),
            "tp_vs_plain_tp": vs_plain, "tp_vs_single": ratio(per_round, "tp", "single"),
            "fastest_window_tokens_per_s": fastest, "tp_vs_plain_tp_fastest_windows": fastest["tp"] / fastest["plain_tp"],
            "tp_vs_single_fastest_windows": fastest["tp"] / fastest["single"],
            "tp_vs_plain_tp_judged": judged(per_round, fastest, "tp", "plain_tp"),
            "per_round_tokens_per_s": per_round, "per_window_tokens_per_s": t, "met": bool(vs_plain >= 0.97)}


def measure(ctx: Context, sizes: dict) -> dict:
    device = distributed_device(NPROC)
    rounds, windows, log_every = sizes["tp_rounds"], sizes["tp_windows"], sizes["tp_log_every"]
    models = {m[0].split("=")[1]: measure_model(ctx, tuple(m), rounds, windows, log_every, device)
              for m in sizes["tp_models"][device]}
    return {"device": device, "processes": NPROC, "tp": NPROC, "threads_per_process": 1, "precision": "bf16",
            "optimizer": "AdamW fused=False foreach=False on both sides", "windows": windows,
            "log_every": log_every, "rounds": rounds, "models": models,
            "target": ">= 0.97x", "met": all(m["met"] for m in models.values())}


def rows(r: dict) -> list[str]:
    where = f"{r['processes']} proc x {r['threads_per_process']} thread" if r["device"] == "cpu" \
        else f"{r['processes']} GPUs"
    one = "1 proc x 1 thread" if r["device"] == "cpu" else "1 GPU"
    out = []
    for name, m in r["models"].items():
        out += [f"| g. tensor parallel {r['tp']} (`world=ddp world.tp={r['tp']}`), {where}, {name} {m['batch']} | "
                f"{m['tp_tokens_per_s']:,.0f} tok/s | hand-written parallelize_module loop "
                f"{m['plain_tp_tokens_per_s']:,.0f} tok/s | {judged_cell(m['tp_vs_plain_tp'], m['tp_vs_plain_tp_judged'])} | "
                f"{r['target']} | "
                f"{met_cell(m['met'])} |",
                f"| g. tensor parallel {r['tp']} vs one process, {name} {m['batch']} | {m['tp_tokens_per_s']:,.0f} tok/s | "
                f"world=single, {one} {m['single_tokens_per_s']:,.0f} tok/s | {m['tp_vs_single']:.2f}x (fastest "
                f"windows: {m['tp_vs_single_fastest_windows']:.2f}x) | — | — |"]
    return out


# Sizes: rounds (each runs the four cases once), the models by device, timed log windows per run, log_every.
TP = Item(measure, rows,
          full={"tp_rounds": 3, "tp_models": {"cpu": [tuple(DEFAULT)], "cuda": [tuple(DEFAULT), tuple(MEDIUM)]},
                "tp_windows": 6, "tp_log_every": 3},
          quick={"tp_rounds": 1, "tp_models": {"cpu": [tuple(TINY)], "cuda": [tuple(TINY)]},
                 "tp_windows": 2, "tp_log_every": 1})
