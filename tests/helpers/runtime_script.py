"""A script on trainer.Runtime for tests/test_own_loop.py, run by `python -m trainer launch` (or plainly).

    runtime_script.py two OUT [STEPS [SAVE_EVERY]]   a GAN-shaped step: two models, two optimizers, two schedules
    runtime_script.py gather N BATCH                 eval outputs gathered across ranks, each sample once
    runtime_script.py save_on_main_only OUT          rt.save_state under `if rt.is_main_process` (a mistake)
    runtime_script.py backward_outside OUT           rt.backward outside rt.accumulate with accumulation (a mistake)
    runtime_script.py pipeline OUT                   a GPT's step through rt.forward_backward (world.pp or not)
    runtime_script.py pipeline_backward OUT          rt.backward under world.pp (a mistake)
    runtime_script.py pipeline_uneven OUT            batches of 3 under world.pp's 2 microbatches (a mistake)
    runtime_script.py diverge OUT                    rank 0 saves its state while rank 1 exports (a mistake)
    runtime_script.py hang RANK                      two steps, then RANK stops while the others go on (a hang)
    runtime_script.py leave RANK                     two steps, then RANK's script ends (sys.exit) while the others
                                                     go on (a hang)
    runtime_script.py slow_phases SECONDS            a pause before the first step, a step, an eval of forwards
                                                     only, then a step: the pause and the eval each last longer
                                                     than SECONDS
    runtime_script.py single                         Runtime("single"), which launch started on several (a mistake)
    runtime_script.py unused                         a model with a parameter its forward leaves unused, under DDP
                                                     without world.find_unused_parameters (a mistake)
    runtime_script.py teacher                        a frozen teacher set up beside a student (distillation): prints
                                                     each rank's teacher weight sum and the student's after a step
    runtime_script.py rank_shaped                    a model whose width depends on the rank (a mistake)
    runtime_script.py at_exit OUT [fail|exit3]       registers an atexit handler writing OUT/rank{R}.txt, then
                                                     ends (fail: rank 1 raises first; exit3: rank 1 ends with
                                                     sys.exit(3))
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

import trainer


def say(line: str) -> None:
    """One line in one write: the ranks share the launcher's stdout, unbuffered, where print's pieces (the text,
    then the newline) from two ranks interleaved ("good stepped:good stepped: True")."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 4, generator=g) * 0.5 + 1.0, torch.randn(n, 4, generator=g))


def two(rt: trainer.Runtime, out: str, steps: int = 6, save_every: int = 0) -> None:
    torch.manual_seed(rt.seed)
    gen, disc = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)), nn.Sequential(nn.Linear(4, 8), nn.Tanh(),
                                                                                          nn.Linear(8, 1))
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-2, betas=(0.5, 0.9))
    opt_d = torch.optim.SGD(disc.parameters(), lr=5e-2, momentum=0.9)
    sched_g = torch.optim.lr_scheduler.StepLR(opt_g, step_size=2, gamma=0.5)
    gen, disc, opt_g, opt_d = rt.setup(gen, disc, opt_g, opt_d, names=["gen", "disc", "opt_g", "opt_d"])
    rt.register("sched_g", sched_g)
    loader = rt.loader(data(), batch_size=8 // rt.world_size)
    step = rt.load_state(f"{out}/checkpoints") or 0
    while step < steps:
        for real, z in loader:
            # The discriminator's step: real against generated samples, in one forward (DDP wants one per backward).
            opt_d.zero_grad(set_to_none=True)
            with torch.no_grad():
                fake = gen(z)
            scores = disc(torch.cat([real, fake]))
            loss_d = nn.functional.softplus(-scores[: len(real)]).mean() + nn.functional.softplus(scores[len(real):]).mean()
            rt.backward(loss_d)
            rt.clip_grad_norm_(disc, 1.0)
            rt.step(opt_d)
            # The generator's step, through the discriminator (whose gradients from it are dropped above).
            loss_g = nn.functional.softplus(-disc(gen(z))).mean()
            rt.backward(loss_g)
            rt.step(opt_g, sched_g)
            step += 1
            if save_every and step % save_every == 0:
                rt.save_state(f"{out}/checkpoints", step)
            if step == steps:
                break
    rt.save_model(gen, out, name="gen")
    rt.save_model(disc, out, name="disc")
    rt.end()


def gather(rt: trainer.Runtime, n: int, batch: int) -> None:
    """Each eval sample's row is [index, value]: the gathered rows must be every index once, in order."""
    values = torch.linspace(-1, 1, n) ** 3
    dataset = TensorDataset(torch.arange(n, dtype=torch.float32), values)
    loader = rt.eval_loader(dataset, batch_size=batch)
    rows = torch.cat([torch.stack(b, dim=1) for b in loader])
    try:  # the ranks' row counts differ: plain rt.gather refuses them (gloo aborted the process)
        rt.gather(rows)
        refused = None
    except trainer.UserError as e:
        refused = str(e)
    everything = rt.gather_for_metrics(rows, loader)
    # A number per rank (Accelerate's gather(loss)): one row each, as on one process.
    scalars = rt.gather(torch.tensor(float(rt.rank)))
    summed = rt.reduce(rt.rank + 1, "sum")  # (a number for a number: it was a 0-dim tensor on 2 processes)
    # A metric that is not a sum over ranks: the median of all values (and the count, to see none repeats).
    rt.print(json.dumps({"indices": everything[:, 0].tolist(), "median": everything[:, 1].median().item(),
                         "local_rows": rows.shape[0], "gather_refused": refused, "scalars": scalars.tolist(),
                         "summed": [type(summed).__name__, summed]}))
    rt.end()


def save_on_main_only(rt: trainer.Runtime, out: str) -> None:
    model = rt.setup(nn.Linear(2, 2))
    if rt.is_main_process:  # first an object registered on the main rank only: refused at the save, by every rank
        rt.register("counter", torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1)]), lambda s: 1))
    try:
        rt.save_state(f"{out}/checkpoints", 1)
    except trainer.UserError as e:
        say(f"rank {rt.rank} refused: {e}")
    if rt.is_main_process:
        rt.save_state(f"{out}/checkpoints", 1)
    del model


def backward_outside(rt: trainer.Runtime, out: str) -> None:
    model = rt.setup(nn.Linear(2, 2))
    loss = model(torch.ones(1, 2)).sum()
    rt.backward(loss)


def bare_model(rt: trainer.Runtime) -> None:
    """The mistake: the module passed to setup run instead of what setup returned (under DDP, its wrapper)."""
    bare = nn.Linear(2, 2)
    model, opt = rt.setup(bare, torch.optim.SGD(bare.parameters(), lr=0.1))
    assert model is not bare  # (DDP wraps it)
    with rt.accumulate(bare):
        rt.backward(bare(torch.ones(1, 2)).sum())


def bare_forward(rt: trainer.Runtime) -> None:
    """The mistake past rt.accumulate: the wrapper given to it, the module underneath run. Model `good` runs what
    setup returned and steps (its gradients agree on both ranks); `bad` runs the bare module on each rank's own
    data and is refused at its first step, before any update."""
    good, local, bad = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
    good, opt_good = rt.setup(good, torch.optim.SGD(good.parameters(), lr=0.1))
    local, opt_local = rt.setup(local, torch.optim.SGD(local.parameters(), lr=0.1))
    wrapped, opt_bad = rt.setup(bad, torch.optim.SGD(bad.parameters(), lr=0.1))
    x = torch.full((1, 2), float(rt.rank + 1))  # each rank's own data
    with rt.accumulate(good):
        rt.backward(good(x).sum())
    say(f"good stepped: {rt.step(opt_good)}")
    with rt.no_sync(local, True):  # (unsynced on purpose, as local SGD steps: not the mistake)
        rt.backward(local(x).sum())
    say(f"local stepped: {rt.step(opt_local)}")
    before = bad.weight.detach().clone()
    try:
        with rt.accumulate(wrapped):
            rt.backward(bad(x).sum())
        rt.step(opt_bad)
    finally:
        say(f"bad unchanged: {torch.equal(bad.weight, before)}")


def pipeline(rt: trainer.Runtime, out: str, backward: bool = False, batch_size: int = 8) -> None:
    """Four steps of a two-block GPT on a mean cross-entropy, each through rt.forward_backward (or, a mistake under
    world.pp, the model and rt.backward); the losses are printed as JSON and the weights saved to OUT."""
    import torch.nn.functional as F

    from trainer.recipes.lm.model import GPT

    torch.manual_seed(rt.seed)
    model = GPT(vocab_size=32, seq_len=8, n_layer=2, n_head=2, d_model=16, dropout=0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = rt.setup(model, optimizer)
    tokens = torch.randint(0, 32, (32, 9), generator=torch.Generator().manual_seed(2))
    loader = rt.loader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch_size, shuffle=False)

    def loss_fn(m, batch):
        x, y = batch
        logits = m(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))

    losses = []
    for batch in loader:
        with rt.accumulate(model):
            if backward:
                rt.backward(loss_fn(model, batch))
                continue
            loss, _ = rt.forward_backward(model, batch, loss_fn)
        if rt.sync_gradients:
            rt.clip_grad_norm_(model, 1.0)
        rt.step(optimizer)
        losses.append(rt.reduce(loss).item())
    rt.print(json.dumps({"losses": losses}))
    rt.save_model(model, out)
    rt.end()


def diverge(rt: trainer.Runtime, out: str) -> None:
    model = rt.setup(nn.Linear(2, 2))
    if rt.rank == 0:
        rt.save_state(f"{out}/checkpoints", 1)
    else:  # left its loop early, say, and went on to the export
        rt.save_model(model, out)


def hang(rt: trainer.Runtime, rank: int, leave: bool = False) -> None:
    torch.manual_seed(rt.seed)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = rt.setup(model, opt)
    for step in range(3):
        if step == 2 and rt.rank == rank:
            if leave:
                sys.exit(0)  # the script ends on this rank alone: the others wait for it in the gradient all-reduce
            time.sleep(3600)  # stuck in the user's own code: the other ranks wait for it in the gradient all-reduce
        rt.backward(model(torch.ones(2, 4)).sum())
        rt.step(opt)
    rt.print("finished")


class Slow(nn.Module):
    """A model whose forward takes `seconds` of (simulated) compute."""

    def __init__(self, seconds: float):
        super().__init__()
        self.linear, self.seconds = nn.Linear(4, 4), seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return self.linear(x)


def slow_phases(rt: trainer.Runtime, seconds: float) -> None:
    """Longer than world.hang_timeout=`seconds` without an optimizer step, twice, and never stuck: set-up before the
    loop's first progress (not watched yet), and an eval of forwards only (each forward is progress)."""
    model = Slow(seconds / 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = rt.setup(model, opt)
    time.sleep(1.5 * seconds)  # building data, say: before the loop's first progress, so not watched
    for phase in ("train", "eval", "train"):
        if phase == "eval":
            with torch.no_grad():
                for _ in range(8):  # 2 x seconds in all, without a backward or a step
                    model(torch.ones(2, 4))
        else:
            rt.backward(model(torch.ones(2, 4)).sum())
            rt.step(opt)
    rt.end()
    time.sleep(1.5 * seconds)  # an upload, say: after the loop, no longer watched
    print("finished")


def unused(rt: trainer.Runtime) -> None:
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(4, 1), nn.Linear(4, 1)

        def forward(self, x):
            return self.used(x)

    model = Two()
    model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    rt.backward(model(torch.ones(2, 4) * (rt.rank + 1)).sum())
    rt.step(opt)
    rt.end()


def refreeze(rt: trainer.Runtime, unfreeze: bool) -> None:
    """Two steps of a two-layer model under DDP, one layer's requires_grad changed between them."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    model[0].requires_grad_(not unfreeze)
    model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(2):
        if step == 1:
            rt.unwrap(model)[0].requires_grad_(unfreeze)
        rt.backward(model(torch.ones(2, 4) * (rt.rank + 1)).sum())
        rt.step(opt)
    rt.end()


def not_set_up(rt: trainer.Runtime) -> None:
    """A generator set up, a discriminator left out of rt.setup and stepped by its own optimizer."""
    gen, disc = nn.Linear(4, 4), nn.Linear(4, 1)
    gen, opt_g = rt.setup(gen, torch.optim.SGD(gen.parameters(), lr=0.1))
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.1)
    x = torch.ones(2, 4) * (rt.rank + 1)
    disc(gen(x).detach()).sum().backward()
    opt_d.step()
    say(f"rank {rt.rank} stepped the discriminator")
    rt.end()


def teacher(rt: trainer.Runtime) -> None:
    torch.manual_seed(rt.rank)  # each rank's own teacher weights: rank 0's must reach every rank
    frozen, student = nn.Linear(4, 4).requires_grad_(False), nn.Linear(4, 4)
    student, frozen, opt = rt.setup(student, frozen, torch.optim.SGD(student.parameters(), lr=0.1))
    x = torch.ones(2, 4) * (rt.rank + 1)
    with rt.accumulate(student):
        rt.backward((student(x) - frozen(x)).pow(2).mean())
        rt.step(opt)
    teacher_sum = sum(p.sum().item() for p in frozen.parameters())
    student_sum = sum(p.sum().item() for p in rt.unwrap(student).parameters())
    say(f"rank {rt.rank} teacher {teacher_sum:.6f} student {student_sum:.6f}")
    rt.end()


def rank_shaped(rt: trainer.Runtime) -> None:
    model = nn.Linear(4, 4 + rt.rank)
    rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))


def at_exit(rt: trainer.Runtime, out: str, fail: str) -> None:
    import atexit
    from pathlib import Path

    atexit.register(Path(out, f"rank{rt.rank}.txt").write_text, "ran")
    if fail == "fail" and rt.rank == 1:
        raise RuntimeError("rank 1 fails after registering its handler")
    rt.end()
    if fail == "exit3" and rt.rank == 1:
        sys.exit(3)


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    runtime = trainer.Runtime("single" if mode == "single" else None)  # (single: a world that is one process)
    {"two": lambda: two(runtime, args[0], *map(int, args[1:])),
     "gather": lambda: gather(runtime, int(args[0]), int(args[1])),
     "save_on_main_only": lambda: save_on_main_only(runtime, args[0]),
     "backward_outside": lambda: backward_outside(runtime, args[0]),
     "bare_model": lambda: bare_model(runtime),
     "bare_forward": lambda: bare_forward(runtime),
     "pipeline": lambda: pipeline(runtime, args[0]),
     "pipeline_backward": lambda: pipeline(runtime, args[0], backward=True),
     "pipeline_uneven": lambda: pipeline(runtime, args[0], batch_size=3),
     "diverge": lambda: diverge(runtime, args[0]),
     "hang": lambda: hang(runtime, int(args[0])),
     "leave": lambda: hang(runtime, int(args[0]), leave=True),
     "slow_phases": lambda: slow_phases(runtime, float(args[0])),
     "single": lambda: runtime.end(),
     "unused": lambda: unused(runtime),
     "at_exit": lambda: at_exit(runtime, args[0], (args[1:] or [""])[0]),
     "freeze": lambda: refreeze(runtime, unfreeze=False),
     "not_set_up": lambda: not_set_up(runtime),
     "unfreeze": lambda: refreeze(runtime, unfreeze=True),
     "teacher": lambda: teacher(runtime),
     "rank_shaped": lambda: rank_shaped(runtime)}[mode]()
