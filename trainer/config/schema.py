"""Typed schemas for the framework's own config sections, and the checks run when a config is built.

The framework sections (`trainer`, `checkpoint`, `ema`) are dataclasses: Hydra type-checks command-line
overrides against them. `world` is the strategy (`world._target_`, with its options) plus the launch
topology (`LAUNCH_KEYS`, typed by `LaunchConfig`). Recipe sections (`model`, `data`, `task`, `optim`,
`scheduler`) are free-form `_target_` nodes owned by the recipe; `validate` checks the keys the
framework reads. No torch import here: `--help` and `--cfg job` must stay fast.
"""

from __future__ import annotations

import copy
import functools
import math
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, ListConfig, OmegaConf

from trainer.config import slurm
from trainer.errors import ConfigError, UserError, suggest


@dataclass
class TrainerConfig:
    max_steps: int | None = 1000  # optimizer steps to run in total; null with max_epochs (which decides anyway)
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    grad_clip: float | None = 1.0  # max global grad norm; null disables clipping
    log_every: int = 10  # optimizer steps between metric events
    eval_every: int = 250  # optimizer steps between evals; 0 = only at the end
    eval_samples: int | None = None  # evaluate on the first N val samples; null = the whole split
    eval_batch_size: int | None = None  # null = data.batch_size
    seed: int = 0
    compile: bool = False  # torch.compile the model (checkpoints still save the plain module)
    compile_backend: str = "inductor"  # torch.compile backend (inductor generates fused kernels)
    compile_mode: str | None = None  # torch.compile's mode (max-autotune, reduce-overhead, ...); null = its default
    # inductor's options instead of a mode (torch._inductor.list_options()), e.g. coordinate_descent_tuning: true
    compile_options: dict[str, Any] = field(default_factory=dict)
    nonfinite: str = "stop"  # on a NaN/inf loss or grad norm: stop | skip
    max_nonfinite_skips: int = 10  # with nonfinite=skip: stop after this many consecutive skips
    nonfinite_check: str = "auto"  # step (host reads the grad norm every step) | log (no per-step host sync) | auto
    progress: str = "auto"  # auto (bar on a terminal, lines otherwise) | bar | lines | off
    peak_tflops: float | None = None  # per-device peak for MFU; null = GPU table, or a CPU matmul probe
    max_epochs: int | None = None  # instead of max_steps: passes over the training split (the steps are derived)
    eval_every_epochs: int | None = None  # instead of eval_every: an eval every N epochs
    activation_checkpointing: bool = False  # recompute each block's activations in backward: less memory, more time


@dataclass
class LaunchConfig:
    """The launch topology under `world` (the other keys of `world` are the strategy's options)."""

    nproc_per_node: Any = 1  # int, or "auto" = one per GPU (1 on CPU)
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # host:port of node 0 when nnodes > 1
    max_restarts: int = 0  # elastic restarts of all workers after a failure
    rdzv_timeout: int = 600  # seconds every node waits for the others (nnodes > 1) before giving up
    hang_timeout: float | None = 600  # seconds without progress on any rank before the job is stopped; 0/null: off
    device: str = "auto"  # auto | cpu | cuda
    threads: Any = "auto"  # CPU threads per process; auto = cores / processes on this machine


LAUNCH_KEYS = tuple(f.name for f in fields(LaunchConfig))

# Config groups whose options each add a node of their own under the group's key (logger.wandb,
# callbacks.early_stopping), several at once: a key under an option not chosen is a missing choice.
LIST_GROUPS = ("logger", "callbacks")


def nproc_per_node(value) -> int:
    """world.nproc_per_node as a count: `auto` is one process per GPU (1 without one)."""
    if value == "auto":
        import torch

        return max(1, torch.cuda.device_count())
    return int(value)


@dataclass
class CheckpointConfig:
    every_n_steps: int = 0  # save every N optimizer steps; 0 = only at the end
    keep_last: int | None = 2  # complete checkpoints kept; older ones are deleted after a new one is complete (null: all)
    best_metric: str | None = None  # e.g. val/loss: also keep the best checkpoint by this metric
    best_mode: str = "min"  # min | max
    every_n_epochs: int | None = None  # instead of every_n_steps: a checkpoint every N epochs
    save_final: bool = True  # a checkpoint at the end too, so raising trainer.max_steps continues the run
    async_save: bool = True  # copy the state to CPU at the step, write it in a background thread
    max_shard_mb: float = 4096  # model.safetensors larger than this is exported as shards + index.json


@dataclass
class EMAConfig:
    enabled: bool = False
    decay: float = 0.999
    warmup: bool = False  # decay_t = min(decay, (1 + t) / (10 + t)), t = EMA updates so far
    update_every: int = 1  # optimizer steps between EMA updates


@dataclass
class LoRAConfig:
    rank: int = 0  # 0 = no adapters; 8 or 16 are usual (trainer/models/lora.py)
    alpha: float = 16.0  # the adapters' output is scaled by alpha / rank
    dropout: float = 0.0  # on the adapters' input
    targets: list[str] = field(default_factory=list)  # linear layers: last name parts (qkv), globs, full names


@dataclass
class FinetuneConfig:
    weights: str | None = None  # start from: a .safetensors file, a Hugging Face model dir, a finished run dir
    dtype: str | None = None  # the loaded weights' dtype (fp32, bf16, fp16); null = the model's own
    lora: LoRAConfig = field(default_factory=LoRAConfig)


@dataclass
class Config:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)  # pretrained weights, LoRA (trainer/models/finetune.py)
    resume: str | None = None  # null = fresh | auto = newest complete checkpoint of this run dir | PATH
    # The launch keys' defaults; conf/world/NAME.yaml adds the strategy (_target_) and its options.
    world: Any = field(default_factory=lambda: asdict(LaunchConfig()))
    model: Any = None
    data: Any = None
    task: Any = None
    optim: Any = None
    scheduler: Any = None
    precision: Any = None
    logger: Any = field(default_factory=dict)
    callbacks: Any = field(default_factory=dict)  # name -> a _target_ node (trainer/loop/callbacks.py)


ConfigStore.instance().store(name="trainer_schema", node=Config)

# Keys of `data` read by the framework's loaders; the rest go to the dataset builder (`data._target_`).
LOADER_KEYS = ("batch_size", "shuffle", "num_workers")


def typed(schema, node: DictConfig | dict | None):
    """A config section as its dataclass (values type-checked against the schema). A section's values typed once
    per process: a run types its ten sections ~20 times (~20 ms each in OmegaConf's merge), each a fresh copy,
    which the caller may change."""
    values = OmegaConf.to_container(node) if isinstance(node, DictConfig | ListConfig) else node or {}
    key = (schema, repr(values))  # (the merge reads nothing but these values)
    found = _typed.get(key)
    if found is None:
        found = OmegaConf.to_object(OmegaConf.merge(_structured(schema), values))  # (merge copies, never writes it)
        if len(_typed) < 256 and "${" not in key[1]:  # (an interpolation, ${oc.env:...}, may resolve otherwise later;
            _typed[key] = found  # a process running sweeps of many points: a bound, not an LRU)
    return copy.deepcopy(found)


_typed: dict = {}


@functools.cache
def _structured(schema) -> DictConfig:
    """The schema's config, built once (most of `typed`'s time; a run types ten sections)."""
    return OmegaConf.structured(schema)


def launch_config(world: DictConfig) -> LaunchConfig:
    """The launch keys of `world` as a typed LaunchConfig (a ConfigError names a key of the wrong type)."""
    try:
        return typed(LaunchConfig, {k: world[k] for k in LAUNCH_KEYS if k in world})
    except Exception as e:  # noqa: BLE001 - OmegaConf's ValidationError
        key = getattr(e, "full_key", "") or "?"
        raise ConfigError(f"world.{key}: {str(e).splitlines()[0]}. See python -m trainer --cfg job.") from None


def strategy_options(world: DictConfig) -> dict[str, Any]:
    """`world` without the launch keys: what the strategy class receives."""
    return {k: v for k, v in world.items() if k not in LAUNCH_KEYS}


# -- validation ---------------------------------------------------------------------------------------
def _check(ok: bool, key: str, value: Any, expected: str, fix: str = "") -> None:
    if not ok:
        # A number as text: ${oc.env:LR} gives text, which an untyped section (optim, data) keeps as it is, where
        # the schema's typed keys convert it.
        if isinstance(value, str) and _numeric_text(value) and ("number" in expected or "integer" in expected):
            fix = (f"It is text, as an interpolation such as ${{oc.env:VAR}} gives it: write ${{oc.decode:${{oc.env:VAR}}}} "
                   f"to have it read as a number (on the command line, quoted for Hydra inside the shell's quotes: "
                   f"'{key}=\"${{oc.decode:${{oc.env:VAR}}}}\"')." + (" " + fix if fix else ""))
        raise ConfigError(f"{key}={value!r} is invalid: expected {expected}.{' ' + fix if fix else ''}")


def _numeric_text(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node) if isinstance(node, (DictConfig, ListConfig)) else node


def _known_keys(cfg: DictConfig) -> None:
    """A key added to a typed section (`+trainer.foo=1`, as the unknown-key message's advice reads) that the section
    does not have: one paragraph here, where it was a ConfigKeyError traceback once the run dir was made."""
    import dataclasses

    sections = [("trainer", TrainerConfig), ("checkpoint", CheckpointConfig), ("ema", EMAConfig),
                ("finetune", FinetuneConfig), ("finetune.lora", LoRAConfig)]  # (finetune's: a traceback once training)
    for section, schema in sections:
        node = OmegaConf.select(cfg, section, default=None)
        if not isinstance(node, DictConfig):  # (a section given a value of its own: the type check names it)
            continue
        fields = [f.name for f in dataclasses.fields(schema)]
        unknown = [k for k in node if k not in fields]
        if unknown:
            raise ConfigError(f"{section}.{unknown[0]} is not a setting of `{section}`, which the framework reads "
                              f"itself.{suggest(unknown[0], fields)} Its settings: {', '.join(fields)}. Remove "
                              f"+{section}.{unknown[0]}=... (a key of your own goes under task, model or data, or at "
                              "the top level with +KEY=VALUE).")


def _typed_sections(cfg: DictConfig) -> None:
    """The framework's own sections against their schema, as composing a run checks them: a run's saved config with
    overrides applied (eval, sample) is plain YAML, where `ema=false` or `trainer.eval_batch_size=abc` reached the
    checks below, or the code, as a traceback."""
    sections = (("trainer", TrainerConfig), ("checkpoint", CheckpointConfig), ("ema", EMAConfig))
    for section, _ in sections:
        if section not in cfg:  # (`~trainer` on the command line: every later read of it was a traceback)
            raise ConfigError(f"the `{section}` settings were removed (~{section}), and every run reads them. Leave "
                              f"them in; change one with {section}.KEY=VALUE (see them with: python -m trainer --cfg "
                              "job).")
        node = cfg.get(section)
        if node is not None and not isinstance(node, DictConfig):
            raise ConfigError(f"{section}={_plain(node)!r} is invalid: expected the `{section}` settings, each set as "
                              f"{section}.KEY=VALUE. See them with: python -m trainer --cfg job")
    _known_keys(cfg)  # (a key a section lacks: named with the keys it has)
    for section, schema in sections:
        try:
            typed(schema, cfg.get(section))
        except Exception as e:  # noqa: BLE001 - OmegaConf's ValidationError
            key = getattr(e, "full_key", "") or "?"
            raise ConfigError(f"{section}.{key}: {str(e).splitlines()[0]}. See the expected types with: python -m "
                              "trainer --cfg job") from None


def _int64_only(tree: Any, path: str = "") -> None:
    """An integer beyond 64 bits anywhere in the config's plain tree (trainer.seed=99999999999999999999): torch and
    Python's C code take none, and each key failed in its own way, some after training (an OverflowError traceback
    at the last eval)."""
    if isinstance(tree, dict | list):
        for key, value in (tree.items() if isinstance(tree, dict) else enumerate(tree)):
            if not (path == "" and key == "hydra"):
                _int64_only(value, f"{path}.{key}" if path else str(key))
        return
    _check(not _is_int(tree) or -2**63 <= tree < 2**63, path, tree,
           f"an integer that fits in 64 bits (at most {2**63 - 1})")


def validate(cfg: DictConfig) -> None:
    """Check the types and ranges of what the framework reads, before any process group starts or any
    file is written. Torch-free, so `--cfg job` runs it too."""
    _int64_only(OmegaConf.to_container(cfg, resolve=False))
    _typed_sections(cfg)
    t = cfg.trainer
    _check(t.max_steps >= 1 if t.max_steps is not None else t.max_epochs is not None, "trainer.max_steps", t.max_steps,
           "an integer >= 1, or null with trainer.max_epochs set", "The run needs a length: trainer.max_epochs=N.")
    _check(t.grad_accum_steps >= 1, "trainer.grad_accum_steps", t.grad_accum_steps, "an integer >= 1")
    _check(t.log_every >= 1, "trainer.log_every", t.log_every, "an integer >= 1")
    _check(t.eval_every >= 0, "trainer.eval_every", t.eval_every, "an integer >= 0 (0 = eval only at the end)")
    _check(t.grad_clip is None or t.grad_clip > 0, "trainer.grad_clip", t.grad_clip, "a number > 0, or null",
           "null switches clipping off.")
    _check(t.nonfinite in ("stop", "skip"), "trainer.nonfinite", t.nonfinite, "'stop' or 'skip'")
    _check(t.max_nonfinite_skips >= 1, "trainer.max_nonfinite_skips", t.max_nonfinite_skips, "an integer >= 1")
    _check(t.nonfinite_check in ("auto", "step", "log"), "trainer.nonfinite_check", t.nonfinite_check,
           "auto, step or log")
    _check(t.nonfinite_check != "log" or t.nonfinite == "stop", "trainer.nonfinite_check", t.nonfinite_check,
           "step or auto with trainer.nonfinite=skip", "Whether a skipped step advances the LR schedule is decided on the host.")
    _check(t.progress in ("auto", "bar", "lines", "off"), "trainer.progress", t.progress, "auto, bar, lines or off")
    _check(t.eval_samples is None or t.eval_samples >= 1, "trainer.eval_samples", t.eval_samples, "an integer >= 1, or null")
    _check(t.eval_batch_size is None or t.eval_batch_size >= 1, "trainer.eval_batch_size", t.eval_batch_size,
           "an integer >= 1, or null (= data.batch_size)")
    if t.compile_mode is not None or t.compile_options:  # (the names themselves are checked against torch's lists)
        key = "trainer.compile_mode" if t.compile_mode is not None else "trainer.compile_options"
        value = t.compile_mode if t.compile_mode is not None else _plain(t.compile_options)
        _check(t.compile, key, value, "unset while trainer.compile=false", "Add trainer.compile=true to compile with it.")
        _check(t.compile_backend == "inductor", key, value, f"unset with trainer.compile_backend={t.compile_backend}",
               "Modes and options are inductor's.")
        _check(t.compile_mode is None or not t.compile_options, key, value,
               "either trainer.compile_mode or trainer.compile_options, not both (torch.compile takes one)",
               "A mode is a set of options (torch._inductor.list_mode_options(MODE) lists them): write them out "
               "with yours.")
    _check(t.peak_tflops is None or t.peak_tflops > 0, "trainer.peak_tflops", t.peak_tflops, "a number > 0, or null")
    for key in ("max_epochs", "eval_every_epochs"):
        _check(t[key] is None or t[key] >= 1, f"trainer.{key}", t[key], "an integer >= 1, or null")
    _check(cfg.checkpoint.every_n_epochs is None or cfg.checkpoint.every_n_epochs >= 1, "checkpoint.every_n_epochs",
           cfg.checkpoint.every_n_epochs, "an integer >= 1, or null")

    c, e = cfg.checkpoint, cfg.ema
    _check(c.every_n_steps >= 0, "checkpoint.every_n_steps", c.every_n_steps, "an integer >= 0 (0 = only at the end)")
    _check(c.keep_last is None or c.keep_last >= 1, "checkpoint.keep_last", c.keep_last,
           "an integer >= 1 (how many of the newest checkpoints to keep)", "Or null to keep every one.")
    _check(c.best_mode in ("min", "max"), "checkpoint.best_mode", c.best_mode, "'min' or 'max'")
    _check(c.best_metric is None or c.best_metric.startswith(("val/", "val_ema/")), "checkpoint.best_metric",
           c.best_metric, "a metric logged at eval, e.g. val/loss or val_ema/loss", "Or null.")
    _check(not (c.best_metric or "").startswith("val_ema/") or e.enabled, "checkpoint.best_metric", c.best_metric,
           "a val/ metric without ema.enabled=true (only an EMA's evals log val_ema/)", "Or turn the EMA on.")
    _check(c.max_shard_mb > 0, "checkpoint.max_shard_mb", c.max_shard_mb, "a number > 0")
    stopping = (cfg.get("callbacks") or {}).get("early_stopping")
    if isinstance(stopping, DictConfig) and stopping.get("_target_") == "trainer.loop.callbacks.EarlyStopping":
        # (its own constructor refuses the rest when the run builds it; these were found only at the first eval)
        monitor = _plain(stopping.get("monitor", "val/loss"))
        _check(isinstance(monitor, str) and monitor.startswith(("val/", "val_ema/")), "callbacks.early_stopping.monitor",
               monitor, "a metric logged at eval, e.g. val/loss, val_ema/loss or a sample metric (val/class_match)")
        _check(not monitor.startswith("val_ema/") or e.enabled, "callbacks.early_stopping.monitor", monitor,
               "a val/ metric without ema.enabled=true (only an EMA's evals log val_ema/)", "Or turn the EMA on.")
    _check(0.0 <= e.decay < 1.0, "ema.decay", e.decay, "a number in [0, 1), e.g. 0.999")
    _check(e.update_every >= 1, "ema.update_every", e.update_every, "an integer >= 1")

    for group in LIST_GROUPS:  # (`+logger.wandb.project=x` alone makes a node that builds nothing)
        for name, node in (cfg.get(group) or {}).items():
            if node is not None and not (isinstance(node, DictConfig) and "_target_" in node):  # (null: one dropped)
                from trainer.config.compose import group_options

                choose = (f"Choose it: {group}={name} (several: {group}=[{name},...])" if name in group_options(group)
                          else f"The options of {group} are {', '.join(group_options(group))}")
                _check(False, f"{group}.{name}", _plain(node), f"the settings of a chosen option of {group}, with a "
                       f"_target_", f"{choose}; or point {group}.{name}._target_ at a class of your own.")
    for key in ("model", "data", "task", "optim", "scheduler", "precision", "world"):
        node = cfg.get(key)
        _check(isinstance(node, DictConfig) and "_target_" in node, key, _plain(node), "a config node with a _target_",
               f"Select one with {key}=NAME or point {key}._target_ at your class.")
    resume = cfg.get("resume")
    if resume not in (None, "auto"):
        from pathlib import Path

        if isinstance(resume, str) and not resume.strip():  # (Path('') is '.': the current directory was searched)
            raise ConfigError("resume= is empty: pass auto, null, or the path of a checkpoint "
                              "(RUN_DIR/checkpoints/step_N), a checkpoints/ dir or a run dir.")
        from trainer.checkpoint.store import taken_back

        if not (isinstance(resume, str) and (Path(resume).expanduser().is_dir()
                                             or taken_back(Path(resume).expanduser()) is not None)):
            given = Path(resume).expanduser() if isinstance(resume, str) else None
            what = ("is a file, not a directory" if given is not None and given.is_file() else "does not exist")
            hint = (" Did you mean resume=auto?" if isinstance(resume, str) and "/" not in resume and
                    suggest(resume, ["auto"]) else "")
            raise ConfigError(f"resume={resume!r} {what}: pass auto, null, or the path of a checkpoint "
                              "(RUN_DIR/checkpoints/step_N), a checkpoints/ dir or a run dir."
                              + (hint or (checkpoints_beside(given) if given is not None else "")))
    _validate_data(cfg.data)
    _validate_finetune(cfg.get("finetune"))
    for section in ("optim", "scheduler"):
        _refuse_settings_as_parts(section, cfg[section])
    for name, node in per_part(cfg.optim).items():
        _validate_optim(node, f"optim.{name}" if name else "optim")
    for name, node in per_part(cfg.scheduler).items():
        _validate_scheduler(node, f"scheduler.{name}" if name else "scheduler")
    _validate_world(cfg.world, cfg.data.get("batch_size"), cfg.precision.get("_target_"))
    pp, weights = _plain(cfg.world.get("pp", 1)), (cfg.get("finetune") or {}).get("weights")
    _check(weights is None or pp == 1, "world.pp", pp, f"1 with finetune.weights={weights}",
           "Pipeline stages cannot load pretrained weights yet (each stage would take its own part of the files), "
           "nor evaluate a run that started from them: use world=ddp, world=fsdp or world.tp for it.")
    # Settings of pipeline stages that a run without them never reads (a plain DDP run, when world.pp was forgotten).
    mb = _plain(cfg.world.get("microbatches"))
    _check(pp != 1 or mb is None, "world.microbatches", mb, "null with world.pp=1",
           "It cuts each micro-batch into pieces for the pipeline's stages, and a run of one stage has none, so it "
           "would do nothing. Add world.pp=N (N stages), or leave it out.")
    schedule = _plain(cfg.world.get("pp_schedule"))
    _check(pp != 1 or schedule is None or str(schedule).lower() == "1f1b", "world.pp_schedule", schedule,
           "1F1B (the default) with world.pp=1",
           "It orders the pipeline's stages, and a run of one stage has none, so it would do nothing. Add "
           "world.pp=N (N stages), or leave it out.")
    # The schedule runs the stage modules itself: torch.compile of the whole model never ran (a compile: true on record).
    compiled = bool((cfg.get("trainer") or {}).get("compile"))
    _check(pp == 1 or not compiled, "trainer.compile", compiled, f"false with world.pp={pp}",
           "The pipeline's schedule calls each stage's modules itself, which a compile of the whole model never "
           "reaches: it would compile nothing. Leave trainer.compile out under world.pp, or train without stages "
           "(world.tp, world=fsdp) to compile.")
    rank = ((cfg.get("finetune") or {}).get("lora") or {}).get("rank") or 0
    _check(rank == 0 or pp == 1, "world.pp", pp, f"1 with finetune.lora.rank={rank}",
           "Pipeline stages cannot carry LoRA adapters yet (each stage holds only its own blocks), nor evaluate a "
           "run trained with them: use world=ddp, world=fsdp, world.tp or world=deepspeed for it.")


def checkpoints_beside(path) -> str:
    """For a `resume=` that is not there: the checkpoint it meant (`step_15` is written `step_00000015`), or those
    its directory holds."""
    import re

    parent = path.parent
    if not parent.is_dir():
        return ""
    numbered = re.fullmatch(r"step_([0-9]+)", path.name)
    if numbered and (parent / f"step_{int(numbered.group(1)):08d}").is_dir():
        return f" The checkpoint of step {int(numbered.group(1))} is {parent / f'step_{int(numbered.group(1)):08d}'}."
    try:
        steps = sorted(p.name for p in parent.iterdir() if re.fullmatch(r"step_[0-9]{8,}", p.name) and p.is_dir())
    except OSError:  # (a directory this user cannot list: the refusal stands without the hint)
        return ""
    return f" {parent} holds {', '.join(steps[-5:])}." if steps else ""


def _validate_finetune(f: DictConfig | None) -> None:
    if f is None:
        return
    _check(f.dtype in (None, "fp32", "bf16", "fp16"), "finetune.dtype", f.dtype, "fp32, bf16, fp16 or null")
    lora = f.lora
    _check(_is_int(lora.rank) and lora.rank >= 0, "finetune.lora.rank", lora.rank, "an integer >= 0 (0 = no LoRA)")
    _check(lora.alpha > 0, "finetune.lora.alpha", lora.alpha, "a number > 0 (the adapters' scale is alpha / rank)")
    _check(0.0 <= lora.dropout < 1.0, "finetune.lora.dropout", lora.dropout, "a number in [0, 1)")
    _check(lora.rank == 0 or len(lora.targets) > 0, "finetune.lora.targets", _plain(lora.targets),
           "the linear layers to adapt with finetune.lora.rank > 0", "E.g. finetune.lora.targets=[qkv,proj].")
    _check(lora.rank > 0 or len(lora.targets) == 0, "finetune.lora.rank", lora.rank,
           "an integer >= 1 with finetune.lora.targets set", "E.g. finetune.lora.rank=8.")


def _validate_data(d: DictConfig) -> None:
    bs = d.get("batch_size")
    _check(_is_int(bs) and bs >= 1, "data.batch_size", bs, "an integer >= 1 (the per-process micro-batch)")
    nw = d.get("num_workers", 0)
    _check(_is_int(nw) and nw >= 0, "data.num_workers", nw, "an integer >= 0")
    # Each is a process of its own, per training process, and torch starts as many as asked (only warning):
    # 99999999999999999999 forked until the machine stopped. Far above any machine's useful count is refused.
    from trainer.parallel.layout import available_cores

    cores = available_cores()
    most = max(256, 8 * cores)
    _check(nw <= most, "data.num_workers", nw, f"an integer in [0, {most}]",
           f"Each is a loader process of its own in every training process (this machine has {cores} cores); a few "
           "per process is usual.")
    _check(isinstance(d.get("shuffle", True), bool), "data.shuffle", d.get("shuffle"), "true or false")
    if "seq_len" in d:
        _check(_is_int(d.seq_len) and d.seq_len >= 1, "data.seq_len", d.seq_len, "an integer >= 1")


def per_part(node: DictConfig) -> dict[str | None, DictConfig]:
    """An `optim` or `scheduler` node as the node of each model part: {None: node} for one optimizer; with keys
    whose values are nodes (`optim.generator: {lr: 2e-4}`, for a task whose own training_step steps one optimizer
    per part) each part's node is the base node with those keys changed (its own `_target_` too, if given)."""
    parts = [k for k, v in node.items() if isinstance(v, DictConfig)]
    if not parts:
        return {None: node}
    base = OmegaConf.masked_copy(node, [k for k in node if k not in parts])
    return {p: OmegaConf.merge(_taken_by(base, node[p]), node[p]) for p in parts}


def _taken_by(base: DictConfig, part: DictConfig) -> DictConfig:
    """The base node's keys a part inherits: all of them, or where the part names another class
    (`optim.discriminator._target_=torch.optim.SGD` under Adam's `betas`), those that class takes."""
    import inspect

    target = part.get("_target_")
    if target is None or target == base.get("_target_"):
        return base
    from trainer.config.targets import locate

    try:
        params = inspect.signature(locate("optim._target_", target)).parameters
    except (TypeError, ValueError, UserError):
        return base  # (its own check names the problem when it is built)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return base
    return OmegaConf.masked_copy(base, [k for k in base if k.startswith("_") or k in params])


def _validate_optim(o: DictConfig, where: str = "optim") -> None:
    """The keys torch's optimizers share. Which keys a given optimizer takes is checked at its class."""
    # (a plain dict: a DictConfig's get of an absent key raises and catches inside, ~0.1 ms a key)
    o = OmegaConf.to_container(o, resolve=True) if isinstance(o, DictConfig) else o
    lr = o.get("lr")
    _check(_is_number(lr) and 0 < lr < math.inf, f"{where}.lr", lr, "a finite number > 0")
    if o.get("betas") is not None:
        b = o["betas"]
        _check(isinstance(b, (list, tuple)) and len(b) == 2 and all(_is_number(x) and 0 <= x < 1 for x in b),
               f"{where}.betas", b, "two numbers in [0, 1), e.g. [0.9, 0.95]")
    if "betas" in o and o.get("betas") is None:  # (torch was called with betas=None: a TypeError traceback)
        raise ConfigError(f"{where}.betas=null is invalid: expected two numbers in [0, 1), e.g. [0.9, 0.95]. To use "
                          f"the optimizer's default, leave the key out: ~{where}.betas.")
    for key in ("eps", "weight_decay"):
        v = o.get(key)
        _check(v is None or (_is_number(v) and 0 <= v < math.inf), f"{where}.{key}", v, "a finite number >= 0")
    v = o.get("adamw_lr")  # (optim=muon's rate for what Muon does not take)
    _check(v is None or (_is_number(v) and 0 < v < math.inf), f"{where}.adamw_lr", v, "a finite number > 0")
    momentum = o.get("momentum")
    _check(momentum is None or (_is_number(momentum) and 0 <= momentum < 1), f"{where}.momentum", momentum,
           "a number in [0, 1), e.g. 0.9")
    _check(not o.get("nesterov") or not _is_number(momentum) or momentum > 0, f"{where}.momentum", momentum,
           f"a number in (0, 1) with {where}.nesterov=true", f"Or {where}.nesterov=false.")
    if "ns_steps" in o:
        _check(_is_int(o["ns_steps"]) and 1 <= o["ns_steps"] < 100, f"{where}.ns_steps", o["ns_steps"],
               "an integer in [1, 100) (Newton-Schulz iterations; 5 is usual)")
    for key in ("fused", "foreach", "capturable", "differentiable", "maximize", "amsgrad", "nesterov"):
        _check(not isinstance(o.get(key), str | int | float | list | dict) or isinstance(o.get(key), bool),
               f"{where}.{key}", o.get(key), "true or false (or null)")
    _check(not (o.get("fused") and o.get("foreach")), f"{where}.foreach", True, f"false or null with {where}.fused=true",
           f"torch runs one kernel or the other: {where}.fused=false to use foreach.")


# Settings of torch's optimizers and the framework's schedules: a part of a task is never named so.
SETTINGS = {"lr", "eps", "betas", "weight_decay", "momentum", "dampening", "nesterov", "amsgrad", "foreach", "fused",
            "maximize", "capturable", "differentiable", "alpha", "rho", "lambd", "initial_accumulator_value",
            "lr_decay", "adamw_lr", "ns_steps", "warmup_steps", "min_lr_ratio", "total_steps"}


def _refuse_settings_as_parts(section: str, node: DictConfig) -> None:
    """`optim.eps={a: 1}`: a mapping under a setting's name is a wrong value, not a part's node (a task with parts
    has `optim.generator: {...}`); it read as a part named eps ("optim.eps.a is not an option of
    optim.eps._target_=AdamW")."""
    for key, value in node.items():
        if isinstance(value, DictConfig) and key in SETTINGS:
            raise ConfigError(f"{section}.{key}={_plain(value)} is invalid: {key} is a setting, a value "
                              f"({section}.{key}=VALUE), not a mapping. (A task with parts, each with its own "
                              f"optimizer, sets {section}.PART.{key}=VALUE.)")


def _validate_scheduler(s: DictConfig, where: str = "scheduler") -> None:
    w = s.get("warmup_steps", 0)
    _check(_is_int(w) and w >= 0, f"{where}.warmup_steps", _plain(w), "an integer >= 0")
    r = s.get("min_lr_ratio", 0.0)
    _check(_is_number(r) and 0 <= r <= 1, f"{where}.min_lr_ratio", _plain(r), "a number in [0, 1]")


def refuse_one_process_on_nodes(world: DictConfig) -> None:
    """A training run of a one-process strategy (world=single) on several nodes, SLURM's or world.nnodes's: each
    node would train its own copy of the run. (Not part of validate: eval, tune, launch and --cfg may run there.)"""
    from trainer.config.targets import locate

    w = launch_config(world)
    found = slurm.topology(os.environ) if slurm.leaves_topology_to_slurm(w.nnodes, w.node_rank, w.rdzv_endpoint) \
        else None
    nodes = found[0] if found is not None else w.nnodes
    if nodes > 1 and not getattr(locate("world._target_", world._target_), "distributed", True):
        where = (f"SLURM job {os.environ.get('SLURM_JOB_ID')} runs it on {nodes} nodes" if found is not None
                 else f"world.nnodes={nodes}")
        raise ConfigError(f"world._target_={world._target_} trains in one process, but {where}: each node would "
                          "train its own copy of this run. Train across the nodes with world=ddp (or world=fsdp), or "
                          "run it on one node" + (" (sbatch --nodes=1)." if found is not None else "."))


def _validate_world(world: DictConfig, batch_size: Any = None, precision: Any = None) -> None:
    w = launch_config(world)
    n = w.nproc_per_node
    _check(n == "auto" or (_is_int(n) and n >= 1), "world.nproc_per_node", n, "an integer >= 1 or 'auto'")
    _check(1 <= w.nnodes <= slurm.MAX_NODES, "world.nnodes", w.nnodes, f"an integer in [1, {slurm.MAX_NODES}]")
    _check(0 <= w.node_rank < w.nnodes, "world.node_rank", w.node_rank, f"an integer in [0, world.nnodes={w.nnodes})")
    _check(w.max_restarts >= 0, "world.max_restarts", w.max_restarts, "an integer >= 0")
    _check(w.rdzv_timeout >= 1, "world.rdzv_timeout", w.rdzv_timeout, "a number of seconds >= 1")
    _check(w.hang_timeout is None or w.hang_timeout >= 0, "world.hang_timeout", w.hang_timeout,
           "a number of seconds > 0 (0 or null switches the hang watchdog off)")
    _check(w.threads == "auto" or (_is_int(w.threads) and w.threads >= 1), "world.threads", w.threads,
           "an integer >= 1 or 'auto'")
    if w.nnodes > 1:
        _check(bool(w.rdzv_endpoint), "world.rdzv_endpoint", w.rdzv_endpoint,
               "host:port of node 0 when world.nnodes > 1", "Pass world.rdzv_endpoint=NODE0_HOST:29500 on every node.")
    if w.rdzv_endpoint is not None:
        try:
            slurm.split_endpoint(w.rdzv_endpoint)
        except ValueError as e:
            _check(False, "world.rdzv_endpoint", w.rdzv_endpoint, f"HOST:PORT of node 0 ({e})",
                   "Pass node 0's address, e.g. world.rdzv_endpoint=node0:29500.")
    if slurm.leaves_topology_to_slurm(w.nnodes, w.node_rank, w.rdzv_endpoint):
        slurm.topology(os.environ)  # under SLURM the launcher reads the job's variables: refuse bad ones now
    kind, _, index = str(w.device).partition(":")
    _check(w.device == "auto" or (kind in ("cuda", "mps") and (not index or index.isdigit())) or w.device == "cpu",
           "world.device", w.device, "auto, cpu, cuda, cuda:N or mps (a CPU has no index)")
    from trainer.parallel.layout import (  # the layout's own checks, before workers start
        check_degree,
        check_pipeline,
    )

    if "stage" in world:  # (world=deepspeed's ZeRO stage: refused only by its constructor, past --cfg job and config)
        stage = _plain(world.stage)
        _check(stage is None or (_is_int(stage) and stage in (1, 2, 3)), "world.stage", stage,
               "1, 2 or 3 (the ZeRO stage), or null")
    if "bucket_cap_mb" in world:  # (DDP took a negative size without a word)
        cap = _plain(world.bucket_cap_mb)
        _check(cap is None or (_is_number(cap) and cap > 0), "world.bucket_cap_mb", cap,
               "a number of megabytes > 0, or null for DDP's default (25)")
    tp = check_degree(_plain(world.get("tp", 1)), n * w.nnodes if _is_int(n) else None)
    if "pp" in world:
        pp, _, _ = check_pipeline(_plain(world.pp), _plain(world.get("pp_schedule", "1F1B")),
                                  _plain(world.get("microbatches")), n * w.nnodes if _is_int(n) else None, tp,
                                  batch_size)
        _check(pp == 1 or not str(precision).endswith("FP16"), "world.pp", pp, "1 with precision=fp16",
               "The pipeline's stages would each decide alone to skip an overflowed step; use precision=bf16.")


# The lm recipe's size keys (model.n_layer, ... which debug=smoke sets) and what a Hugging Face config calls them
# (trainer/models/hf.py builds with them).
HF_SIZE_ALIASES = {"n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "d_model": "hidden_size",
                   "seq_len": "max_position_embeddings"}
HF_CAUSAL_LM = "trainer.models.hf.causal_lm"


def spell_as_torch(container: dict) -> None:
    """`world.pp_schedule` is taken in any case (`1f1b`) and recorded as torch spells it, so that a resume that
    spells it otherwise is not a changed setting."""
    world = container.get("world")
    if isinstance(world, dict) and isinstance(world.get("pp_schedule"), str):
        from trainer.parallel.layout import SCHEDULES

        given = world["pp_schedule"]
        world["pp_schedule"] = next((s for s in SCHEDULES if s.lower() == given.lower()), given)


def agree_hf_sizes(container: dict) -> None:
    """A Hugging Face model's config given both a size key of its own and the lm recipe's name for it, differing
    (`model.num_hidden_layers=4` beside debug=smoke's `n_layer: 1`): the model's own key is what the user asked
    for, and the recipe's name is set to it, so that the saved config (model_config.json) builds that model. The
    builder lets the recipe's name win, as the runs written before this rule recorded it."""
    model = container.get("model")
    if not isinstance(model, dict) or model.get("_target_") != HF_CAUSAL_LM:
        return
    for alias, own in HF_SIZE_ALIASES.items():
        if alias in model and own in model and model[alias] != model[own]:
            model[alias] = model[own]


def hf_size_twin(model: Any, key: str) -> str | None:
    """The other name of a Hugging Face model's size key `key` (`d_model` <-> `hidden_size`) where its config
    has both, else None. An override of a saved run's config (eval, sample) sets both, or the value the file
    recorded for the other would win (agree_hf_sizes) and the override be dropped without a word."""
    if not hasattr(model, "get") or model.get("_target_") != HF_CAUSAL_LM:
        return None
    names = {**HF_SIZE_ALIASES, **{own: alias for alias, own in HF_SIZE_ALIASES.items()}}
    twin = names.get(key)
    return twin if twin is not None and key in model and twin in model else None
