"""GPT-2 124M's training step on a GPU: where torch.compile's boundary goes, and the Trainer beside the best.

    python -m benchmarks.gpt2 [--steps K] [--rounds N] [OVERRIDES ...]     (default: GPT-2 124M's shape, bf16)

In one process, in turns (K steps each, N rounds): the hand-written loop (benchmarks/loop.py's PlainLoop) with
`torch.compile(model)` and the cross-entropy eager, the same loop with the model and the cross-entropy compiled as
one function (nanoGPT's model computes its own loss), and `Trainer.fit()` with `trainer.compile=true`. Prints
each one's median ms a step, tokens/s and MFU (against `trainer.peak_tflops`, else the GPU's dense bf16 peak that
trainer/loop/metrics.py knows). For the MFU rows of BENCHMARKS.md's GPU section (gpu_check.sh runs it); not a `make
bench` item, since a CPU compiles this model for minutes.
"""

from __future__ import annotations

import argparse
import statistics

# GPT-2 124M: 12 x 768, GPT-2's vocabulary padded to 50304, 1024 tokens, batch 32 (as in gpu_check.sh).
GPT2 = ["model=gpt_medium", "model.vocab_size=50304", "data.seq_len=1024", "data.batch_size=32", "optim.lr=6e-4",
        "trainer.log_every=10"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpt2", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="steps a turn (default: 10)")
    p.add_argument("--rounds", type=int, default=5, help="turns of each (default: 5)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each first: compilation (default: 3)")
    p.add_argument("overrides", nargs="*", help="config overrides after GPT-2's (default: none)")
    args = p.parse_args(argv)

    import torch

    from .harness import COMMON, alternate, compose, no_checkpoints
    from .loop import PlainLoop, beside_plain, fit_steps

    overrides = [*COMMON, *GPT2, *args.overrides, "trainer.compile=true"]
    total = (args.warmup + args.steps * args.rounds) + 2
    cfg = compose([*overrides, f"trainer.max_steps={total}", *no_checkpoints(compose(overrides))])
    with beside_plain(cfg, "bench-gpt2-") as (trainer, _):
        device, bf16 = trainer.backend.device, cfg.precision._target_.endswith("BF16")
        tokens = cfg.data.batch_size * cfg.data.seq_len
        flops = trainer.cost.flops_per_target
        peak = (trainer.cost.peak_tflops or 0) * 1e12
        sides = {"plain, model compiled": PlainLoop(cfg, trainer.data.train, device, bf16, compile="model").run,
                 "plain, model and loss compiled": PlainLoop(cfg, trainer.data.train, device, bf16, compile="loss").run,
                 "Trainer, trainer.compile=true": lambda n: fit_steps(trainer, n)}
        for run in sides.values():
            run(args.warmup)
        laps = alternate({name: (lambda run=run: run(args.steps).wall) for name, run in sides.items()}, args.rounds)
        memory = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")

    name = torch.cuda.get_device_name(0) if device.type == "cuda" else str(device)
    print(f"{' '.join(GPT2 + args.overrides)} on {name}; {args.rounds} turns of {args.steps} steps, medians:")
    for label, walls in laps.items():
        s = statistics.median(walls)
        mfu = f"{tokens / s * flops / peak:6.1%}" if flops and peak else "   n/a"
        print(f"  {label:32s} {1000 * s:8.2f} ms/step {tokens / s:>11,.0f} tokens/s  MFU {mfu}  "
              f"(turns: {', '.join(f'{1000 * w:.1f}' for w in walls)})")
    print(f"  peak memory allocated in the process: {memory:.1f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
