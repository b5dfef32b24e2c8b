"""The DeepSpeed config a `world=deepspeed` run gives the engine: the user's own `ds_config.json` (`world.config`)
made consistent with the run's config, as Accelerate does.

- An "auto" entry takes the run's value (batch sizes, accumulation, clipping, precision, optimizer, schedule).
- An entry that contradicts the run's config is refused: one paragraph names each entry and the setting it
  contradicts. An entry the run has no counterpart for keeps the file's value; one left "auto" is dropped, so
  DeepSpeed uses its default (Accelerate sizes some ZeRO buckets from the model's hidden size instead).
- `world.stage`, `world.offload_optimizer` and `world.offload_param` are the `zero_optimization` entries;
  null leaves them to the file (else ZeRO-2, no offload).

What the engine gets then differs from the file in three ways, so that the framework's semantics hold:

- DeepSpeed's `gradient_accumulation_steps` is 1 and its micro batch is a rank's whole step (data.batch_size x
  trainer.grad_accum_steps). The framework marks the accumulation boundary itself and divides each micro-batch's
  loss by the targets of the whole global batch; DeepSpeed's own accumulation would divide it by k once more.
- The "optimizer" and "scheduler" sections are checked against optim= and scheduler=, then dropped: the
  optimizer optim= builds is the engine's (client) optimizer and scheduler= drives its learning rate, both
  checkpointed in the framework's format. (Keys that only pick DeepSpeed's implementation, such as
  `torch_adam`, have no effect then.)
- DeepSpeed clips at `trainer.grad_clip` (its `gradient_clipping`), prints no progress lines, and takes the
  client optimizer with optimizer offload (`zero_force_ds_cpu_optimizer: false`).

Pure Python: nothing here imports DeepSpeed or torch, so config mistakes are found before any process starts.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from trainer.errors import ConfigError

AUTO = "auto"
# torch.optim's optimizers that update each element from its own gradient and state alone, so that stepping them on
# ZeRO's flat 1-D partitions is the step on the whole tensors. DeepSpeed asserts on any client optimizer but its
# own few ("untested") unless the config allows it: the framework allows these (tested: SGD matches one process).
ELEMENTWISE = {"SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "ASGD", "Rprop"}
# Optimizers whose step reads a parameter as a whole, which a flat partition is not: refused before any process starts.
# (Any other is DeepSpeed's to accept: its own, FusedAdam or DeepSpeedCPUAdam, or one a world.config allows.)
WHOLE_TENSOR = {"MuonAdamW": "optim=muon orthogonalises each 2-D weight matrix as a whole",
                "Muon": "Muon orthogonalises each 2-D weight matrix as a whole",
                "Adafactor": "Adafactor factors each matrix's second moment into its rows' and columns'",
                "LBFGS": "LBFGS steps on all the parameters as one vector, with a line search"}
# DeepSpeed's scheduler types that describe scheduler=cosine / scheduler=constant.
SCHEDULES = {"WarmupCosineLR": "cosine", "WarmupDecayLR": "cosine", "WarmupLR": "constant"}


@dataclass(frozen=True)
class RunValues:
    """The run's settings a DeepSpeed config has entries for. None: not known where this is built (precision=auto
    before it is resolved, the optimizer before it exists, a hand-written loop's batch size)."""

    batch_size: int | None = None  # data.batch_size
    grad_accum_steps: int | None = None  # trainer.grad_accum_steps
    grad_clip: float | None = None  # trainer.grad_clip (None: no clipping)
    clip_known: bool = False  # whether grad_clip is the run's value (None is a value there)
    dp_size: int | None = None  # data-parallel ranks
    precision: str | None = None  # fp32 | bf16 | fp16
    init_scale: float | None = None  # precision=fp16's loss scaler
    growth_interval: int | None = None
    optimizer: str | None = None  # the optimizer's class name (torch.optim.AdamW -> AdamW)
    lr: float | None = None
    betas: tuple[float, float] | None = None
    eps: float | None = None
    weight_decay: float | None = None
    schedule: str | None = None  # cosine | constant | another schedule's target
    warmup_steps: int | None = None
    min_lr_ratio: float | None = None
    max_steps: int | None = None

    @classmethod
    def from_auto(cls, auto: dict[str, Any]) -> RunValues:
        """From `world.auto` (conf/world/deepspeed.yaml fills it from the rest of the config)."""
        known = {f: auto[f] for f in ("batch_size", "grad_accum_steps", "lr", "eps", "weight_decay", "warmup_steps",
                                      "min_lr_ratio", "max_steps") if auto.get(f) is not None}
        precision = str(auto.get("precision") or "").rsplit(".", 1)[-1].lower()  # trainer.parallel.precision.BF16 -> bf16
        schedule = str(auto.get("scheduler") or "").rsplit(".", 1)[-1] or None  # trainer.loop.schedule.cosine -> cosine
        optimizer = str(auto.get("optimizer") or "").rsplit(".", 1)[-1] or None
        betas = auto.get("betas")
        return cls(**known, grad_clip=auto.get("grad_clip"), clip_known="grad_clip" in auto,
                   precision=precision if precision in ("fp32", "bf16", "fp16") else None, schedule=schedule,
                   optimizer=optimizer, betas=tuple(betas) if betas is not None else None)

    def with_objects(self, precision, optimizer, dp_size: int) -> RunValues:
        """Completed from the built objects, which are what runs (precision=auto resolved, optimizer defaults)."""
        d = optimizer.defaults
        betas = d.get("betas")
        return replace(self, dp_size=dp_size, precision=precision.name,
                       init_scale=getattr(precision, "init_scale", None),
                       growth_interval=getattr(precision, "growth_interval", None),
                       optimizer=type(optimizer).__name__, lr=_number(d.get("lr")), eps=d.get("eps"),
                       weight_decay=d.get("weight_decay"), betas=tuple(betas) if betas is not None else None)


def _number(x: Any) -> Any:
    return float(x) if hasattr(x, "item") else x  # a tensor LR


def read(path: str) -> dict[str, Any]:
    """`world.config`: a DeepSpeed JSON config file."""
    p = Path(path).expanduser()
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise ConfigError(f"world.config={path!r} cannot be read ({e.strerror or e}). Give the path of a DeepSpeed "
                          "JSON config (ds_config.json), or world.config=null for world.stage and its options.") from None
    except ValueError as e:
        raise ConfigError(f"world.config={path!r} is not JSON ({e}). DeepSpeed configs are JSON objects: "
                          '{"zero_optimization": {"stage": 2}, ...}.') from None
    if not isinstance(data, dict):
        raise ConfigError(f"world.config={path!r} holds a {type(data).__name__}, not a JSON object: "
                          '{"zero_optimization": {"stage": 2}, ...}.')
    return data


class _Check:
    """Fills the "auto" entries of one config and collects its contradictions with the run's settings."""

    def __init__(self, cfg: dict[str, Any]):
        self.cfg, self.conflicts = cfg, []

    def node(self, path: tuple[str, ...], create: bool = True) -> dict[str, Any] | None:
        node = self.cfg
        for key in path:
            child = node.get(key)
            if not isinstance(child, dict):
                if not create or (child is not None and child != AUTO):
                    return None
                child = node[key] = {}
            node = child
        return node

    def entry(self, path: str, value: Any, setting: str, same=None) -> None:
        """`path` ("a.b.c") is `value` (the run's `setting`): filled where absent or "auto", refused where it
        differs. Nothing happens where the run's value is unknown (None)."""
        *parents, key = path.split(".")
        node = self.node(tuple(parents), create=value is not None)
        if node is None or value is None:
            return
        if key not in node or node[key] == AUTO:
            node[key] = list(value) if isinstance(value, tuple) else value
        elif not (same or _same)(node[key], value):
            self.conflicts.append(f"{path} is {json.dumps(node[key])} there but {setting}")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def resolve(file: dict[str, Any], run: RunValues, *, stage: int | None, offload_optimizer: bool | None,
            offload_param: bool | None, source: str = "world.config", refuse: bool = True) -> dict[str, Any]:
    """The engine's config: `file` with its "auto" entries filled from `run` and the world options, checked against
    them (a ConfigError names every contradiction; `refuse=False`: the file's entries stand, for a look at its shape
    before the run's values are all known), then set up for the framework (see the module docstring)."""
    check = _Check(copy.deepcopy(file))
    cfg = check.cfg
    if "bfloat16" in cfg and "bf16" not in cfg:  # DeepSpeed's other name for the section
        cfg["bf16"] = cfg.pop("bfloat16")
    b, k = run.batch_size, run.grad_accum_steps
    check.entry("train_micro_batch_size_per_gpu", b, f"data.batch_size={b}")
    check.entry("gradient_accumulation_steps", k, f"trainer.grad_accum_steps={k}")
    if b is not None and k is not None and run.dp_size is not None:
        check.entry("train_batch_size", b * k * run.dp_size, f"data.batch_size x trainer.grad_accum_steps x "
                    f"data-parallel ranks = {b} x {k} x {run.dp_size} = {b * k * run.dp_size}")
    if run.clip_known:
        clip = float(run.grad_clip or 0.0)
        check.entry("gradient_clipping", clip, f"trainer.grad_clip={run.grad_clip if run.grad_clip else 'null'}")
    _zero(check, stage, offload_optimizer, offload_param)
    _precision(check, run)
    _optimizer(check, run)
    _schedule(check, run)
    if refuse:
        _partitionable(cfg, run, source)
    if check.conflicts and refuse:
        raise ConfigError(
            f"{source} contradicts this run's config: " + "; ".join(check.conflicts) + ". The run's config decides "
            'these: write "auto" for them in the file (they are then taken from the config), or change the config '
            "to match the file.")
    return _for_engine(cfg, run)


def _zero(check: _Check, stage: int | None, offload_optimizer: bool | None, offload_param: bool | None) -> None:
    zero = check.node(("zero_optimization",))
    check.entry("zero_optimization.stage", stage, f"world.stage={stage}")
    if zero.get("stage") in (None, AUTO):
        zero["stage"] = 2
    for key, value in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        node = zero.get(key)
        if node is None or node == AUTO:
            zero.pop(key, None)
            if value:
                zero[key] = {"device": "cpu"}
            continue
        if not isinstance(node, dict):
            continue  # (DeepSpeed names the malformed entry)
        device = node.get("device", AUTO)
        if device == AUTO:
            node["device"] = "cpu" if value else "none"
        elif value is not None and (device != "none") != value:
            check.conflicts.append(f'zero_optimization.{key}.device is "{device}" there but '
                                   f"world.{key}={str(value).lower()}")


def _precision(check: _Check, run: RunValues) -> None:
    if run.precision is None:
        return
    for section, mode in (("fp16", "fp16"), ("bf16", "bf16")):
        check.entry(f"{section}.enabled", run.precision == mode, f"precision={run.precision}")
    if run.precision == "fp16" and run.init_scale:
        power = math.log2(run.init_scale)
        if power != int(power):
            check.conflicts.append(f"precision.init_scale={run.init_scale} is not a power of two, which DeepSpeed's "
                                   "fp16.initial_scale_power needs")
        else:
            check.entry("fp16.initial_scale_power", int(power), f"precision.init_scale={run.init_scale:g} (2^{int(power)})")
        check.entry("fp16.loss_scale_window", run.growth_interval, f"precision.growth_interval={run.growth_interval}")
        check.entry("fp16.loss_scale", 0, "precision=fp16 scales the loss dynamically (fp16.loss_scale 0)")
        fp16 = check.node(("fp16",))
        fp16.setdefault("hysteresis", 1)  # as torch's GradScaler: the scale halves at the first overflow


def _optimizer(check: _Check, run: RunValues) -> None:
    node = check.cfg.get("optimizer")
    if not isinstance(node, dict):
        return
    if run.optimizer is not None:
        check.entry("optimizer.type", run.optimizer, f"optim builds {run.optimizer}",
                    same=lambda a, b: isinstance(a, str) and a.lower() == b.lower())
    for key, value, setting in (("lr", run.lr, "optim.lr"), ("betas", run.betas, "optim.betas"),
                                ("eps", run.eps, "optim.eps"), ("weight_decay", run.weight_decay, "optim.weight_decay")):
        if value is not None:
            shown = list(value) if isinstance(value, tuple) else value
            check.entry(f"optimizer.params.{key}", value, f"{setting}={json.dumps(shown)}")


def _partitionable(cfg: dict[str, Any], run: RunValues, source: str) -> None:
    """Refuse an optimizer ZeRO cannot step on its flat partitions (WHOLE_TENSOR), unless the file allows it."""
    what = WHOLE_TENSOR.get(run.optimizer or "")
    if what is None or cfg.get("zero_allow_untested_optimizer") is True:
        return
    raise ConfigError(f"world=deepspeed steps the optimizer on flat 1-D partitions of the parameters (ZeRO), which "
                      f"is the same step only for an optimizer that updates each element on its own; {what}. Use "
                      "world=ddp or world=fsdp for it.")


def _schedule(check: _Check, run: RunValues) -> None:
    node = check.cfg.get("scheduler")
    if not isinstance(node, dict):
        return
    kind = node.get("type", AUTO)
    if run.schedule is not None and kind != AUTO and SCHEDULES.get(kind) != run.schedule:
        check.conflicts.append(f'scheduler.type is "{kind}" there but scheduler={run.schedule} (WarmupCosineLR and '
                               "WarmupDecayLR describe scheduler=cosine, WarmupLR scheduler=constant)")
    counterparts = {"warmup_num_steps": (run.warmup_steps, "scheduler.warmup_steps"),
                    "total_num_steps": (run.max_steps, "trainer.max_steps"),
                    "warmup_max_lr": (run.lr, "optim.lr"), "cos_min_ratio": (run.min_lr_ratio, "scheduler.min_lr_ratio"),
                    "warmup_type": ("linear", "scheduler= warms up linearly")}
    params = node.get("params") if isinstance(node.get("params"), dict) else {}
    for key, value in params.items():
        if key not in counterparts:
            if value != AUTO:
                check.conflicts.append(f"scheduler.params.{key} is {json.dumps(value)} there, which scheduler= has no "
                                       'setting for ("auto" or remove it)')
            continue
        run_value, setting = counterparts[key]
        if run_value is not None:
            check.entry(f"scheduler.params.{key}", run_value,
                        setting if " " in setting else f"{setting}={json.dumps(run_value)}")


def _drop_auto(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _drop_auto(v) for k, v in node.items() if v != AUTO}
    return node


def _for_engine(cfg: dict[str, Any], run: RunValues) -> dict[str, Any]:
    cfg.pop("optimizer", None)
    cfg.pop("scheduler", None)
    cfg = _drop_auto(cfg)
    # One engine step is one framework step (see the module docstring).
    per_rank = (run.batch_size or 1) * (run.grad_accum_steps or 1)
    cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"] = per_rank, 1
    cfg.pop("train_batch_size", None)  # DeepSpeed computes it: micro batch x 1 x ranks
    cfg["zero_force_ds_cpu_optimizer"] = False
    if run.optimizer in ELEMENTWISE:
        cfg["zero_allow_untested_optimizer"] = True
    cfg.setdefault("steps_per_print", 2**62)
    for section in ("fp16", "bf16"):
        if isinstance(cfg.get(section), dict) and not cfg[section].get("enabled", False):
            del cfg[section]
    if isinstance(cfg.get("bf16"), dict):
        cfg["bf16"].setdefault("check_grad_overflow", True)  # a NaN/inf step is skipped in bf16 too
    return cfg
