"""The batch's way to the GPU: what it costs the host, and the Trainer's loop overhead on CUDA with each way.

    python -m benchmarks.h2d [--windows N]          (CUDA only; gpu_check.sh runs it)

On CUDA a model as small as gpt_tiny is launch-bound: a step takes as long as the host takes to issue it, so any
host work the hand-written loop does not do shows up whole in the loop bench (BENCHMARKS.md, GPU: +0.4 to +0.5 ms
a step, where the same bench on a CPU shows +0.06). The one part of the Trainer's step that only CUDA runs is the
batch's way to the GPU: pinned in the main process, then a non-blocking copy.

1. Host time of one batch's copy, per way and size (median of 200): pinned then copied without blocking; pageable
   copied without blocking; pageable copied blocking (the hand-written loop's `x.to(device)`). Each with the GPU
   idle, and behind ~5 ms of queued work: a way that waits for the stream takes those milliseconds.
2. The loop bench's gpt_tiny row (benchmarks/loop.py) once per way of the Trainer's loader (no workers), in one
   process: a DataLoader with pin_memory=True (the loader until the third GPU run), batches cut in the process and
   pinned (trainer/data/sampling.py's, as it is), and cut in the process and left pageable.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time


def copy_costs(reps: int = 200) -> list[str]:
    import torch

    dev = torch.device("cuda")
    sizes = {"gpt_tiny 4x33 (1 KiB)": (4, 33), "gpt_small 8x257 (16 KiB)": (8, 257),
             "GPT-2 32x1025 (256 KiB)": (32, 1025), "images 64x3x224x224 fp32 (37 MiB)": (64, 3, 224, 224)}
    ways = {"pinned, non_blocking": lambda t: t.pin_memory().to(dev, non_blocking=True),
            "pageable, non_blocking": lambda t: t.to(dev, non_blocking=True),
            "pageable, blocking": lambda t: t.to(dev)}
    khz = getattr(torch.cuda.get_device_properties(0), "clock_rate", 1_980_000)  # (an H100 SXM: 1,980 MHz)
    cycles = int(5e-3 * khz * 1e3)  # ~5 ms of the GPU's clock
    lines = [f"host time of one batch's copy to the GPU, median of {reps}, us (idle GPU / behind ~5 ms of queued "
             "work):"]
    for label, shape in sizes.items():
        base = torch.randn(shape) if len(shape) > 2 else torch.randint(0, 50000, shape)
        cells = []
        for way, copy in ways.items():
            out = []
            for busy in (False, True):
                times = []
                for _ in range(reps):
                    t = base.clone()  # a fresh batch, as a collate makes one
                    torch.cuda.synchronize()
                    if busy:
                        torch.cuda._sleep(cycles)
                    s = time.perf_counter()
                    copy(t)
                    times.append(time.perf_counter() - s)
                    torch.cuda.synchronize()
                out.append(statistics.median(times) * 1e6)
            cells.append(f"{way} {out[0]:,.0f} / {out[1]:,.0f}")
        lines.append(f"  {label:36s} " + "; ".join(cells))
    return lines


WAYS = ("a DataLoader, pinned", "in-process, pinned (as is)", "in-process, pageable")


@contextlib.contextmanager
def loader_way(way: str):
    """The Trainer's training loader replaced for the block (the loop bench builds it inside fit())."""
    from trainer.data import sampling

    original = sampling.train_loader

    def patched(dataset, sampler, num_workers, device, seed, resume=None):
        if way == WAYS[0]:
            from torch.utils.data import DataLoader

            return DataLoader(dataset, batch_sampler=sampler, collate_fn=sampling._collate_fn(dataset), pin_memory=True)
        return sampling.in_process_batches(dataset, sampler)

    if way != WAYS[1]:
        sampling.train_loader = patched
    try:
        yield
    finally:
        sampling.train_loader = original


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.h2d", description=__doc__.split("\n\n")[0])
    p.add_argument("--windows", type=int, default=250, help="the loop bench's windows of 5 steps (default: 250)")
    p.add_argument("--ways", default="0,1,2", help="which of the loader's ways part 2 runs, by index (default: all)")
    p.add_argument("--no-copies", action="store_true", help="leave part 1 (the copies' host time) out")
    args = p.parse_args(argv)

    import torch

    from .harness import TINY, Context
    from .loop import bench_loop

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.h2d measures copies to a GPU: no CUDA device here")
    torch.set_num_threads(1)
    if not args.no_copies:
        print("\n".join(copy_costs()), flush=True)
    ctx = Context(quick=False, data=(), threads=1, default_model=())
    print(f"the loop bench's gpt_tiny row ({args.windows} windows of 5 steps), per way of the Trainer's loader:")
    for way in (WAYS[int(i)] for i in args.ways.split(",")):
        with loader_way(way):
            r = bench_loop(ctx, list(TINY), (args.windows, 5, 100), {"key": "overhead_ms_per_step", "max": 0.1,
                                                                   "text": "<= 0.1 ms/step"})
        print(f"  {way:28s} Trainer {r['trainer_ms_per_step']:.3f} ms/step, plain {r['plain_ms_per_step']:.3f}: "
              f"{r['overhead_ms_per_step']:+.3f} ms ({r['throughput_ratio']:.3f}x; A/A control "
              f"{r['control_overhead_ms_per_step']:+.3f}, clock {r['clock']})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
