"""Which part of the Trainer's step costs what over a hand-written loop: each part replaced by the loop's own.

    python -m benchmarks.step_parts [--rounds N] [--steps K] [OVERRIDES ...]   (default: gpt_tiny 4x32 bf16)

The loop bench (benchmarks/loop.py) says how much longer the Trainer's step is than the hand-written loop's;
`profile_steps` counts the operators each makes. This says where the difference is: in each round, K steps of
the hand-written loop (benchmarks/loop.py's PlainLoop), then K steps of `Trainer.fit()` with one part of its
step swapped for what the hand-written loop does in its place, for every part in turn, and once with all of
them swapped. A part whose swap removes the difference is where it was. A diagnostic for a profiling session
(gpu_check.sh runs it on CUDA), not a `make bench` item: the swaps skip what the framework checks (non-finite
norms, accumulation, noise streams), so only the timing of a swapped run means anything.

The parts:
    data       batches cut by the hand-written loop and copied with `.to(device)`, for the Trainer's loader
               (on CUDA: a DataLoader pinning each batch, then non-blocking copies)
    contexts   `rt.micro_step` (the Trainer's accumulation) and the samples' noise stream entered as no-ops
    backward   `loss * scale` backward without the Runtime's checks and the strategy and precision layers
    clip       torch's `clip_grad_norm_` on the parameters, without the Runtime's bookkeeping
    guard      the non-finite guard off (no norm read on the CPU, no latch and found_inf on a GPU)
    step       `optimizer.step()` without the Runtime's owner lookup and the strategy and precision layers
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics

PARTS = ("data", "contexts", "backward", "clip", "guard", "step")


def swaps(trainer, plain, part: str) -> contextlib.ExitStack:
    """The patches that swap `part` (or every part: "all") of `trainer`'s step for the plain loop's, except the
    data, which `Windows` swaps batch by batch."""
    from unittest import mock

    import torch

    from trainer import noise
    from trainer.loop.runtime import Runtime

    stack = contextlib.ExitStack()
    chosen = PARTS if part == "all" else (part,)
    if "contexts" in chosen:
        def micro_step(self, *models, ends_step):
            self.sync_gradients = True
            return contextlib.nullcontext()

        stack.enter_context(mock.patch.object(Runtime, "micro_step", micro_step))  # (the Trainer's accumulation)
        stack.enter_context(mock.patch.object(noise, "for_samples", lambda positions, seed: contextlib.nullcontext()))
    if "backward" in chosen:
        stack.enter_context(mock.patch.object(Runtime, "backward", lambda self, loss, scale=None: (loss * scale).backward()))
    if "clip" in chosen:
        params = [p for p in trainer.model.parameters() if p.requires_grad]
        stack.enter_context(mock.patch.object(
            Runtime, "clip_grad_norm_", lambda self, target, max_norm: torch.nn.utils.clip_grad_norm_(params, max_norm)))
    if "guard" in chosen:
        stack.enter_context(mock.patch.object(trainer.guard, "allows", lambda *a, **k: True))
        stack.enter_context(mock.patch.object(trainer.guard, "skip_on_device", lambda opt: contextlib.nullcontext()))
        stack.enter_context(mock.patch.object(trainer.guard, "record", lambda *a: None))
    if "step" in chosen:
        def step(self, optimizer, scheduler=None, *, zero_grad=True):
            optimizer.step()
            return True

        stack.enter_context(mock.patch.object(Runtime, "step", step))
    return stack


class Windows:
    """The Trainer's loader for the whole measurement (one `fit()` call, so no window pays a call's start): every
    `steps` batches it closes the Trainer's window, runs the plain loop's, and opens the next case's."""

    def __init__(self, trainer, plain, cases: list[str], steps: int):
        self.trainer, self.plain, self.cases, self.steps = trainer, plain, cases, steps
        self.diffs: dict[str, list[float]] = {c: [] for c in cases}
        self.real = self.case = self.watch = self.patches = None
        self.plain_ms = 0.0

    def loader(self, original):
        def batches(sampler, device, seed):
            self.real = iter(original(sampler, device, seed))
            for i in itertools.count():
                if i % self.steps == 0:
                    self.turn(i // self.steps)
                yield self.plain.batch() if self.case in ("data", "all") else next(self.real)
        return batches

    def close(self) -> None:
        """Undo the open window's patches (at its end, or when fit() raised in it)."""
        if self.patches is not None:
            self.patches.close()
            self.patches = None

    def turn(self, window: int) -> None:
        from .harness import Stopwatch

        if self.watch is not None:
            lap = self.watch.lap(self.steps)
            self.close()
            self.diffs[self.case].append(lap.wall * 1e3 - self.plain_ms)
        if window >= len(self.cases):
            self.case = self.watch = None
            return
        self.plain_ms = self.plain.run(self.steps).wall * 1e3
        self.case = self.cases[window]
        self.patches = swaps(self.trainer, self.plain, self.case) if self.case != "as is" else contextlib.ExitStack()
        self.watch = Stopwatch(self.trainer.backend.device)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_parts", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15, help="rounds, each timing every swap once (default: 15)")
    p.add_argument("--steps", type=int, default=40, help="steps a side in each timed window (default: 40)")
    p.add_argument("overrides", nargs="*", help="config overrides (default: the loop bench's gpt_tiny sizes)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps < 2:
        p.error("--rounds must be at least 1 and --steps at least 2 (a window closes at the next window's first batch)")

    import torch

    from .harness import COMMON, TINY, compose, no_checkpoints
    from .loop import beside_plain, fit_steps

    torch.set_num_threads(1)
    overrides = [*COMMON, *(args.overrides or TINY)]
    cases = ("as is", *PARTS, "all")
    # Each round takes every case once, in a rotating order; the first round warms every swap up and is not counted.
    order = [c for r in range(args.rounds + 1) for c in itertools.islice(itertools.cycle(cases), r, r + len(cases))]
    total = (len(order) + 1) * args.steps
    cfg = compose([*overrides, f"trainer.max_steps={total}", "world.threads=1", *no_checkpoints(compose(overrides))])
    if cfg.trainer.grad_accum_steps != 1:
        p.error(f"trainer.grad_accum_steps={cfg.trainer.grad_accum_steps}: the hand-written loop takes one batch a step, "
                "so the Trainer's steps are timed with one micro-batch each; set trainer.grad_accum_steps=1")
    with beside_plain(cfg, "bench-parts-") as (trainer, plain):
        device = trainer.backend.device
        windows = Windows(trainer, plain, order, args.steps)
        trainer.data.loader = windows.loader(trainer.data.loader)
        try:
            fit_steps(trainer, total - 1)
        finally:
            windows.close()
    diffs = {c: windows.diffs[c][1:] for c in cases}  # (the warm-up round left out)

    print(f"{' '.join(args.overrides or TINY)} on {device}: the Trainer's step minus the hand-written loop's, wall "
          f"clock, ms a step (median of {args.rounds} rounds of {args.steps} steps a side; quartiles)")
    for case, v in diffs.items():
        q = statistics.quantiles(v, n=4) if len(v) > 1 else [v[0]] * 3
        label = "as is" if case == "as is" else f"{case} swapped" if case != "all" else "all swapped"
        print(f"  {label:20s} {statistics.median(v):+8.3f}   ({q[0]:+.3f} .. {q[2]:+.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
