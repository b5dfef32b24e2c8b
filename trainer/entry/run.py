"""From a prepared config to a running Trainer: the one place config becomes objects.

`build(cfg, run_dir)` returns the Trainer a run starts from (process group, strategy, model, data,
optimizer, loggers, checkpointer); `train(cfg, run_dir)` is build, resume, fit, export. The CLI, the
workers, `check`, the tests and the benchmarks all go through them; Hydra never reaches below here.
`cfg` is a prepared config (`trainer.compose(overrides)`, or `trainer.config.compose.prepare(cfg)`).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.checkpoint import store as ckpt
from trainer.checkpoint.manager import resume, set_abandoned_branch_aside
from trainer.config.instantiate import build_data, build_logger, build_loggers, build_node, build_strategy
from trainer.config.schema import (
    CheckpointConfig,
    EMAConfig,
    TrainerConfig,
    launch_config,
    per_part,
    typed,
)
from trainer.config.targets import compile_args
from trainer.data.sampling import Data, epoch_length
from trainer.errors import CheckpointError, ConfigError, Preempted, StorageError, UserError
from trainer.io import one_attempt
from trainer.loop import watchdog
from trainer.loop.callbacks import Callbacks
from trainer.loop.ema import EMA
from trainer.loop.metrics import Cost
from trainer.loop.nonfinite import NonFiniteGuard
from trainer.loop.runtime import Runtime
from trainer.loop.trainer import Trainer
from trainer.parallel import seed_everything, unwrap
from trainer.parallel.backend import Backend, usable_device
from trainer.redaction import redact

TEXT_DATA = "trainer.recipes.lm.data.text_file"  # data=text's _target_


def build_optimizer(cfg: DictConfig, model: torch.nn.Module, say=print) -> torch.optim.Optimizer:
    """`optim` is a partial (`_partial_: true`); weight decay applies to matrices only (not norms, biases),
    unless the optimizer class groups the parameters itself (`param_groups(model)`, as optim=muon does)."""
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.requires_grad]
    if not params:  # (torch's "optimizer got an empty parameter list" was a traceback)
        has = sum(1 for _ in model.parameters())
        raise ConfigError(f"the model ({type(unwrap(model)).__name__}, model._target_) has "
                          + (f"{has} parameters, every one frozen (requires_grad=False)" if has else "no parameters")
                          + ": the optimizer would have nothing to train. Give it parameters that train (an "
                          "nn.Linear, an nn.Parameter), or unfreeze some.")
    kinds = {isinstance(p, DTensor) for p in params}
    if len(kinds) == 2 and (cfg.get("fused") or cfg.get("foreach") is not False) and "fused" in cfg:
        # Tensor parallelism without FSDP leaves the parameters it does not split as plain tensors, and
        # torch's fused and foreach kernels refuse a mix of plain tensors and DTensors in one list (splitting
        # the groups by kind would make checkpoints of this layout unloadable under the others).
        say("note: world=ddp with world.tp mixes DTensor shards and plain tensors, which optim.fused and "
            "optim.foreach kernels refuse; using the per-parameter loop (optim.fused=false optim.foreach=false).")
        cfg = OmegaConf.merge(cfg, {"fused": False, "foreach": False})
    elif True in kinds and cfg.get("fused") and _fused_without_shards(cfg._target_):
        # torch registers the fused kernels of Adam and AdamW for DTensor shards alone: SGD's (which inherits the
        # base optim's fused: true) was a NotImplementedError traceback on every rank under FSDP.
        say(f"note: {cfg._target_}'s fused kernel takes no DTensor shards (world=fsdp, world.tp), so optim.fused=false "
            "here (its foreach kernel instead).")
        cfg = OmegaConf.merge(cfg, {"fused": False})
    # A rate given as a whole number (optim.lr=3) is a float to the optimizer: an int in its groups (and the
    # schedule's base_lrs) made a checkpoint of float rates refuse to resume under it ("expected an integer").
    rates = {k: float(v) for k, v in cfg.items() if (k == "lr" or str(k).endswith("_lr")) and type(v) is int}
    if rates:
        cfg = OmegaConf.merge(cfg, rates)
    from trainer.config.targets import locate, unused_nulls

    nulls = unused_nulls(locate("optim", cfg._target_), {k: v for k, v in cfg.items() if not str(k).startswith("_")})
    if nulls:  # (an optimizer of one's own without the config's `foreach: null`: left out of the call)
        cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k not in nulls])
    factory = build_node("optim", cfg)
    grouping = getattr(getattr(factory, "func", factory), "param_groups", None)
    if grouping is not None:
        return factory(grouping(model))
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    return factory([g for g in groups if g["params"]])


def _fused_without_shards(target: str) -> bool:
    """Whether torch's fused kernel of the optimizer class `target` has no DTensor rule (any but Adam and AdamW)."""
    from trainer.config.targets import locate

    cls = locate("optim", target)
    return not (isinstance(cls, type) and issubclass(cls, (torch.optim.Adam, torch.optim.AdamW)))


def build_optimizers(cfg: DictConfig, model: torch.nn.Module, rt: Runtime, say=print):
    """One optimizer over the model (set up on the runtime), or, where `optim` has part nodes (optim.generator:
    {...}, for a task's own training_step), one per part over `model.<part>`'s parameters: a dict by part."""
    nodes = per_part(cfg)
    if list(nodes) == [None]:
        return rt.setup(build_optimizer(cfg, model, say=say), names=["optimizer"])
    raw = unwrap(model)
    missing = [p for p in nodes if not isinstance(getattr(raw, p, None), torch.nn.Module)]
    if missing:
        children = ", ".join(n for n, _ in raw.named_children())
        raise ConfigError(f"optim.{missing[0]} names no part of the model ({type(raw).__name__}'s children: "
                          f"{children}). Give one optim.NAME per child the task's training_step steps.")
    return {p: rt.setup(build_optimizer(node, getattr(raw, p), say=say), names=[p]) for p, node in nodes.items()}


def build_schedulers(cfg: DictConfig, optimizer, total_steps: int):
    """The schedule of each optimizer: `scheduler`, with scheduler.NAME's changes for optimizer NAME."""
    nodes = per_part(cfg)
    names = list(optimizer) if isinstance(optimizer, dict) else []
    extra = [n for n in nodes if n is not None and n not in names]
    if extra:  # (one optimizer: a TypeError from the schedule's function; several: silently ignored)
        have = (f"its optimizers are {', '.join(f'optim.{n}' for n in names)}" if names else
                "it has one optimizer, optim, whose schedule is scheduler's own keys (scheduler.warmup_steps=...)")
        raise ConfigError(f"scheduler.{extra[0]} names no optimizer of this run: scheduler.NAME changes the schedule "
                          f"of optim.NAME, and {have}. Remove scheduler.{extra[0]}, or set the key on the schedule "
                          "it means.")
    if not isinstance(optimizer, dict):
        return _schedule("scheduler", cfg, optimizer, total_steps)
    base = OmegaConf.masked_copy(cfg, [k for k in cfg if not isinstance(cfg[k], DictConfig)])
    return {name: _schedule(f"scheduler.{name}", nodes.get(name, base), opt, total_steps)
            for name, opt in optimizer.items()}


def _schedule(section: str, node: DictConfig, optimizer, total_steps: int):
    """`section._target_` called as a schedule is: f(optimizer, total_steps=N), partial over its keys. A torch
    scheduler of its own (StepLR) takes no total_steps: that was a bare TypeError; one returning no scheduler was
    an AttributeError at the first step."""
    from trainer.config.targets import call_refused

    make = build_node(section, node)
    refused = call_refused(make, optimizer, total_steps=total_steps)
    if refused is not None:
        raise ConfigError(f"{section}._target_={node.get('_target_')} is called as f(optimizer, total_steps=N) with "
                          f"its keys given, and it cannot be ({refused}). A torch scheduler (StepLR, ...) takes no "
                          "total_steps: wrap it in a function of yours, def make(optimizer, total_steps, **keys): "
                          "return StepLR(optimizer, **keys), and point _target_ at that.")
    scheduler = make(optimizer, total_steps=total_steps)
    if not (callable(getattr(scheduler, "get_last_lr", None)) and callable(getattr(scheduler, "state_dict", None))):
        raise ConfigError(f"{section}._target_={node.get('_target_')} returned a {type(scheduler).__name__}, not a "
                          "learning-rate scheduler (a torch.optim.lr_scheduler.LRScheduler, with get_last_lr and "
                          "state_dict: the run steps it, logs its rate and checkpoints it).")
    return scheduler


def _check_evals_have_data(cfg: DictConfig, val_data) -> None:
    """What needs an eval's metrics (checkpoint.best_metric, callbacks=early_stopping) where the data built no val split
    (data=text of a file too short to keep one: it trains on all of it): no eval ever ran, so neither ever acted,
    without a word."""
    from trainer.data.streaming import sized

    if val_data is not None and sized(val_data) != 0:
        return
    needs = [k for k, v in (("checkpoint.best_metric", (cfg.get("checkpoint") or {}).get("best_metric")),
                            ("callbacks=early_stopping", (cfg.get("callbacks") or {}).get("early_stopping"))) if v]
    if needs:
        target = str(cfg.data.get("_target_"))
        text = target == TEXT_DATA  # (data=text's own split, explained; a function of one's own returns its own)
        raise ConfigError(f"{' and '.join(needs)} act{'s' if len(needs) == 1 else ''} on the evals' metrics, but "
                          f"data._target_={target!r} built no val split ("
                          + ("or an empty one: data=text keeps the end of its text as val only where a window of "
                             "data.seq_len + 1 fits there beside the training text), so no eval would run. Give it "
                             "more text (or a smaller data.seq_len)" if text else
                             "or an empty one), so no eval would run. Have it return a val dataset")
                          + f", or leave {' and '.join(needs)} out.")


def epochs_to_steps(tcfg: TrainerConfig, ccfg: CheckpointConfig, samples: int, global_batch: int, say) -> None:
    """trainer.max_epochs / eval_every_epochs and checkpoint.every_n_epochs as steps of the global batch (an
    epoch is `samples` positions of the one global sample stream: ceil(samples / global batch) steps)."""
    import math

    per_epoch = math.ceil(samples / global_batch)
    if tcfg.max_epochs is not None:
        # max_epochs decides the length; a max_steps beside it (the recipe's, or the user's) is not used, and says so.
        unused = tcfg.max_steps if tcfg.max_steps not in (None, tcfg.max_epochs * per_epoch) else None
        tcfg.max_steps = tcfg.max_epochs * per_epoch
        # The sample stream runs on across epochs (trainer/data/sampling.py): no global batch is short, none is padded.
        read = tcfg.max_steps * global_batch
        say(f"trainer.max_epochs={tcfg.max_epochs}: {tcfg.max_steps} steps of {global_batch} samples "
            f"({per_epoch} per epoch of {samples}). The sample stream runs on across epochs: a global batch that "
            f"reaches the end of an epoch is completed from the next epoch's order (nothing dropped or padded), so "
            f"the run reads {read} samples, {read / samples:.2f} passes."
            + (f" trainer.max_steps={unused} is not used: max_epochs decides the run's length (drop trainer.max_epochs "
               f"to train {unused} steps)." if unused is not None else ""))
    if tcfg.eval_every_epochs is not None:
        steps = tcfg.eval_every_epochs * per_epoch
        if tcfg.eval_every not in (0, steps):
            say(f"trainer.eval_every={tcfg.eval_every} is not used: trainer.eval_every_epochs="
                f"{tcfg.eval_every_epochs} decides (every {steps} steps).")
        tcfg.eval_every = steps
    if ccfg.every_n_epochs is not None:
        steps = ccfg.every_n_epochs * per_epoch
        if ccfg.every_n_steps not in (0, steps):
            say(f"checkpoint.every_n_steps={ccfg.every_n_steps} is not used: checkpoint.every_n_epochs="
                f"{ccfg.every_n_epochs} decides (every {steps} steps).")
        ccfg.every_n_steps = steps


def epochs_after_resume(trainer, every_n_epochs: int | None, say) -> None:
    """Settings in epochs, resumed at another global batch than the one the epochs were first counted at (the run
    state's `epoch_batch`, kept through every later resume). trainer.max_epochs: the run ends when the samples its
    epochs planned at that batch are read at this one, and its schedule spans that many steps. (`epochs_to_steps`
    counts every step at this batch: a larger one ended the run early, or called it already finished at the
    resume, and a smaller one trained past its epochs.) trainer.eval_every_epochs and checkpoint.every_n_epochs
    (`every_n_epochs`): due where the samples reach the end of an epoch, not every so many steps of this batch."""
    import math

    from trainer.loop.schedule import Schedule

    tcfg, before, now = trainer.cfg, trainer.epoch_batch, trainer.global_batch
    samples = epoch_length(trainer.data.train)
    if before in (None, now) or trainer.stop_reason is not None or not samples:
        return
    epoch = math.ceil(samples / before) * before  # one epoch's samples, as the steps were first counted
    trainer.sample_periods = {name: n * epoch for name, n in (("eval", tcfg.eval_every_epochs),
                                                              ("checkpoint", every_n_epochs)) if n}
    if trainer.sample_periods:
        say("resume: " + " and ".join(f"{'an eval' if name == 'eval' else 'a checkpoint'} every {n // epoch} epoch(s)"
                                      for name, n in trainer.sample_periods.items())
            + f" now fall where the samples reach the end of an epoch ({epoch} samples), at the new global batch of "
              f"{now}, rather than every so many of its steps.")
    if tcfg.max_epochs is None:
        return
    planned = tcfg.max_epochs * epoch
    left = max(0, planned - trainer.samples_seen)
    steps = trainer.step + math.ceil(left / now)
    if steps == tcfg.max_steps:
        return
    counted, tcfg.max_steps = tcfg.max_steps, steps
    fixed = [name for name, sched in trainer.schedulers.items() if not isinstance(sched, Schedule)]
    for sched in trainer.schedulers.values():
        if isinstance(sched, Schedule):
            sched.retotal(steps)
    say(f"resume: trainer.max_epochs={tcfg.max_epochs} planned {planned} samples at the run's first global batch of "
        f"{before}; {left} are left after sample {trainer.samples_seen}, so at the new batch of {now} the run ends at "
        f"step {steps} (not {counted}), and the learning-rate schedule spans {steps} steps"
        + (f" (but for {', '.join(fixed)}: a scheduler of your own keeps the length it was built with)" if fixed else "")
        + ".")


def warn_long_warmup(scheduler: DictConfig, max_steps: int, say) -> None:
    """One line when the warmup does not end before the run does (each optimizer's schedule: scheduler.NAME's too):
    the learning rate never reaches optim.lr."""
    own = [(name, node) for name, node in scheduler.items() if isinstance(node, DictConfig) and "warmup_steps" in node]
    for name, node in [(None, scheduler), *own]:
        key = f"scheduler.{name}.warmup_steps" if name else "scheduler.warmup_steps"
        warmup = node.get("warmup_steps") or 0
        if warmup >= max_steps:
            say(f"warning: {key}={warmup} is not shorter than the run ({max_steps} steps): the learning rate is "
                f"still rising when it ends and never reaches {'optim.' + name + '.lr' if name else 'optim.lr'}. "
                f"Lower {key}.")


def warn_unchecked_early_stopping(trainer: Trainer, say) -> None:
    """One line when early stopping can never stop the run: it is checked at the evals, and the only one is the
    final eval (trainer.eval_every=0, debug=smoke's, or not below the run's steps)."""
    from trainer.loop.callbacks import EarlyStopping

    every, steps = trainer.cfg.eval_every, trainer.cfg.max_steps
    names = [n for n, cb in trainer.callbacks.callbacks.items() if isinstance(cb, EarlyStopping)]
    if names and (every <= 0 or every >= steps):
        say(f"warning: callbacks.{names[0]} can never stop this run: it is checked at each eval, and with "
            f"trainer.eval_every={every} ({steps} steps) the only eval is the final one. Set trainer.eval_every to a "
            "number of steps below the run's.")


def preflight(cfg: DictConfig, run_dir: Path, device: str = "auto", world_size: int | None = None) -> None:
    """Build what can fail from a config mistake, cheaply, before any worker process starts:
    the strategy, the model on the meta device (no memory), the task, the precision and the datasets
    (whose cache is then built once, here, for all workers). `world_size`: the job's processes where something else
    decided them (torchrun), else world's."""
    from trainer.config.schema import nproc_per_node

    device = usable_device(device)  # (world.device, which the launcher has typed)
    strategy = build_strategy(cfg.world)
    precision = build_node("precision", cfg.precision, device_type=device.type, sharded=strategy.shards_parameters)
    launch = launch_config(cfg.world)
    strategy.check_world(world_size or nproc_per_node(launch.nproc_per_node) * launch.nnodes, precision)  # (the config's
    # own first)
    from trainer.models.finetune import check, factory
    from trainer.parallel.materialize import SkipMetaInit

    with torch.device("meta"), SkipMetaInit():
        model = factory(lambda: _model(cfg.model), cfg.get("finetune"))()
        strategy.check_model(model)
    check(model, cfg.get("finetune"))  # pretrained weights that do not fit the model: before any worker starts
    _task(cfg.task)
    build_data(cfg.data)
    for name, node in (cfg.logger or {}).items():  # trackers' constructors validate and start nothing
        if node is not None:
            build_logger(name, node, run_dir)


# Settings each node may have its own of: its rank, cores, workers and rendezvous address, where it reads its data
# and caches, and what only global rank 0 uses (trackers, the progress display).
NODE_LOCAL = ("world.node_rank", "world.nnodes", "world.threads", "world.nproc_per_node", "world.device",
              "world.rdzv_endpoint", "world.rdzv_timeout", "data.path", "data.cache_dir", "data.num_workers", "logger",
              "trainer.progress")


def refuse_nodes_that_differ(cfg: DictConfig, backend: Backend, run_dir: Path) -> None:
    """Every rank's config against rank 0's, once at the start (one gather): each node's launcher composes its own
    command line, and nodes started with other settings (optim.lr, precision, trainer.max_steps) trained
    different things without a word, or hung at the first step one of them did not take. And on several nodes,
    their run dirs: one dir, which node 0's launcher locked (see `_run_dir_seen`)."""
    if not backend.distributed:
        return
    from trainer.checkpoint.settings import flat

    mine = {k: v for k, v in flat(OmegaConf.to_container(cfg, resolve=True)).items()
            if not any(k == n or k.startswith(n + ".") for n in NODE_LOCAL)}
    every = backend.gather_object((mine, _run_dir_seen(run_dir, backend.world_size)))
    seen = [s for _, s in every]
    if len({lock for _, _, lock in seen}) > 1:
        other = next(s for s in seen if s[2] != seen[0][2])
        (host, path, _), (other_host, other_path, _) = (seen[0], other) if seen[0][2] else (other, seen[0])
        raise ConfigError(f"the nodes of this job do not write one run dir: {host} writes {path}, where node 0's "
                          f"launcher locked the run dir for the job, and {other_host} writes {other_path}, which "
                          f"{'is another path' if other_path != path else 'is another dir by the same path (a disk of its own)'} "
                          "without that lock. Global rank 0, which writes the run's files, is on whichever node the "
                          "rendezvous ranks first. Give every node's command the same hydra.run.dir=DIR, on a "
                          "filesystem they all reach (the default outputs/DATE/TIME differs between nodes started in "
                          "different seconds). Nothing was trained.")
    every = [m for m, _ in every]
    differ = sorted({k for other in every[1:] for k in set(other) | set(every[0]) if other.get(k) != every[0].get(k)})
    if differ:
        first = next(r for r, other in enumerate(every) if any(other.get(k) != every[0].get(k) for k in differ))
        listed = ckpt.listed([f"{k}: {every[0].get(k)!r} on rank 0, {every[first].get(k)!r} on rank {first}"
                              for k in differ])
        raise ConfigError(f"the nodes of this job were started with different settings ({listed}): every node must run "
                          "the same command line, apart from world.node_rank and what is its own (world.threads, "
                          "data.path, data.num_workers, ...). Nothing was trained. Start them again with the same "
                          "overrides (precision=auto may choose differently on nodes of other hardware: name one).")


def _run_dir_seen(run_dir: Path, world_size: int) -> tuple[str, str, str | None]:
    """(host, run dir, the lock record seen there) of this rank, where the job spans nodes under this framework's
    launcher: node 0's launcher took the run dir's lock, writing its record (trainer/runlock.py), before any worker
    started, so every rank of a job writing one run dir reads the same record; else (host, dir, None) alike."""
    import os
    import socket

    from trainer.entry.worker import LAUNCHER_ENV
    from trainer.runlock import LOCK

    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if local >= world_size or LAUNCHER_ENV not in os.environ:  # (one node; or torchrun's, which locks nothing)
        return "", "", None
    try:
        record = (run_dir / LOCK).read_text(errors="replace").strip()
    except OSError:
        record = ""
    return socket.gethostname(), str(run_dir.resolve()), record


def _model(node: DictConfig) -> torch.nn.Module:
    """`model._target_`'s model, which must be a torch module (a plain class's object was an AttributeError deep in
    the strategy, 'NotModule' object has no attribute 'to')."""
    model = build_node("model", node)
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model._target_={node.get('_target_')} returned a value of type {type(model).__name__}, "
                          "not a torch.nn.Module: the model is a module (its parameters are what trains). Point it "
                          "at an nn.Module subclass, or a function returning one.")
    return model


def _task(node: DictConfig):
    """`task._target_`'s task, with the methods a run calls (a task without them was an AttributeError or a
    TypeError at the first step): num_targets, and loss unless it has a training_step of its own."""
    task = build_node("task", node)
    missing = [m for m in ("num_targets", "loss") if not callable(getattr(task, m, None))
               and not (m == "loss" and callable(getattr(task, "training_step", None)))]
    if missing:
        raise ConfigError(f"task._target_={node.get('_target_')} ({type(task).__name__}) has no {' and no '.join(missing)}"
                          f"(): a task gives num_targets(batch), what a batch's loss is averaged over, and loss(model, "
                          "batch) (or a training_step of its own). See the README, Your own model, data and loss.")
    return task


def build(cfg: DictConfig, run_dir: str | Path, preemption=None) -> Trainer:
    """The Trainer a run of `cfg` starts from, on this process (joining the process group if there is one).
    Leave the group with `trainer.backend.teardown()` (`train` does)."""
    run_dir = Path(run_dir)
    launch = launch_config(cfg.world)
    usable_device(launch.device)
    backend = Backend(device=launch.device, threads=launch.threads)
    strategy = build_strategy(cfg.world)
    backend.setup(process_group=strategy.needs_process_group)
    try:
        refuse_nodes_that_differ(cfg, backend, run_dir)
        from trainer.parallel.precision import AUTO_TARGET, emulation_note, resolve_auto

        # precision=auto, unless the CLI resolved it already: rank 0 chooses, every rank computes in its choice.
        if cfg.precision.get("_target_") == AUTO_TARGET:
            cfg, chosen = backend.broadcast_object(resolve_auto(cfg) if backend.is_main else None)
            if backend.is_main:
                print(chosen, flush=True)
        note = emulation_note(cfg.precision, backend.device) if backend.is_main else None
        if note:
            print(note, flush=True)
        tcfg: TrainerConfig = typed(TrainerConfig, cfg.trainer)
        ccfg: CheckpointConfig = typed(CheckpointConfig, cfg.get("checkpoint"))
        ecfg: EMAConfig = typed(EMAConfig, cfg.get("ema"))
        precision = build_node("precision", cfg.precision, device_type=backend.device.type,
                               sharded=strategy.shards_parameters)  # built for the strategy it serves
        strategy.check_world(backend.world_size, precision)  # (a run of one process has no preflight)
        # The runtime sets the strategy up and takes the step's calls: the Trainer is a loop on trainer.Runtime.
        rt = Runtime(strategy, precision, grad_accum_steps=tcfg.grad_accum_steps, seed=tcfg.seed, backend=backend)
        # The same seed on every rank for what the task and the data draw while they are built (a dataset made with
        # torch.randn): the same data on every rank, and at every run of this config.
        seed_everything(tcfg.seed)
        task = _task(cfg.task)
        train_data, val_data = build_data(cfg.data)
        _check_evals_have_data(cfg, val_data)
        if hasattr(task, "setup"):  # e.g. fit a normaliser on the training split (see trainer/task.py)
            from trainer.config.targets import call_refused

            if call_refused(task.setup, train_data, val_data, run_dir):  # (setup(self, train, val): a TypeError)
                raise ConfigError(f"the task's setup ({type(task).__name__}.setup) must take (train, val, run_dir): "
                                  "run_dir is where a task keeps records of its own (None outside a run). Add the "
                                  "parameter, e.g. def setup(self, train, val, run_dir=None).")
            task.setup(train_data, val_data, run_dir)
        if hasattr(task, "training_step"):  # its forwards reach one part of the model at a time
            strategy.expect_unused_parameters()
        # Same seed on every rank: identical initial weights.
        from trainer.models import finetune

        model = rt.build_model(finetune.factory(lambda: _model(cfg.model), cfg.get("finetune")),
                               tcfg.activation_checkpointing)
        weights_source = finetune.start(model, cfg.get("finetune"), tcfg.seed, backend.is_main)  # pretrained, LoRA
        raw_model = unwrap(model)
        frozen = finetune.frozen_keys(raw_model)  # a LoRA run's base: rebuilt on resume, never in checkpoints
        ema = EMA(raw_model, ecfg.decay, ecfg.warmup, ecfg.update_every, frozen) if ecfg.enabled else None
        if tcfg.compile:
            model = torch.compile(model, **compile_args(tcfg))
        say = print if backend.is_main else (lambda *a, **k: None)
        # The model's FLOPs are counted before the optimizers are built: DeepSpeed's ZeRO-3 partitions the
        # parameters then (each rank's numel() goes to 0, and train/mfu read 17x low).
        cost = Cost(raw_model, backend.device, precision.dtype, tcfg.peak_tflops, backend.world_size, say=say)
        registered = rt.models["model"]
        optimizer = build_optimizers(cfg.optim, model, rt, say)
        if rt.models["model"] is not registered:  # a strategy with its own engine wrapped model and optimizer
            model = rt.models["model"]
        if ema is not None:
            ema.attach(strategy)  # (ZeRO-3 partitioned the parameters just now: the EMA keeps this rank's part)
        epochs_to_steps(tcfg, ccfg, epoch_length(train_data), cfg.data.batch_size * tcfg.grad_accum_steps * strategy.dp_size,
                        say)
        scheduler = build_schedulers(cfg.scheduler, optimizer, tcfg.max_steps)
        # Different randomness per rank from here on (dropout), reproducible per (seed, rank).
        seed_everything(tcfg.seed + backend.rank)
        checkpointer = ckpt.Checkpointer(
            run_dir / "checkpoints", ccfg.every_n_steps, ccfg.keep_last, ccfg.best_metric, ccfg.best_mode,
            ccfg.save_final, ccfg.async_save, OmegaConf.to_yaml(OmegaConf.create(redact(OmegaConf.to_container(cfg)))),
            backend=backend, sharded=strategy.sharded)
        data = Data(train_data, val_data, cfg.data.batch_size, cfg.data.get("shuffle", True),
                    cfg.data.get("num_workers", 0))
        trainer = Trainer(
            runtime=rt, model=model, task=task, optimizer=optimizer, scheduler=scheduler, data=data, config=tcfg, loggers=build_loggers(cfg.logger, run_dir, backend.is_main),
            checkpointer=checkpointer, ema=ema, guard=NonFiniteGuard.build(tcfg, precision, optimizer, backend),
            cost=cost,
            components={**({"task": task} if hasattr(task, "state_dict") else {}),
                        **({"finetune": finetune.Source(backend.broadcast_object(weights_source))}
                           if frozen and finetune.settings(cfg.get("finetune")).weights else {})},
            preemption=preemption,
            callbacks=Callbacks({name: build_node(f"callbacks.{name}", node)
                                 for name, node in (cfg.get("callbacks") or {}).items() if node is not None}),
        )
        trainer.config = cfg  # the run's config as built (precision=auto resolved), for what the run records
        trainer.launch = launch  # world's launch keys as typed here: what the entry points read (hang_timeout)
        trainer.weights_source = weights_source  # finetune.weights: path and sha256 of its files (main rank)
        return trainer
    except BaseException:
        backend.teardown()
        raise


def save_config(cfg: DictConfig, run_dir: Path) -> Path:
    """`config.yaml`: the run's resolved config, secrets redacted (what `trainer eval` and `resume` read)."""
    from trainer.io import atomic_write_text

    path = Path(run_dir) / "config.yaml"
    atomic_write_text(path, config_text(cfg))
    return path


def config_text(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(redact(OmegaConf.to_container(cfg))))


def write_run_info(run_dir: Path, cfg: DictConfig, trainer: Trainer) -> None:
    """`run_info.json`: what it takes to reproduce the run, beside config.yaml and .hydra/overrides.yaml."""
    import json
    import os
    import platform
    import subprocess
    import sys
    from importlib import metadata

    from trainer.entry.rundir import JOB_OVERRIDES_ENV
    from trainer.io import atomic_write_json
    from trainer.redaction import secret_values

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=5)
            return out.stdout.strip() if out.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired):
            return None

    commit = git("rev-parse", "HEAD")
    packages = {}
    for name in ("trainer", "torch", "hydra-core", "omegaconf", "wandb", "safetensors", "tqdm"):
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            packages[name] = None
    info = {
        # `python -m trainer ...` as typed, not the path of trainer/__main__.py that Python puts in argv[0]. A sweep's
        # point that a launcher ran in a process of its own (submitit: its _submit.py and a pickle's dir): the
        # command that runs this point alone, in this run dir.
        "command": (["python", "-m", "trainer", *sys.argv[1:]]
                    if Path(sys.argv[0]).parts[-2:] == ("trainer", "__main__.py") else
                    ["python", "-m", "trainer", *json.loads(os.environ[JOB_OVERRIDES_ENV]), f"hydra.run.dir={run_dir}"]
                    if "submitit" in sys.argv[0] and JOB_OVERRIDES_ENV in os.environ else list(sys.argv)),
        "git_commit": commit,
        "git_dirty": bool(git("status", "--porcelain")) if commit else None,
        "seed": trainer.cfg.seed,
        "world_size": trainer.backend.world_size,
        "strategy": type(trainer.strategy).__name__,
        "device": str(trainer.backend.device),
        "precision": {"name": trainer.precision.name, "reason": getattr(trainer.precision, "reason", None)},
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": packages,
        "finetune_weights": getattr(trainer, "weights_source", None),  # the pretrained weights it started from
        "cwd": os.getcwd(),  # where its relative paths (data.path=corpus.txt) were read from (`eval` checks)
        # The job's overrides (a sweep's point's alone), by which a sweep
        # rerun with resume=auto finds this run (trainer/entry/rundir.py, sweep_point_dir).
        "overrides": json.loads(os.environ[JOB_OVERRIDES_ENV]) if JOB_OVERRIDES_ENV in os.environ else None,
    }
    # Secrets out of every value (the command line, and anything else here): the config's and the environment's.
    atomic_write_json(run_dir / "run_info.json", redact(info, secret_values(OmegaConf.to_container(cfg))))


EXPORT_MARKER = "export.json"


def export(trainer: Trainer, cfg: DictConfig, run_dir: Path) -> None:
    """The final weights (and the EMA's, and a stateful task's) as whole tensors in the run dir, then
    `export.json` naming the step and every file of the export with its size and sha256: written last, so a
    missing or older one, or a listed file missing or changed, means the export must be (re)done. Every rank
    takes part under a sharded strategy (each tensor is gathered in turn)."""
    from trainer.io import atomic_write_json
    from trainer.models.export import (
        export_model,
        export_task_state,
        file_digests,
        remove_export,
        write_hf_config,
    )

    ccfg: CheckpointConfig = typed(CheckpointConfig, cfg.get("checkpoint"))
    model_config = redact(OmegaConf.to_container(cfg.model, resolve=True))
    base = OmegaConf.select(cfg, "finetune.weights", default=None)  # (a LoRA adapter's base, by its absolute path)
    base = str(Path(base).expanduser().absolute()) if isinstance(base, str) and base else None
    if trainer.backend.is_main:  # an earlier export's temp files (.model.safetensors.XXXX.tmp: a process killed while
        for stale in run_dir.glob(".*.tmp"):  # it wrote them, whole copies of the weights), kept for good otherwise
            if stale.is_file() and not stale.is_symlink():  # (this run holds the run dir: no other writer's)
                stale.unlink(missing_ok=True)
    parts = [("model", trainer.strategy.model_state_dict(trainer.model))]
    if trainer.ema is not None:
        parts.append(("model_ema", trainer.ema.model_state_dict()))
    files: list[str] = []
    try:
        for name, state in parts:
            if not (trainer.backend.is_main or trainer.strategy.sharded):
                continue
            tensors = trainer.strategy.full_state_dict(state)
            if trainer.backend.is_main:
                files += export_model(tensors, run_dir, name, model_config, ccfg.max_shard_mb, base)
        if trainer.backend.is_main:
            if trainer.ema is None:  # an earlier export's EMA weights (ema.enabled turned off on a resume): not these
                remove_export(run_dir, "model_ema")
            if hasattr(trainer.task, "state_dict"):
                files.append(export_task_state(trainer.task.state_dict(), run_dir))
            files += write_hf_config(trainer.raw_model, run_dir)  # a Hugging Face model's: from_pretrained(RUN_DIR)
            atomic_write_json(run_dir / EXPORT_MARKER, {"step": trainer.step, "names": [n for n, _ in parts],
                                                        "files": file_digests(run_dir, sorted(set(files))),
                                                        "stopped": trainer.stop_reason or None})
    except OSError as e:
        raise StorageError(f"could not write the exported weights to {run_dir} ({e.strerror or e}). The final "
                           f"checkpoint (step {trainer.step}) is complete: free disk space and rerun with "
                           "resume=auto, which writes the export.") from None


def set_earlier_attempt_aside(run_dir: Path, cfg: DictConfig, loggers, is_main: bool, say, why: str,
                              checkpoints: Path | None = None) -> None:
    """A run dir's run starting over (no checkpoint found, or another run's checkpoint): what its earlier attempt
    wrote is kept beside, never overwritten, spliced into or pruned: its events (metrics.prev.jsonl), exported
    weights (export.prev/: with checkpoint.save_final=false their only copy), config.yaml (config.prev.yaml),
    run_info.json (run_info.prev.json: the command it ran) and, given `checkpoints`, its checkpoints
    (checkpoints.prev/)."""
    from trainer.errors import StorageError
    from trainer.models.export import set_aside

    loggers.start_fresh()
    if not is_main:
        return
    try:
        aside = set_aside(run_dir)
        # An earlier attempt's TensorBoard events where this run logs none there (no logger=tensorboard, whose own
        # start_fresh moved them): kept under this start's number too, not shown as this run's curves nor set aside
        # by a later start under the next number.
        from trainer.io import free_name

        board = run_dir / "tensorboard"
        if board.is_dir() and not board.is_symlink() and any(board.glob("events.out.tfevents.*")):
            board.rename(free_name(board, ".prev"))
        # An earlier attempt's config.yaml, or a file of the user's own; not the one the CLI wrote for this very job
        # before its workers started (the same text).
        earlier = run_dir / "config.yaml"
        if earlier.is_file() and not earlier.is_symlink() and earlier.read_text() != config_text(cfg):
            earlier.replace(free_name(earlier, ".prev", before_suffix=True))
        info = run_dir / "run_info.json"  # (this start writes its own once it trains)
        if info.is_file() and not info.is_symlink():
            info.replace(free_name(info, ".prev", before_suffix=True))
        moved = ckpt.set_aside(checkpoints) if checkpoints is not None and ckpt.Checkpointer(checkpoints).complete() else None
    except OSError as e:
        raise StorageError(f"could not move the earlier attempt's files in {run_dir} aside ({e.strerror or e}); "
                           "nothing was overwritten. Make the run dir writable, or give this run a dir of its own "
                           "(hydra.run.dir=...).") from None
    if aside is not None:
        say(f"{why}: the earlier attempt's exported weights are kept in {aside}.")
    if moved is not None:
        say(f"{why}: the earlier attempt's checkpoints are kept in {moved}.")


def export_record(run_dir: Path) -> dict | None:
    """{"step": the step of the run dir's complete export, "stopped": why the run stopped before its length (early
    stopping), or None}; None when there is no complete export (export.json, every file it lists as written)."""
    import json

    from trainer.models.export import export_intact

    try:
        marker = json.loads((run_dir / EXPORT_MARKER).read_text())
        if not export_intact(run_dir, marker["files"]):
            return None
        stopped = marker.get("stopped")
        return {"step": int(marker["step"]), "stopped": stopped if isinstance(stopped, str) else None}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def later_export_kept(trainer, cfg: DictConfig, run_dir: Path, source: Path, say) -> bool:
    """Whether the run goes on from `source` with the run dir's export safe. An export of a later step than the
    checkpoint (checkpoint.save_final=false keeps no checkpoint of the final step) means the run got further than
    `source`: resume=auto then either finds the run finished there (False: nothing to do) or stops, since going
    on would retrain those steps over that export. A checkpoint named on purpose (a rollback), or the one
    resume=auto fell back to past a damaged newer one, goes on, the export kept in export.prev/."""
    from trainer.checkpoint.store import step_of
    from trainer.errors import CheckpointError, StorageError
    from trainer.models.export import set_aside

    backend = trainer.backend
    named = cfg.get("resume") not in (None, "auto") and step_of(Path(cfg.resume)) >= 0  # (not resume=RUN_DIR)
    # Named, a checkpoint of a branch set aside shares the run's line up to the step that branch left it at: an
    # export after that is the line's this job leaves (back to a finished branch, it was kept as that branch's).
    shared = trainer.step
    if named and backend.is_main and trainer.checkpointer.dir is not None:
        shared = min(shared, trainer.checkpointer.branch_point(source))
    record, shared = backend.broadcast_object((export_record(run_dir), shared) if backend.is_main else None)
    later = record["step"] if record is not None else None
    if later is None or later <= shared:
        return True
    if not named and not trainer.checkpointer.fell_back:
        if later >= trainer.cfg.max_steps or record["stopped"]:
            why = (f"{record['stopped']}, at step {later}" if record["stopped"] else
                   f"its export is of step {later} >= trainer.max_steps={trainer.cfg.max_steps}")
            say(f"the run is already finished: {why} (its newest checkpoint, {source.name}, is of step "
                f"{trainer.step}: checkpoint.save_final=false keeps none of the final step). Nothing was changed.")
            return False
        raise CheckpointError(
            f"resume=auto: the run's exported weights ({run_dir / EXPORT_MARKER}) are of step {later}, later than its "
            f"newest checkpoint ({source}, step {trainer.step}; checkpoint.save_final=false keeps none of the final "
            f"step), so going on from there would train steps {trainer.step + 1}-{later} again and replace that "
            f"export. Nothing was changed. To do so anyway, pass resume={source} (the export is then kept in "
            f"export.prev/); to train on from step {later}'s weights, start a new run from them "
            f"(finetune.weights={run_dir} in a run dir of its own).")
    if backend.is_main:
        try:
            aside = set_aside(run_dir)
        except OSError as e:
            raise StorageError(f"could not move the export of step {later} in {run_dir} aside ({e.strerror or e}); "
                               "nothing was overwritten. Make the run dir writable.") from None
        say(f"resume={cfg.get('resume')}: the exported weights of step {later} are kept in {aside}.")
        if named:  # (a rollback: its events are kept too; not resume=auto's fallback past a damaged checkpoint)
            trainer.checkpointer.abandoned.append(f"the export of step {later}")
    return True


def exported(run_dir: Path, step: int) -> bool:
    """Whether export.json says the export of step `step` is complete, and every file it lists is as written."""
    return (export_record(run_dir) or {}).get("step") == step


EVAL_DATA_GIVEN_ENV = "TRAINER_EVAL_DATA_GIVEN"  # set by `eval` for its processes: data=/data.* given on its command line


def check_eval_data(trainer, cfg: DictConfig) -> None:
    """An eval with the run's own data settings must read the run's data: a relative data.path is read from the
    current directory, so an eval started elsewhere read another file (or none) and reported its numbers as the
    run's. The training set's fingerprint (the lm recipe's sha256 of its tokens) the checkpoint recorded tells.
    Data settings of the user's own (data.path=... on purpose) evaluate what they name."""
    import os

    from trainer.inference.finished import refuse_other_data

    if not os.environ.get(EVAL_DATA_GIVEN_ENV):
        refuse_other_data(getattr(trainer, "trained_on", None), trainer.data.identity(), cfg.resume)


class CheckpointVanished(CheckpointError):
    """The checkpoint an eval chose was deleted before it was read (a run still training pruned it)."""

    @classmethod
    def of(cls, path) -> CheckpointVanished:
        return cls(f"checkpoint {path} was removed while this eval started: the run is still training, and its "
                   "checkpoint.keep_last pruned it. Run the eval again (it takes the newest checkpoint then), or name "
                   "one the run keeps (checkpoint=best, or a copy's path).")


def evaluate(cfg: DictConfig, run_dir: str | Path) -> dict[str, float]:
    """The val metrics of the checkpoint `cfg.resume` names (its weights, and its EMA's when the run kept one),
    on this config's world; `run_dir` is scratch space. The main rank prints them as one JSON line."""
    import json

    trainer = build(cfg, Path(run_dir))
    done = False
    watch = watchdog.start(trainer.launch.hang_timeout, run_dir, trainer.backend.info)
    try:
        try:
            trainer.load_checkpoint(Path(cfg.resume), resume=False)
        except CheckpointError:
            if Path(cfg.resume).exists():
                raise
            raise CheckpointVanished.of(cfg.resume) from None
        watchdog.beat()
        check_eval_data(trainer, cfg)
        metrics = trainer.evaluate()
        if trainer.ema is not None:
            with trainer.ema.swapped_in():
                metrics.update(trainer.evaluate(prefix="val_ema"))
        if trainer.backend.is_main:
            if not metrics:  # (the line alone, with no metric in it, said nothing of why)
                data = cfg.get("data") or {}
                how = ("data.val_path=FILE" if "val_path" in data else "data.val_fraction=F (0 < F < 1: the last part "
                       "of the data)" if "val_fraction" in data else f"the settings of its data._target_ "
                       f"({data.get('_target_')}) that give one")
                print(f"note: the run's data has no val split, so there is nothing to evaluate: name one with {how}, "
                      "after the run dir.", file=sys.stderr, flush=True)
            print(json.dumps({"checkpoint": str(cfg.resume), "step": trainer.step, **metrics}), flush=True)
        done = True
        return metrics
    finally:
        try:
            trainer.backend.teardown(wait_for_peers=done)
        finally:
            watch.stop()


def tune_batch_size(cfg: DictConfig, run_dir: str | Path) -> int | None:
    """`python -m trainer tune batch_size` on every rank (trainer/entry/tuning.py)."""
    from trainer.entry.tuning import find_batch_size

    return find_batch_size(cfg, Path(run_dir))


def tune_lr(cfg: DictConfig, run_dir: str | Path) -> float | None:
    """`python -m trainer tune lr` on every rank (trainer/entry/tuning.py)."""
    from trainer.entry.tuning import find_lr

    return find_lr(cfg, Path(run_dir))


def script(cfg: DictConfig, run_dir: str | Path) -> None:
    """`python -m trainer launch ... SCRIPT.py ARGS`, on every rank: the user's script as `__main__`, with the job's
    config where `trainer.Runtime()` finds it."""
    import json
    import os
    import runpy
    import sys

    from trainer.entry.commands import SCRIPT_ENV
    from trainer.errors import TrainerExit
    from trainer.loop.runtime import LAUNCH_ENV

    path, *args = json.loads(os.environ[SCRIPT_ENV])
    ours = LAUNCH_ENV not in os.environ  # one process: the launcher started no workers, so it is not set yet
    if ours:
        os.environ[LAUNCH_ENV] = json.dumps(OmegaConf.to_container(cfg))
    argv, sys.argv = sys.argv, [path, *args]
    sys.path.insert(0, str(Path(path).parent))
    # The script's trainer.Runtime starts the watch at its loop's first forward or step (world.hang_timeout).
    watchdog.arm(launch_config(cfg.world).hang_timeout, run_dir)
    try:
        runpy.run_path(path, run_name="__main__")
    except (TrainerExit, SystemExit, KeyboardInterrupt):
        raise
    except Exception as e:
        _script_crashed(e, alone=ours)
        raise
    finally:
        watchdog.disarm()
        sys.argv = argv
        sys.path.remove(str(Path(path).parent))
        if ours:
            os.environ.pop(LAUNCH_ENV, None)


def script_traceback(e: BaseException) -> str | None:
    """The traceback of a launched script's own exception from the script's first frame (the CLI's, the
    launcher's, the worker's and runpy's frames came first: a dozen lines that are not the script's); None where
    it did not pass through the script, or TRAINER_DEBUG=1 asks for all."""
    import json
    import os
    import traceback

    from trainer.entry.commands import SCRIPT_ENV
    from trainer.errors import debug_enabled

    if SCRIPT_ENV not in os.environ or debug_enabled():
        return None
    path, tb = json.loads(os.environ[SCRIPT_ENV])[0], e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != path:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(e), e, tb)) if tb is not None else None


def _script_crashed(e: Exception, alone: bool) -> None:
    """A launched script's own crash in one process: its traceback (`script_traceback`), exit 1. On several
    processes each worker records its own so (trainer/entry/worker.py), and the launcher reports it."""
    shown = script_traceback(e) if alone else None
    if shown is not None:
        print(shown, end="", file=sys.stderr, flush=True)
        sys.exit(1)


def train(cfg: DictConfig, run_dir: str | Path) -> dict[str, float]:
    """Train with a prepared config, writing outputs to `run_dir`: on the worker processes its world asks for
    (started here, as the CLI starts them), or in this process. Returns the final metrics."""
    from trainer import runlock
    from trainer.entry import launcher

    if not isinstance(cfg, DictConfig):  # (a dict, or a list of overrides: compose builds the config they mean)
        raise ConfigError(f"trainer.train takes the config trainer.compose returns (an omegaconf DictConfig), not a "
                          f"{type(cfg).__name__}: trainer.train(trainer.compose(['recipe=lm', ...]), run_dir).")
    if not isinstance(run_dir, str | os.PathLike):
        raise ConfigError(f"trainer.train(cfg, run_dir): run_dir={run_dir!r} is not a path: pass the directory the "
                          "run writes (new or existing).")
    from trainer.config.schema import validate
    from trainer.entry.rundir import refuse_as_run_dir

    # What the CLI checks before a run, as a notebook may change the config after compose (cfg.trainer.max_steps =
    # -3 trained; a batch size of 0 was a ZeroDivisionError) or name a checkpoint as the run dir (trained over it).
    refuse_as_run_dir(os.fspath(run_dir), "run_dir", "pass a new one")
    try:
        validate(cfg)
    except (OmegaConfBaseException, KeyError, AttributeError) as e:  # (a config missing a section compose gives)
        raise ConfigError(f"trainer.train: the config lacks what a run reads ({type(e).__name__}: {e}). Build it "
                          "with trainer.compose([...]) and change its values, not its sections.") from None
    # One job per run dir, as the CLI's (trainer/runlock.py): two notebooks training into one dir interleaved
    # their metrics and checkpoints. A worker's launcher holds it for the job; the CLI's job here already does.
    made = not Path(run_dir).exists()
    owned = None if launcher.in_torchrun() else runlock.hold(Path(run_dir), "run_dir (trainer.train's second argument)")
    try:
        if launcher.starts_workers(cfg):  # trainer.train(cfg) of a world of several processes
            return launcher.run(cfg, Path(run_dir)) or {}
        return train_here(cfg, run_dir)
    except UserError:
        if made and owned is not None:  # (a refused run left its new dir with the lock alone, where the CLI's goes)
            runlock.remove_if_unused(Path(run_dir), {runlock.LOCK, "config.yaml", "run_info.json"})
        raise
    finally:
        if owned is not None:
            owned.release()


def setup_failed(run_dir: Path, e: OSError, then: str) -> StorageError:
    """The paragraph for an OSError while a run dir is set up (before any step): what failed, on which file, and the
    way out its errno points at (`then`: what to do once fixed)."""
    import errno

    where = f": {e.filename}" if getattr(e, "filename", None) else ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        fix = "Free disk space (or give the run a dir on a larger disk)"
    elif e.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR, errno.EEXIST):
        fix = "Make the place writable (or give the run another dir)"
    else:
        fix = "Fix what the error names"
    return StorageError(f"setting the run dir {run_dir} up failed ({e.strerror or e}{where}); nothing was trained, "
                        f"and nothing the dir held was overwritten or deleted. {fix}, then {then}.")


@contextlib.contextmanager
def _run_dir_writes(run_dir: Path):
    """What a start writes before its first step (what the resume rewinds or sets aside, the config, the run's
    records): an OSError there (a full disk, a read-only place) is a StorageError, one paragraph and exit 74, not a
    traceback. Nothing has been trained in this start, and each file is written whole or not at all."""
    try:
        yield
    except OSError as e:
        raise setup_failed(run_dir, e, "rerun the same command") from None


def train_here(cfg: DictConfig, run_dir: str | Path) -> dict[str, float]:
    """`train` in this process, whatever world size the config asks for (a worker's, and `trainer check`'s runs)."""
    from trainer.loop.preemption import PreemptionFlag

    run_dir = Path(run_dir)
    # From the very start: a SIGTERM while the model or the data are built stops the run with exit 75 too.
    preemption = PreemptionFlag().install()
    finished = False
    try:
        trainer = build(cfg, run_dir, preemption)
    except BaseException:
        preemption.uninstall()
        raise
    backend, loggers, cfg = trainer.backend, trainer.loggers, trainer.config
    say = print if backend.is_main else (lambda *a, **k: None)
    warn_long_warmup(cfg.scheduler, trainer.cfg.max_steps, say)  # (a training run's: eval builds the same Trainer)
    warn_unchecked_early_stopping(trainer, say)
    from trainer.data.streaming import sized

    val = trainer.data.val
    if (val is None or sized(val) == 0) and (trainer.cfg.eval_every or trainer.cfg.eval_every_epochs):
        say(f"note: data._target_={cfg.data.get('_target_')} built no val split, so this run has no evals (no val/ "
            "metrics) whatever trainer.eval_every says.")  # (the run went on without them, without a word)
    # From here to the end (teardown included), no progress for world.hang_timeout s stops the job (exit 70).
    watch = watchdog.start(trainer.launch.hang_timeout, run_dir, backend.info)
    try:
        trainer.data.check_readers(trainer.strategy.dp_size)  # (a training run's: eval builds the same Trainer)
        trainer.data.check_batch()
        # Setting the run dir up for this start: a full disk or a read-only place is one paragraph (exit 74).
        with _run_dir_writes(run_dir):
            trainer.checkpointer.check_writable()  # (before the resume, which may set an earlier attempt's files aside)
            with one_attempt(run_dir):  # (one number for all this start sets aside: checkpoints.prev-3 with metrics.prev-3)
                restarts = backend.info.restart_count
                if restarts:  # (torch's agent restarts the workers without a word of its own but a SIGTERM warning)
                    say(f"elastic restart {restarts} of world.max_restarts={trainer.launch.max_restarts}: a worker of "
                        "the previous attempt failed (its error, if it left one, is above); every worker restarts "
                        "from the newest checkpoint.")
                source = resume(trainer, cfg, say)
                watchdog.beat()
                if source is not None:
                    epochs_after_resume(trainer, (cfg.get("checkpoint") or {}).get("every_n_epochs"), say)
                    own = trainer.checkpointer.dir
                    elsewhere = own is not None and source.resolve().parent != own.resolve()
                    elsewhere = backend.broadcast_object(elsewhere and not ckpt.same_run(run_dir, source) if backend.is_main else None)
                    if elsewhere:  # another run's checkpoint: this run dir's own attempt is kept aside, not spliced into
                        trainer.count_from_here()
                        set_earlier_attempt_aside(run_dir, cfg, loggers, backend.is_main, say, f"starting from {source}", own)
                    else:
                        if not later_export_kept(trainer, cfg, run_dir, source, say):
                            loggers.finish({})
                            finished = True
                            return {}
                        # A rollback (resume=PATH to an earlier checkpoint of this run): the branch it leaves is kept.
                        branch = None
                        if backend.is_main and not trainer.checkpointer.fell_back and not backend.info.restart_count:
                            branch = set_abandoned_branch_aside(trainer.checkpointer, source, trainer.step, loggers,
                                                                run_dir, config_text(cfg), say,
                                                                tuple(trainer.checkpointer.abandoned))
                        if branch is not None:  # back to a branch set aside: its own events up to the checkpoint
                            loggers.take_branch(*branch, upto=trainer.step, run_dir=run_dir)
                        else:
                            loggers.rewind(trainer.step)  # drop events logged after the checkpoint
                    if source.name in trainer.checkpointer.taken_back:  # (back in the run's line: see branch_from)
                        source = trainer.checkpointer.dir / source.name
                    say(f"resumed from {source} at step {trainer.step}")
                    if trainer.finished:
                        if backend.is_main and not (run_dir / "config.yaml").is_file():  # (a branch's, set aside)
                            save_config(cfg, run_dir)
                        if not backend.broadcast_object(exported(run_dir, trainer.step)):
                            say(f"the run finished at step {trainer.step} but its export is missing or incomplete: writing it.")
                            export(trainer, cfg, run_dir)
                        epochs = trainer.cfg.max_epochs
                        say(f"the run is already finished: {trainer.stop_reason or 'step'}"
                            + ("" if trainer.stop_reason else f" {trainer.step} >= trainer.max_steps={trainer.cfg.max_steps}"
                               + (f" (trainer.max_epochs={epochs}). Raise trainer.max_epochs" if epochs is not None
                                  else ". Raise trainer.max_steps") + " to train further."))
                        loggers.finish({})
                        finished = True
                        return {}
                else:
                    set_earlier_attempt_aside(run_dir, cfg, loggers, backend.is_main, say, "starting fresh")
            if backend.is_main:
                save_config(cfg, run_dir)  # (the CLI wrote it before the workers started; this is the API's path)
                if hasattr(trainer.task, "write_records"):  # a task's own records (diffusion's normaliser), now too
                    trainer.task.write_records(run_dir)
                loggers.log_config(OmegaConf.to_container(cfg, resolve=True))
                write_run_info(run_dir, cfg, trainer)
        try:
            final = trainer.fit()
            export(trainer, cfg, run_dir)
            trainer.note_late_stop("while the weights were exported")
        except BaseException as e:
            # Every rank stops at the same step boundary on preemption: they can leave together.
            finished = isinstance(e, Preempted)
            loggers.finish({}, exit_code=getattr(e, "exit_code", 1))  # trackers mark the run failed/preempted
            raise
        loggers.finish(final)
        finished = True
        return final
    finally:
        preemption.uninstall()
        try:
            backend.teardown(wait_for_peers=finished)
        finally:
            watch.stop()


# What a job runs on every rank (trainer/entry/launcher.py passes the function; workers find it here by its name).
ENTRY_POINTS = {f.__name__: f for f in (train, evaluate, tune_batch_size, tune_lr, script)}
