"""`trainer.Runtime`: the framework's machinery for a loop you write yourself, and the one the Trainer runs on.

Coming from Accelerate or Lightning Fabric, a script keeps its loop and gains five calls::

    rt = trainer.Runtime(world="ddp", precision="bf16", grad_accum_steps=4)
    model, optimizer = rt.setup(model, optimizer)        # placed, wrapped (DDP) or sharded (FSDP, tp)
    loader = rt.loader(dataset, batch_size=8)           # this rank's part of one global sample stream
    for batch in loader:
        with rt.accumulate(model):                       # gradients synced in a step's last micro-step only
            with rt.autocast():
                loss = model(batch)
            rt.backward(loss)
        if rt.sync_gradients:                            # the step's gradients are all there
            rt.clip_grad_norm_(model, 1.0)
        rt.step(optimizer, scheduler)                    # steps, schedules and zeroes at the boundary only

The Runtime owns the process (device, process group, threads: `Backend`), the strategy (how models are placed,
wrapped and sharded, and gradients synced and clipped) and the precision (autocast, loss scaling), which it
builds for the strategy. It registers every model, optimizer and loader it sets up, so `save_state` and
`load_state` checkpoint all of them in the framework's pickle-free format (resumable under any strategy and
world size), and `save_model` exports one as safetensors. The declarative Trainer (trainer/loop/trainer.py) takes its
steps through the same calls: there is one code path.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import operator
import os
import re
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from trainer.checkpoint.store import is_count
from trainer.errors import CheckpointError, ConfigError, UserError, a_, suggest
from trainer.loop import watchdog
from trainer.loop.loaders import EvalLoader, Loader, RunPosition
from trainer.parallel import Strategy, unwrap
from trainer.parallel.backend import Backend, usable_device
from trainer.parallel.strategy import SingleDevice
from trainer.task import split_loss

WORLDS = ("single", "ddp", "fsdp", "deepspeed")
# What a run dir holds beside checkpoints, which no directory of checkpoints alone does.
RUN_FILES = (".lock", "metrics.jsonl", "samples.jsonl", "config.yaml", "run_info.json", "model.safetensors")


def _strategy(world: str | Strategy, options: dict[str, Any]) -> Strategy:
    if isinstance(world, Strategy):
        return world
    from trainer import parallel as strategies

    if world not in WORLDS:
        raise UserError(f"Runtime(world={world!r}) is invalid: expected one of {', '.join(WORLDS)} (or a Strategy).")
    from trainer.config.targets import check_scalar_types

    classes = {"single": "SingleDevice", "ddp": "DDP", "fsdp": "FSDP", "deepspeed": "DeepSpeed"}
    cls = getattr(strategies, classes[world])
    # (a string where a bool or a number goes, reshard_after_forward="no": torch's traceback at rt.setup, as the CLI
    # refuses world.KEY=VALUE of the wrong kind)
    check_scalar_types(f"Runtime({world!r}, world_options=...): world", cls, options)
    try:
        return cls(**options)
    except TypeError as e:
        raise UserError(f"Runtime(world={world!r}, world_options={options!r}): {e}. The options are the keys of "
                        f"conf/world/{world}.yaml but the launch keys.") from None


def _precision(precision: Any, device_type: str, sharded: bool):
    from trainer.parallel import precision as modes

    if not isinstance(precision, str):
        if not (callable(getattr(precision, "autocast", None)) and hasattr(precision, "scaler")):
            # (Runtime(precision=torch.float16) was taken, and the first rt.autocast() an AttributeError)
            raise UserError(f"Runtime(precision={precision!r}) is invalid: expected one of 'auto', "
                            f"{', '.join(repr(m) for m in modes.MODES)} (a name, not a dtype).")
        return precision
    if precision == "auto":
        return modes.auto(device_type, sharded=sharded)
    if precision not in modes.MODES:
        accelerates = {"no": " ('no' is Accelerate's name for fp32: precision='fp32')",
                       "fp8": " (fp8 is not supported)"}.get(precision.lower(), "")
        raise UserError(f"Runtime(precision={precision!r}) is invalid: expected one of auto, "
                        f"{', '.join(modes.MODES)}{accelerates}.")
    return modes.MODES[precision](device_type, sharded=sharded)


# What DistributedDataParallel raises at the forward after a backward that left trainable parameters without a
# gradient (without find_unused_parameters): the step before ran on gradients its buckets never averaged.
UNUSED_BY_DDP = "Expected to have finished reduction in the prior iteration"


def _unused_parameters(model: nn.Module, torch_says: str) -> UserError:
    """DDP's unused-parameter error as one paragraph naming the parameters (torch names their indices among the
    trainable ones)."""
    import re

    trainable = [n for n, p in getattr(model, "module", model).named_parameters() if p.requires_grad]
    found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", torch_says)
    indices = [int(i) for i in found.group(1).split()] if found else []
    names = [trainable[i] for i in indices if i < len(trainable)]
    listed = (", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")) if names else \
        "torch does not say which"
    return UserError(f"the model has trainable parameters its forward left without a gradient ({listed}): "
                     "DistributedDataParallel waits for those in every backward, and the gradients it buckets with "
                     "them were never averaged, so the run stopped at the next forward. Turn on its search for them, "
                     "world.find_unused_parameters=true (world.static_graph=true where the same ones are unused every "
                     "step; Runtime('ddp', world_options={...}) in a loop of your own), or freeze them "
                     "(requires_grad_(False)). No checkpoint was written since the last one.")


class Runtime:
    """Everything a training loop needs from the framework, for one process of a job.

    `world`: "single", "ddp", "fsdp" or "deepspeed" (or a Strategy), with `world_options` (the keys of
    conf/world/*.yaml: `tp`, `bucket_cap_mb`, `reshard_after_forward`, `stage`, ...). `precision`: "fp32", "bf16",
    "fp16" or "auto" (or a
    precision object built for the strategy). Left at None, both come from the config of the job when the script
    runs under `python -m trainer launch SCRIPT.py [overrides]`, else "single" and "fp32". Run it under that
    launcher, under torchrun, or as a plain `python script.py` (one process).
    """

    def __init__(self, world: str | Strategy | None = None, precision: Any = None, *,
                 grad_accum_steps: int | None = None, seed: int | None = None, device: str | None = None,
                 threads: int | str | None = None, world_options: dict[str, Any] | None = None,
                 log_with: list[str] | str | None = None, run_dir: str | os.PathLike | None = None,
                 backend: Backend | None = None, **unknown: Any):
        # Under `launch`, what the script passes wins and the job's config gives the rest (it once gave all of it:
        # Runtime(grad_accum_steps=2) ran with the config's 1, and Runtime(precision=...) dropped the job's world).
        launched = launched_config() if backend is None else None
        if launched is None and backend is None:
            _one_paragraph_errors()  # (under launch, the worker reports them: exit 2)
        if unknown:  # (Accelerator's keywords were a bare TypeError)
            _refuse_keywords(unknown)
        if isinstance(world, str) and not world.strip():  # (taken as single without a word)
            raise UserError("Runtime(world='') is empty: pass 'single', 'ddp', 'fsdp' or 'deepspeed' (or leave it "
                            "out: under launch the job's world=, else single).")
        if world_options is not None and not isinstance(world_options, dict):  # ("tp=2" was a bare ValueError)
            raise UserError(f"Runtime(world_options={world_options!r}) is invalid: expected a dict of the strategy's "
                            "options, e.g. world_options={'tp': 2}.")
        if log_with is not None and not (isinstance(log_with, str) or (
                isinstance(log_with, list | tuple) and all(isinstance(n, str) for n in log_with))):
            raise UserError(f"Runtime(log_with={log_with!r}) is invalid: expected a tracker's name or a list of them "
                            "('wandb', 'tensorboard').")
        if launched is not None and world is None:
            from trainer.config.instantiate import build_strategy

            strategy = build_strategy(launched.world)
        else:
            strategy = _strategy(world or "single", dict(world_options or {}))
        if launched is not None:
            device = launched.world.get("device", "auto") if device is None else device
            threads = launched.world.get("threads", "auto") if threads is None else threads
            grad_accum_steps = launched.trainer.get("grad_accum_steps", 1) if grad_accum_steps is None else grad_accum_steps
            seed = launched.trainer.get("seed", 0) if seed is None else seed
        grad_accum_steps = 1 if grad_accum_steps is None else grad_accum_steps
        device, threads = device or "auto", "auto" if threads is None else threads
        if not isinstance(grad_accum_steps, int) or isinstance(grad_accum_steps, bool) or grad_accum_steps < 1:
            raise UserError(f"Runtime(grad_accum_steps={grad_accum_steps!r}) is invalid: expected an integer >= 1.")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):  # (failed at the first batch)
            raise UserError(f"Runtime(seed={seed!r}) is invalid: expected an integer.")
        if threads != "auto" and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
            raise UserError(f"Runtime(threads={threads!r}) is invalid: expected 'auto' or an integer >= 1 (the CPU "
                            "threads each process computes with).")
        if run_dir is not None:
            _path_arg("Runtime(run_dir=...)", run_dir)
        if backend is None:
            usable_device(device, named="world.device={!r}" if launched is not None else "Runtime(device={!r})")
        self.backend = backend or Backend(device=device, threads=threads)
        self.strategy = strategy
        made_group = not torch.distributed.is_initialized()  # (a group the caller made is the caller's to end)
        self.backend.setup(process_group=strategy.needs_process_group)
        if isinstance(strategy, SingleDevice) and self.backend.world_size > 1 and backend is not None:  # (a run's)
            raise UserError(f"world=single was started on {self.backend.world_size} processes (rank "
                            f"{self.backend.rank}, by torchrun or another launcher): each would train a copy of its "
                            "own on its share of the batches, their gradients never averaged. Use world=ddp (or "
                            "world=fsdp) under a launcher, or start it as one process: python -m trainer ...")
        if isinstance(strategy, SingleDevice) and self.backend.world_size > 1:
            raise UserError(f"Runtime({world!r}) was started on {self.backend.world_size} processes (rank "
                            f"{self.backend.rank}): each would train a copy of its own on its share of the batches, "
                            "their gradients never averaged. Use Runtime('ddp') (or 'fsdp') in a script started on "
                            "several processes, or start it as one: python SCRIPT.py.")
        # One job per run dir, as the CLI's (trainer/runlock.py): two scripts writing one run_dir at once
        # interleaved their metrics.jsonl, tracker files and checkpoints there. The main rank holds it until rt.end().
        self._run_dir_hold = None
        self._unused_dir = None  # a run dir this Runtime made, removed at exit if the script never got to use it
        if backend is None and run_dir is not None:
            made = not Path(run_dir).exists()
            self._run_dir_hold = self._hold_run_dir(Path(run_dir), alone=launched is None and made_group)
            if made and self._run_dir_hold is not None:
                # A script refused after this (rt.setup of a wrong object, a mistake in its own code before its
                # first rt.log) left a new dir holding the lock and an empty metrics.jsonl. rt.end() keeps the dir;
                # so does anything written there.
                # At the process's exit, not when this object goes (a function's Runtime, dropped before the
                # script wrote its own files there, took the dir from under it).
                import atexit

                from trainer import runlock

                def remove_unused(path: Path = Path(run_dir)) -> None:
                    runlock.remove_if_unused(path, {runlock.LOCK})

                atexit.register(remove_unused)
                self._unused_dir = remove_unused
        if launched is not None and precision is None:
            from trainer.config.instantiate import build_node
            from trainer.parallel.precision import AUTO_TARGET, resolve_auto

            cfg = launched
            if cfg.precision.get("_target_") == AUTO_TARGET:  # rank 0 chooses, every rank computes in its choice
                cfg, chosen = self.backend.broadcast_object(resolve_auto(cfg) if self.backend.is_main else None)
                if chosen and self.backend.is_main:  # (what it chose, and why: as `python -m trainer` says it)
                    print(chosen, flush=True)
            precision = build_node("precision", cfg.precision, device_type=self.backend.device.type,
                                   sharded=strategy.shards_parameters)
        self.precision = _precision(precision or "fp32", self.backend.device.type, strategy.shards_parameters)
        try:
            strategy.setup(self.backend, self.precision)
        except BaseException as e:
            # A script's own Runtime (not the framework's run, eval or tune, which pass their backend) on one process.
            alone = launched is None and backend is None and not self.backend.distributed
            if alone and made_group:
                self.backend.teardown()  # (the process group of one it made: a later Runtime makes its own)
            if not (alone and isinstance(e, ConfigError)
                    and max(getattr(strategy, "tp", 1) or 1, getattr(strategy, "pp", 1) or 1) > 1):
                raise
            # A layout over several processes in a script started with `python script.py`: the fix is how it is
            # started, not world.* (which such a script has nowhere to set).
            raise ConfigError(f"{e} This script runs as one process: start it on several, e.g. `python -m trainer "
                              f"launch world=... world.nproc_per_node=N SCRIPT.py` (or torchrun --nproc-per-node N "
                              "SCRIPT.py).") from None
        self.grad_accum_steps, self.seed = grad_accum_steps, 0 if seed is None else seed
        # How many checkpoints save_state keeps: the job's checkpoint.keep_last under launch.
        self.keep_last = launched.checkpoint.get("keep_last", 2) if launched is not None else 2
        self.run_dir = Path(run_dir) if run_dir is not None else None
        # Under `launch`, the job's hang watch (world.hang_timeout) follows this loop's progress: a forward of a set-up
        # model, a backward, an optimizer step, a save or a load (trainer/loop/watchdog.py; the Trainer beats itself).
        self._watched = launched is not None
        self.loggers = self._loggers(launched, log_with)
        self._logged = False  # whether this process has logged (rt.load_state rewinds the loggers only before)
        self._loaded = False  # whether rt.load_state loaded a checkpoint (a resume: the run's history continues)
        self._restores_trackers = False  # whether the load in progress restores the trackers' state (load_state)
        self._loaded_from: set[Path] = set()  # the dirs rt.load_state loaded a checkpoint from
        self._stale_hook = None  # an optimizer step pre-hook, once a set-up model's parameters were replaced
        self._replaced: dict[int, weakref.ref] = {}  # the parameters sharding replaced, by id
        self._current_optimizers: weakref.WeakSet = weakref.WeakSet()  # set up, or found over the current parameters
        self._saved_into: set[Path] = set()  # the dirs rt.save_state wrote into
        self._rolled_back_to: Path | None = None  # a checkpoint loaded while later ones exist (the main rank's)
        self._attempt: int | None = None  # the .prev number its rollback's records took at the load
        self._fresh_attempt: int | None = None  # the .prev number an earlier run's metrics took at the first rt.log
        self._set_aside: Path | None = None  # an earlier run's metrics.jsonl, moved at this run's first rt.log
        self._config: dict[str, Any] | None = None  # rt.init_trackers' config, until the trackers can take it
        # The job's logger=... has nowhere to write without a run_dir: said once, at the first rt.log.
        self._unlogged = sorted(launched.get("logger") or {}) if launched is not None and run_dir is None else []
        # What save_state checkpoints: models and optimizers by name, and every other stateful object.
        self.models: dict[str, nn.Module] = {}
        self.optimizers: dict[str, tuple[str, torch.optim.Optimizer]] = {}  # name -> (its model's name, optimizer)
        self.stateful: dict[str, Any] = {}
        self._ended = False  # rt.end() was called: the trackers are finished
        self._schedulers: list[Any] = []  # the schedulers rt.step has stepped (save_state refuses one not registered)
        self._scheduled: dict[int, int] = {}  # each of those schedulers' last_epoch after rt.step stepped it
        # A registered scheduler the loop steps itself: (its last_epoch at its optimizer's last step boundary, how
        # many boundaries running it moved grad_accum_steps times since the one before).
        self._stepped_by_loop: dict[int, tuple[int, int]] = {}
        self._said_unapplied = False  # (the note of a loop that ended mid-accumulation: once)
        # fp16: each model's first gradient and its version after the step's last backward, until rt.unscale_ (or
        # rt.clip_grad_norm_) unscales them: changed in place before that, they were changed while still scaled.
        self._scaled: dict[str, tuple[torch.Tensor, int]] = {}
        self._said_scaled = False  # (that warning: once)
        self._backwards = 0  # rt.backward calls so far, and their count at each optimizer's last rt.step (by id)
        self._backwards_at_step_start = 0  # (and at the first micro-step of the step under way)
        self._backwards_at_step: dict[int, int] = {}
        self._originals: dict[int, tuple[str, str]] = {}  # id of a set-up model's original parameter -> (model, name)
        self._set_up: set[int] = set()  # ids of the modules set up (original and wrapped)
        self._micro = 0  # micro-steps taken in accumulate() (the step boundary is every grad_accum_steps-th)
        self._cycle, self._cycle_models = frozenset(), ()  # the models the accumulation under way is of (their ids)
        self._window_lrs: dict[int, tuple] = {}  # id(optimizer) -> its learning rates as last seen in this step
        self._lr_moves, self._lr_moved_before = 0, 0  # micro-steps of this step that saw it change; steps before, running
        self._in_accumulate = False
        self._continues_step = False  # the micro-step in accumulate() is not its step's first
        self._this_micro = 1  # which micro-step of its step that is
        self._backward_here = False  # a backward ran in that micro-step
        self.sync_gradients = True  # whether this micro-step ends an optimizer step (gradients are synced)
        self._pending_reduce: set[str] = set()  # models whose gradients the strategy must still average (ddp x tp)
        self._listed: dict[str, list[torch.Tensor]] = {}  # each set-up model's parameters, listed once (_trainable)
        # DDP models whose first step found every rank's gradients equal. Checked in a script's own loop only: the
        # framework's Trainer runs what it wrapped, and the batch-size finder steps unsynced on purpose.
        self._replicas_checked: set[str] | None = set() if backend is None else None
        self._ddp_trainable: dict[str, int] = {}  # a DDP model's count of trainable parameters at its first step
        self.position = RunPosition()
        self._checkpointer = None
        # A gloo group of its own for the barrier that checks every rank called save_state (made now, on every
        # rank: making it later, on the one rank that called save_state, would itself hang).
        self._monitor = self.backend.side_group() if self.backend.distributed else None

    # -- where this process sits -----------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.backend.device

    @property
    def rank(self) -> int:
        return self.backend.rank

    @property
    def world_size(self) -> int:
        return self.backend.world_size

    @property
    def is_main_process(self) -> bool:
        return self.backend.is_main

    @property
    def local_rank(self) -> int:
        """This process's rank on its machine (the device it uses: cuda:local_rank)."""
        return self.backend.info.local_rank

    @property
    def is_local_main_process(self) -> bool:
        """The first process of each machine: the one to touch machine-local files (a cache, a download)."""
        return self.backend.info.local_rank == 0

    def __getattr__(self, name: str):
        """Accelerate's and Fabric's names for what the Runtime calls otherwise: one paragraph naming ours, not an
        AttributeError (only reached for a name the Runtime lacks)."""
        ours = OTHER_NAMES.get(name)
        if ours is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        raise UserError(f"rt.{name} is {ours[0]}'s: here {ours[1]} (see the README's 'Coming from Accelerate').")

    def print(self, *args, **kwargs) -> None:
        """print, on the main process only (flushed unless flush=False is given, as accelerator.print passes it)."""
        if self.backend.is_main:
            print(*args, **{"flush": True, **kwargs})

    def wait_for_everyone(self) -> None:
        self.backend.barrier()

    @contextlib.contextmanager
    def main_process_first(self, local: bool = True) -> Iterator[None]:
        from trainer.parallel.backend import main_process_first

        with main_process_first(local):
            yield

    # -- setup -------------------------------------------------------------------------------------------
    def setup(self, *objects: Any, names: list[str] | None = None) -> Any:
        """Models placed, wrapped or sharded by the strategy; optimizers pointed at the parameters that result.
        Returns the objects in the order given (one object: just it). Models and optimizers are named for
        checkpoints in the order they are set up ("model", "model_1", ...; "optimizer", "optimizer_1", ...)
        unless `names` says otherwise; a name is also how `save_state` keys them."""
        self._not_ended("rt.setup")
        if names is not None and (isinstance(names, str) or not all(isinstance(n, str) and n for n in names)):
            raise UserError(f"Runtime.setup(..., names={names!r}): expected a list of names (non-empty strings), one "
                            "for each object: what save_state keys them by.")  # ([1, 2] failed only at a resume)
        names = list(names) if names is not None else [None] * len(objects)
        if len(names) != len(objects):
            raise UserError(f"Runtime.setup: {len(names)} names for {len(objects)} objects: one name per object, models "
                            "and optimizers alike, in the order given (rt.setup(gen, disc, opt_g, opt_d, names=['gen', "
                            "'disc', 'opt_g', 'opt_d'])).")
        out = list(objects)
        for i, obj in enumerate(objects):
            if isinstance(obj, nn.Module):
                out[i] = self._setup_model(obj, names[i])
        for i, obj in enumerate(objects):
            if isinstance(obj, torch.optim.Optimizer):
                out[i] = self._setup_optimizer(obj, names[i])
            elif not isinstance(obj, nn.Module):
                raise UserError(f"Runtime.setup got a {type(obj).__name__}: it sets up nn.Modules and torch "
                                "optimizers. Data goes through rt.loader(dataset, batch_size=...), schedulers to "
                                "rt.step(optimizer, scheduler).")
        for i, obj in enumerate(objects):  # a strategy with an engine (DeepSpeed's) wrapped model and optimizer
            if isinstance(obj, nn.Module):
                out[i] = self.models[self._name_of(out[i])]
        return out[0] if len(out) == 1 else tuple(out)

    def build_model(self, factory: Callable[[], nn.Module], activation_checkpointing: bool = False,
                    name: str | None = None) -> nn.Module:
        """A model built by `factory` and set up, so that no process holds the whole of a sharded one: under FSDP
        or tensor parallelism it is built on the meta device and materialised shard by shard by its
        `init_weights()`, with the weights one process would draw from `seed` (trainer/parallel/materialize.py)."""
        model = self.strategy.build_model(factory, self.seed, activation_checkpointing)
        return self._register_model(model, name, {})

    def _setup_model(self, model: nn.Module, name: str | None) -> nn.Module:
        if id(model) in self._set_up:
            raise UserError(f"Runtime.setup: this {type(model).__name__} is set up already (as "
                            f"{self._name_of(model)!r}). Set up each model once and keep what setup returned.")
        if self.backend.distributed:
            self._refuse_models_that_differ(model)
        if self.strategy.shards_parameters and self.backend.distributed:
            # Every rank shards its own copy: they must be the same. Rank 0's weights go to all, as DDP does.
            self.backend.broadcast_tensors_([*model.parameters(), *model.buffers()])
        originals = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        before = list(model.parameters())
        self.strategy.parallelize(model)
        wrapped = self.strategy.wrap(model)
        now = {id(p) for p in wrapped.parameters()}
        # Sharding replaced the parameters: an optimizer built over the old ones and never set up would step them,
        # and nothing the model uses (it trained nothing, without a word). Any optimizer's step checks. (Weak
        # references: a parameter freed lets its id go to a new one, which is no stale parameter.)
        self._replaced.update({id(p): weakref.ref(p) for p in before if id(p) not in now})
        # (on several processes, any optimizer's first step also checks that it steps a set-up model's parameters)
        if (self._replaced or self.backend.distributed) and self._stale_hook is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            self._stale_hook = register_optimizer_step_pre_hook(self._refuse_a_stale_optimizer)
        return self._register_model(wrapped, name, originals, original=model)

    def _refuse_models_that_differ(self, model: nn.Module) -> None:
        """Every rank sets up the same model: rank 0's weights are broadcast into each rank's (DDP, FSDP), and
        tensors of other shapes failed inside torch (DDP: a traceback; FSDP: gloo aborted the process)."""
        mine = [(n, tuple(t.shape), str(t.dtype)) for n, t in [*model.named_parameters(), *model.named_buffers()]]
        every = self.backend.gather_object(mine)
        if all(theirs == every[0] for theirs in every):
            return
        rank = next(r for r, theirs in enumerate(every) if theirs != every[0])
        first, other = every[0], every[rank]
        diff = next(((a, b) for a, b in zip(first, other) if a != b), None)
        if diff is not None:
            said = (f"{diff[0][0]} is {list(diff[0][1])} {diff[0][2]} on rank 0 and {diff[1][0]} "
                    f"{list(diff[1][1])} {diff[1][2]} on rank {rank}")
        else:
            said = f"rank 0 has {len(first)} parameters and buffers, rank {rank} {len(other)}"
        raise UserError(f"Runtime.setup: the ranks set up different models ({said}). Every rank must build the same "
                        f"model (its weights may differ: rank 0's go to every rank) and set up its models in the same "
                        "order; nothing depending on the rank belongs in a model's shape.")

    def _refuse_a_stale_optimizer(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        if optimizer in self._current_optimizers:
            return
        stale = next((p for g in optimizer.param_groups for p in g["params"]
                      if (ref := self._replaced.get(id(p))) is not None and ref() is p), None)
        if stale is None:
            if self._steps_a_set_up_model(optimizer):
                self._current_optimizers.add(optimizer)  # (checked once: its parameters are the model's)
            return
        name, param = self._originals[id(stale)]
        raise UserError(f"this {type(optimizer).__name__} holds the parameters of {name!r} from before rt.setup "
                        f"sharded them ({param}): its steps would change nothing the model uses. Set it up with the "
                        "model, `model, opt = rt.setup(model, opt)` (or rt.setup(opt) before its first step), which "
                        "points it at the sharded parameters.")

    def _steps_a_set_up_model(self, optimizer: torch.optim.Optimizer) -> bool:
        """On several processes, an optimizer stepping parameters of no set-up model (a model left out of rt.setup)
        steps each rank's copy on that rank's gradients alone: the copies drift apart, silently. Refused; True when
        its parameters are all a set-up model's (False: some have no gradient yet, checked again at its next step).
        DeepSpeed's engine steps flat partitions of its own, no model's parameters: not checked there."""
        if not self.backend.distributed or type(self.strategy).__name__ == "DeepSpeed":
            return True
        ours = {id(p) for m in self.models.values() for p in m.parameters()}
        outside = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in ours]
        foreign = [p for p in outside if p.grad is not None]
        if foreign:
            raise UserError(f"this {type(optimizer).__name__} steps {len(foreign)} parameters of no model set up "
                            f"here (the first of shape {list(foreign[0].shape)}): on {self.backend.world_size} "
                            "processes each rank would step its own copy on its own gradients, and the copies drift "
                            "apart (only a set-up model's gradients are averaged). Set that model up with it: `model, "
                            "opt = rt.setup(model, opt)`. Nothing was updated.")
        return not outside

    def _register_model(self, wrapped: nn.Module, name: str | None, originals: dict[int, str],
                        original: nn.Module | None = None) -> nn.Module:
        name = name or self._free_name("model", self.models)
        if name in self.models:
            raise UserError(f"Runtime.setup: a model named {name!r} is set up already; pass names=[...].")
        self.models[name] = wrapped
        if self._watched:
            wrapped.register_forward_pre_hook(_forward_progress)
        self._set_up.update({id(wrapped), id(unwrap(wrapped)), *([id(original)] if original is not None else [])})
        self._originals.update({pid: (name, pname) for pid, pname in originals.items()})
        return wrapped

    def _setup_optimizer(self, optimizer: torch.optim.Optimizer, name: str | None) -> torch.optim.Optimizer:
        if any(opt is optimizer for _, opt in self.optimizers.values()):
            raise UserError("Runtime.setup: this optimizer is set up already. Set up each optimizer once.")
        if optimizer.state:
            raise UserError("Runtime.setup: the optimizer has taken steps already. Set it up before its first step "
                            "(its state would not follow the parameters onto their devices and shards).")
        live = {id(p): (m, n) for m, model in self.models.items()
                for n, p in unwrap(model).named_parameters(remove_duplicate=False)}
        owners, foreign = set(), 0
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                where = live.get(id(p)) or self._originals.get(id(p))
                if where is None:
                    foreign += 1
                    params.append(p)
                    continue
                owners.add(where[0])
                named = dict(unwrap(self.models[where[0]]).named_parameters(remove_duplicate=False))
                if where[1] not in named and self.strategy.pipeline is not None:
                    continue  # a parameter of another pipeline stage: that rank's optimizer steps it
                params.append(named[where[1]])
            group["params"] = params
        if foreign:
            raise UserError(f"Runtime.setup: the optimizer holds {foreign} parameters of no model set up here. Set up "
                            "the model first (rt.setup(model, optimizer) does both, models first), and build the "
                            "optimizer over that model's parameters.")
        if len(owners) != 1:
            raise UserError(f"Runtime.setup: one optimizer over the parameters of {len(owners) or 'no'} models "
                            f"({', '.join(sorted(owners))}): give each model its own optimizer (a GAN's generator "
                            "and discriminator each have one).")
        name = name or self._free_name("optimizer", self.optimizers)
        if name in self.optimizers:
            raise UserError(f"Runtime.setup: an optimizer named {name!r} is set up already; pass names=[...].")
        owner = owners.pop()
        # A strategy whose engine takes model and optimizer together (DeepSpeed) wraps them here.
        self.models[owner], optimizer = self.strategy.attach_optimizer(self.models[owner], optimizer)
        self._listed.pop(owner, None)  # (listed again from the engine, at the first step)
        self._set_up.add(id(self.models[owner]))
        self.optimizers[name] = (owner, optimizer)
        self._current_optimizers.add(optimizer)  # (set up: pointed at the model's parameters)
        # (not under an engine that steps and zeroes the optimizer itself: DeepSpeed's)
        if isinstance(optimizer, torch.optim.Optimizer) and not self.strategy.engine_steps:
            optimizer.register_step_pre_hook(self._check_own_step)
            optimizer.zero_grad = _CheckedZeroGrad(self, optimizer.zero_grad)  # (torch has no zero_grad hook)
        return optimizer

    def _check_own_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        """A set-up optimizer's step() called by the user, not through rt.step: refused where its update would be
        silently wrong. Accelerate's wrapped optimizer skips such a call mid-accumulation; an optimizer here stays the
        user's own object, and a hook cannot skip a step, so it is refused before it changes anything."""
        if self._watched:
            watchdog.progress()
        if self.strategy.stepping:
            return
        owner = next((m for m, o in self.optimizers.values() if o is optimizer), None)
        if not self.sync_gradients:
            why = (f"in the middle of an accumulation (after micro-step {self._micro} of {self.grad_accum_steps}): it "
                   "would apply part of the step's gradients, unsynced between ranks, as a step of its own")
        elif self.precision.scaler is not None:
            why = ("under precision=fp16: the gradients are still multiplied by the loss scale, and the scaler would "
                   "neither skip an overflowed step nor update its scale")
        elif owner in self._pending_reduce:
            why = ("before the gradients were averaged over the data-parallel ranks (tensor parallelism under DDP "
                   "averages them in rt.step and rt.clip_grad_norm_)")
        else:
            return  # a plain step at the boundary: the same update rt.step would make
        raise UserError(f"optimizer.step() of the optimizer of {owner!r} was called {why}. Call rt.step(optimizer, "
                        "scheduler) instead of optimizer.step(), scheduler.step() and optimizer.zero_grad(): it steps "
                        "only at the step boundary, through the loss scaler, and zeroes the gradients there.")

    @staticmethod
    def _free_name(base: str, taken: dict) -> str:
        return next(n for n in (base, *(f"{base}_{i}" for i in range(1, len(taken) + 2))) if n not in taken)

    def _check_set_up(self, models, what: str) -> None:
        """Each of `models` must be what rt.setup returned: under DDP the module passed to setup is not the one that
        syncs gradients, so a loop that ran it trained every rank on its own gradients, and nothing said so."""
        set_up = self.models.values()
        for m in models:
            inner = m  # (torch.compile of a set-up model is that model: `torch.compile(rt.setup(model))`, the Trainer's)
            while not any(inner is s for s in set_up) and hasattr(inner, "_orig_mod"):
                inner = inner._orig_mod
            if any(inner is s for s in set_up):
                continue
            if not isinstance(m, nn.Module):
                raise UserError(f"{what} got a {type(m).__name__}, not a model: pass the model(s) rt.setup returned "
                                "(`model, optimizer = rt.setup(model, optimizer)`).")
            # A part of a set-up model that no wrapper stands in for (one process, FSDP2's in-place sharding): its
            # forward is the model's own (`rt.accumulate(gan.generator)`).
            if any(unwrap(s) is s and any(m is sub for sub in s.modules()) for s in set_up):
                continue
            name = self._name_of(m)
            if name is None:
                raise UserError(f"{what} got a {type(m).__name__} that was not set up: pass it through rt.setup(model, "
                                "optimizer) first and use the model setup returns.")
            raise UserError(f"{what} got the module passed to rt.setup for {name!r}, not the "
                            f"{type(self.models[name]).__name__} setup returned for it: that one syncs the gradients "
                            "between processes (DDP, FSDP), and a forward through the module underneath trains every "
                            "rank on its own gradients. Keep what setup returned, `model, optimizer = "
                            "rt.setup(model, optimizer)`, and run its forward.")

    def _name_of(self, model: nn.Module) -> str | None:
        return next((n for n, m in self.models.items() if m is model), None) or next(
            (n for n, m in self.models.items() if unwrap(m) is unwrap(model)), None)

    def register(self, name: str, obj: Any) -> Any:
        """Checkpoint `obj` (anything with state_dict/load_state_dict: a scheduler, a custom counter) under `name`
        in save_state/load_state."""
        if not isinstance(name, str) or not name:
            raise UserError(f"Runtime.register({name!r}, ...): the name to save it under is a non-empty string.")
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise UserError(f"Runtime.register({name!r}): a {type(obj).__name__} has no state_dict/load_state_dict.")
        if name in self.stateful or name in ("trainer", "optimizer", "rng", "loggers", "precision"):
            raise UserError(f"Runtime.register: the name {name!r} is taken.")
        self.stateful[name] = obj
        return obj

    # -- data --------------------------------------------------------------------------------------------
    def loader(self, dataset, batch_size: int, shuffle: bool | None = None, num_workers: int = 0,
               name: str | None = None, collate_fn: Callable | None = None, **dataloader_args: Any) -> Loader:
        """This rank's micro-batches of `dataset` (`batch_size` per process and micro-step), on the device: the
        same global batches on any number of processes. Checkpointed by save_state. `shuffle` defaults to True for
        a map-style dataset and False for an IterableDataset (read in its own order). `collate_fn` makes a batch of
        a list of samples, as a DataLoader's does (padding sequences of different lengths); by default the dataset's
        own `collate_fn` attribute, else torch's default_collate."""
        _not_a_loader(dataset, "loader")
        _not_dataloader_args("loader", dataloader_args)
        _loader_args("loader", batch_size=batch_size, num_workers=num_workers)
        _collate_arg("loader", collate_fn)
        if shuffle is not None and not isinstance(shuffle, bool):  # ("no" shuffled)
            raise UserError(f"rt.loader(shuffle={shuffle!r}): expected True, False or None (the dataset's kind decides).")
        from trainer.data.streaming import is_stream, sized

        if shuffle is None:
            shuffle = not is_stream(dataset)

        if sized(dataset) == 0:
            raise UserError(f"rt.loader got an empty {type(dataset).__name__} (len 0): there is nothing to train on. "
                            "Check how the dataset was built (a path, a filter, a split that left nothing).")
        taken = self.stateful.get(name)
        if name in ("trainer", "optimizer", "rng") or (taken is not None and not isinstance(taken, Loader)):
            raise UserError(f"rt.loader(name={name!r}): the name is taken by "
                            f"{'the run itself' if taken is None else 'rt.register'} (each loader's position is saved "
                            "under its name). Give the loader a name of its own, or leave name out for a free one.")
        # (a loader made again under its name, for a new phase, replaces the old one in save_state)
        loader = Loader(self, dataset, batch_size, shuffle, num_workers, self.seed, collate_fn)
        self.stateful[name or self._free_name("loader", self.stateful)] = loader
        return loader

    def eval_loader(self, dataset, batch_size: int, limit: int | None = None, collate_fn: Callable | None = None,
                    **dataloader_args: Any) -> EvalLoader:
        """This rank's share of an eval set, each sample once (see EvalLoader; rt.gather_for_metrics); `collate_fn`
        as rt.loader's."""
        _not_a_loader(dataset, "eval_loader")
        _not_dataloader_args("eval_loader", dataloader_args)
        _loader_args("eval_loader", batch_size=batch_size, **({} if limit is None else {"limit": limit}))
        _collate_arg("eval_loader", collate_fn)
        from trainer.data.streaming import sized

        if sized(dataset) is None:  # (len() raised a TypeError traceback)
            raise UserError(f"rt.eval_loader({type(dataset).__name__}, ...): a stream without __len__ has no end an "
                            "eval could split between the ranks and count each sample of once. Give the dataset a "
                            "__len__ (the samples of one pass; `limit` then takes the first of them).")
        return EvalLoader(self, dataset, batch_size, limit, collate_fn)

    # -- the step ------------------------------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager:
        return self.precision.autocast()

    def accumulate(self, *models: nn.Module, last: bool | None = None) -> contextlib.AbstractContextManager:
        """One micro-step of a loop of one's own: gradients are synced between ranks only in the last of every
        `grad_accum_steps` (DDP's no_sync, FSDP's set_requires_gradient_sync); `rt.step` steps only then. `last=True`
        marks the loop's last micro-batch of its data (`i == len(loader) - 1`), which ends a step too, whatever the
        count, as Accelerate's prepared loader does at its epoch's end; False or None: the count alone decides."""
        if last is not None and not isinstance(last, bool):  # ("no" ended the step)
            raise UserError(f"rt.accumulate(..., last={last!r}): expected True, False or None (True: the loop's last "
                            "micro-batch of its data, which ends a step whatever the count).")
        if models:
            self._check_set_up(models, "rt.accumulate")
        models = models or tuple(self.models.values())
        named = frozenset(map(id, models))
        if self._micro > 0 and named != self._cycle:  # (a GAN's two blocks a micro-batch: one model never steps)
            listed = [", ".join(str(self._name_of(m)) for m in ms) for ms in (models, self._cycle_models)]
            raise UserError(f"rt.accumulate({listed[0]}) in the middle of an accumulation of {listed[1]} (before "
                            f"its micro-step {self._micro + 1} of {self.grad_accum_steps}): each rt.accumulate "
                            "call is one micro-step of the models it names, so two blocks a micro-batch would "
                            "bring one model to its step boundary every micro-batch and the other never. Put "
                            "both in one block a micro-batch, `with rt.accumulate(gen, disc):`, or give each "
                            "model all its micro-batches in turn (as recipe=gan does).")
        self._cycle, self._cycle_models = named, models
        if self._micro == 0:
            self._window_lrs = {id(o): _lrs(o) for o in self._optimizers_of(models)}
            self._lr_moved_before = self._lr_moved_before + 1 if self._lr_moves else 0  # (steps running)
            self._lr_moves = 0
        else:
            self._check_lr_kept()
        # (last=False is no end of the data: it must not hold a step back past its count, which made a loop that
        # passed `last=i == len(loader) - 1` accumulate its whole epoch into one step, its gradient A times too large)
        return self.micro_step(*models, ends_step=self._micro + 1 >= self.grad_accum_steps or last is True)

    def micro_step(self, *models: nn.Module, ends_step: bool) -> contextlib.AbstractContextManager:
        """One micro-step of a loop that knows where each step ends (the Trainer: a step is a list of micro-batches),
        without `accumulate`'s count: `ends_step` says whether gradients sync here and `rt.step` steps."""
        models = models or tuple(self.models.values())
        self._this_micro = self._micro + 1  # (1-based, for what a check says)
        if self._micro == 0:
            self._backwards_at_step_start = self._backwards
        elif self._backwards != self._backwards_at_step_start:  # (a step whose earlier micro-steps had a backward:
            self._check_not_zeroed(models)                      # their gradients must still be there)
        self._continues_step, self._backward_here = self._micro > 0, False  # (what a zero_grad here would lose)
        self._micro = 0 if ends_step else self._micro + 1
        self.sync_gradients = ends_step
        return _MicroStep(self, [self.strategy.no_sync(m, enabled=not ends_step) for m in models])

    def _optimizers_of(self, models) -> list[torch.optim.Optimizer]:
        names = {self._name_of(m) for m in models}
        return [o for m, o in self.optimizers.values() if m in names]

    def _check_lr_kept(self) -> None:
        """Within one step's micro-steps (a loop of one's own) no optimizer steps, so its learning rate stays: one
        that changes between them is changed by a scheduler.step() called every micro-batch, as in Accelerate's loops,
        where the prepared scheduler skips those calls. Here the scheduler is the user's own object and would run the
        schedule grad_accum_steps times too fast, with no error. Refused once the learning rate moved at two
        micro-steps of one step, or (grad_accum_steps=2) in three steps running: an epoch's scheduler, stepped where
        an epoch ends in the middle of a step, moves it at most once a step."""
        moved = None
        for optimizer in self._optimizers_of(self._cycle_models):
            before, now = self._window_lrs.get(id(optimizer)), _lrs(optimizer)
            if before is not None and now != before:
                moved, self._window_lrs[id(optimizer)] = optimizer, now
        if moved is not None:
            self._lr_moves += 1
            # A scheduler stepped every micro-batch moves it at every micro-step after a step's first: twice a step
            # from grad_accum_steps=3 on; at 2, once a step, every step (three running: an epoch of 3 micro-batches
            # ends mid-step every other step). An epoch's scheduler moves it at most once a step, where an epoch ends.
            if self._lr_moves >= 2 or (self.grad_accum_steps == 2 and self._lr_moved_before >= 2):
                owner = next(m for m, o in self.optimizers.values() if o is moved)
                self._lr_moves, self._lr_moved_before = 0, 0  # (said once)
                raise UserError(f"the learning rate of the optimizer of {owner!r} keeps changing in the middle of "
                                f"accumulations (again before micro-step {self._micro + 1} of {self.grad_accum_steps}), "
                                "where no optimizer step runs: a scheduler.step() called every micro-batch runs the "
                                f"schedule {self.grad_accum_steps} times too fast. Pass the scheduler to "
                                "rt.step(optimizer, scheduler), which steps it once per optimizer step (or call "
                                "scheduler.step() only when rt.step returns True); a learning rate set by hand, set "
                                "it after rt.step.")

    def _check_not_zeroed(self, models) -> None:
        """Mid-accumulation, the gradients of the micro-steps before must still be there (zero_grad is rt.step's)."""
        if self.strategy.shards_data_parallel:
            return  # FSDP keeps the unsynced gradients to itself until the boundary
        for m in models:
            params = [p for p in m.parameters() if p.requires_grad]
            if params and all(p.grad is None for p in params):
                raise UserError(f"the gradients of {self._name_of(m)!r} were zeroed in the middle of an accumulation "
                                f"(before micro-step {self._this_micro} of {self.grad_accum_steps}'s backward): the "
                                "earlier micro-steps' gradients are lost. rt.step(optimizer) zeroes them at the step "
                                "boundary; do not zero them yourself (optimizer.zero_grad(), model.zero_grad()).")

    def backward(self, loss: torch.Tensor, scale: float | torch.Tensor | None = None) -> None:
        """`loss` x `scale` backward, with fp16's loss scaling. `scale` defaults to 1 / grad_accum_steps (a mean
        loss per micro-batch becomes the mean over the step's micro-batches, as in Accelerate)."""
        self._not_ended("rt.backward")
        self._backward(loss, scale)

    def _backward(self, loss: torch.Tensor, scale: float | torch.Tensor | None, summed: bool = False) -> None:
        """`backward`; `summed`: the loss is a sum over the batch's targets (forward_backward's mean=False, the
        Trainer's task.loss), which its refusal of a loss that is not one number says how to give."""
        if self.grad_accum_steps > 1 and not self._in_accumulate:
            raise UserError(f"rt.backward outside rt.accumulate(model) with grad_accum_steps={self.grad_accum_steps}: "
                            "rt.step could not tell the step boundary (it would step every micro-batch, each loss "
                            f"scaled by 1/{self.grad_accum_steps}), and on several processes every backward would "
                            "sync gradients. Put the forward and backward of each micro-batch in `with "
                            "rt.accumulate(model):`.")
        if self.strategy.pipeline is not None:  # the model's forward there hands activations on, outside autograd
            raise UserError("rt.backward under pipeline parallelism (world.pp): each stage's backward must run in the "
                            "pipeline's schedule, microbatch by microbatch. Use `loss, sums = rt.forward_backward(model, "
                            "batch, loss_fn)` (loss_fn(model, batch) -> loss) for each micro-batch instead of calling "
                            "the model and rt.backward.")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            shown = (f"a tensor of shape {list(loss.shape)}" if loss.numel() != 1 else "a tensor without a graph "
                     "(computed under torch.no_grad, detached, or from no parameter)") \
                if isinstance(loss, torch.Tensor) else a_(type(loss).__name__)
            # (a loss without a graph was told to reduce itself, which gives it none: say where the graph was lost)
            graphless = isinstance(loss, torch.Tensor) and loss.numel() == 1
            if summed:  # (the advice above, a mean, would shrink this loss by the batch's size, silently)
                raise UserError(f"the loss (the Trainer's: task.loss of task._target_) must be the SUM of the batch's "
                                f"per-target losses as one number with its graph, a 0-dim tensor (or a dict with it "
                                f"under 'loss'); got {shown}. " + (
                                    "Compute it from the model's output with torch's float operations (not .item(), "
                                    ".detach(), .long() or torch.no_grad)." if graphless else
                                    "Sum it (`.sum()`, not `.mean()`: the Trainer divides by the global batch's count "
                                    "of targets, task.num_targets)."))
            raise UserError(f"rt.backward takes the loss as one number with its graph, a 0-dim tensor; got {shown}. " + (
                "Compute it from the model's output with torch's float operations (not .item(), .detach(), .long() or "
                "torch.no_grad)." if graphless else "Reduce it first (`loss.mean()`, or `.sum()` divided by the "
                "batch's count)."))
        if scale is None:
            scale = 1.0 / self.grad_accum_steps
        elif not ((isinstance(scale, numbers.Real) and not isinstance(scale, bool) and math.isfinite(scale)) or (
                isinstance(scale, torch.Tensor) and scale.numel() == 1)):  # (nan made every parameter NaN, silently)
            raise UserError(f"rt.backward(loss, scale={scale!r}): expected a finite number (or a one-element tensor), "
                            f"what the loss is multiplied by; None gives 1/grad_accum_steps.")
        if self._continues_step and not self._backward_here and self._backwards != self._backwards_at_step_start:
            self._check_not_zeroed(self._cycle_models or tuple(self.models.values()))  # (a zero_grad() in the block)
        self._backward_here = True
        self._backwards += 1
        self.strategy.backward(loss * scale if not (isinstance(scale, float) and scale == 1.0) else loss)
        if self.sync_gradients and self.strategy.reduces_gradients:
            self._pending_reduce.update(self.models)
        # (not where parameters are sharded: an in-place edit of a DTensor gradient moves no version to compare)
        if self.sync_gradients and self.precision.scaler is not None and not self.strategy.shards_parameters:
            for name, model in self.models.items():  # (the first gradient: one parameter looked at, as a rule)
                grad = next((p.grad for p in self._listed.get(name) or model.parameters()
                             if p.requires_grad and p.grad is not None), None)
                if grad is not None:
                    self._scaled[name] = (grad, grad._version)
        if self._watched:
            watchdog.progress()

    def forward_backward(self, model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], Any],
                         scale: float | torch.Tensor | None = None,
                         mean: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One micro-batch's forward and backward: `loss_fn(model, batch)` (a loss, or a dict of "loss" and other
        additive sums) under autocast, then `backward(loss, scale)`. Returns (loss, sums), as computed.

        Under pipeline parallelism (world.pp) the strategy's schedule runs both, microbatch by microbatch, on every
        stage, `loss_fn` seeing each microbatch's rows of `batch`, and every rank gets the last stage's loss and
        sums. `mean=True` (a loop of your own: the loss is the micro-batch's mean, as in Accelerate): the
        microbatches' losses are averaged. `mean=False`: the loss is additive over rows (the Trainer's: a sum
        divided by the global target count) and the microbatches' losses are summed."""
        if self.strategy.pipeline is None:
            with self.autocast():
                try:
                    loss, sums = split_loss(loss_fn(model, batch))
                except RuntimeError as e:
                    if UNUSED_BY_DDP not in str(e):
                        raise
                    raise _unused_parameters(model, str(e)) from None
            self._backward(loss, scale, summed=not mean)
            return loss, sums
        scale = 1.0 / self.grad_accum_steps if scale is None else scale
        self._backward_here = True
        self._backwards += 1
        loss, sums = self.strategy.pipeline.forward_backward(batch, loss_fn, scale, self.autocast, mean=mean)
        if self.sync_gradients and self.strategy.reduces_gradients:
            self._pending_reduce.update(self.models)
        if self._watched:
            watchdog.progress()
        return loss, sums

    def _params(self, target) -> list[torch.Tensor]:
        if isinstance(target, nn.Module):
            return [p for p in target.parameters() if p.requires_grad]
        return [p for p in target if p.requires_grad]

    def _trainable(self, name: str) -> list[torch.Tensor]:
        """The set-up model `name`'s parameters that require gradients. Its parameters are listed once, at the
        first step, after everything that replaces them (wrapping, sharding, cutting pipeline stages); each call
        reads their requires_grad, so freezing and unfreezing take effect. Walking every submodule instead, at
        every step, was most of the Trainer's per-step Python calls beyond a hand-written loop's."""
        listed = self._listed.get(name)
        if listed is None:
            listed = self._listed[name] = list(self.models[name].parameters())
        return [p for p in listed if p.requires_grad]

    def _synced(self, model_names) -> None:
        """Average the gradients the strategy did not (tensor parallelism under DDP: DDP cannot hold DTensors)."""
        if not self._pending_reduce:  # (every step of every other strategy)
            return
        for name in sorted(set(model_names) & self._pending_reduce):
            self.strategy.reduce_gradients(self._trainable(name))
            self._pending_reduce.discard(name)

    def _owners(self, params: list[torch.Tensor]) -> tuple[set[str], list[torch.optim.Optimizer]]:
        ids = {id(p) for p in params}
        models = {m for m, model in self.models.items() if any(id(p) in ids for p in model.parameters())}
        opts = [opt for _, (m, opt) in self.optimizers.items() if m in models]
        return models, opts

    def _check_at_boundary(self, call: str) -> None:
        if not self.sync_gradients:
            raise UserError(f"{call} in the middle of an accumulation (after micro-step {self._micro} of "
                            f"{self.grad_accum_steps}): the step's gradients are not all there yet, so its norm "
                            "would clip a part of them, and under fp16 the micro-steps still to come would add "
                            "gradients carrying the loss scale to unscaled ones. Call it at the step boundary: "
                            "`if rt.sync_gradients: rt.clip_grad_norm_(model, max_norm)`.")

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """fp16: divide `optimizer`'s gradients by the loss scale (once per step; clip_grad_norm_ does it)."""
        if self.precision.scaler is not None:
            self._check_at_boundary("rt.unscale_")
        model = next((m for m, o in self.optimizers.values() if o is optimizer), None)
        if model is not None:
            self._synced([model])
            self._scaled.pop(model, None)
        self.strategy.unscale_(optimizer)

    def clip_grad_norm_(self, target, max_norm: float | None) -> torch.Tensor:
        """Clip the true (unscaled, synced) gradients of a model or parameters to `max_norm` over every rank and
        mesh; None only measures. Returns the total norm before clipping, on the device."""
        self._check_at_boundary("rt.clip_grad_norm_")
        if max_norm is not None and (isinstance(max_norm, bool) or not isinstance(max_norm, (int, float))
                                     or not max_norm >= 0):  # (a negative one flipped the gradients)
            raise UserError(f"rt.clip_grad_norm_(model, max_norm={max_norm!r}): expected a number >= 0 (None only "
                            "measures the norm).")
        if isinstance(target, torch.Tensor):
            target = [target]
        elif not isinstance(target, nn.Module):
            given = type(target).__name__
            target = list(target) if isinstance(target, Iterable) and not isinstance(target, (str, bytes)) else None
            if target is None or not all(isinstance(p, torch.Tensor) for p in target):
                raise UserError(f"rt.clip_grad_norm_ got a {given}: pass a set-up model or its parameters "
                                "(`rt.clip_grad_norm_(model, 1.0)` or `rt.clip_grad_norm_(model.parameters(), 1.0)`).")
        name = self._name_of(target) if isinstance(target, nn.Module) else None
        params = self._trainable(name) if name is not None else self._params(target)
        if name is not None:  # a set-up model: its owner is known without looking at every parameter
            models, opts = {name}, [opt for m, opt in self.optimizers.values() if m == name]
        else:
            models, opts = self._owners(params)
        for opt in opts:
            self._check_backward_was_ours(opt, "rt.clip_grad_norm_")
        self._synced(models)
        for opt in opts:
            self.strategy.unscale_(opt)  # (what self.unscale_ does once its model is synced, as it is now)
        for name in models if self._scaled else ():
            self._scaled.pop(name, None)
        return self.strategy.clip_grad_norm_(params, max_norm)

    def step(self, optimizer: torch.optim.Optimizer, scheduler=None, *, zero_grad: bool = True) -> bool:
        """At a step boundary: the optimizer's step (fp16: unless the loss scaler skips it), then the scheduler's
        (only after a real update), then zero the gradients. Mid-accumulation: nothing. Returns whether the
        update was applied."""
        self._not_ended("rt.step")
        if not self.sync_gradients:
            return False
        owner = next((m for m, o in self.optimizers.values() if o is optimizer), None)
        if owner is None:
            if isinstance(optimizer, _SCHEDULERS):
                raise UserError(f"rt.step got a {type(optimizer).__name__} where the optimizer goes: the order is "
                                "rt.step(optimizer, scheduler).")
            raise UserError("rt.step got an optimizer that was not set up: pass it to rt.setup(model, optimizer).")
        if scheduler is not None and (isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
                                      or not callable(getattr(scheduler, "step", None))):
            why = ("steps on a metric (`scheduler.step(val_loss)`), which rt.step does not have: call that yourself, "
                   "after rt.step, when the metric is measured" if hasattr(scheduler, "step")
                   else "has no step(): pass a learning-rate scheduler, or None")
            raise UserError(f"rt.step(optimizer, scheduler): the {type(scheduler).__name__} given as the scheduler "
                            f"{why}. Nothing was updated.")
        if scheduler is not None:
            self._check_scheduler(optimizer, owner, scheduler)
        if self.grad_accum_steps > 1:
            self._check_loop_schedulers(optimizer, owner, scheduler)
        self._check_backward_was_ours(optimizer, "rt.step")
        if self._scaled:
            self._say_changed_while_scaled(owner)
        if isinstance(self.models[owner], nn.parallel.DistributedDataParallel) and self.backend.distributed:
            self._check_ddp_trainable(owner)
        self._synced([owner])
        if self._replicas_checked is not None and owner not in self._replicas_checked:
            self._check_replicas_agree(owner)
        applied = self.strategy.optimizer_step(optimizer)
        if scheduler is not None and not any(scheduler is known for known in self._schedulers):
            self._schedulers.append(scheduler)
        if applied and scheduler is not None:
            scheduler.step()
        if scheduler is not None:
            self._scheduled[id(scheduler)] = getattr(scheduler, "last_epoch", None)
        self._backwards_at_step[id(optimizer)] = self._backwards
        if self._watched:  # (DeepSpeed's engine steps without the optimizer hook that beats)
            watchdog.progress()
        if zero_grad:  # (the optimizer's own zero_grad, or DeepSpeed's no-op: not the check on the user's calls)
            zero = optimizer.zero_grad
            (zero.own if isinstance(zero, _CheckedZeroGrad) else zero)(set_to_none=True)
        return applied

    def _check_backward_was_ours(self, optimizer: torch.optim.Optimizer, call: str) -> None:
        """At a step boundary, gradients with no rt.backward since this optimizer's last step came from a backward
        of the user's own (`loss.backward()`): the same gradients where rt.backward would only call it, but not under
        accumulation (each micro-batch's loss unscaled: the step's gradients grad_accum_steps times a big batch's),
        fp16 (no loss scale: the scaler's unscale fails) or tensor parallelism under DDP (never averaged)."""
        if self._backwards != self._backwards_at_step.get(id(optimizer), 0) or not (
                self.grad_accum_steps > 1 or self.precision.scaler is not None or self.strategy.reduces_gradients):
            return
        owner = next((m for m, o in self.optimizers.values() if o is optimizer), None)
        if owner is None or not any(p.grad is not None for p in self._trainable(owner)):
            return
        why = (f"with grad_accum_steps={self.grad_accum_steps} each micro-batch's loss must be scaled by 1/"
               f"{self.grad_accum_steps}" if self.grad_accum_steps > 1 else "under fp16 the loss must carry the loss "
               "scale" if self.precision.scaler is not None else "tensor parallelism's gradients must be averaged "
               "over the data-parallel ranks afterwards")
        raise UserError(f"{call}: the gradients of {owner!r} come from a backward of your own (`loss.backward()`), "
                        f"not rt.backward(loss): {why}, which rt.backward does. Call `rt.backward(loss)` in place of "
                        "`loss.backward()`. Nothing was updated.")

    def _check_ddp_trainable(self, name: str) -> None:
        """DistributedDataParallel averages the gradients of the parameters that required them when it was built, and
        (without find_unused_parameters) waits for each of them in every backward: a parameter unfrozen since is
        never averaged (each rank steps it on its own gradient, silently), and one frozen since leaves its bucket
        unreduced, then torch's "Expected to have finished reduction" at the next forward."""
        model = self.models[name]
        now = sum(p.requires_grad for p in self._listed.get(name) or model.parameters())
        first = self._ddp_trainable.setdefault(name, now)
        if now > first or (now < first and not model.find_unused_parameters):
            what = (f"{now - first} of its parameters were unfrozen since its first step: DistributedDataParallel "
                    "averages only those that required gradients when rt.setup wrapped it, so each rank would step "
                    "those on its own gradients. Unfreeze them before rt.setup (frozen ones can be left out of the "
                    "optimizer), or set the model up again" if now > first else
                    f"{first - now} of its parameters were frozen since its first step: DistributedDataParallel waits "
                    "for their gradients, so the gradients it buckets with them were not averaged in this step, and "
                    "its next forward would fail. Freeze them before rt.setup, or let DDP look for unused parameters: "
                    "Runtime('ddp', world_options={'find_unused_parameters': True}) (under launch: "
                    "world.find_unused_parameters=true)")
            raise UserError(f"rt.step: the DDP model {name!r}: {what}. Nothing was updated.")

    def _check_scheduler(self, optimizer: torch.optim.Optimizer, owner: str, scheduler) -> None:
        """The scheduler rt.step steps must be the optimizer's, and stepped by rt.step alone: a scheduler.step() of
        the loop's own besides (left over from a plain loop, or every micro-batch) runs the schedule faster."""
        if isinstance(scheduler, torch.optim.Optimizer):  # (stepped as the first one's schedule: a second update)
            raise UserError(f"rt.step(optimizer, scheduler): the second argument is an optimizer "
                            f"({type(scheduler).__name__}), which rt.step would step as the first one's scheduler"
                            + (": the same optimizer, updated twice" if scheduler is optimizer else "") + ". Step each "
                            "optimizer in a call of its own: rt.step(opt_a), rt.step(opt_b) (or rt.step(opt, "
                            "scheduler) with its scheduler). Nothing was updated.")
        other = getattr(scheduler, "optimizer", optimizer)
        if other is not optimizer:
            of = next((m for m, o in self.optimizers.values() if o is other), None)
            raise UserError(f"rt.step(optimizer, scheduler): the {type(scheduler).__name__} schedules "
                            f"{'the optimizer of ' + repr(of) if of else 'another optimizer'}, not the one of {owner!r} "
                            "given with it, whose learning rate it would never move. Pass each optimizer with its own "
                            "scheduler. Nothing was updated.")
        seen = self._scheduled.get(id(scheduler))
        now = getattr(scheduler, "last_epoch", None)
        if seen is not None and now is not None and now != seen:
            raise UserError(f"rt.step(optimizer, scheduler): the {type(scheduler).__name__} of {owner!r} was stepped "
                            f"{now - seen} time(s) outside rt.step since rt.step last stepped it (a scheduler.step() of "
                            "your own besides): the schedule would run that much faster. rt.step steps it once per "
                            "applied update; remove the other call. Nothing was updated.")

    def _say_changed_while_scaled(self, owner: str) -> None:
        """fp16: gradients changed in place after the step's last backward and before anything unscaled them were
        changed while they still carried the loss scale. A `torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`
        of the loop's own then measures the scaled norm (thousands) and clips the true gradients to almost nothing,
        silently (Accelerate's loops have the same trap); an edit that does not depend on the scale (zeroing some
        rows, dividing by a count) is right. The two cannot be told apart from here: a warning, once, not a refusal.
        (Single process and DDP: an in-place edit of FSDP's sharded gradients moves no version to see.)"""
        grad, version = self._scaled.pop(owner, (None, None))
        if grad is None or grad._version == version or self._said_scaled:
            return
        self._said_scaled = True
        if self.backend.is_main:
            print(f"warning: the gradients of {owner!r} were changed in place while they still carried fp16's loss "
                  "scale (before rt.unscale_ or rt.clip_grad_norm_). If that was a clip of your own "
                  "(torch.nn.utils.clip_grad_norm_), it measured the scaled norm and cut the true gradients to a "
                  "sliver of max_norm: clip with rt.clip_grad_norm_(model, max_norm), which unscales first. An edit "
                  "that does not depend on the scale is right; call rt.unscale_(optimizer) before it to make this "
                  "warning go.", file=sys.stderr, flush=True)

    def _check_loop_schedulers(self, optimizer: torch.optim.Optimizer, owner: str, passed) -> None:
        """A registered scheduler of `optimizer` that the loop steps itself must not step every micro-batch, as
        Accelerate's loops do (its prepared scheduler skips those calls): here it is the user's own object and would
        run the schedule grad_accum_steps times too fast. A StepLR or MultiStepLR moves the learning rate at most once
        a step that way, which `_check_lr_kept` cannot tell from an epoch's scheduler: its count can. Refused once it
        moved exactly grad_accum_steps times between step boundaries, two boundaries running (an epoch's scheduler,
        stepped where epochs end, would need epochs of one micro-batch)."""
        for name, sched in self.stateful.items():
            if (not isinstance(sched, torch.optim.lr_scheduler.LRScheduler) or sched is passed
                    or getattr(sched, "optimizer", None) is not optimizer):
                continue
            now = getattr(sched, "last_epoch", None)  # (a ChainedScheduler has none: its parts are counted, if registered)
            if not isinstance(now, int):
                continue
            before, running = self._stepped_by_loop.get(id(sched), (None, 0))
            running = running + 1 if before is not None and now - before == self.grad_accum_steps else 0
            self._stepped_by_loop[id(sched)] = (now, running)
            if running >= 2:
                raise UserError(f"the {type(sched).__name__} registered as {name!r} (the optimizer of {owner!r}) moved "
                                f"{self.grad_accum_steps} times between optimizer steps, {running} steps running: a "
                                "scheduler.step() called every micro-batch (as Accelerate's loops do, where the "
                                "prepared scheduler skips it) runs the schedule grad_accum_steps times too fast here. "
                                f"Pass it to rt.step(optimizer, {name}), which steps it once per optimizer step, or "
                                "call its step() only when rt.step returns True. Nothing was updated.")

    def no_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        if enabled and self._replicas_checked is not None:  # (a loop that steps unsynced on purpose: local SGD)
            name = self._name_of(model)
            if name is not None:
                self._replicas_checked.add(name)
        return self.strategy.no_sync(model, enabled)

    def _check_replicas_agree(self, name: str) -> None:
        """At a DDP model's first step, every rank must hold the same gradients: DistributedDataParallel averages
        them only in a backward through its wrapper, so a loop whose forward runs the module underneath (kept
        from before rt.setup) steps each rank on its own gradients, and the replicas drift apart with no error.
        One gather of a number per parameter, once. The sums are of absolute values in float64 (no cancellation),
        so equal gradients summed on two kinds of CPU differ by rounding alone (< 1e-9 relative), while a rank's
        own gradients differ from another's in the leading digits."""
        self._replicas_checked.add(name)
        model = self.models[name]
        if not (self.backend.distributed and isinstance(model, nn.parallel.DistributedDataParallel)):
            return
        params = self._trainable(name)
        with_grad = [p.grad.detach().abs().sum(dtype=torch.float64) for p in params if p.grad is not None]
        found = iter(torch.stack(with_grad).tolist() if with_grad else [])
        every = self.backend.gather_object([next(found) if p.grad is not None else None for p in params])

        def same(a: float | None, b: float | None) -> bool:
            if a is None or b is None:
                return a is None and b is None
            if not (math.isfinite(a) and math.isfinite(b)):  # (an fp16 overflow: inf or nan on every rank)
                return not (math.isfinite(a) or math.isfinite(b))
            return abs(a - b) <= 1e-6 * max(abs(a), abs(b))

        differ = next(((r, i) for r, theirs in enumerate(every) for i, (a, b) in enumerate(zip(every[0], theirs))
                       if not same(a, b)), None)
        if differ is not None:
            rank, i = differ
            param = self._originals.get(id(params[i]), (name, f"parameter {i}"))[1]
            # (under gradient_as_bucket_view an unused parameter's gradient is its bucket's zeros, not None)
            unused = [j for j in range(len(params)) if all(theirs[j] in (None, 0.0) for theirs in every)]
            if unused and not getattr(model, "find_unused_parameters", True):
                # A parameter no rank's forward used: DDP waits for its gradient, and leaves the bucket it shares
                # with others unreduced.
                first = self._originals.get(id(params[unused[0]]), (name, f"parameter {unused[0]}"))[1]
                raise UserError(f"the gradients of {name!r} differ between ranks at its first step ({param}), and "
                                f"{len(unused)} of its trainable parameters got no gradient (or exact zeros) on any "
                                f"rank ({first}, ...): "
                                "DistributedDataParallel waits for those, and leaves the gradients it buckets with "
                                "them unaveraged. For a model whose forward leaves parameters unused, turn on its "
                                "search for them: Runtime('ddp', world_options={'find_unused_parameters': True}) (a "
                                "Runtime() under launch: world.find_unused_parameters=true), or freeze them "
                                "(requires_grad_(False)). "
                                "Nothing was updated.")
            raise UserError(f"the gradients of {name!r} differ between ranks at its first step ({param}: the sum of "
                            f"their absolute values is {every[0][i]} on rank 0, {every[rank][i]} on rank {rank}). "
                            "DistributedDataParallel averages them only in a backward through the model rt.setup "
                            "returned; a forward of the module underneath it (the one passed to rt.setup) leaves "
                            "each rank with its own, and the copies of the model drift apart. Keep and run what "
                            "rt.setup returns (`model, opt = rt.setup(model, opt)`), in the forward as in "
                            "rt.accumulate (a loop that steps on unsynced gradients on purpose enters rt.no_sync(model, "
                            "True), which this check leaves alone). Nothing was updated.")

    # -- ranks ---------------------------------------------------------------------------------------------
    def unwrap(self, model: nn.Module) -> nn.Module:
        """The plain module under DDP and torch.compile (under FSDP: the module, its parameters still shards)."""
        return unwrap(model)

    def reduce(self, value, op: str = "mean"):
        """The sum, mean, max or min of a tensor or number over all ranks: a tensor for a tensor, a number for a
        number (on one process as on several)."""
        if op not in ("sum", "mean", "max", "min"):
            raise UserError(f"rt.reduce(op={op!r}): expected sum, mean, max or min.")
        if not isinstance(value, torch.Tensor) and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise UserError(f"rt.reduce got a {type(value).__name__}: it takes a tensor or a number (an int or a "
                            "float), the same kind on every rank.")
        out = self.backend.all_reduce(value, op="sum" if op == "mean" else op)
        out = out / self.world_size if op == "mean" else out
        return out.item() if isinstance(out, torch.Tensor) and not isinstance(value, torch.Tensor) else out

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` (same shape on all), concatenated along dim 0 in rank order, on every rank. A number
        (a 0-dim tensor: a loss) is one row per rank, on one process as on several; so is a plain number."""
        if isinstance(tensor, (int, float)) and not isinstance(tensor, bool):
            tensor = torch.tensor(tensor, device=self.device)
        if not isinstance(tensor, torch.Tensor):
            raise UserError(f"rt.gather got a {type(tensor).__name__}: it takes a tensor (the same shape on every "
                            "rank) or a number; for other objects, gather them as tensors (torch.tensor(values)).")
        tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor
        if self.backend.distributed:  # (gloo aborts the process on unequal shapes: say which, in one paragraph)
            shapes = self.backend.gather_object((tuple(tensor.shape), str(tensor.dtype)))
            if len(set(shapes)) > 1:
                listed = ", ".join(f"rank {r}: {list(s)} {d}" for r, (s, d) in enumerate(shapes))
                raise UserError(f"rt.gather needs the same shape and dtype on every rank, and got {listed}. Pad to "
                                "one shape first, or gather per-sample rows of an eval set with "
                                "rt.gather_for_metrics(outputs, eval_loader), which takes each rank's own count.")
        return self.backend.all_gather_cat(tensor)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.backend.broadcast_object(obj, src)

    def gather_for_metrics(self, outputs: torch.Tensor, loader: EvalLoader) -> torch.Tensor:
        """The per-sample `outputs` of every rank (rows in the order `loader` yielded this rank's samples), as one
        tensor in dataset order, every sample exactly once: the repeats a rank ran to keep collective forwards in
        step are dropped, nothing is padded. On every rank."""
        if not isinstance(outputs, torch.Tensor):
            raise UserError("rt.gather_for_metrics: expected one tensor of per-sample rows (torch.cat the batches).")
        if not isinstance(loader, EvalLoader):
            raise UserError(f"rt.gather_for_metrics(outputs, loader): the loader must be rt.eval_loader's, which reads "
                            f"each sample once; got a {type(loader).__name__}"
                            + (" (rt.loader's training stream, which runs on across epochs)" if isinstance(loader, Loader)
                               else "") + ". Evaluate over eval_loader = rt.eval_loader(dataset, batch_size=...).")
        if outputs.shape[0] < len(loader.indices):
            per_batch = 0 < outputs.shape[0] <= loader.batch_size
            raise UserError(f"rt.gather_for_metrics: {outputs.shape[0]} rows for the {len(loader.indices)} samples "
                            "this rank's loader yields" + (
                                ", one batch's: it takes the whole eval's rows once, after the loop (where "
                                "Accelerate's is called every batch), so that every sample is there exactly once "
                                "with no padding. Keep each batch's rows in a list and call it with torch.cat(list)."
                                if per_batch else ": give one row per sample, for every batch (torch.cat of each "
                                "batch's rows), once, after the loop."))
        gathered = self.backend.gather_samples(loader.indices, outputs[: len(loader.indices)])
        if self._watched:
            watchdog.progress()
        return gathered

    # -- checkpoints and exports ----------------------------------------------------------------------------
    def _manager(self, directory: Path, keep_last: int | None):
        from trainer.checkpoint.manager import CheckpointManager, Parts
        from trainer.checkpoint.store import Checkpointer
        from trainer.models.finetune import after_load, frozen_keys

        if self._checkpointer is None or self._checkpointer.dir != directory:
            self._checkpointer = Checkpointer(directory, keep_last=keep_last, backend=self.backend,
                                              sharded=self.strategy.sharded)
        self._checkpointer.keep_last = keep_last
        parts = Parts(self.strategy, self.models, self.optimizers,
                      {name: frozen_keys(m) for name, m in self.models.items()}, after_load=after_load,
                      config_hyperparameters=False)
        # Beside the user's: the trackers' run, and the precision's state (fp16's loss scale: a resume that started
        # it over at 65536 skipped steps again, and the resumed run was not the uninterrupted one).
        own = {"loggers": _TrackerState(self),
               **({"precision": self.precision} if hasattr(self.precision, "load_state_dict") else {})}
        return CheckpointManager(self._checkpointer, parts, self.position, {**self.stateful, **own},
                                 every_component=True)

    def _refuse_another_runs(self, directory: Path, call: str, what: str) -> None:
        """`directory` of rt.save_state or rt.save_model inside a checkpoint, or a `python -m trainer` run's dir (or
        its checkpoints/) other than this Runtime's run_dir: the saves replaced that run's exported weights or its
        last checkpoint, or set its checkpoints aside, and the run no longer loaded or resumed."""
        from trainer.checkpoint.store import MANIFEST, step_of

        given = directory.expanduser().absolute()
        for p in (given, *given.parents):
            if step_of(p) >= 0 and (p / MANIFEST).is_file():
                raise UserError(f"{call}({str(directory)!r}): that is inside the checkpoint {p}, whose files its "
                                f"manifest lists and checks: writing {what} there would damage it. Pass a directory "
                                "of its own.")
        if self.run_dir is not None and given.resolve().is_relative_to(Path(self.run_dir).resolve()):
            return  # (this run's own dir: an earlier attempt's files there are set aside, not lost)
        for run in (given, given.parent) if given.name.startswith("checkpoints") else (given,):
            # (what the framework's runs write: not a Hydra app's own .hydra/ and config.yaml)
            cli_run = (run / "run_info.json").is_file() or ((run / "export.json").is_file() and
                                                            (run / "model_config.json").is_file())
            if cli_run:
                raise UserError(f"{call}({str(directory)!r}): {run} is the run dir of a `python -m trainer` run, "
                                f"whose exported weights and checkpoints its eval, sample and resume read: {what} "
                                "written there would replace or set them aside. Pass a directory of its own; to "
                                f"write there as this script's own run, give it as trainer.Runtime(run_dir={str(run)!r}) "
                                "(the earlier files are then set aside, not replaced).")

    def save_state(self, directory: str | os.PathLike, step: int, keep_last: int | None = None) -> Path:
        """Checkpoint every model, optimizer, loader and registered object, and each rank's RNG, as
        `directory/step_<step>` (atomic, pickle-free; the `keep_last` newest are kept: default checkpoint.keep_last
        under launch, where null keeps every one, else 2). Every rank must call it, at a step boundary."""
        self._not_ended("rt.save_state")
        _path_arg("rt.save_state(directory, step)", directory)
        if not is_count(step):
            raise UserError(f"rt.save_state(directory, step={step!r}): the step must be a whole number >= 0 (the "
                            "checkpoint is named step_<step>, and rt.load_state takes the newest by it).")
        if keep_last is not None and not (is_count(keep_last) and keep_last >= 1):
            raise UserError(f"rt.save_state(keep_last={keep_last!r}): expected a whole number >= 1 (how many of the "
                            "newest checkpoints to keep), or None for the default.")
        if self._micro > 0:
            raise UserError(f"rt.save_state in the middle of an accumulation (after micro-step {self._micro} of "
                            f"{self.grad_accum_steps}): a checkpoint holds no gradients, so a resume from it would "
                            "lose these micro-batches while its loader skips them. Save after rt.step, when "
                            "rt.sync_gradients is true.")
        if Path(directory).exists() and not Path(directory).is_dir():
            raise UserError(f"rt.save_state({str(directory)!r}) is a file: pass a directory, which save_state writes "
                            "its checkpoints into (step_<step>), as rt.load_state reads them.")
        self._refuse_another_runs(Path(directory), "rt.save_state", "checkpoints")
        if not (self.models or self.optimizers or self.stateful):  # (it wrote a checkpoint of nothing but the RNG)
            raise UserError("rt.save_state before anything was set up or registered: the checkpoint would hold no "
                            "model, optimizer or loader. Call it after rt.setup(model, optimizer) (and rt.register of "
                            "what else the loop needs back).")
        unregistered = [type(sc).__name__ for sc in self._schedulers
                        if not any(sc is obj for obj in self.stateful.values())]
        if unregistered:  # (every rank steps the same schedulers: refused on each, before anything is written)
            raise UserError(f"rt.save_state: the {', '.join(unregistered)} that rt.step steps is not registered, so "
                            "the checkpoint would not hold its schedule and a resume would start it over (the "
                            "learning rate back at its first value). Register it once, before rt.load_state: "
                            "rt.register(\"scheduler\", scheduler) (Accelerate's prepare(scheduler)).")
        self._all_ranks_here("save_state", self._checkpointed_names())
        back, self._rolled_back_to = self._rolled_back_to, None
        if back is not None and back.parent.resolve() == Path(directory).resolve():
            # The first save after a rollback: the checkpoints written after the one loaded are the branch it leaves,
            # moved aside together (its events were kept at the load, under the same number).
            from trainer.checkpoint.manager import set_abandoned_branch_aside
            from trainer.checkpoint.store import Checkpointer
            from trainer.io import one_attempt

            with one_attempt(back.parent.parent, number=self._attempt):
                set_abandoned_branch_aside(Checkpointer(back.parent), back, self.position.step, self.loggers, None,
                                           None, _note)
        self._set_earlier_run_aside(Path(directory))
        self.position.step = step = operator.index(step)
        path = self._manager(Path(directory), keep_last or self.keep_last).save(step, None, wait=True)
        if self._watched:
            watchdog.progress()
        return path

    def _set_earlier_run_aside(self, directory: Path) -> None:
        """The first save into a dir this process loaded nothing from: checkpoints there are an earlier run's, which
        this run's saves would replace (the same steps) and prune (keep_last). They move to `DIR.prev` (-2, ...),
        as the Trainer's fresh start keeps an earlier attempt's."""
        from trainer.checkpoint.store import Checkpointer, set_aside

        key = directory.resolve()
        if key in self._saved_into:
            return
        self._saved_into.add(key)
        failed = None  # (a user's mistake or a storage error, and its paragraph)
        if self.backend.is_main and key not in self._loaded_from and directory.is_dir() and \
                Checkpointer(directory).complete():
            run_files = sorted(n for n in RUN_FILES if (directory / n).exists())
            if run_files:  # (moving the dir aside would move this run's open files, and its lock, with it)
                failed = ("user", f"rt.save_state({str(directory)!r}): it holds checkpoints this process loaded none "
                          f"of (an earlier run's) beside a run's own files ({', '.join(run_files)}), which moving those "
                          "checkpoints aside would move too; nothing was written or moved. Save into a directory for "
                          f"checkpoints alone (rt.save_state({str(directory / 'checkpoints')!r}, step)), or "
                          "rt.load_state(DIR) first to continue that run.")
            else:
                from trainer.io import one_attempt

                try:
                    same = self.run_dir is not None and directory.parent.resolve() == Path(self.run_dir).resolve()
                    with one_attempt(directory.parent, number=self._fresh_attempt if same else None):
                        moved = set_aside(directory)  # (under the number metrics.prev-N took at the first rt.log)
                    _note(f"rt.save_state({str(directory)!r}): it held checkpoints this process loaded none of (an "
                          f"earlier run's, or a branch it left): they are kept in {moved}, and this run's start there. "
                          "rt.load_state(DIR) before the first save continues a run instead")
                except OSError as e:
                    failed = ("storage", f"rt.save_state({str(directory)!r}): it holds checkpoints this process loaded "
                              f"none of, which could not be moved aside ({e.strerror or e}); nothing was written. Make "
                              "it writable, or save into a directory of this run's own.")
        if self.backend.distributed:  # (no rank writes into the dir before it is moved; every rank stops alike)
            failed = self.backend.broadcast_object(failed)
        if failed is not None:
            from trainer.errors import StorageError

            kind, why = failed
            raise (UserError if kind == "user" else StorageError)(why)

    def load_state(self, path: str | os.PathLike) -> int | None:
        """Load a checkpoint of save_state (a `step_*` dir, or the newest complete one under `path`): under any
        strategy and world size. Returns its step, or None when `path` holds no checkpoint yet. Every rank."""
        from trainer.checkpoint.store import MANIFEST, Checkpointer, step_of

        _path_arg("rt.load_state(path)", path)

        # Refused whether or not a checkpoint is there yet: a first run (nothing to load) would otherwise pass, and
        # its restart be refused. (With a checkpoint, the load compared its weights with no model: "not in the model".)
        if not self.models:
            raise UserError(f"rt.load_state({str(path)!r}) before rt.setup: no model is set up to take the "
                            "checkpoint's weights. Call `model, optimizer = rt.setup(model, optimizer)` first, then "
                            "rt.load_state (Accelerate's order too: prepare, then load_state).")
        self._all_ranks_here("load_state", self._checkpointed_names())
        self._scheduled.clear()  # (a registered scheduler's position is the checkpoint's now)
        path = Path(path)
        numbered = re.fullmatch(r"step_([0-9]+)", path.name)  # (save_state names them step_00000005: 8 digits)
        if (step_of(path) >= 0 or numbered) and not path.is_dir():
            from trainer.config.schema import checkpoints_beside

            raise UserError(f"rt.load_state({str(path)!r}): there is no such checkpoint.{checkpoints_beside(path)} "
                            f"Pass one that exists, "
                            f"or its directory ({path.parent}) for the newest there (None when there is none yet).")
        if path.exists() and not path.is_dir():
            raise UserError(f"rt.load_state({str(path)!r}) is a file: pass a checkpoint save_state wrote (a step_* "
                            "directory) or the directory save_state wrote them into.")
        if not (path / MANIFEST).exists() and step_of(path) >= 0 and path.is_dir():  # (it was a fresh start: None)
            raise CheckpointError(f"rt.load_state({str(path)!r}): that checkpoint has no manifest.json, which a save "
                                  "writes last: it is incomplete (a save or copy that stopped before it) or damaged, "
                                  f"so it cannot be loaded. Pass its directory ({path.parent}) for the newest complete "
                                  "one there. Nothing was loaded.")
        if not (path / MANIFEST).exists():
            there = Checkpointer(path) if path.is_dir() else None
            found = there.complete() if there else []
            damaged = [p.name for p in (there.unreadable() if there else [])
                       if not found or step_of(p) > step_of(found[-1])]
            if damaged and self.backend.is_main:  # (it was a fresh start, or an older step, without a word)
                _note(f"rt.load_state({str(path)!r}): {', '.join(damaged)} {'has' if len(damaged) == 1 else 'have'} no "
                      "readable manifest.json (a save or copy that stopped before it, or a damaged checkpoint): "
                      f"skipped, so {'the loop starts fresh' if not found else 'it loads ' + found[-1].name}")
            if not found:
                below = sorted({str(p.parent.parent) for p in path.glob("*/step_*/" + MANIFEST)}) if path.is_dir() else []
                if below and self.backend.is_main:  # (a fresh start is what it returns: say where checkpoints are)
                    _note(f"rt.load_state({str(path)!r}): no checkpoint there (a fresh start), but {', '.join(below)} "
                          "holds some: pass that directory to continue from its newest")
                elif not path.exists() and self.backend.is_main:  # (a first run's dir: quiet, unless a typo's)
                    _say_a_close_checkpoint_dir(path)
                return None
            path = found[-1]
        # The trackers continue their runs (the wandb run id) on a restart: a load before this process logged, of a
        # checkpoint of this run_dir's (another run's wandb run is that run's record, and a late load, for an eval,
        # leaves the run already started alone).
        self._restores_trackers = not self._logged and self.run_dir is not None and \
            path.resolve().is_relative_to(Path(self.run_dir).resolve())
        built = {name: _base_lrs(opt) for name, (_, opt) in self.optimizers.items()}
        self._manager(path.parent, 2).load(path)
        self._loaded = True
        if self.backend.is_main:
            self._say_loaded_lrs(built)
        self._loaded_from.add(path.parent.resolve())
        # A checkpoint older than others written after it: a rollback once this run saves there (not a load for an
        # eval). The abandoned branch's events, where some are after it, are copied before the rewind below cuts
        # them, under the number its checkpoints take at that save.
        another = self.backend.is_main and not self._logged and self._another_runs(path)
        # (another run's checkpoints after it are that run's business: this run saves elsewhere)
        later = Checkpointer(path.parent).written_after(path) if self.backend.is_main and not another else []
        self._rolled_back_to = path if later else None
        if later and not self._logged and self.run_dir is not None:
            from trainer.io import one_attempt
            from trainer.tracking.loggers import last_step

            with one_attempt(self.run_dir) as self._attempt:
                metrics = Path(self.run_dir) / "metrics.jsonl"
                kept = self.loggers.keep_copy() if metrics.is_file() and (last_step(metrics) or 0) > \
                    self.position.step else []
            if kept:
                _note(f"rt.load_state({str(path)!r}) goes back before {', '.join(p.name for p in later)}: the events "
                      f"logged after it are kept in {', '.join(map(str, kept))}")
        if another:
            self._start_from_another_run(path)
        elif self.backend.is_main and not self._logged:  # a restart: the events logged after the checkpoint go,
            self.loggers.rewind(self.position.step)       # the loop logs them again (not a load late in a run)
        elif self.backend.is_main and self._set_aside is not None:
            print(f"note: rt.load_state after rt.log: the run's metrics up to this checkpoint are in "
                  f"{self._set_aside}, set aside at the first rt.log as an earlier run's; this run's go on in "
                  f"{self.run_dir / 'metrics.jsonl'}. Call rt.load_state before rt.log to keep them in one file.",
                  file=sys.stderr, flush=True)
            self._set_aside = None
        if self.backend.is_main:
            self._log_config()  # (after the rewind: the config text goes at the checkpoint's step)
        if self._watched:
            watchdog.progress()
        return self.position.step

    def _say_loaded_lrs(self, built: dict[str, tuple]) -> None:
        """An optimizer built with another learning rate than its checkpoint's takes the checkpoint's (as torch's
        load_state_dict does, with its other settings): said, where a restart with a new rate had it
        ignored without a word (the Trainer applies a new optim.lr and says so). Under a scheduler, its base rates
        (`initial_lr`) are compared: the rate itself is the schedule's, mid-way."""
        for name, (_, opt) in self.optimizers.items():
            now = _base_lrs(opt)
            if name in built and now != built[name] and all(isinstance(lr, float) for lr in now + built[name]):
                scheduled = any("initial_lr" in g for g in opt.param_groups)
                how = ("its scheduler's base_lrs and the groups' 'initial_lr'" if scheduled else
                       "for group in optimizer.param_groups: group['lr'] = ...")
                _note(f"rt.load_state: the optimizer {name!r} takes the checkpoint's "
                      f"{'base ' if scheduled else ''}learning rate {', '.join(f'{lr:g}' for lr in now)} (this script "
                      f"built it with {', '.join(f'{lr:g}' for lr in built[name])}), as torch's load_state_dict does; "
                      f"to train on with another, set it after rt.load_state ({how})")

    def _another_runs(self, path: Path) -> bool:
        """Whether checkpoint `path` is another run's: it sits in a run dir of its own (one with a metrics.jsonl)
        other than this run_dir, and this run_dir holds no copy of it. (Checkpoints a loop keeps outside any run dir
        are its own.)"""
        from trainer.checkpoint.store import same_run

        if self.run_dir is None:
            return False
        run_dir, home = Path(self.run_dir).resolve(), path.resolve().parent.parent
        return home != run_dir and not path.resolve().is_relative_to(run_dir) and \
            (home / "metrics.jsonl").is_file() and not same_run(run_dir, path)

    def _start_from_another_run(self, path: Path) -> None:
        """A loop of one's own that starts from another run's checkpoint is a run of its own, as the Trainer's is:
        this run_dir's earlier history (metrics.jsonl, the trackers' files) is set aside, and its checkpoints at
        the first save, under one attempt number, rather than the two histories spliced into one file."""
        metrics = Path(self.run_dir) / "metrics.jsonl"
        if not metrics.is_file() or not metrics.stat().st_size:
            self.loggers.rewind(self.position.step)  # (nothing of its own yet: the trackers start at the checkpoint)
            return
        aside = self._set_history_aside(metrics)
        _note(f"rt.load_state({str(path)!r}) is another run's checkpoint: {self.run_dir} held a run of its own, whose "
              f"metrics are kept as {aside.name} (its checkpoints are set aside at this run's first save, under the "
              "same number), and this run's history starts at the checkpoint's step")

    def _checkpointed_names(self) -> list[str]:
        return sorted([*self.models, *self.optimizers, *self.stateful])

    def _all_ranks_here(self, what: str, names: list[str] | None = None) -> None:
        """Every rank must call `what`: a rank that calls it alone would wait in its collectives forever (the
        usual mistake: under `if rt.is_main_process`). A barrier that names the ranks that never came. With the
        `names` a checkpoint holds: the same on every rank (an rt.register under `if rt.is_main_process` was saved
        from rank 0 and refused at the load by the others)."""
        if self.backend.distributed:
            timeout = float(os.environ.get("TRAINER_COLLECTIVE_TIMEOUT", 120))
            missing = self.backend.monitored_barrier(timeout, group=self._monitor)
            if missing is not None:
                raise UserError(f"rt.{what} was called on rank {self.rank} but not on every rank within {timeout:g} s "
                                f"({missing}): "
                                f"every rank must call it (do not put rt.{what} under `if rt.is_main_process`; "
                                + ("every rank reads its own part" if what == "load_state" else
                                   "it writes from the main rank, or from every rank holding a shard, by itself")
                                + "). A rank "
                                "that left its loop early (a `break`, a return or sys.exit on one rank only) never "
                                "comes either.")
            # The barrier is the same for every such call: ranks in different ones would pass it together, then
            # wait forever in each other's collectives.
            calls = self.backend.gather_object((what, names), group=self._monitor)
            if len({c for c, _ in calls}) > 1:
                listed = ", ".join(f"rank {r}: rt.{c}" for r, (c, _) in enumerate(calls))
                raise UserError(f"the ranks called different Runtime methods at the same point ({listed}): every rank "
                                "must call rt.save_state, rt.load_state and rt.save_model, in the same order (a rank "
                                "that left its loop early, with a `break` on one rank only, went on to the next).")
            everywhere = set.intersection(*(set(n or ()) for _, n in calls))
            partial = {name: [r for r, (_, n) in enumerate(calls) if name in (n or ())]
                       for name in sorted(set().union(*(n or () for _, n in calls)) - everywhere)}
            if partial:
                listed = "; ".join(f"{name!r} on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))} only"
                                   for name, r in partial.items())
                raise UserError(f"rt.{what}: the ranks set up different things to checkpoint ({listed}). Every rank "
                                "must set up the same models and loaders and register the same objects, under the same "
                                "names (not under `if rt.is_main_process`): each rank saves and loads its own state, "
                                "and rt.save_state writes from the main rank by itself. Nothing was "
                                + ("written." if what == "save_state" else "loaded."))

    def save_model(self, model: nn.Module, directory: str | os.PathLike, max_shard_size: str | int = "1GB",
                   name: str = "model") -> list[str] | None:
        """The whole model as safetensors in `directory` (`<name>.safetensors`, or shards with the Hugging Face
        index above `max_shard_size`), and a Hugging Face model's config.json (so that `from_pretrained(directory)`
        loads it; a peft model's adapter in peft's layout in adapter/ instead), written by the main rank. Every rank
        must call it (shards are gathered)."""
        from trainer.models.export import export_model, is_peft_model, write_hf_config, write_peft_adapter

        if not isinstance(model, nn.Module):
            raise UserError(f"rt.save_model got a {type(model).__name__}: pass the model (what rt.setup returned, or "
                            "the module itself); an optimizer's and the rest of the run's state go in rt.save_state.")
        _path_arg("rt.save_model(model, directory)", directory)
        if Path(directory).exists() and not Path(directory).is_dir():
            raise UserError(f"rt.save_model({str(directory)!r}, ...): that path is a file; save_model writes a "
                            "directory (model.safetensors and, for a Hugging Face model, config.json). Pass a "
                            "directory, new or existing.")
        if not (isinstance(name, str) and name and name not in (".", "..") and not set(name) & {"/", "\\", "\0"}):
            raise UserError(f"rt.save_model(..., name={name!r}): the name of the weights file (<name>.safetensors) is "
                            "a file name, without a directory part (which would write outside the directory given): "
                            "give the directory as the second argument, and a plain name (the default, 'model', is "
                            "the one from_pretrained reads).")
        if name.endswith(".safetensors") and name != ".safetensors":  # (it wrote model.safetensors.safetensors)
            name = name[: -len(".safetensors")]
        self._refuse_another_runs(Path(directory), "rt.save_model", "weights")
        from trainer.io import unwritable

        problem = unwritable(Path(directory))
        if problem is not None:
            raise UserError(f"rt.save_model({str(directory)!r}, ...): {problem}; nothing was written. Pass a directory "
                            "this process can write.")
        megabytes = _megabytes(max_shard_size)  # (checked before the gathering: every rank refuses it alike)
        self._all_ranks_here("save_model")
        tensors = self.strategy.full_state_dict(self.strategy.model_state_dict(model))
        if self._watched:
            watchdog.progress()
        if not self.backend.is_main:
            return None
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        written = export_model(tensors, directory, name, None, megabytes)  # (no empty model_config.json)
        if name == "model" and is_peft_model(unwrap(model)):  # (the adapter, for PeftModel.from_pretrained)
            written += write_peft_adapter(unwrap(model), tensors, directory)
        elif name == "model":  # (the name from_pretrained reads)
            written += write_hf_config(unwrap(model), directory)
        if self._watched:
            watchdog.progress()
        return written

    # -- logging -------------------------------------------------------------------------------------------
    def _loggers(self, launched, log_with):
        """metrics.jsonl in run_dir, and the trackers `log_with` names ("wandb", "tensorboard"), or under `launch`
        those of the job's logger=...; on the main process only. Without a run_dir, none."""
        from trainer.tracking.loggers import JsonlLogger, LoggerGroup, NullLogger

        names = [log_with] if isinstance(log_with, str) else list(log_with or [])
        if self.run_dir is None:
            if names:
                raise UserError(f"Runtime(log_with={log_with!r}) needs run_dir=...: where the trackers write.")
            return NullLogger()
        if not self.backend.is_main:
            return NullLogger()
        if launched is not None and not names:
            from trainer.config.instantiate import build_loggers

            return build_loggers(launched.get("logger"), self.run_dir, True)
        from trainer.tracking.tensorboard_logger import TensorBoardLogger
        from trainer.tracking.wandb_logger import WandbLogger

        trackers = {"wandb": WandbLogger, "tensorboard": TensorBoardLogger}  # (each imports its library when built)
        unknown = [n for n in names if n not in trackers]
        if unknown:
            raise UserError(f"Runtime(log_with={unknown[0]!r}) is invalid: expected {' or '.join(trackers)}.")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        built = [trackers[n](run_dir=self.run_dir) for n in names]
        return LoggerGroup([JsonlLogger(self.run_dir), *built])

    def init_trackers(self, config: dict[str, Any] | None = None) -> None:
        """Record the run's config with the trackers (main process only). Written once the run knows whether it is
        a new one or a resume (its first rt.log, rt.load_state or rt.end): a new run's writers must open only after
        an earlier run's files are set aside, and a resume's at its checkpoint's step."""
        if self.backend.is_main and config:
            self._config = config

    def _log_config(self) -> None:
        if self._config is not None:
            config, self._config = self._config, None
            self.loggers.log_config(config)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Metrics to the trackers, from the main process (the others' calls do nothing)."""
        if not isinstance(metrics, dict):
            raise UserError(f"rt.log got a {type(metrics).__name__}: pass a dict of names and numbers, and the step "
                            "(`rt.log({'train/loss': loss.item()}, step)`).")
        if not is_count(step):
            raise UserError(f"rt.log(..., step={step!r}): the step must be a whole number >= 0.")
        step = operator.index(step)
        if "step" in metrics and not (isinstance(metrics["step"], int | float | torch.Tensor) and
                                      float(metrics["step"]) == step):  # ({"step": 5} replaced the record's step)
            raise UserError("rt.log: a metric named 'step' would replace the step of metrics.jsonl's record: the "
                            "step is rt.log's second argument. Name the metric otherwise (e.g. 'train/step').")
        for key, value in metrics.items():  # (float() of these raised a bare ValueError on the main rank alone)
            if isinstance(value, (str, bytes)) or (isinstance(value, torch.Tensor) and value.numel() != 1) or not (
                    isinstance(value, torch.Tensor) or hasattr(value, "__float__")):
                shown = f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)[:80]
                raise UserError(f"rt.log: {key!r} is {shown}, not a number: log one number a key (`.mean()` of a "
                                "tensor, `.item()` of a one-element one).")
        if self._ended:
            raise UserError("rt.log after rt.end(): the trackers are finished and metrics.jsonl is closed. Log the "
                            "final metrics (a last eval's) before rt.end(), which comes last in the script.")
        first, self._logged = not self._logged, True
        if self.backend.is_main:
            if first and not self._loaded:
                self._start_fresh(step)
            self._log_config()
            if self._unlogged:
                print(f"note: rt.log: the job's logger={','.join(self._unlogged)} has no directory to write in, so "
                      "these metrics go nowhere: pass one to the script's trainer.Runtime(run_dir=DIR) (metrics.jsonl "
                      "and the trackers' files go there).", file=sys.stderr, flush=True)
                self._unlogged = []
            # (a loss straight from the backward: float() of it warns about its graph, pointing at this line)
            self.loggers.log_metrics({k: float(v.detach() if isinstance(v, torch.Tensor) else v)
                                      for k, v in metrics.items()}, step)

    def _start_fresh(self, step: int) -> None:
        """A run whose first rt.log, without a checkpoint loaded, logs a step the run_dir's metrics.jsonl already
        has is a new run: the earlier one's metrics.jsonl (and its trackers' files) are set aside, as the Trainer's
        fresh start sets them aside, so the two histories never mix in one file. A later step (a script that
        evaluates the run and logs after it) is appended."""
        from trainer.tracking.loggers import last_step

        metrics = self.run_dir / "metrics.jsonl" if self.run_dir is not None else None
        if metrics is None or not metrics.is_file() or not metrics.stat().st_size:
            return
        last = last_step(metrics)
        if last is not None and step > last:  # appended: the trackers go on after `last` (TensorBoard's writer
            self.loggers.rewind(last)          # would otherwise purge from step 1, hiding the run's curves)
            return
        aside = self._set_history_aside(metrics)
        if not metrics.stat().st_size and aside.is_file():
            self._set_aside = aside
            print(f"note: rt.log: {self.run_dir} held an earlier run's metrics, and this run loaded no checkpoint "
                  f"before logging: they are kept as {aside.name}, and this run's start in metrics.jsonl (rt.load_state "
                  "before the first rt.log continues a run's history instead).", file=sys.stderr, flush=True)

    def _set_history_aside(self, metrics: Path) -> Path:
        """The run_dir's earlier history set aside as a fresh start keeps it (`loggers.start_fresh`), under one number
        for metrics.prev-N.jsonl, tensorboard.prev-N/ and the checkpoints the first save sets aside; the name
        metrics.jsonl takes."""
        from trainer.io import free_name, one_attempt
        from trainer.models.export import set_aside

        with one_attempt(self.run_dir) as self._fresh_attempt:
            aside = free_name(metrics, ".prev", before_suffix=True)  # (the name start_fresh gives it)
            self.loggers.start_fresh()
            # The earlier run's exported weights (rt.save_model into the run dir), which this run's would replace.
            export = set_aside(self.run_dir)
        if export is not None:
            print(f"note: rt.log: the earlier run's exported weights are kept in {export}.", file=sys.stderr, flush=True)
        return aside

    def _hold_run_dir(self, run_dir: Path, alone: bool):
        """The run dir's lock, taken by the main rank; a refusal is every rank's (they would wait for it)."""
        from trainer import runlock

        held = refused = None
        if self.backend.is_main:
            try:
                held = runlock.hold(run_dir, "Runtime(run_dir=...)")
            except ConfigError as e:
                refused = str(e)
        if self.backend.distributed:
            refused = self.backend.broadcast_object(refused)
        if refused:
            if alone and not self.backend.distributed:
                self.backend.teardown()  # (the process group of one it made: a later Runtime makes its own)
            raise ConfigError(refused)
        if held is not None:
            weakref.finalize(self, held.release)  # (a Runtime dropped without rt.end(), in a notebook)
        return held

    def _not_ended(self, call: str) -> None:
        """After rt.end() the process group is gone (a collective of several processes would fail, or wait) and the
        trackers are finished: the loop's calls come before it."""
        if self._ended:
            raise UserError(f"{call} after rt.end(): the run is finished (its process group left, its trackers "
                            "closed). rt.end() comes last in the script, after the loop and its saves.")

    def _say_unapplied(self) -> None:
        """A note (once) where the loop ended in the middle of an accumulation whose micro-steps had backwards: a
        DataLoader of the loop's own whose epoch is not a multiple of grad_accum_steps micro-batches leaves its last
        ones' gradients unapplied (Accelerate's prepared loader ends the step there; `rt.loader`'s epochs are whole
        steps)."""
        if self._micro == 0 or self._backwards == self._backwards_at_step_start or self._said_unapplied:
            return
        self._said_unapplied = True
        if self.backend.is_main:
            _note(f"the loop's last {self._micro} micro-batch(es) were never applied: it ended after micro-step "
                  f"{self._micro} of {self.grad_accum_steps} of a step (a DataLoader of your own whose epoch is not a "
                  f"multiple of {self.grad_accum_steps} micro-batches). To step on them, pass last=True to the last "
                  "micro-batch's rt.accumulate (`rt.accumulate(model, last=i == len(loader) - 1)`), or use "
                  "rt.loader, whose epochs are whole steps")

    def end(self) -> None:
        """Finish the trackers and leave the process group (every rank, at the end of the script)."""
        self._say_unapplied()
        self._ended = True
        if self._unused_dir is not None:
            import atexit

            atexit.unregister(self._unused_dir)
        if self._watched:  # (what the script does after its loop is its own: no longer watched for hangs)
            watchdog.disarm()
        if self.backend.is_main:
            self._log_config()  # (a script that never logged)
            self.loggers.finish({})
        if self._checkpointer is not None:
            self._checkpointer.close()
        if self._stale_hook is not None:
            self._stale_hook.remove()
            self._stale_hook = None
        self.backend.teardown(wait_for_peers=True)
        if self._run_dir_hold is not None:
            self._run_dir_hold.release()


def _note(line: str) -> None:
    """A line for the user about what a load or save did to the run's files (the main rank's): on stderr."""
    print(line if line.startswith("resume:") else f"note: {line}.", file=sys.stderr, flush=True)


# Accelerator(...)'s keywords, and what Runtime(...) takes instead.
ACCELERATE_KEYWORDS = {"mixed_precision": "precision='bf16' (or 'fp16', 'fp32', 'auto')",
                       "gradient_accumulation_steps": "grad_accum_steps=N",
                       "project_dir": "run_dir=DIR", "logging_dir": "run_dir=DIR", "cpu": "device='cpu'"}


# Accelerator's and Fabric's attributes and methods the Runtime has under another name, or does another way.
OTHER_NAMES = {
    "num_processes": ("Accelerate", "rt.world_size"), "process_index": ("Accelerate", "rt.rank"),
    "local_process_index": ("Accelerate", "rt.local_rank"), "global_rank": ("Fabric", "rt.rank"),
    "is_global_zero": ("Fabric", "rt.is_main_process"),
    "prepare": ("Accelerate", "`model, optimizer = rt.setup(model, optimizer)` for models and optimizers, "
                "`rt.loader(dataset, batch_size=...)` for data, `rt.register('scheduler', scheduler)` for a scheduler"),
    "prepare_model": ("Accelerate", "rt.setup(model)"), "prepare_optimizer": ("Accelerate", "rt.setup(model, optimizer)"),
    "prepare_data_loader": ("Accelerate", "rt.loader(dataset, batch_size=...)"),
    "prepare_scheduler": ("Accelerate", "rt.register('scheduler', scheduler), and rt.step(optimizer, scheduler)"),
    "setup_module": ("Fabric", "rt.setup(model)"), "setup_optimizers": ("Fabric", "rt.setup(model, optimizer)"),
    "setup_dataloaders": ("Fabric", "rt.loader(dataset, batch_size=...)"),
    "gradient_accumulation_steps": ("Accelerate", "rt.grad_accum_steps"),
    "mixed_precision": ("Accelerate", "rt.precision"), "all_gather": ("Fabric", "rt.gather(tensor)"),
    "all_reduce": ("Fabric", "rt.reduce(tensor, 'mean')"), "barrier": ("Fabric", "rt.wait_for_everyone()"),
    "clip_gradients": ("Fabric", "rt.clip_grad_norm_(model, max_norm)"),
    "no_backward_sync": ("Fabric", "`with rt.accumulate(model):`, which syncs only at the step's last micro-batch"),
    "save": ("Accelerate and Fabric", "rt.save_state(dir, step) for a checkpoint, rt.save_model(model, dir) for "
             "weights"),
    "load": ("Fabric", "step = rt.load_state(dir)"),
    "optimizer_step_was_skipped": ("Accelerate", "rt.step(optimizer)'s return value (False: fp16 skipped it)"),
    "set_seed": ("Accelerate", "trainer.Runtime(seed=N)"), "seed_everything": ("Fabric", "trainer.Runtime(seed=N)"),
    "skip_first_batches": ("Accelerate", "nothing: rt.loader's state is in rt.save_state, and rt.load_state "
                           "continues its epoch where the checkpoint left it"),
    "get_tracker": ("Accelerate", "rt.log({...}, step=s) to every tracker of Runtime(log_with=...)"),
    "launch": ("Fabric", "python -m trainer launch [world=ddp world.nproc_per_node=N] SCRIPT.py"),
}


def _refuse_keywords(unknown: dict[str, Any]) -> None:
    import inspect

    from trainer.errors import suggest

    own = [n for n in inspect.signature(Runtime.__init__).parameters if n not in ("self", "unknown")]
    said = []
    for name in unknown:
        if name in ACCELERATE_KEYWORDS:
            said.append(f"{name} is Accelerate's: here {ACCELERATE_KEYWORDS[name]}")
        else:
            hint = suggest(name, own).strip()
            said.append(f"{name} is not one of its keywords" + (f" ({hint})" if hint else ""))
    raise UserError(f"trainer.Runtime({', '.join(f'{n}=...' for n in unknown)}): {'; '.join(said)}. Its keywords: "
                    f"{', '.join(own)} (see the README's 'Coming from Accelerate').")


def _megabytes(size: str | int) -> float:
    """`max_shard_size` in MiB: bytes (an int) or a size like '500MB'; more than nothing (a negative int wrote one
    shard file per tensor)."""
    mb = None
    if isinstance(size, int) and not isinstance(size, bool):
        mb = size / 2**20
    elif isinstance(size, str):
        units = {"KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40}
        text = size.strip().upper()
        for unit, factor in units.items():
            if text.endswith(unit) and text[: -len(unit)].strip().replace(".", "", 1).isdigit():
                mb = float(text[: -len(unit)]) * factor / 2**20
    if mb is None or mb <= 0:
        raise UserError(f"max_shard_size={size!r} is invalid: expected bytes (an int > 0) or a size like '500MB' or "
                        "'1GB'.")
    return mb


LAUNCH_ENV = "TRAINER_CONFIG"  # set by `python -m trainer launch` for its workers (trainer/entry/worker.py: CONFIG_ENV)


def launched_config():
    """The job's config when this process runs under `python -m trainer launch`, else None."""
    import json

    text = os.environ.get(LAUNCH_ENV)
    if not text:
        return None
    from omegaconf import OmegaConf

    return OmegaConf.create(json.loads(text))


_SCHEDULERS = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def _base_lrs(optimizer: torch.optim.Optimizer) -> tuple:
    """Each group's base learning rate: a scheduler's `initial_lr` where one set it, else the rate."""
    return tuple(g.get("initial_lr", g.get("lr")) for g in optimizer.param_groups)


def _lrs(optimizer: torch.optim.Optimizer) -> tuple:
    """The learning rates of `optimizer`'s groups, compared without a device sync: a tensor lr (capturable
    optimizers) by its identity and version, which a scheduler's in-place fill bumps."""
    return tuple((id(lr), lr._version) if isinstance(lr := g.get("lr"), torch.Tensor) else lr
                 for g in optimizer.param_groups)


def _not_a_loader(dataset: Any, what: str) -> None:
    """rt.loader takes a dataset and makes the batches; Accelerate's prepare takes a DataLoader (it was read as a
    dataset of batches, and failed at the first batch with a traceback)."""
    if isinstance(dataset, torch.utils.data.DataLoader):
        from torch.utils.data import default_collate

        own = dataset.collate_fn not in (default_collate, torch.utils.data.dataloader.default_convert)
        raise UserError(f"rt.{what} got a DataLoader: it takes the dataset and makes this rank's batches itself (the "
                        "same global batches on any number of processes, resumable). Pass the DataLoader's dataset: "
                        f"rt.{what}(loader.dataset, batch_size=...{', collate_fn=loader.collate_fn' if own else ''}, "
                        "...), where Accelerate has accelerator.prepare(DataLoader(...))"
                        f"{' (this one has a collate_fn of its own, which the batches need too)' if own else ''}.")
    if not isinstance(dataset, torch.utils.data.IterableDataset) and not (hasattr(dataset, "__len__") and (
            hasattr(dataset, "__getitem__") or hasattr(dataset, "__getitems__"))):  # (None: a bare TypeError)
        raise UserError(f"rt.{what} got a {type(dataset).__name__}: it takes a dataset, a map-style one (__len__ and "
                        "__getitem__: a torch Dataset, a list of samples) or an IterableDataset (a stream).")


# A DataLoader's arguments that rt.loader has no use for, and why (Accelerate's users pass them to their DataLoader).
_DATALOADER_ARGS = {
    "drop_last": "an epoch is whole steps: a global batch that reaches the end of the data is completed from the next "
                 "epoch's order, so no batch is short and none is dropped",
    "sampler": "the order is one global stream of samples, shuffled by `shuffle` and the Runtime's seed, the same on "
               "any number of processes (a sampler of your own would make it depend on them); for another order, "
               "reorder the dataset",
    "batch_sampler": "the batches are `batch_size` samples of one global stream (see sampler)",
    "pin_memory": "on CUDA the batches are page-locked already; elsewhere it does nothing",
    "persistent_workers": "the workers persist across epochs already",
    "generator": "the order is drawn from the Runtime's seed (Runtime(seed=...))",
    "worker_init_fn": "the framework seeds the workers: a sample's random draws depend on its place in the stream, "
                      "not on which process or worker reads it",
}


def _not_dataloader_args(what: str, args: dict) -> None:
    """A DataLoader's keyword passed to rt.loader was a TypeError traceback: said with why it has no use here."""
    if not args:
        return
    key = next(iter(args))
    why = _DATALOADER_ARGS.get(key)
    known = "dataset, batch_size, shuffle, num_workers, name, collate_fn" if what == "loader" else \
        "dataset, batch_size, limit, collate_fn"
    raise UserError(f"rt.{what}({key}=...): " + (f"rt.{what} takes no {key}: {why}." if why else
                                                f"no such argument.{suggest(key, known.split(', '))}") +
                    f" It takes {known}.")


def _collate_arg(what: str, collate_fn: Any) -> None:
    if collate_fn is not None and not callable(collate_fn):
        raise UserError(f"rt.{what}(collate_fn={collate_fn!r}): expected a function that makes one batch of a list of "
                        "samples (as a DataLoader's collate_fn), or None for the dataset's own or torch's default.")


def _say_a_close_checkpoint_dir(path: Path) -> None:
    """rt.load_state of a dir that does not exist is a first run's fresh start (None); where a sibling of a close name
    holds checkpoints (`ckpts` for `ckpt`), the path is more likely a typo, which restarted the training every time."""
    from trainer.checkpoint.store import MANIFEST

    try:
        holding = [d.name for d in path.parent.iterdir() if d.is_dir() and any(d.glob("step_*/" + MANIFEST))]
    except OSError:  # (no parent, or one this process cannot list: nothing to say)
        return
    close = suggest(path.name, holding).removeprefix(" Did you mean ").rstrip("?")
    if close:
        dirs = ", ".join(str(path.parent / name) for name in close.split(", "))
        _note(f"rt.load_state({str(path)!r}): no such directory, so the loop starts fresh (None), but {dirs} beside "
              "it holds checkpoints: if that is where the loop saves, a typo here would start every run afresh; "
              "load that path to continue from its newest")


def _path_arg(call: str, value: Any) -> None:
    """A path argument (a str or a pathlib.Path): anything else was a TypeError traceback from deep inside."""
    if not isinstance(value, (str, os.PathLike)) or isinstance(value, str) and not value:
        raise UserError(f"{call}: expected a path (a str or a pathlib.Path), got {value!r}.")


def _loader_args(what: str, **counts: Any) -> None:
    """rt.loader's and rt.eval_loader's counts: integers (batch_size >= 1, the others >= 0), each named when not."""
    for key, value in counts.items():
        low = 1 if key == "batch_size" else 0
        try:
            count = operator.index(value)  # an int or a numpy integer, not a float or a str (bool: refused below)
        except TypeError:
            count = None
        if count is None or isinstance(value, bool) or count < low:
            raise UserError(f"rt.{what}({key}={value!r}): {key} must be an integer >= {low}.")


def _one_paragraph_errors() -> None:
    """A script's own Runtime, run as `python SCRIPT.py` or under torchrun: a mistake the framework names (a
    UserError and the like) that the script does not catch is the one paragraph it is under `launch`, with the line of
    the script that made the call, not a traceback through the framework (the interpreter's exit code, 1). Other
    exceptions, and every one with TRAINER_DEBUG=1, keep the hook there was."""
    from trainer.errors import TrainerExit, debug_enabled, report

    previous = sys.excepthook
    if getattr(previous, "_trainer", False):
        return

    def hook(kind, err, tb):
        if not isinstance(err, TrainerExit) or debug_enabled():
            return previous(kind, err, tb)
        import traceback

        # The script's line: the last frame outside the framework and torch (an optimizer's step hook raises there).
        inside = tuple(str(Path(m.__file__).resolve().parent) + os.sep for m in (sys.modules["trainer"], torch))
        frames = [f for f in traceback.extract_tb(tb) if not str(Path(f.filename).resolve()).startswith(inside)]
        report(err)
        if frames:
            print(f"  (at {frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}; TRAINER_DEBUG=1 shows the "
                  "traceback)", file=sys.stderr, flush=True)

    hook._trainer = True
    sys.excepthook = hook


class _TrackerState:
    """The trackers' state (LoggerGroup: the wandb run id) under "loggers" in save_state, restored where
    load_state says (`Runtime._restores_trackers`)."""

    def __init__(self, rt: Runtime):
        self.rt = rt

    def state_dict(self) -> dict[str, Any]:
        return self.rt.loggers.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.rt._restores_trackers:
            self.rt.loggers.load_state_dict(state)


def _forward_progress(module: nn.Module, args: Any) -> None:
    """A set-up model's forward under `launch`: progress for the hang watch. Not inside a compiled graph, where the
    count would be traced once rather than kept (the loop's backward and step still count there)."""
    if not torch.compiler.is_compiling():
        watchdog.progress()


class _CheckedZeroGrad:
    """A set-up optimizer's zero_grad: refused where it would throw away the gradients of a step's earlier
    micro-batches (in or after a micro-step that is not the step's last, past its first backward), which
    rt.step keeps until the boundary and zeroes there. Elsewhere, the optimizer's own."""

    __slots__ = ("rt", "own")

    def __init__(self, rt: Runtime, own: Callable):
        self.rt, self.own = rt, own

    def __call__(self, set_to_none: bool = True) -> None:
        rt = self.rt
        if rt._in_accumulate:
            lost = rt._continues_step or (rt._backward_here and not rt.sync_gradients)
        else:
            lost = rt._micro > 0
        if lost:
            raise UserError(f"optimizer.zero_grad() in the middle of an accumulation (micro-step "
                            f"{rt._micro or rt.grad_accum_steps} of {rt.grad_accum_steps}): it would throw away the "
                            "gradients of the step's earlier micro-batches. rt.step(optimizer) zeroes them at the step "
                            "boundary: leave this call out (a step's first micro-step may still zero before its "
                            "backward).")
        return self.own(set_to_none=set_to_none)


class _MicroStep:
    """`rt.accumulate`'s context: the strategy's no_sync of each model, entered together. A class, not a generator
    and an ExitStack: the Trainer enters one every micro-step, and most strategies' no_sync is a nullcontext."""

    __slots__ = ("rt", "contexts", "stack")

    def __init__(self, rt: Runtime, contexts: list[contextlib.AbstractContextManager]):
        self.rt, self.contexts, self.stack = rt, contexts, None

    def __enter__(self) -> None:
        real = [c for c in self.contexts if type(c) is not contextlib.nullcontext]
        if real:
            with contextlib.ExitStack() as stack:
                for c in real:
                    stack.enter_context(c)
                self.stack = stack.pop_all()  # entered: exited in __exit__ (or here, if one of them failed)
        self.rt._in_accumulate = True

    def __exit__(self, *exc) -> bool | None:
        self.rt._in_accumulate = False
        if self.stack is not None:
            return self.stack.__exit__(*exc)
        return None
