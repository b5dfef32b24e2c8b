"""Finders that agree across ranks: the largest micro-batch that fits, and a learning-rate range test.

`python -m trainer tune batch_size|lr [OVERRIDES] [tune.KEY=VALUE ...] [save=PATH]` builds the run the overrides
describe (on its world: one process, or every rank of world=ddp) in a scratch dir, tries, and prints the result
as an override (`data.batch_size=64`, `optim.lr=0.003`); `save=PATH` writes that override to a file.

Every decision is the same on every rank. The batch-size finder runs each trial's forward and backward without
gradient sync, so a rank that runs out of memory has no collective to leave its peers waiting in, and only
then do the ranks agree (a min over "it fitted") on whether the size fits: Lightning's BatchSizeFinder decides
on rank 0 and Accelerate's find_executable_batch_size per process, which leaves the ranks disagreeing or hung.
The LR range test reduces each step's loss over the ranks, so every rank sees the same curve and suggestion.
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, open_dict

from trainer.errors import ConfigError
from trainer.io import output_file_problem

# Each finder's settings (tune.KEY=VALUE) and their defaults.
SETTINGS = {
    "batch_size": {"memory_mb": None, "max_batch_size": 4096},
    "lr": {"min_lr": 1e-7, "max_lr": 1.0, "steps": 100},
}
USAGE = ("python -m trainer tune batch_size [--config-dir DIR] [OVERRIDES] [tune.memory_mb=MB] "
         "[tune.max_batch_size=N] [save=PATH]\n"
         "       python -m trainer tune lr [--config-dir DIR] [OVERRIDES] [tune.min_lr=1e-7] [tune.max_lr=1] "
         "[tune.steps=100] [save=PATH]")


# -- the command (the parent) ------------------------------------------------------------------------------
def command(argv: list[str]) -> int:
    """Check what can be checked before any process starts (`prepare`), then run the finder on the run's world
    in a scratch dir."""
    import shutil
    import tempfile

    from trainer.entry.launcher import run

    cfg = prepare(argv)
    scratch = Path(tempfile.mkdtemp(prefix="trainer-tune-"))
    try:
        from trainer.entry.run import tune_batch_size, tune_lr

        run(cfg, scratch, entry={"batch_size": tune_batch_size, "lr": tune_lr}[cfg.tune.what])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


def prepare(argv: list[str]) -> DictConfig:
    """The checked config of `tune WHAT ARGS` (the run's, with the finder's settings under `tune`)."""
    from trainer.config.compose import load, path_value
    from trainer.errors import suggest

    if not argv or argv[0] not in SETTINGS:
        raise ConfigError(f"say what to find: batch_size or lr.{suggest(argv[0], SETTINGS) if argv else ''} "
                          f"Usage: {USAGE}")
    what, settings, save, overrides, config_dir = argv[0], dict(SETTINGS[argv[0]]), None, [], None
    args = iter(argv[1:])
    for arg in args:
        key, sep, value = arg.partition("=")
        if key == "--config-dir":  # your own config files, as `python -m trainer --config-dir DIR` takes them
            from trainer.config.compose import check_config_dir

            config_dir = value if sep else next(args, None)
            if not config_dir:
                raise ConfigError(f"--config-dir needs a directory: --config-dir DIR. Usage: {USAGE}")
            check_config_dir(Path(config_dir).expanduser(), config_dir)
        elif key.startswith("tune."):
            name = key[len("tune."):]
            if name not in settings:
                raise ConfigError(f"{key} is not a setting of `tune {what}`.{suggest(name, settings)} It takes: "
                                  f"{', '.join(f'tune.{k}' for k in settings)}.")
            settings[name] = _value(arg)
        elif key == "save" and sep:
            save = str(Path(path_value("save", value)).expanduser().resolve())
            problem = output_file_problem(save) or _not_a_tune_file(Path(save))  # (before the sweep, not after it)
            if problem:
                raise ConfigError(f"save={value}: {problem}.")
        else:
            overrides.append(arg)
    _check_settings(what, settings)
    cfg = load(overrides, config_dir=config_dir)
    _check_world(what, cfg, settings)
    with open_dict(cfg):
        cfg.logger = {}  # a finder logs nothing anywhere
        cfg.tune = {**settings, "what": what, "save": save, "overrides": overrides, "config_dir": config_dir}
    return cfg


def _not_a_tune_file(path: Path) -> str | None:
    """Why `save=` may not replace the file at `path`: only a file a finder wrote (one line of KEY=VALUE overrides)
    is rewritten. A run's config.yaml or a script given there was replaced by `optim.lr=...` (the run no longer
    evaluated)."""
    import re

    if not path.is_file():
        return None
    try:
        text = path.read_text() if path.stat().st_size <= 4096 else None
    except (OSError, UnicodeDecodeError):
        text = None
    if text is not None and (not text.strip() or re.fullmatch(r"[\w.+~/-]+=\S+( [\w.+~/-]+=\S+)*", text.strip())):
        return None  # (an empty file too: mktemp's)
    return ("that file exists and is not one a finder wrote (a line of KEY=VALUE overrides): it would be replaced. "
            "Give a new path (e.g. save=best_lr.txt), or move that file first")


def _value(override: str) -> Any:
    """The value of a tune.KEY=VALUE as Hydra reads overrides (1e-5 is a number, null is None)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from trainer.config.compose import unparsable

    try:
        return OverridesParser.create().parse_override(override).value()
    except Exception as e:  # noqa: BLE001 - hydra's OverrideParseException
        raise unparsable([override], e) from None


def _check_settings(what: str, s: dict[str, Any]) -> None:
    def number(key: str, minimum: float, integer: bool = False) -> None:
        v = s[key]
        ok = isinstance(v, int if integer else (int, float)) and not isinstance(v, bool) and v >= minimum
        if not ok:
            raise ConfigError(f"tune.{key}={v!r} is invalid: expected {'an integer' if integer else 'a number'} "
                              f">= {minimum}.")

    if what == "batch_size":
        if s["memory_mb"] is not None:
            number("memory_mb", 1)
        number("max_batch_size", 1, integer=True)
    else:
        number("min_lr", 1e-12)
        number("max_lr", 1e-12)
        number("steps", 5, integer=True)
        if s["max_lr"] <= s["min_lr"]:
            raise ConfigError(f"tune.max_lr={s['max_lr']} must be above tune.min_lr={s['min_lr']}: the test sweeps "
                              "the learning rate from the one up to the other.")


def _check_world(what: str, cfg: DictConfig, s: dict[str, Any]) -> None:
    from trainer.config.instantiate import build_strategy
    from trainer.config.schema import launch_config
    from trainer.parallel.backend import resolve_device

    if what == "lr":
        from trainer.config.schema import per_part

        parts = [name for name in per_part(cfg.optim) if name is not None]
        if parts:  # (a task's own training_step steps them, each on its own schedule: the sweep cannot drive them)
            raise ConfigError(f"tune lr sweeps one learning rate, optim.lr, through the Trainer's one-loss step; "
                              f"this run's task steps optimizers of its own ({', '.join(f'optim.{p}' for p in parts)}) "
                              "in its training_step, on their own schedules, which the sweep does not reach (their "
                              f"losses would stay flat whatever it tried). Try each part's rate by hand "
                              f"({' '.join(f'optim.{p}.lr=...' for p in parts)}) with a short trainer.max_steps.")
        return
    if build_strategy(cfg.world).collective_forward:
        w = cfg.world
        which = [f"{k}={w.get(k)}" for k in ("tp", "pp") if (w.get(k) or 1) != 1]
        which += [f"stage={w.stage}"] if str(w.get("_target_", "")).endswith("DeepSpeed") and w.get("stage") else []
        this = f"world._target_={w.get('_target_')}" + (f" with world.{', world.'.join(which)}" if which else "")
        raise ConfigError(f"tune batch_size runs where each rank's forward is its own (world=single, world=ddp, "
                          f"DeepSpeed stages 1 and 2), not yet where the forward itself is a collective, as under "
                          f"{this} (world=fsdp, world.tp > 1, world.pp > 1, DeepSpeed stage 3): a rank that runs out "
                          "of memory there leaves the others waiting inside the forward. Find the micro-batch "
                          "without those (an upper bound: sharding holds less per rank) or try sizes by hand.")
    if resolve_device(launch_config(cfg.world).device).type == "cpu" and s["memory_mb"] is None:
        raise ConfigError("on a CPU nothing runs out of memory before the machine does: give the budget each process "
                          "may use, e.g. tune.memory_mb=4000 (its peak resident memory, torch itself included).")


# -- the finders (every rank) ----------------------------------------------------------------------------------
def find_batch_size(cfg: DictConfig, run_dir: Path) -> int | None:
    """The largest data.batch_size of 1, 2, 4, ... (up to tune.max_batch_size and the training split) for which
    one training step fits on every rank: no out-of-memory error, and a peak within tune.memory_mb if given.
    Sizes are tried in increasing order, so on a CPU the process's peak resident memory so far is the peak of the
    latest trial."""
    from trainer.entry.run import build

    trainer = build(cfg, run_dir)
    be, opts = trainer.backend, cfg.tune
    say = print if be.is_main else (lambda *a, **k: None)
    done = False
    try:
        train = trainer.data.train  # (a stream without a length: tune.max_batch_size bounds it alone)
        limit = opts.max_batch_size if not hasattr(train, "__len__") else min(opts.max_batch_size, len(train))
        best, size, failed = None, 1, None
        while size <= limit:
            ok, peak, why = _trial(trainer, size, opts.memory_mb)
            everyone = be.all_reduce(1.0 if ok else 0.0, op="min", on_host=True)
            reports = be.gather_object((ok, peak, why)) if be.distributed else [(ok, peak, why)]
            fullest = max(p for _, p, _ in reports)
            if float(everyone) < 1:
                failed = (size, [(r, w) for r, (o, _, w) in enumerate(reports) if not o])
                say(f"data.batch_size={size}: does not fit ({'; '.join(f'rank {r}: {w}' for r, w in failed[1])})",
                    flush=True)
                break
            say(f"data.batch_size={size}: fits (peak {fullest:.0f} MB on the fullest rank)", flush=True)
            best, size = size, size * 2
        if best is None:
            raise ConfigError(f"not even data.batch_size=1 fits ({'; '.join(f'rank {r}: {w}' for r, w in failed[1])}). "
                              "Raise tune.memory_mb, or make the model or data.seq_len smaller.")
        if be.is_main:
            split = f" or the training split's {len(train)} samples" if hasattr(train, "__len__") else ""
            why = (f"{failed[0]} does not" if failed else
                   f"the largest tried: tune.max_batch_size={opts.max_batch_size}{split}")
            _report(opts, [f"data.batch_size={best}"], f"the largest micro-batch that fits on every rank ({why})")
        done = True
        return best
    finally:
        trainer.backend.teardown(wait_for_peers=done)


def _trial(trainer, size: int, budget_mb: float | None) -> tuple[bool, float, str]:
    """One training step's worth of memory on a micro-batch of `size` samples: forward, backward (without gradient
    sync: no collective to hang in) and the optimizer's update. (fits, peak MB, why not)."""
    import gc
    import itertools

    import torch

    from trainer.data.sampling import collate_fn_of, in_process_batches
    from trainer.parallel.hardware import peak_memory_mb
    from trainer.task import split_loss

    be, model, opt = trainer.backend, trainer.model, trainer.optimizer
    train = trainer.data.train
    if isinstance(train, torch.utils.data.IterableDataset):  # a stream: its first samples (it has no indices)
        samples = list(itertools.islice(iter(train), size))
        if not samples:
            raise ConfigError("the training stream yields no sample, so no batch size can be tried: check data.path.")
        samples = (samples * (size // len(samples) + 1))[:size]  # (a stream shorter than the size: repeated)

        def take():
            return collate_fn_of(train)(samples)
    else:
        start = (be.rank * size) % len(train)
        indices = [(start + i) % len(train) for i in range(size)]

        def take():
            return next(in_process_batches(train, iter([indices])))
    if be.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(be.device)
    try:
        batch = be.to_device(take())
        with trainer.strategy.no_sync(model, enabled=True), trainer.precision.autocast():
            loss, _ = split_loss(trainer.task.loss(model, batch))
        trainer.precision.backward(loss / max(float(trainer.task.num_targets(batch)), 1.0))
        trainer.rt.step(opt, zero_grad=False)
        if be.device.type == "cuda":
            torch.cuda.synchronize(be.device)
        ok, why = True, ""
    except (torch.cuda.OutOfMemoryError, MemoryError) as e:
        ok, why = False, f"out of memory ({str(e).splitlines()[0][:120] if str(e) else type(e).__name__})"
    except RuntimeError as e:  # the CPU allocator's "can't allocate memory"
        if "allocate" not in str(e):
            raise
        ok, why = False, f"out of memory ({str(e).splitlines()[0][:120]})"
    finally:
        opt.zero_grad(set_to_none=True)
        batch = loss = None
        gc.collect()
        if be.device.type == "cuda":
            torch.cuda.empty_cache()
    peak = peak_memory_mb(be.device)
    if ok and budget_mb is not None and peak > budget_mb:
        ok, why = False, f"peak {peak:.0f} MB is over tune.memory_mb={budget_mb}"
    return ok, peak, why


def find_lr(cfg: DictConfig, run_dir: Path) -> float | None:
    """The learning-rate range test (Smith 2015; Lightning's lr_find): tune.steps optimizer steps on the run's
    global batches with the learning rate rising exponentially from tune.min_lr to tune.max_lr (each parameter
    group keeps its ratio to optim.lr), stopping when the smoothed loss passes 4x its best or is not finite. The
    suggestion is where the smoothed loss falls fastest against log(lr)."""
    import torch

    from trainer.data.sampling import train_loader
    from trainer.entry.run import build
    from trainer.errors import NonFiniteError

    trainer = build(cfg, run_dir)
    be, opts = trainer.backend, cfg.tune
    done = False
    try:
        trainer.data.check_batch()  # (the range test trains on the config's batches)
        base = float(cfg.optim.lr)
        lrs = [opts.min_lr * (opts.max_lr / opts.min_lr) ** (i / (opts.steps - 1)) for i in range(opts.steps)]
        # The schedule of the test replaces the run's (warmup, cosine): step i runs at lrs[i].
        trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(
            trainer.optimizer, lambda i: lrs[min(i, len(lrs) - 1)] / base)
        batches = iter(train_loader(trainer.data.train, trainer.sampler(), trainer.data.num_workers, be.device,
                                    trainer.cfg.seed))
        trainer.model.train()
        tried, raw, smooth, avg, best = [], [], [], 0.0, math.inf
        for i, lr in enumerate(lrs):
            micro = [be.to_device(next(batches)) for _ in range(trainer.cfg.grad_accum_steps)]
            n_global, _ = trainer.sync_counts(micro)
            try:
                out = trainer.train_step(micro, n_global)
            except NonFiniteError:
                break
            trainer.step += 1
            trainer.samples_seen += trainer.global_batch
            replicas = be.world_size // trainer.strategy.dp_size  # tensor-parallel peers share a batch
            loss = float(be.all_reduce(out["loss_sum"].detach().double())) / replicas / float(n_global)
            if not math.isfinite(loss):
                break
            avg = BETA * avg + (1 - BETA) * loss
            value = avg / (1 - BETA ** (i + 1))  # debiased, as Lightning's and fastai's
            tried.append(lr)
            raw.append(loss)
            smooth.append(value)
            best = min(best, value)
            if value > 4 * best:
                break
        if len(tried) < 5:
            raise ConfigError(f"the loss diverged within {len(tried)} steps of tune.min_lr={opts.min_lr}: lower "
                              "tune.min_lr.")
        pick, lowest, fell = suggest(tried, raw, smooth)
        if be.is_main:
            for j in range(0, len(tried), max(len(tried) // 10, 1)):
                print(f"lr={tried[j]:.3g}  loss={smooth[j]:.4f}", flush=True)
        if not fell:  # (every rank saw the same curve: every rank stops here)
            from trainer.errors import UserError

            kept = f", and save={opts.save} was left as it was" if opts.save else ""
            raise UserError(f"tune lr: the smoothed loss never fell by more than its own noise in this test (3 standard "
                            f"deviations of the losses about it), so its steepest point, lr={tried[pick]:.3g}, would "
                            f"be a pick from the noise: nothing is suggested{kept}. Give the test more signal: more "
                            "tune.steps, a larger data.batch_size, or a range that reaches where the loss falls "
                            f"(tune.min_lr={opts.min_lr}, tune.max_lr={opts.max_lr}).")
        if be.is_main:
            ended = ("the loss diverged past lr=" f"{tried[-1]:.3g}") if len(tried) < len(lrs) else \
                f"it ran up to tune.max_lr={opts.max_lr}"
            # An optimizer's other rates (optim=muon's adamw_lr) rose with optim.lr in the test: keep their ratio.
            others = [f"optim.{k}={float(v) * tried[pick] / base:.3g}" for k, v in cfg.optim.items()
                      if str(k).endswith("_lr") and isinstance(v, (int, float)) and not isinstance(v, bool)]
            scaled = f" ({', '.join(o.split('=')[0] for o in others)} scaled with it, as in the test)" if others else ""
            _report(opts, [f"optim.lr={tried[pick]:.3g}", *others],
                    f"where the loss fell fastest{scaled}; it was lowest at lr={tried[lowest]:.3g}, and {ended}")
        done = True
        return tried[pick]
    finally:
        trainer.backend.teardown(wait_for_peers=done)


BETA = 0.98  # the smoothing of the test's losses (an exponential average, as Lightning's and fastai's)


def suggest(tried: list[float], raw: list[float], smooth: list[float]) -> tuple[int, int, bool]:
    """(the suggestion's index, the lowest smoothed loss's index, whether the loss fell beyond its noise).

    The suggestion is where the smoothed loss falls fastest against log(lr), past the first steps (their average
    is short), among the points where it has fallen below its start by more than the noise of both. Before that
    the curve is flat, and on little or noisy data its wiggles there can be steeper than the fall itself (a rate
    picked from the noise: Lightning's lr_find can do that). The noise: the spread of the losses about a straight
    line through their neighbours, up to the lowest point (the median absolute second difference: a fall, even one
    spanning the whole test, is nearly straight from one step to the next), times what the debiased average of
    j + 1 of them keeps of it. Where the loss never fell beyond that, the steepest point of the whole curve, and
    False."""
    n = len(tried)
    skip = min(max(n // 10, 1), n - 3)
    lowest = min(range(n), key=smooth.__getitem__)
    end = max(lowest, 2)
    bends = sorted(abs(raw[i + 1] - 2 * raw[i] + raw[i - 1]) for i in range(1, end))
    # (a second difference of independent losses has sqrt(6) sigma, the median of its absolute value 0.6745 of that)
    sigma = bends[len(bends) // 2] / (0.6745 * math.sqrt(6))

    def noise(j: int) -> float:  # of smooth[j]: its weights are (1 - BETA) BETA^(j - k) / (1 - BETA^(j + 1))
        return sigma * (1 - BETA) / (1 - BETA ** (j + 1)) * math.sqrt((1 - BETA ** (2 * j + 2)) / (1 - BETA ** 2))

    def slope(j: int) -> float:
        return (smooth[j + 1] - smooth[j - 1]) / math.log(tried[j + 1] / tried[j - 1])

    fell = [j for j in range(skip, min(lowest, n - 2) + 1)
            if smooth[skip] - smooth[j + 1] > 3 * (noise(skip) + noise(j + 1))]
    return min(fell or range(skip, n - 1), key=slope), lowest, bool(fell)


def _report(opts: DictConfig, overrides: list[str], why: str) -> None:
    """The result as overrides, the command that uses them, and the file `save=PATH` asked for."""
    from trainer.io import atomic_write_text

    keys = {o.split("=", 1)[0] for o in overrides}
    kept = [o for o in opts.overrides if o.split("=", 1)[0] not in keys]
    config_dir = ["--config-dir", opts.config_dir] if opts.get("config_dir") else []
    override = " ".join(overrides)
    print(f"{override}: {why}. Run with: {shlex.join(['python', '-m', 'trainer', *config_dir, *kept, *overrides])}",
          flush=True)
    if opts.save:
        atomic_write_text(Path(opts.save), override + "\n")
        print(f"written to {opts.save} (python -m trainer $(cat {opts.save}) ...)", flush=True)
