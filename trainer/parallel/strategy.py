"""The strategy interface, and its simplest case: one process on one device.

A strategy owns what changes with the parallelism: placing, wrapping and initialising the model,
gradient sync during accumulation, gradient clipping, the data-parallel coordinates that the sampler
and the loss normalisation use, and the model and optimizer state of checkpoints and exports.
`world._target_` picks the class; the other keys of `world` (but the launch keys) are its options.

Model and optimizer state go through `torch.distributed.checkpoint.state_dict`, which gives the same
keys (the plain module's parameter names) for a plain module, DDP and FSDP, so a checkpoint of one
strategy resumes under another.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from trainer.parallel.layout import Layout


def seed_everything(seed: int) -> None:
    """Python's, torch's (every device's) and numpy's global generators (a dataset's augmentation may draw from any:
    numpy's unseeded made two runs of one config draw other numbers; Lightning's and Accelerate's seed it too)."""
    import numpy as np  # (a dependency: torch has imported it already)

    random.seed(seed)
    torch.manual_seed(seed)  # all devices
    np.random.seed(seed % 2**32)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under DDP, DeepSpeed's engine and torch.compile wrappers: what checkpoints and exports save."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel) or _is_engine(model):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def _is_engine(model: nn.Module) -> bool:
    """DeepSpeed's engine (world=deepspeed), told by its module: nothing here imports DeepSpeed."""
    return type(model).__module__.startswith("deepspeed.") and isinstance(getattr(model, "module", None), nn.Module)


def recompute_in_backward(unit: nn.Module) -> None:
    """Activation checkpointing of `unit`: its forward runs under `torch.utils.checkpoint` (non-reentrant), so its
    activations are recomputed in backward instead of kept. The instance's own `forward` is replaced, not the module
    wrapped: parameter names (checkpoints, plans, LoRA targets) stay as they are, and the unit's hooks (FSDP's) still
    fire around each call. torch.compile traces it as one checkpointed region; torch's composable `checkpoint` (module
    hooks around saved-tensor hooks) failed under compile, its recomputation not matching the compiled forward."""
    import types

    # Bound methods, not closures: a deepcopy of the model (an EMA of your own) rebinds them to the copy.
    unit._forward_recomputed = unit.forward
    unit.forward = types.MethodType(_checkpointed_forward, unit)


def _checkpointed_forward(self: nn.Module, *args, **kwargs):
    if torch.compiler.is_compiling():  # (a compiled region takes selective-checkpoint contexts only)
        return checkpoint(self._forward_recomputed, *args, use_reentrant=False, **kwargs)
    from trainer.noise import replayed_in_recompute

    return checkpoint(self._forward_recomputed, *args, use_reentrant=False, context_fn=replayed_in_recompute,
                      **kwargs)


class Strategy:
    """One process, one device: every method is the plain PyTorch call. The base of the others.

    What the launcher and the checkpointer must do follows from two things: `distributed` (a class attribute:
    may run on several processes) and whether parameters are DTensor shards (`shards_parameters`: FSDP shards
    them over the data-parallel ranks, tensor parallelism over its own). Sharded parameters make the state
    `sharded` (every rank writes checkpoint files and takes part in exports), need a process group even at one
    process (`needs_process_group`: DTensor machinery), and make a forward a collective (`collective_forward`:
    eval and sampling happen on all ranks in lockstep).

    The degrees (`tp`, and the data-parallel degree that follows from the world size) are the job's `Layout`
    (layout.py): built in `setup`, it builds the mesh and applies tensor parallelism for every strategy.
    """

    distributed = False
    shards_data_parallel = False  # FSDP: parameters, gradients and optimizer state sharded over the dp ranks

    tp = 1  # tensor-parallel degree (world.tp, on strategies that take it)
    pp, pp_schedule, microbatches = 1, "1F1B", 1  # pipeline stages (world.pp, on strategies that take it)
    layout: Layout | None = None  # the job's degrees, from setup on
    mesh = None  # the device mesh, ("dp",), ("dp", "tp") or ("pp", "dp"[, "tp"]), when parameters are sharded or staged
    pipeline = None  # this rank's pipeline stages and their schedule (pipeline.py), with world.pp > 1
    _dp_group = None  # the dp dimension's process group, once asked for (see dp_group)
    unit_classes: list[str] | None = None  # the model's repeated blocks, by class name (FSDP's world.wrap)

    @property
    def shards_parameters(self) -> bool:
        """Whether parameters become DTensor shards: the model is then built on the meta device."""
        return self.shards_data_parallel or self.tp > 1

    @property
    def sharded(self) -> bool:
        """Whether every rank writes checkpoint files of its own (shards, or its pipeline stages' tensors)."""
        return self.shards_parameters or self.pp > 1

    @property
    def needs_process_group(self) -> bool:
        return self.shards_parameters or self.pp > 1

    @property
    def collective_forward(self) -> bool:
        return self.shards_parameters or self.pp > 1

    def setup(self, backend, precision) -> None:
        """Called once per process, after the process group exists and before the model is built."""
        if getattr(precision, "sharded", False) != self.shards_parameters:
            raise TypeError(f"{type(precision).__name__} was built for {'' if precision.sharded else 'un'}sharded "
                            f"gradients but {type(self).__name__} {'shards' if self.shards_parameters else 'does not shard'}"
                            " them: build it with sharded=strategy.shards_parameters.")
        self.backend, self.precision = backend, precision
        self.layout = Layout(backend.world_size, self.tp, self.pp)
        if self.shards_parameters or self.layout.needs_mesh:
            self.mesh = self.layout.build_mesh(backend.device.type)
            # DTensor logs a warning on every rank where a redistribution on a 2-D mesh takes two collectives (the
            # gradient norm's reduction and the export's gather under fsdp x tp): the framework's own, about
            # nothing a user can change, and repeated by each rank where only rank 0 is to print.
            logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        if self.pp > 1:
            from trainer.parallel.pipeline import Pipeline

            self.pipeline = Pipeline(self.pp, self.pp_schedule, self.microbatches, self.mesh, backend)

    # -- where this rank sits in the data-parallel dimension --------------------------------------------
    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp") if self.mesh is not None else self.backend.rank

    @property
    def dp_size(self) -> int:
        # (From the layout: indexing the mesh builds a sub-mesh each time, ~0.2 ms, and the loop asks every step.)
        return self.layout.dp if self.layout is not None else self.backend.world_size

    @property
    def dp_group(self) -> Any:
        """The process group over which batches differ (None: all ranks)."""
        if self.mesh is None or not self.layout.needs_mesh:
            return None
        if self._dp_group is None:
            self._dp_group = self.mesh["dp"].get_group()
        return self._dp_group

    # -- the model ---------------------------------------------------------------------------------------
    def check_model(self, model: nn.Module) -> None:
        """Config mistakes visible on the model built on the meta device (called before workers start)."""
        if self.tp > 1:
            from trainer.parallel.tensor_parallel import check_plan

            check_plan(model, self.tp)
        if self.pp > 1:
            from trainer.parallel.pipeline import check_model

            check_model(model, self.pp, self.pp_schedule)

    def check_world(self, world_size: int, precision) -> None:
        """Config mistakes visible once the number of processes and the precision are known (called before workers
        start, so that no worker finds them after the run dir is made)."""

    def units(self, model: nn.Module) -> list[nn.Module]:
        """The model's repeated blocks, children before parents: FSDP's units, and what activation
        checkpointing wraps. `unit_classes` (world.wrap), else the model's `_no_split_modules` (the lm GPT says
        Block; Hugging Face models say theirs), else each child of the model's nn.ModuleLists."""
        names = self.unit_classes if self.unit_classes is not None else getattr(model, "_no_split_modules", None)
        if names is None:
            found = [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]
        else:
            present = {type(m).__name__ for m in model.modules()}
            unknown = [n for n in names if n not in present]
            if unknown:
                from trainer.errors import ConfigError, suggest

                # The model's own repeated blocks, as the fix: its _no_split_modules (where world.wrap was the mistake
                # and they are right), else its ModuleLists' children.
                declared = getattr(model, "_no_split_modules", None) if self.unit_classes is not None else None
                blocks = [n for n in declared or () if n in present] or sorted(
                    {type(m).__name__ for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst})
                fix = (f"Its repeated blocks: world.wrap=[{','.join(blocks)}]" if blocks else
                       "Name the class of its repeated blocks (world.wrap=[ClassName])")
                if self.unit_classes is None:  # (the model's own declaration: world.wrap was never given)
                    raise ConfigError(
                        f"{type(model).__name__}._no_split_modules names {', '.join(unknown)}, which the model does not "
                        f"contain, so its repeated blocks (FSDP's units, what activation checkpointing recomputes) "
                        f"cannot be found.{suggest(unknown[0], present)} Its module classes: "
                        f"{', '.join(sorted(present))}. Correct _no_split_modules in the model's class, or override it: "
                        f"{fix[0].lower() + fix[1:]}.")
                raise ConfigError(
                    f"world.wrap names {', '.join(unknown)}, which the model ({type(model).__name__}) does not "
                    f"contain.{suggest(unknown[0], present)} Its module classes: {', '.join(sorted(present))}. {fix}."
                )
            found = [m for m in model.modules() if type(m).__name__ in names and m is not model]
        return list(reversed(found))

    def build_model(self, factory: Callable[[], nn.Module], seed: int,
                    activation_checkpointing: bool = False) -> nn.Module:
        """Construct the model and wrap it for training. Every rank builds the same initial weights.

        A model with `init_weights()` is re-initialised from `seed` after construction. Under a strategy
        that shards parameters it is built on the meta device, parallelised, then materialised shard by
        shard by that same `init_weights()`, which gives the same weights (see materialize.py), so the
        whole model never exists on one process. A model without it is built whole on every rank first."""
        model = None
        if self.shards_parameters and self.pp == 1:  # (pipeline stages are cut from the whole model: see split)
            with torch.device("meta"):
                model = factory()
        on_meta = model is not None and hasattr(model, "init_weights")
        if not on_meta:
            from trainer.parallel.materialize import built_whole

            model = built_whole(factory, seed, seed_everything)
        if activation_checkpointing:
            units = self.units(model)
            if not units:  # (it recomputed nothing, and said nothing: no memory saved)
                from trainer.errors import ConfigError

                raise ConfigError(
                    f"trainer.activation_checkpointing=true recomputes the activations of each of the model's repeated "
                    f"blocks, and {type(model).__name__} declares none: it has no `_no_split_modules` (the class names "
                    "of its blocks, as Hugging Face models have) and no nn.ModuleList of them, so nothing would be "
                    f"recomputed and no memory saved. Add `_no_split_modules = [\"BlockClass\"]` to "
                    f"{type(model).__name__} (or world=fsdp world.wrap=[BlockClass]), or set "
                    "trainer.activation_checkpointing=false.")
            for unit in units:
                recompute_in_backward(unit)
        self.parallelize(model)
        if on_meta:
            from trainer.parallel.materialize import materialize

            materialize(model, self.param_device, seed, seed_everything)
        return self.wrap(model)

    @property
    def param_device(self) -> torch.device:
        return self.backend.device

    def parallelize(self, model: nn.Module) -> None:
        """Keep this rank's pipeline stages, apply the layout's tensor parallelism, then the strategy's
        data-parallel sharding, in place."""
        if self.pipeline is not None:
            self.pipeline.split(model)
        self.layout.apply_tensor_parallel(model, self.mesh)
        self.shard(model)

    def expect_unused_parameters(self) -> None:
        """A forward may leave some parameters without a gradient (a task's own training_step calls the model's
        parts in turn: a GAN's discriminator step does not reach the generator). Nothing to do here, nor for
        FSDP, whose units take part only when they run."""

    def shard(self, model: nn.Module) -> None:
        """Shard the (tensor-parallel) model over the data-parallel ranks (FSDP); nothing here."""

    def ema_partitions(self) -> Any:
        """How the EMA finds this rank's part of each parameter when it is neither a plain tensor nor a DTensor
        (ZeRO-3's flat partitions: see deepspeed.py); None here, as for every strategy of torch's own."""
        return None

    reduces_gradients = False  # whether reduce_gradients has work to do (DDP and FSDP average in the backward)

    def reduce_gradients(self, params: list[torch.Tensor]) -> None:
        """Average gradients over data-parallel ranks where the wrapper did not (DDP and FSDP do it in the
        last micro-step's backward)."""

    def wrap(self, model: nn.Module) -> nn.Module:
        return model.to(self.param_device)

    def no_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        """Skip the gradient sync in this backward (all micro-steps of an accumulation but the last)."""
        return contextlib.nullcontext()

    # -- the step's calls (trainer.Runtime makes them; a strategy with its own engine, such as DeepSpeed's,
    # overrides them) ----------------------------------------------------------------------------------------
    def attach_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        """(model, optimizer) once the optimizer over `model`'s parameters is set up: here, both as they are."""
        return model, optimizer

    def backward(self, loss: torch.Tensor) -> None:
        self.precision.backward(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.precision.unscale_(optimizer)

    # True while the strategy itself steps an optimizer: its update, or torch's zero-gradient step that gives an
    # empty state its shape. Any other step() of a set-up optimizer is the user's own (Runtime._check_own_step).
    stepping = False
    engine_steps = False  # an engine (DeepSpeed's) steps and zeroes the optimizer itself: no own-step checks

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """The update; False when it was skipped (fp16's loss scaler found an overflow)."""
        self.stepping = True
        try:
            return self.precision.step(optimizer)
        finally:
            self.stepping = False

    @contextlib.contextmanager
    def _shaping(self):
        """Around torch's state-dict helpers, which initialise an empty optimizer state with a zero-gradient step."""
        self.stepping = True
        try:
            yield
        finally:
            self.stepping = False

    def clip_grad_norm_(self, params: list[torch.Tensor], max_norm: float | None) -> torch.Tensor:
        """Clip to `max_norm` (None: only measure). Returns the total norm before clipping, on the device."""
        if self.pipeline is not None:  # the norm of every stage's gradients
            return self.pipeline.clip_grad_norm_(params, max_norm, clip_grad_norm_across_meshes)
        if self.shards_parameters:
            return clip_grad_norm_across_meshes(params, max_norm)
        if max_norm is None:
            return nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        return nn.utils.clip_grad_norm_(params, max_norm)

    # -- state ----------------------------------------------------------------------------------------------
    def state_module(self, model: nn.Module) -> nn.Module:
        """The module whose state_dict keys are the plain model's (no DDP/compile prefixes)."""
        return unwrap(model)

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """This rank's model state (DTensors under sharded strategies), keyed like the plain module's."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.state_module(model))

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state keyed by parameter name (not position), so any strategy can load it.

        Before the first step the state is empty and stays so: torch's helper would initialise it with a
        zero-gradient step (AdamW's step count would then be off by one after a resume). Its groups are kept: an
        optimizer without per-parameter state (SGD without momentum) has nothing else, and its learning rate, which
        a torch scheduler's resume leaves to the optimizer's state, would start over."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if not optimizer.state:
            return {"state": {}, "param_groups": self.optimizer_groups(model, optimizer)}
        return get_optimizer_state_dict(self.state_module(model), optimizer)

    def optimizer_groups(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
        """The optimizer's groups keyed by parameter name, as torch's helper writes them, without the zero-gradient
        step it takes first on an empty state (a step at every save: LBFGS wants a closure, and an update not scaled
        by the learning rate would change the weights)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        with _no_zero_gradient_step():
            return get_optimizer_state_dict(self.state_module(model), optimizer)["param_groups"]

    def optimizer_template(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The shape of a stepped optimizer's state (to check a checkpoint against before loading it).
        Initialises an empty state with torch's zero-gradient step; `reset_optimizer` undoes that."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        with self._shaping():
            return get_optimizer_state_dict(self.state_module(model), optimizer)

    @staticmethod
    def reset_optimizer(optimizer: torch.optim.Optimizer) -> None:
        optimizer.state.clear()

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """`strict=False`: `state` may leave tensors out (a LoRA run's frozen base: see finetune.frozen_keys)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.state_module(model), state, options=StateDictOptions(strict=strict))

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        if not state.get("param_groups"):  # saved before the first step by an earlier version: a fresh optimizer
            self.reset_optimizer(optimizer)
            return
        if not state.get("state"):  # no per-parameter state: the groups alone, without the helper's zero-gradient step
            with _no_zero_gradient_step():
                set_optimizer_state_dict(self.state_module(model), optimizer, state)
            self.reset_optimizer(optimizer)
            return
        with self._shaping():
            set_optimizer_state_dict(self.state_module(model), optimizer, state)

    # -- checkpoints -------------------------------------------------------------------------------------------
    def checkpoint_writer(self):
        """Which tensors of a checkpoint this rank writes (snapshot.Writer), or None: the main rank's plain
        tensors and every rank's DTensor shards. Pipeline stages each write their own."""
        return self.pipeline.writer() if self.pipeline is not None else None

    def restrict_checkpoint(self, model: dict, tree: Any) -> tuple[dict, Any]:
        """A checkpoint's model tensors and state tree, cut to what this rank holds (pipeline stages: their own
        parameters and their state; otherwise all of it)."""
        return self.pipeline.restrict(model, tree) if self.pipeline is not None else (model, tree)

    def full_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole CPU tensors of `state` on the main rank ({} elsewhere). With sharded parameters every rank
        must call it: each tensor is gathered in turn, so no rank holds more than one whole tensor besides
        the main rank's copy of the whole."""
        from torch.distributed.tensor import DTensor

        if self.pipeline is not None:  # each tensor from the stage holding it
            return self.pipeline.full_state_dict(state, lambda v: v.full_tensor() if isinstance(v, DTensor) else v)
        out = {}
        for k, v in state.items():  # the same order on every rank
            whole = v.full_tensor() if isinstance(v, DTensor) else v
            if self.backend.is_main:
                # Copies: tied weights share storage, which safetensors refuses; a copy keeps every key.
                out[k] = whole.detach().to("cpu", copy=True).contiguous()
        return out


def clip_grad_norm_across_meshes(params: list[torch.Tensor], max_norm: float | None) -> torch.Tensor:
    """The total 2-norm of the gradients, over DTensors on any number of meshes and plain tensors alike,
    clipped to `max_norm`. torch's clip_grad_norm_ stacks the per-tensor norms, which fails across meshes
    (FSDP x tensor parallel in torch 2.13); here each mesh's norm is reduced on its own and the squares
    are summed."""
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    squares = []
    for grads in groups.values():
        norm = nn.utils.get_total_norm(grads)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float() ** 2)
    total = torch.stack(squares).sum().sqrt() if squares else torch.zeros(())
    if max_norm is not None:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        local = [g.to_local() if isinstance(g, DTensor) else g for grads in groups.values() for g in grads]
        if local:
            torch._foreach_mul_(local, coef.to(local[0].device))
    return total


@contextlib.contextmanager
def _no_zero_gradient_step():
    """torch's optimizer state-dict helpers without the zero-gradient step they take first on an empty state (for the
    groups alone: a step at every save of a stateless optimizer, a closure LBFGS lacks there)."""
    from torch.distributed.checkpoint import state_dict as helpers

    init, helpers._init_optim_state = helpers._init_optim_state, lambda optim: None
    try:
        yield
    finally:
        helpers._init_optim_state = init


class SingleDevice(Strategy):
    """`world=single`: one process on one device (cuda if present, else the CPU)."""
