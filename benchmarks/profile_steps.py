"""What the Trainer's step does that a hand-written loop's does not: both under torch.profiler, op by op.

    python -m benchmarks.profile_steps [--steps N] [OVERRIDES ...]     (default: gpt_tiny 4x32 bf16)

The same model, batches and math as the loop bench (benchmarks/loop.py's PlainLoop beside `Trainer.fit()`). It
prints, per step, each side's wall time, its operator calls, its kernel launches (on CUDA), and the operators
whose calls or self CPU time differ most between the two. On a GPU, where small models are launch-bound, every
extra operator costs a launch and its host time: this is the profile behind the loop rows of BENCHMARKS.md's GPU
section. Not a `make bench` item: it prints a profile, not a figure with a target.
"""

from __future__ import annotations

import argparse
from collections import Counter


def profile(run, steps: int, cuda: bool):
    """(ops per step: name -> (calls, self CPU us), kernel launches per step, device time per step: name -> us) of
    `run(steps)`."""
    import torch
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        run(steps)
    ops, launches, device = {}, 0, {}
    for e in prof.key_averages():
        if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx"):
            launches += e.count
        elif not e.key.startswith(("cuda", "cu", "ProfilerStep")):
            ops[e.key] = (e.count / steps, e.self_cpu_time_total / steps)
        own = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if own:
            device[e.key] = own / steps
    return ops, launches / steps, device


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_steps", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="profiled steps per side (default: 100)")
    p.add_argument("--top", type=int, default=25, help="operators listed (default: 25)")
    p.add_argument("--kernels", type=int, default=0, help="on CUDA: also list the Trainer's N costliest kernels")
    p.add_argument("overrides", nargs="*", help="config overrides (default: the loop bench's gpt_tiny sizes)")
    args = p.parse_args(argv)

    import torch

    from .harness import COMMON, TINY, Stopwatch, compose, no_checkpoints
    from .loop import beside_plain, fit_steps

    torch.set_num_threads(1)
    overrides = [*COMMON, *(args.overrides or TINY)]
    warmup = 20
    cfg = compose([*overrides, f"trainer.max_steps={2 * warmup + 2 * args.steps + 2}", "world.threads=1",
                   *no_checkpoints(compose(overrides))])
    with beside_plain(cfg, "bench-profile-") as (trainer, plain):
        device = trainer.backend.device
        cuda = device.type == "cuda"
        sides = {"trainer": lambda n: fit_steps(trainer, n), "plain": plain.run}
        for run in sides.values():
            run(warmup)
        result = {}
        for name, run in sides.items():
            watch = Stopwatch(device)
            run(args.steps)
            ms = watch.lap(args.steps).wall * 1000
            result[name] = (ms, *profile(run, args.steps, cuda))

    print(f"{' '.join(args.overrides or TINY)} on {device}, {args.steps} steps a side, per step:")
    for name, (ms, ops, launches, _) in result.items():
        calls = sum(c for c, _ in ops.values())
        cpu = sum(t for _, t in ops.values()) / 1000
        print(f"  {name:8s} {ms:8.3f} ms wall (unprofiled), {calls:7.1f} operator calls, {cpu:7.3f} ms self CPU in "
              f"them, {launches:6.1f} kernel launches")
    (_, t_ops, _, t_device), (_, p_ops, _, _) = result["trainer"], result["plain"]
    diff, rare = Counter(), []
    for key in set(t_ops) | set(p_ops):
        if max(t_ops.get(key, (0, 0))[0], p_ops.get(key, (0, 0))[0]) < 0.5:  # not every step: fit()'s own start
            rare.append(key)
            continue
        diff[key] = t_ops.get(key, (0, 0))[1] - p_ops.get(key, (0, 0))[1]
    if rare:
        print(f"\noperators called less than every other step (a fit() call's start, log steps): {', '.join(sorted(rare))}")
    print(f"\nthe {args.top} operators whose self CPU time a step differs most (trainer minus plain):")
    print(f"  {'operator':48s} {'calls t/p':>13s} {'self us t/p':>17s} {'diff us':>8s}")
    for key, d in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:args.top]:
        (tc, tt), (pc, pt) = t_ops.get(key, (0, 0)), p_ops.get(key, (0, 0))
        print(f"  {key[:48]:48s} {tc:6.1f}/{pc:<6.1f} {tt:8.1f}/{pt:<8.1f} {d:+8.1f}")
    calls = {k: t_ops.get(k, (0, 0))[0] - p_ops.get(k, (0, 0))[0] for k in set(t_ops) | set(p_ops)}
    calls = {k: d for k, d in calls.items() if abs(d) >= 0.05}  # each one's extra operator calls (launches on CUDA)
    print(f"\nthe operators called a different number of times a step ({sum(calls.values()):+.1f} calls in all):")
    for key, d in sorted(calls.items(), key=lambda kv: (-abs(kv[1]), kv[0])):
        print(f"  {key[:48]:48s} {t_ops.get(key, (0, 0))[0]:6.1f}/{p_ops.get(key, (0, 0))[0]:<6.1f} {d:+6.1f}")
    if args.kernels and t_device:
        total = sum(t_device.values())
        print(f"\nthe Trainer's {args.kernels} costliest operators and kernels on the device, per step "
              f"({total / 1000:.2f} ms of device time counted a step, nested ones included):")
        for key, us in sorted(t_device.items(), key=lambda kv: -kv[1])[:args.kernels]:
            print(f"  {key[:90]:90s} {us:9.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
