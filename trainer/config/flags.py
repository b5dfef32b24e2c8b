"""Flags that other launchers take, answered with the overrides that do the same here.

People bring `accelerate launch --num_processes 2 --mixed_precision bf16`, torchrun's `--nproc_per_node=2` and
the Hugging Face Trainer's `--learning_rate 3e-4`. `python -m trainer` takes Hydra's flags and KEY=VALUE
overrides only, and Hydra's argparse answers anything else with a usage dump (or, for the flag's value, an
override parse error). `foreign_flags` finds such flags before Hydra parses the command line, and
`FlagsNotTaken` says, in one paragraph, which override does what each flag did, and the whole command.
As in Accelerate, `--num-processes` and `--num_processes` are the same flag.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable

from trainer.errors import ConfigError

# Hydra 1.3's own flags (hydra._internal.utils.get_args_parser), which pass through, and how many values each takes:
# 0, 1 (the next argument), or "?" (--info: one of its topics, if one follows).
HYDRA_ARITY = {"--help": 0, "-h": 0, "--hydra-help": 0, "--version": 0, "--cfg": 1, "-c": 1, "--resolve": 0,
               "--package": 1, "-p": 1, "--run": 0, "-r": 0, "--multirun": 0, "-m": 0, "--shell-completion": 0,
               "-sc": 0, "--config-path": 1, "-cp": 1, "--config-name": 1, "-cn": 1, "--config-dir": 1, "-cd": 1,
               "--experimental-rerun": 1, "--info": "?", "-i": "?"}
HYDRA_FLAGS = tuple(HYDRA_ARITY)
_INFO_TOPICS = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}


def flags_first(argv: list[str]) -> list[str]:
    """Hydra's flags (with their values) before the overrides, the order its parser needs: `debug=smoke --cfg job
    optim.lr=1e-3` was argparse's usage and "unrecognized arguments: optim.lr=1e-3". -m once, however often given;
    a bare --info (no topic after it) last, where its parser takes no override for its topic. Any other dashed
    argument (an Accelerate or torchrun flag, which the CLI translates) stays where it is, with what follows it."""
    flags, overrides, last, rest = [], [], [], iter(argv)
    for a in rest:
        arity = HYDRA_ARITY.get(a.split("=", 1)[0]) if a.startswith("-") else None
        if arity is None:
            overrides.append(a)
        elif "=" in a:  # (--cfg=job: its value with it)
            flags.append(a)
        elif a in ("-m", "--multirun"):
            if not {"-m", "--multirun"} & set(flags):
                flags.append(a)
        elif arity == 1:
            flags += [a, *([value] if (value := next(rest, None)) is not None else [])]
        elif arity == "?":
            value = next(rest, None)
            if value in _INFO_TOPICS:
                flags += [a, value]
            else:
                last.append(a)
                overrides += [value] if value is not None else []
        else:
            flags.append(a)
    return flags + overrides + last


def _processes(n: str) -> list[str]:
    n = "auto" if n in ("auto", "gpu") else n  # torchrun's --nproc_per_node=gpu: one per GPU
    return ["world.nproc_per_node=1"] if n == "1" else ["world=ddp", f"world.nproc_per_node={n}"]


def _precision(mode: str) -> list[str]:
    names = {"no": "fp32", "fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}
    if mode not in names:
        raise ConfigError(f"--mixed_precision {mode}: this framework computes in fp32, bf16 or fp16 "
                          "(precision=fp32|bf16|fp16, or precision=auto: the fastest this machine computes natively); "
                          "fp8 is not supported.")
    return [f"precision={names[mode]}"]


def _machines(n: str) -> list[str]:
    return [f"world.nnodes={n}"] if n == "1" else ["world=ddp", f"world.nnodes={n}"]


def _sharding(strategy: str) -> list[str]:
    keep = {"FULL_SHARD": "true", "1": "true", "SHARD_GRAD_OP": "false", "2": "false"}
    if strategy.upper() == "NO_SHARD" or strategy == "3":
        return ["world=ddp"]
    return ["world=fsdp", f"world.reshard_after_forward={keep.get(strategy.upper(), 'true')}"]


# Accelerate and torchrun give node 0's address as a host and a port; here it is one key, HOST:PORT.
HOST_FLAGS, PORT_FLAGS = ("main_process_ip", "master_addr"), ("main_process_port", "master_port")


# flag name (underscores) -> (takes a value, the overrides that do the same); None: nothing needed here.
FLAGS: dict[str, tuple[bool, Callable[..., list[str]] | str | None]] = {
    # accelerate launch
    "num_processes": (True, _processes),
    "multi_gpu": (False, lambda: ["world=ddp", "world.nproc_per_node=auto"]),
    "mixed_precision": (True, _precision),
    "num_machines": (True, lambda n: _machines(n)),
    "machine_rank": (True, lambda r: [f"world.node_rank={r}"]),
    "main_process_ip": (True, "endpoint"),
    "main_process_port": (True, "endpoint"),
    "use_fsdp": (False, lambda: ["world=fsdp"]),
    "fsdp_sharding_strategy": (True, _sharding),
    "fsdp_offload_params": (True, lambda v: ["world=fsdp", f"world.cpu_offload={v.lower()}"]),
    "fsdp_transformer_layer_cls_to_wrap": (True, lambda names: ["world=fsdp", f"world.wrap=[{names}]"]),
    # DeepSpeed's engine (the [deepspeed] extra); world=fsdp gives ZeRO-2/3 on torch alone (README: Sharding).
    "use_deepspeed": (False, lambda: ["world=deepspeed"]),
    "zero_stage": (True, lambda s: ["world=deepspeed", f"world.stage={s}"]),
    "gradient_accumulation_steps": (True, lambda n: [f"trainer.grad_accum_steps={n}"]),
    "cpu": (False, lambda: ["world.device=cpu"]),
    "num_cpu_threads_per_process": (True, lambda n: [f"world.threads={n}"]),
    "dynamo_backend": (True, lambda b: ["trainer.compile=false"] if b.lower() == "no" else
                       ["trainer.compile=true", f"trainer.compile_backend={b.lower()}"]),
    "dynamo_mode": (True, lambda m: ["trainer.compile=true", f"trainer.compile_mode={m.lower()}"]),
    "main_training_function": (True, None),
    # torchrun
    "nproc_per_node": (True, _processes),
    "nnodes": (True, lambda n: _machines(n)),
    "node_rank": (True, lambda r: [f"world.node_rank={r}"]),
    "master_addr": (True, "endpoint"),
    "master_port": (True, "endpoint"),
    "rdzv_endpoint": (True, lambda e: [f"world.rdzv_endpoint={e}"]),
    "max_restarts": (True, lambda n: [f"world.max_restarts={n}"]),
    "standalone": (False, None),
    "rdzv_backend": (True, None),
    "rdzv_id": (True, None),
    # the Hugging Face Trainer's arguments
    "bf16": (False, lambda: ["precision=bf16"]),
    "fp16": (False, lambda: ["precision=fp16"]),
    "learning_rate": (True, lambda v: [f"optim.lr={v}"]),
    "per_device_train_batch_size": (True, lambda n: [f"data.batch_size={n}"]),
    "num_train_epochs": (True, lambda n: [f"trainer.max_epochs={n}", "trainer.max_steps=null"]),
    "output_dir": (True, lambda d: [f"hydra.run.dir={d}"]),
    "resume_from_checkpoint": (True, lambda p: [f"resume={p}"]),
    "report_to": (True, lambda name: [f"logger={name}"]),
}


class FlagsNotTaken(ConfigError):
    """Flags of another launcher on this command line; the message names the overrides that do the same."""


def _name(token: str) -> str:
    return token.split("=", 1)[0].lstrip("-").replace("-", "_")


def _hydra_flag(token: str) -> bool:
    flag = token.split("=", 1)[0]
    if flag in HYDRA_FLAGS:
        return True
    # argparse takes an unambiguous prefix of a long flag (--config-d); leave those to it.
    return flag.startswith("--") and len(flag) > 3 and any(f.startswith(flag) for f in HYDRA_FLAGS)


def foreign_flags(argv: list[str]) -> tuple[list[tuple[str, str | None]], list[str]]:
    """The flags on `argv` that are not Hydra's, as (token, value or None), and the rest of `argv` in order."""
    found, rest, i = [], [], 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("-") or token in ("-", "--") or _hydra_flag(token) or token[1:2].isdigit():
            rest.append(token)
            i += 1
            continue
        name, value = _name(token), None
        if "=" in token:
            value = token.split("=", 1)[1]
        elif FLAGS.get(name, (True,))[0] and i + 1 < len(argv) and not argv[i + 1].startswith("-") \
                and "=" not in argv[i + 1]:
            value = argv[i + 1]
            i += 1
        found.append((token.split("=", 1)[0], value))
        i += 1
    return found, rest


def _nested(name: str, value: str | None, rest: list[str]) -> list[str]:
    """The overrides a flag no launcher has probably means, from the config's keys: `--max_steps 5` ->
    trainer.max_steps=5, `--compile` -> trainer.compile=true."""
    from hydra._internal.utils import get_args_parser

    from trainer.config.compose import _composed, nearest_keys

    args, _ = get_args_parser().parse_known_args(rest)
    cfg = (None if args.multirun else _composed(args.overrides, args.config_dir)) or _composed([], None)
    return [f"{k}={'true' if value is None else value}" for k in nearest_keys(name, cfg)[:1]]


def refuse_foreign_flags(argv: list[str], command: tuple[str, ...] = (), after: tuple[str, ...] = ()) -> None:
    """Raise FlagsNotTaken when `argv` has flags that are not Hydra's, naming the overrides that do the same. The
    command it proposes is `python -m trainer COMMAND... OVERRIDES... AFTER...` (`launch`, then its script)."""
    found, rest = foreign_flags(argv)
    if not found:
        return
    host = next((v for f, v in found if _name(f) in HOST_FLAGS), None) or "NODE0_HOST"
    port = next((v for f, v in found if _name(f) in PORT_FLAGS), None) or "29500"
    # A strategy chosen elsewhere (world=fsdp, --use_fsdp) keeps its processes: --num_processes adds no world=ddp.
    fsdp = ("use_fsdp", "use_deepspeed", "zero_stage", "fsdp_offload_params", "fsdp_transformer_layer_cls_to_wrap")  # (chosen)
    strategy_chosen = any(o.startswith("world=") for o in rest) or any(_name(f) in fsdp for f, _ in found)
    meant: dict[str, list[str]] = {}  # the overrides (as one string) -> the flags that mean them
    not_needed, unknown, inert = [], [], []
    # accelerate's --dynamo_mode does something only with inductor (its --dynamo_backend's default is `no`).
    backend = next(((v or "").lower() for f, v in found if _name(f) == "dynamo_backend"), None)
    for flag, value in found:
        shown = flag if value is None else f"{flag} {value}"
        if _name(flag) == "dynamo_mode" and backend not in (None, "inductor"):
            inert.append(f"{shown} does nothing with --dynamo_backend {backend} (a mode is inductor's)")
            continue
        takes, meaning = FLAGS.get(_name(flag), (None, None))
        if takes is None:
            proposed = _nested(_name(flag), value, rest)
            if not proposed:
                unknown.append(shown)
                continue
        elif meaning is None:
            not_needed.append(shown)
            continue
        elif takes and value is None:
            raise FlagsNotTaken(f"{flag} needs a value; here every setting is a KEY=VALUE override (--cfg job "
                                "lists them).")
        elif meaning == "endpoint":
            proposed = [f"world.rdzv_endpoint={host}:{port}"]
        else:
            proposed = meaning(value) if takes else meaning()
        if strategy_chosen:
            proposed = [o for o in proposed if o != "world=ddp"]
        meant.setdefault(" ".join(proposed), []).append(shown)
    # One value a key (--multi_gpu's nproc_per_node=auto and --num_processes 2 name one setting): a count given wins.
    chosen: dict[str, str] = {}
    for o in (o for group in meant for o in group.split()):
        key, _, value = o.partition("=")
        if not (value == "auto" and key in chosen):
            chosen[key] = o  # (in the place the key first had)
    overrides = list(chosen.values())
    flags = " ".join(f if v is None else f"{f} {v}" for f, v in found)
    what = "is not a flag" if len(found) == 1 else "are not flags"
    said = [f"{group} for {' '.join(shown)}" for group, shown in meant.items()]
    said += [f"{shown} is not needed (the launcher here sets it up)" for shown in not_needed]
    said += [f"{shown} matches no setting (--cfg job lists them all)" for shown in unknown]
    said += inert
    text = (f"{flags} {what} of this command (accelerate launch's, torchrun's or the Hugging Face Trainer's?); "
            f"here every setting is a KEY=VALUE override: {'; '.join(said)}")
    if overrides or not unknown:
        text += f". The same run: {shlex.join(['python', '-m', 'trainer', *command, *overrides, *rest, *after])}"
    raise FlagsNotTaken(text)
