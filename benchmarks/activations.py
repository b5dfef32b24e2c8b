"""h. Activation checkpointing: what `trainer.activation_checkpointing=true` saves in memory and costs in time.

The same CLI run (one process, 1 thread) with and without it, in alternating rounds: its peak memory
(`train/peak_mem_mb` of the last log step: CUDA max allocated, on the CPU the process's peak RSS, which
includes torch's libraries, so the saving shows as a difference in MB more than as a ratio) and its
tokens/s (median log window, the first left out). The batch is larger than the recipe's, so that
activations, which is what checkpointing trades for recomputation, are a visible part of the peak.
"""

from __future__ import annotations

from typing import Any

from .fsdp import cli_overrides, ratio
from .harness import Context, Item, alternate, cli_events, distributed_device, median

AC = "trainer.activation_checkpointing=true"


def run(args: list[str]) -> dict[str, Any]:
    """tokens/s per log window (the first left out) and the peak memory at the end of a CLI run."""
    train = [e for e in cli_events(args) if "train/tokens_per_s" in e]
    return {"tokens_per_s": median([e["train/tokens_per_s"] for e in train[1:]]),
            "peak_mem_mb": train[-1]["train/peak_mem_mb"]}


def measure(ctx: Context, sizes: dict) -> dict:
    device = distributed_device(1)
    model = (*ctx.default_model[:1], *sizes["ac_batch"])
    base = cli_overrides(ctx, model, sizes["ac_windows"], sizes["ac_log_every"], device)
    t = alternate({"ac": lambda: run([*base, AC]), "off": lambda: run(base)}, sizes["ac_rounds"])
    mem = {k: median([x["peak_mem_mb"] for x in v]) for k, v in t.items()}
    speed = {k: [x["tokens_per_s"] for x in v] for k, v in t.items()}
    return {"device": device, "model": model, "rounds": sizes["ac_rounds"],
            "peak_mem_mb": mem, "saved_mb": mem["off"] - mem["ac"], "peak_mem_ratio": mem["ac"] / mem["off"],
            "tokens_per_s": {k: median(v) for k, v in speed.items()}, "speed_ratio": ratio(speed, "ac", "off"),
            "per_round": t}


def rows(r: dict) -> list[str]:
    name, batch, seq = (a.split("=")[1] for a in r["model"])
    what = f"{name} {batch}x{seq}"
    return [f"| h. activation checkpointing, peak memory ({r['device']}, {what}) | {r['peak_mem_mb']['ac']:,.0f} MB | "
            f"without {r['peak_mem_mb']['off']:,.0f} MB | {abs(r['saved_mb']):,.0f} MB {'less' if r['saved_mb'] >= 0 else 'more'} "
            f"({r['peak_mem_ratio']:.2f}x) "
            "| — | — |",
            f"| h. activation checkpointing, speed | {r['tokens_per_s']['ac']:,.0f} tok/s | without "
            f"{r['tokens_per_s']['off']:,.0f} tok/s | {r['speed_ratio']:.2f}x | — | — |"]


# The default model (gpt_small, 8 x 256) on a batch 4x the recipe's; quick: tiny sizes, one round.
ACTIVATIONS = Item(measure, rows,
                   full={"ac_batch": ("data.batch_size=32", "data.seq_len=256"), "ac_rounds": 3,
                         "ac_windows": 3, "ac_log_every": 2},
                   quick={"ac_batch": ("data.batch_size=2", "data.seq_len=32"), "ac_rounds": 1,
                          "ac_windows": 2, "ac_log_every": 1})
