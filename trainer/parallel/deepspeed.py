"""`world=deepspeed`: DeepSpeed's ZeRO engine as a strategy (stages 1, 2 and 3, CPU offload of optimizer state
and parameters), from `world.stage` and its options or from the user's own `ds_config.json` (`world.config`,
made consistent with the run's config by ds_config.py). An optional extra: `pip install --no-build-isolation
'trainer[deepspeed]'` (after torch); nothing imports DeepSpeed unless this strategy is chosen.

`deepspeed.initialize` runs when the optimizer is set up (`attach_optimizer`): the engine becomes the model
and the optimizer built from optim= its client optimizer, whose parameter groups DeepSpeed steps (so scheduler=
drives their learning rate). The framework keeps its own step:

- accumulation: DeepSpeed's `gradient_accumulation_steps` is 1; `no_sync` marks each micro-step's boundary on
  the engine, and the loss arrives normalised by the global batch's targets (`backward` never scales it again);
- clipping: `clip_grad_norm_` measures the norm of the reduced gradients DeepSpeed holds and has DeepSpeed clip
  to `max_norm` in its step; `optimizer_step` is the engine's step, False when DeepSpeed skipped it (an fp16
  overflow, or a NaN/inf gradient: DeepSpeed skips those itself);
- precision: precision=bf16 / fp16 are DeepSpeed's own bf16 / fp16 modes (16-bit weights, fp32 master weights
  and optimizer state in ZeRO's partitions), under the framework's autocast; fp16's loss scale is DeepSpeed's;
- checkpoints and exports: DeepSpeed's `save_checkpoint` pickles, so it is not used. Parameters (fp32 master
  weights) and optimizer moments go through DeepSpeed's public fragment API (`safe_get_full_fp32_param`,
  `safe_get_full_optimizer_state` and their `safe_set_*`), keyed like the plain module's state_dict and
  torch's optimizer state dict, so a checkpoint resumes under any strategy and world size, and the export is
  the whole model. Each tensor is gathered whole on every rank in turn (a collective), and the main rank writes.

One model with one optimizer (a task's own training_step with several optimizers is refused).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import warnings
from dataclasses import replace
from typing import Any

import torch
import torch.nn as nn

from trainer.errors import ConfigError, UserError
from trainer.parallel import ds_config
from trainer.parallel.strategy import Strategy, unwrap

INSTALL = ("world=deepspeed needs DeepSpeed, which is not installed in this environment. Install it after torch "
           "with: pip install --no-build-isolation 'trainer[deepspeed]' (or pip install --no-build-isolation "
           "deepspeed). Without it, world=fsdp gives ZeRO-2/3 semantics on torch's FSDP2 "
           "(world.reshard_after_forward=false is ZeRO-2, world.cpu_offload=true is ZeRO-Offload).")


def import_deepspeed(device_type: str = "cpu"):
    """DeepSpeed, on the accelerator the run uses (on a CPU, its CPU accelerator: no GPU probe, no warning)."""
    if device_type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError as e:
        raise ConfigError(f"{INSTALL} (import deepspeed: {e})") from None
    # Its INFO lines (config dumps, timers) on every rank would drown the run's own output; and torch's notices
    # that collectives DeepSpeed calls are deprecated are not the user's to act on.
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    return deepspeed


class DeepSpeed(Strategy):
    """Options (`world.NAME=...`):

    stage: ZeRO stage: 1 partitions optimizer state, 2 gradients too, 3 parameters too. null: the config file's,
        else 2.
    offload_optimizer: optimizer state and its step in CPU memory (ZeRO-Offload). null: the file's, else false.
    offload_param: parameters in CPU memory (ZeRO-3 only). null: the file's, else false.
    config: a DeepSpeed JSON config (ds_config.json): its "auto" entries are filled from the run's config and an
        entry that contradicts it is refused (see ds_config.py).
    auto: the run's settings a DeepSpeed config has entries for; conf/world/deepspeed.yaml fills them from the rest
        of the config (they are not options to set).
    """

    distributed = True
    engine_steps = True  # engine.step steps (and zeroes) the client optimizer itself
    shards_data_parallel = True  # ZeRO partitions optimizer state (and gradients, and parameters) over the ranks

    def __init__(self, stage: int | None = None, offload_optimizer: bool | None = None,
                 offload_param: bool | None = None, config: str | None = None, auto: dict[str, Any] | None = None):
        if stage is not None and (isinstance(stage, bool) or stage not in (1, 2, 3)):
            raise ConfigError(f"world.stage={stage!r} is invalid: expected 1, 2 or 3 (the ZeRO stage), or null.")
        for key, value in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
            if value is not None and not isinstance(value, bool):
                raise ConfigError(f"world.{key}={value!r} is invalid: expected true, false or null.")
        self.options = {"stage": stage, "offload_optimizer": offload_optimizer, "offload_param": offload_param}
        self.file = ds_config.read(config) if config else {}
        self.source = f"world.config={config}" if config else "world.stage and its options"
        auto = dict(auto or {})
        self.run = ds_config.RunValues.from_auto(auto)
        # The stage and offloads, for the checks below: the world options where given, else the file's. Contradictions
        # between the two, and with the run's settings, are refused once the number of ranks is known too
        # (check_world: before any worker starts, or before the model is built in a run of one process;
        # attach_optimizer in a loop of one's own), all in one paragraph: refused here, those the config alone shows
        # came first, and train_batch_size in a second refusal after the user had fixed them.
        zero = ds_config.resolve(self.file, self.run, **self.options, source=self.source,
                                 refuse=False)["zero_optimization"]
        self.stage = stage if stage is not None else zero["stage"]
        if self.stage not in (1, 2, 3):
            raise ConfigError(f"zero_optimization.stage is {self.stage!r} in {self.source}: world=deepspeed runs ZeRO "
                              "stages 1, 2 and 3 (world=ddp is stage 0).")
        offloads = {k: self.options[k] if self.options[k] is not None else
                    isinstance(zero.get(k), dict) and zero[k].get("device", "none") != "none"
                    for k in ("offload_optimizer", "offload_param")}
        if offloads["offload_param"] and self.stage != 3:
            raise ConfigError(f"world.offload_param needs ZeRO stage 3 (the parameters are partitioned only there); "
                              f"this run has stage {self.stage}. Set world.stage=3, or world.offload_param=false.")
        if auto.get("compile"):
            raise ConfigError("trainer.compile=true is not supported with world=deepspeed yet (the engine wraps the "
                              "model after it would be compiled). Set trainer.compile=false, or use world=ddp or fsdp.")
        self.engine = None
        self._boundary_pending = False  # a step's last backward ran and its engine step has not

    def check_model(self, model: nn.Module) -> None:
        """Before any worker starts (the model is the meta-device one): DeepSpeed must be installed. (The options
        were checked when the strategy was built, which needs no DeepSpeed.)"""
        if importlib.util.find_spec("deepspeed") is None:
            raise ConfigError(INSTALL)
        super().check_model(model)

    def check_world(self, world_size: int, precision) -> None:
        """The file's batch sizes against this many ranks (train_batch_size), with every other contradiction in the
        same paragraph, and fp16 where DeepSpeed cannot compute it: before any worker starts."""
        ds_config.resolve(self.file, replace(self.run, dp_size=world_size), **self.options, source=self.source)
        # fp16 where DeepSpeed cannot compute it (a CPU). Not asked on a GPU here: its answer initialises CUDA, in the
        # launcher that waits for the whole run (the workers ask in setup).
        if precision.name == "fp16" and precision.device_type == "cpu" and importlib.util.find_spec("deepspeed"):
            import_deepspeed(precision.device_type)
            self._check_fp16()

    @staticmethod
    def _check_fp16() -> None:
        from deepspeed.accelerator import get_accelerator

        if not get_accelerator().is_fp16_supported():
            raise ConfigError(f"precision=fp16 with world=deepspeed: DeepSpeed does not compute fp16 on this device "
                              f"({get_accelerator().device_name()}). Use precision=bf16 or fp32 here.")

    # -- what the framework must do for this strategy ---------------------------------------------------
    @property
    def shards_parameters(self) -> bool:
        """ZeRO's partitions are DeepSpeed's own flat buffers, not DTensors: the model is built whole (and plain),
        and checkpoints hold whole tensors, written by the main rank."""
        return False

    @property
    def needs_process_group(self) -> bool:
        return True  # DeepSpeed's engine runs on a process group even at one process

    @property
    def collective_forward(self) -> bool:
        return self.stage == 3  # ZeRO-3 gathers each layer's parameters from every rank in its forward

    def setup(self, backend, precision) -> None:
        super().setup(backend, precision)
        # DeepSpeed reads this process's place from the environment, which a run of one process (no launcher
        # workers) does not have; the process group exists already and DeepSpeed joins it.
        for key, value in (("RANK", backend.rank), ("LOCAL_RANK", backend.info.local_rank),
                           ("WORLD_SIZE", backend.world_size)):
            os.environ.setdefault(key, str(value))
        self.deepspeed = import_deepspeed(backend.device.type)
        if precision.name == "fp16":
            self._check_fp16()
            precision.scaler = _EngineLossScale(self, precision.scaler)

    # -- the engine --------------------------------------------------------------------------------------
    def attach_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        """`deepspeed.initialize` over the model and its optimizer: returns (engine, optimizer)."""
        if self.engine is not None:
            raise UserError("world=deepspeed runs one model with one optimizer, and a second optimizer was set up "
                            "(a task's own training_step with optim.NAME parts, or rt.setup of a second one). Use "
                            "world=ddp or world=fsdp for several optimizers.")
        module = unwrap(model)
        names = {id(p): n for n, p in module.named_parameters()}
        self._groups = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        self._buffer_dtypes = {n: b.dtype for n, b in module.named_buffers()}  # bf16/fp16 casts them
        run = self.run.with_objects(self.precision, optimizer, self.dp_size)
        config = ds_config.resolve(self.file, run, **self.options, source=self.source)
        # DeepSpeed prints a line per rank as it starts (the JIT-built ops it loaded), and its probes of the C
        # compiler log each command at INFO on the root logger (which a one-process run's Hydra shows): both
        # muted; warnings and errors still come through.
        logging.disable(logging.INFO)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                engine, *_ = self.deepspeed.initialize(model=module, optimizer=optimizer, config=config)
        finally:
            logging.disable(logging.NOTSET)
        self.engine = engine
        # The optimizer's parameters are now DeepSpeed's flat partitions, whose gradient buffers are the engine's
        # (with optimizer offload they persist from step to step); its step zeroes the gradients. So the
        # framework's optimizer.zero_grad() (after each step) leaves them alone.
        optimizer.zero_grad = _engine_zeroes_gradients
        loss_scale = getattr(self.precision, "scaler", None)
        if isinstance(loss_scale, _EngineLossScale):
            loss_scale.attached()
        return engine, optimizer

    def no_sync(self, model: nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        """The micro-step's backward ends the step (reduces and partitions the gradients) unless `enabled`.
        Set, not restored: the backward runs after this context."""
        if model is self.engine:
            self._discard_refused_step()
            model.set_gradient_accumulation_boundary(not enabled)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self._discard_refused_step()
        # The loss is normalised already (the global batch's targets): no division by accumulation steps.
        self.engine.backward(loss, scale_wrt_gas=False)
        self._boundary_pending = self.engine.is_gradient_accumulation_boundary()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Nothing: DeepSpeed unscales fp16 gradients in its step; `clip_grad_norm_` divides the norm by the scale."""

    def clip_grad_norm_(self, params: list[torch.Tensor], max_norm: float | None) -> torch.Tensor:
        """The norm of the step's reduced gradients (unscaled; inf when not finite), and DeepSpeed set to clip to
        `max_norm` in its step (None: not at all)."""
        if not self._boundary_pending:
            raise UserError("clip_grad_norm_ under world=deepspeed measures the step's reduced gradients: call it "
                            "after the backward of the step's last micro-batch (when rt.sync_gradients is true).")
        opt = self.engine.optimizer
        opt.clip_grad = float(max_norm or 0.0)
        # DeepSpeed's step measures the same norm again (one more pass and all-reduce): it is handed this one,
        # until the step (`_forget_norm`).
        if self.stage == 3:
            from deepspeed.runtime.utils import combine_grad_norm_groups

            groups = opt._get_norm_groups()
            opt._get_norm_groups = lambda: groups
            scaled = combine_grad_norm_groups(groups)
        else:
            scaled = opt.scaled_global_norm()
            opt.scaled_global_norm = lambda norm_type=2: scaled
        norm = scaled.float() / opt.loss_scale
        # DeepSpeed marks a NaN/inf norm as -1.
        return torch.where((norm < 0) | ~torch.isfinite(norm), torch.full_like(norm, float("inf")), norm)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        self._engine_step()
        return self.engine.was_step_applied()

    def _engine_step(self) -> None:
        try:
            self.engine.step()
        finally:
            self._boundary_pending = False
            for name in ("scaled_global_norm", "_get_norm_groups"):  # the next step measures its own norm
                vars(self.engine.optimizer).pop(name, None)

    def _discard_refused_step(self) -> None:
        """A step whose update the framework refused (trainer.nonfinite=skip: its norm was NaN/inf) still holds its
        gradients in DeepSpeed's partitions: DeepSpeed's step discards them (it skips a NaN/inf step by itself)."""
        if not self._boundary_pending:
            return
        ds_logger = logging.getLogger("DeepSpeed")
        level = ds_logger.level
        ds_logger.setLevel(logging.ERROR)  # its "OVERFLOW! Skipping step" line: the framework counted the skip
        try:
            self._engine_step()
        finally:
            ds_logger.setLevel(level)
        if self.engine.was_step_applied():
            raise UserError("under world=deepspeed every step must end in rt.step(optimizer) (or be refused for a "
                            "NaN/inf gradient): DeepSpeed holds the step's reduced gradients until its step, and "
                            "this one's gradients were finite, so the engine applied them.")

    # -- state -------------------------------------------------------------------------------------------
    def _params(self, model: nn.Module) -> dict[str, nn.Parameter]:
        return dict(unwrap(model).named_parameters())

    def _link_optimizer_state(self) -> None:
        """DeepSpeed 0.19 links each parameter's fragment of the optimizer state at the first step of the first
        parameter group, before the other groups have state: link again, now that all have it (stages 1, 2)."""
        opt = self.engine.optimizer
        if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
            opt._hp_optimizer_states_linked = False
            opt._lazy_init_hp_params_optimizer_state()

    def _inner_state(self) -> dict:
        """The client optimizer's state: one entry per flat partition of a parameter group."""
        return self.engine.optimizer.optimizer.state

    def _stepped(self) -> bool:
        state = self._inner_state()
        return bool(state) and any(float(s.get("step", 0)) > 0 for s in state.values())

    def model_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Whole tensors on the CPU, keyed like the plain module's state_dict: the fp32 master weights of the
        parameters (gathered from their partitions; every rank must call it), and the buffers in their own dtype."""
        module = unwrap(model)
        gathered: dict[int, torch.Tensor] = {}
        out = {}
        for key, value in module.state_dict(keep_vars=True).items():
            if isinstance(value, nn.Parameter):
                if id(value) not in gathered:
                    gathered[id(value)] = self._full(value)
                out[key] = gathered[id(value)]
            else:
                out[key] = value.detach().to("cpu", self._buffer_dtypes.get(key, value.dtype), copy=True)
        return out

    def ema_partitions(self) -> Partitions | None:
        return Partitions(self) if self.stage == 3 else None

    def _full(self, param: nn.Parameter) -> torch.Tensor:
        from deepspeed.utils import safe_get_full_fp32_param

        full = safe_get_full_fp32_param(param) if self.engine is not None else None
        if full is None and hasattr(param, "ds_id"):
            # Not trained by the engine (LoRA's frozen base) or no engine yet, and under ZeRO-3 partitioned all the
            # same: gathered from every rank (a collective, as the master weights' gathering is).
            with self.deepspeed.zero.GatheredParameters([param]):
                return param.detach().to("cpu", torch.float32, copy=True).reshape(param.ds_shape)
        if full is None:  # not trained by the engine (frozen), or no engine yet
            full = param.detach()
        return full.to("cpu", torch.float32, copy=True).reshape(param.ds_shape if hasattr(param, "ds_shape")
                                                                else param.shape)

    def load_model_state_dict(self, model: nn.Module, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """The fp32 master weights from `state` (each rank keeps its partition), and the module's (16-bit or
        partitioned) copies from them; buffers as they are. Every rank must call it."""
        from deepspeed.utils import safe_set_full_fp32_param

        module = unwrap(model)
        params = dict(module.named_parameters())
        for key, value in module.state_dict(keep_vars=True).items():
            if key not in state:
                continue
            if isinstance(value, nn.Parameter):
                if params.get(key) is not value:
                    continue  # the second name of a tied weight
                safe_set_full_fp32_param(value, state[key].to(self.backend.device, torch.float32))
                self._set_module_copy(value, state[key])
            else:
                value.data.copy_(state[key])

    @torch.no_grad()
    def _set_module_copy(self, param: nn.Parameter, value: torch.Tensor) -> None:
        if hasattr(param, "ds_id"):  # ZeRO-3: gathered, changed on every rank alike, partitioned again on exit
            with self.deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                param.data.copy_(value)
        else:
            param.data.copy_(value)

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """torch's optimizer state dict format, keyed by parameter name (get_optimizer_state_dict's, so any
        strategy loads it): each parameter's moments gathered whole from their partitions, on the CPU. Before the
        first step the state is empty, as the other strategies save it. Every rank must call it."""
        if not self._stepped():
            return {"state": {}, "param_groups": []}
        from deepspeed.utils import safe_get_full_optimizer_state

        self._link_optimizer_state()
        keys, step = self._state_keys()
        state = {}
        for name, p in self._params(model).items():
            if not p.requires_grad:
                continue
            entry = {"step": step.clone()} if step is not None else {}
            for key in keys:
                entry[key] = safe_get_full_optimizer_state(p, key).to("cpu", copy=True).reshape(self._shape(p))
            state[name] = entry
        return {"state": state, "param_groups": self._param_groups(optimizer)}

    def _state_keys(self) -> tuple[list[str], torch.Tensor | None]:
        """The optimizer's per-element state (AdamW's exp_avg, exp_avg_sq) and its step count (one for all)."""
        state = self._inner_state()
        if not state:  # an optimizer without state (SGD without momentum)
            return [], None
        flat, entry = next(iter(state.items()))
        keys = [k for k, v in entry.items() if torch.is_tensor(v) and v.shape == flat.shape and k != "step"]
        step = entry.get("step")
        return keys, (torch.as_tensor(step).detach().to("cpu", copy=True) if step is not None else None)

    @staticmethod
    def _shape(p: nn.Parameter) -> torch.Size:
        return p.ds_shape if hasattr(p, "ds_shape") else p.shape

    def _param_groups(self, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
        """The groups as optim= built them: their hyperparameters now (the schedule's LR) and their parameters by
        name. (DeepSpeed keeps one flat partition per group, in the same groups.)"""
        return [{**{k: v for k, v in g.items() if k != "params"}, "params": list(names)}
                for g, names in zip(optimizer.param_groups, self._groups)]

    def optimizer_template(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The shape of a stepped optimizer state (to check a checkpoint against before it is loaded). Before the
        first step it makes the state exist (`_init_state`), which `reset_optimizer` zeroes again."""
        self._init_state(optimizer)
        keys, step = self._state_keys()
        counts = {"step": torch.zeros_like(step)} if step is not None else {}
        state = {name: {**counts, **{k: torch.empty(self._shape(p)) for k in keys}}
                 for name, p in self._params(model).items() if p.requires_grad}
        return {"state": state, "param_groups": self._param_groups(optimizer)}

    def _flats(self) -> list[tuple[int, torch.Tensor]]:
        """DeepSpeed's fp32 flat partitions on this rank, each with the index of its optimizer parameter group (the
        client optimizer's state is keyed by them). ZeRO-3 keeps them aside and hands each to its group only for
        its step; stages 1 and 2 keep one per group in the group."""
        opt = self.engine.optimizer
        if self.stage == 3:
            return [(opt.sub_group_to_group_id[i], f) for i, f in enumerate(opt.fp32_partitioned_groups_flat)]
        return list(enumerate(opt.single_partition_of_fp32_groups))

    @torch.no_grad()
    def _init_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Give the client optimizer its state before its first step (a resume loads into it): one step with zero
        gradients and a zero learning rate over DeepSpeed's flat partitions, which changes no weight, then every
        state tensor zeroed, which is the state a first step starts from (step 0, zero moments)."""
        if self._inner_state():
            return
        flats, groups = self._flats(), optimizer.param_groups
        kept = [(g["params"], g["lr"]) for g in groups]
        grads = [f.grad for _, f in flats]  # (with optimizer offload, DeepSpeed's own gradient buffers)
        for g in groups:
            g["params"], g["lr"] = [], 0.0
        for index, f in flats:
            groups[index]["params"].append(f)
            f.grad = torch.zeros_like(f)
        try:
            optimizer.step()
        finally:
            for g, (params, lr) in zip(groups, kept):
                g["params"], g["lr"] = params, lr
            for (_, f), grad in zip(flats, grads):
                f.grad = grad
        self.reset_optimizer(optimizer)
        self._link_optimizer_state()

    def reset_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Back to the state of a first step: zeroed in place (DeepSpeed's fragments are views of these tensors)."""
        for entry in optimizer.state.values():
            for v in entry.values():
                if torch.is_tensor(v):
                    v.zero_()

    def optimizer_groups(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
        """None here: DeepSpeed's engine steps the optimizer, its rates set by the schedule; a checkpoint's groups
        without per-parameter state (a stateless optimizer's, saved under another strategy) are not loaded."""
        return []

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: dict[str, Any]) -> None:
        """Each parameter's moments into its partitions, and the step count. Every rank must call it."""
        if not state.get("state"):  # saved before the first step: a fresh optimizer
            self.reset_optimizer(optimizer)
            return
        from deepspeed.utils import safe_set_full_optimizer_state

        self._init_state(optimizer)
        keys, _ = self._state_keys()
        steps = []
        for name, p in self._params(model).items():
            saved = state["state"].get(name)
            if saved is None or not p.requires_grad:
                continue
            for key in keys:
                safe_set_full_optimizer_state(p, saved[key].to(self.backend.device), key)
            if "step" in saved:
                steps.append(torch.as_tensor(saved["step"]))
        if steps:
            for entry in self._inner_state().values():
                if "step" in entry:
                    entry["step"].copy_(steps[0]) if torch.is_tensor(entry["step"]) else entry.update(step=steps[0])


def _engine_zeroes_gradients(set_to_none: bool = True) -> None:
    """optimizer.zero_grad under world=deepspeed: nothing (DeepSpeed's step zeroes the gradients)."""


class _EngineLossScale:
    """precision=fp16's loss scaler under DeepSpeed: DeepSpeed's own (its fp16 section scales the loss and skips
    overflowed steps), seen through the calls the framework makes on torch's GradScaler: the scale the non-finite
    guard reads, and a state in GradScaler's format, so a checkpoint's scale resumes under any strategy."""

    def __init__(self, strategy: DeepSpeed, grad_scaler):
        self.strategy, self._saved = strategy, grad_scaler.state_dict()

    def _scaler(self):
        engine = self.strategy.engine
        return getattr(engine.optimizer, "loss_scaler", None) if engine is not None else None

    def attached(self) -> None:
        """The engine exists: give it a scale loaded before it did."""
        if self._saved is not None and self._saved.get("scale") is not None:
            self.load_state_dict(self._saved)

    def get_scale(self) -> float:
        scaler = self._scaler()
        return float(scaler.cur_scale) if scaler is not None else float(self._saved.get("scale") or 2.0**16)

    def update(self, new_scale: float | None = None) -> None:
        """Nothing: DeepSpeed updates its scale in its step (a discarded step's too)."""

    def state_dict(self) -> dict[str, Any]:
        scaler = self._scaler()
        if scaler is None:
            return dict(self._saved)
        since = max(0, int(scaler.cur_iter - scaler.last_overflow_iter - 1)) % max(1, int(scaler.scale_window))
        return {"scale": float(scaler.cur_scale), "growth_factor": float(scaler.scale_factor),
                "backoff_factor": 1.0 / float(scaler.scale_factor), "growth_interval": int(scaler.scale_window),
                "_growth_tracker": since}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        scaler = self._scaler()
        if scaler is None:
            self._saved = dict(state)
            return
        scaler.cur_scale = float(state["scale"])
        # Steps since the last overflow, as DeepSpeed counts them for growing the scale.
        scaler.last_overflow_iter = scaler.cur_iter - 1 - int(state.get("_growth_tracker", 0))
        self._saved = None


class Partitions:
    """ZeRO-3's layout of a parameter, for the EMA (trainer/loop/ema.py): rank r holds elements [r n, (r + 1) n) of the
    flattened parameter, padded to a multiple of the world size (n = `param.ds_tensor.numel()`). The fp32 master
    partition is what the average follows; the module's copy (16-bit or fp32, partitioned or, below DeepSpeed's
    persistence threshold, whole on every rank) is what the forward reads, set through `swapped`."""

    def __init__(self, strategy: DeepSpeed):
        self.strategy, self.backend = strategy, strategy.backend

    @staticmethod
    def local(param: nn.Parameter) -> torch.Tensor:
        from deepspeed.utils import safe_get_local_fp32_param

        return safe_get_local_fp32_param(param).view(-1)

    @contextlib.contextmanager
    def swapped(self, params: list[nn.Parameter], averages: list[torch.Tensor]):
        """The module's copies of `params` hold the averages inside, the master weights' again after (an eval of
        the EMA's weights). Collectives: every rank enters and leaves together."""
        for p, local in zip(params, averages):
            self.strategy._set_module_copy(p, self.full(p, local))
        try:
            yield
        finally:
            for p in params:
                self.strategy._set_module_copy(p, self.full(p, self.local(p)))

    def local_of(self, param: nn.Parameter, whole: torch.Tensor) -> torch.Tensor:
        """This rank's partition of `whole` (a tensor of the parameter's global shape), in fp32."""
        n = param.ds_tensor.numel()
        flat = whole.detach().reshape(-1).to(self.backend.device, torch.float32)
        flat = torch.nn.functional.pad(flat, (0, n * self.backend.world_size - flat.numel()))
        return flat[n * self.backend.rank:n * (self.backend.rank + 1)].clone()

    def whole_frozen(self, param: nn.Parameter) -> torch.Tensor:
        """A parameter no optimizer holds (LoRA's frozen base), whole: it has no master partition to average."""
        return self.strategy._full(param)

    def full(self, param: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
        """The whole tensor from every rank's partition (a collective: every rank calls it, in the same order)."""
        return self.backend.all_gather_cat(local)[:param.ds_numel].view(param.ds_shape)
