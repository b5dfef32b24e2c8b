"""The commands beside training: `python -m trainer env` (what is installed and available), `check` (a
correctness self-test of this machine: accumulation, DDP, FSDP, tensor parallelism and resume), and for a
finished run `eval RUN_DIR` (its val metrics, on any world size) and `sample RUN_DIR`."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path


def _version(pkg: str) -> str:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "not installed"


def env(argv: list[str]) -> int:
    """Print versions, devices and backends, then the default config (like `accelerate env`)."""
    if any(a in ("-h", "--help") for a in argv):
        print("usage: python -m trainer env [OVERRIDES]: versions, devices, backends, what precision=auto would "
              "choose, and the config (with OVERRIDES)")
        return 0
    from trainer.config.compose import load
    from trainer.config.machine import defaults_file
    from trainer.errors import UserError

    try:
        cfg = load(argv, targets=False)  # (a mistake is one paragraph before anything is printed)
    except UserError as err:
        if argv or not defaults_file().is_file():
            raise
        # A mistake in the machine's defaults file (edited by hand): this command, the one a bug report pastes,
        # still reports the machine, and the mistake in place of the config.
        cfg = f"(not composed: {err})"
    import torch
    import torch.distributed as dist

    from trainer.parallel.backend import available_cores
    from trainer.parallel.precision import choose_for, cpu_flags

    flags = cpu_flags()
    relevant = ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16", "amx_tile", "avx512f", "avx2", "bf16")

    rows = [
        ("trainer", _version("trainer")),
        ("Python", f"{platform.python_version()} ({sys.executable})"),
        ("Platform", platform.platform()),
        *[(p, _version(p)) for p in ("torch", "hydra-core", "omegaconf", "wandb", "safetensors", "tqdm")],
        ("CPU cores available", str(available_cores())),
        ("torch threads (intra-op / inter-op)", f"{torch.get_num_threads()} / {torch.get_num_interop_threads()}"),
        ("CUDA available", str(torch.cuda.is_available())),
    ]
    if torch.cuda.is_available():
        rows += [("CUDA / cuDNN", f"{torch.version.cuda} / {torch.backends.cudnn.version()}")]
        rows += [(f"GPU {i}", torch.cuda.get_device_name(i)) for i in range(torch.cuda.device_count())]
        rows += [("bf16 on GPU", str(torch.cuda.is_bf16_supported()))]
    rows += [
        ("torch.distributed", str(dist.is_available())),
        ("gloo / nccl", f"{dist.is_gloo_available()} / {dist.is_nccl_available()}"),
        ("MKL / oneDNN (CPU bf16 matmuls)", f"{torch.backends.mkl.is_available()} / {torch.backends.mkldnn.is_available()}"),
        ("CPU flags (bf16/fp16 units)", "unknown (no /proc/cpuinfo)" if flags is None else
         " ".join(f for f in relevant if f in flags) or "none of " + " ".join(relevant)),
        ("WANDB_MODE", os.environ.get("WANDB_MODE", "(unset)")),
        ("wandb credentials", "yes" if os.environ.get("WANDB_API_KEY") else "not in the environment"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"- {k.ljust(width)} : {v}" for k, v in rows))
    name, why = choose_for("auto")
    print(f"\nprecision=auto would choose: {name} ({why})")
    from trainer.config.machine import describe

    print(f"\nMachine defaults (python -m trainer config): {describe()}")
    print("\nDefault config (python -m trainer --cfg job):\n")
    from omegaconf import OmegaConf

    from trainer.redaction import redact

    print(cfg if isinstance(cfg, str) else OmegaConf.to_yaml(OmegaConf.create(redact(OmegaConf.to_container(cfg)))))
    return 0


# -- check ---------------------------------------------------------------------------------------
# Two blocks, so that the pipeline line has a block for each of its two stages.
CHECK_SETTINGS = ["debug=smoke", "data=text", "trainer.max_steps=12", "trainer.eval_samples=37",
                  "checkpoint.every_n_steps=6", "model.n_layer=2"]


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["train/loss"] for line in lines if "train/loss" in line]


def _compare(name: str, got: list[float], want: list[float], tol: float) -> bool:
    if len(got) != len(want):
        print(f"FAIL  {name}: {len(got)} logged steps, expected {len(want)}")
        return False
    diff = max((abs(a - b) for a, b in zip(got, want)), default=0.0)
    ok = diff <= tol
    print(f"{'OK  ' if ok else 'FAIL'}  {name}: max |loss difference| = {diff:.2e} (tolerance {tol:.0e})", flush=True)
    return ok


def check(argv: list[str]) -> int:
    """Train a tiny model several ways that must agree, and say which agree. Exit 0 if all do."""
    if any(a in ("-h", "--help") for a in argv):
        print("usage: python -m trainer check [OVERRIDES]: trains a tiny model several ways that must agree (1 "
              "process, accumulation, a resume, and on more processes where there are cores) and says which agree; "
              "exit 0 if all do")
        return 0
    from trainer.config.compose import load as compose
    from trainer.errors import ConfigError

    chosen = [a for a in argv if a.lstrip("+").split("=", 1)[0] in ("recipe", "model", "data", "task")]
    if chosen:  # (recipe=gan was "model.n_layer is a setting of model=gpt_medium": check's own setting, not the user's)
        raise ConfigError(f"check {' '.join(chosen)}: check trains its own tiny GPT on its own text, the same on every "
                          "machine, to test this machine and world (its overrides are the world's: world=ddp "
                          "world.nproc_per_node=2). To try a recipe, run it: python -m trainer "
                          f"{' '.join(chosen)} debug=smoke.")
    cfg = compose([*CHECK_SETTINGS, "data.path=check", *argv], targets=False)  # (a mistake: one paragraph, first)
    others = [a for a in argv if "=" in a and not a.startswith("-") and
              a.lstrip("+~").split("=", 1)[0].split(".", 1)[0] not in ("world", "precision", "hydra")]
    if others:  # (trainer.max_steps=1 ran five of its checks, then refused a resume path the user never gave)
        raise ConfigError(f"check {' '.join(others)}: check trains its own tiny GPT with its own schedule, the same on "
                          "every machine, and compares its runs; its overrides are the world's (world=ddp "
                          "world.nproc_per_node=2, world.threads=1). To try settings of your own, run them: python -m "
                          f"trainer {' '.join(others)} debug=smoke.")
    chosen = str(cfg.precision.get("_target_", "")).rsplit(".", 1)[-1]
    if chosen != "FP32":  # (bf16's rounding, 1e-2, read as failures of the fp32 tolerances: a working machine "broken")
        raise ConfigError(f"check compares its runs to fp32's rounding (1e-5 on a CPU), and precision="
                          f"{chosen.lower()} rounds each of them differently, by far more: its runs would read as "
                          "failures on a machine that works. Run `python -m trainer check` without precision= (its "
                          "other overrides, the world's, are what it takes).")
    import contextlib
    import io
    import logging
    import shutil

    import torch

    from trainer.config.compose import load as compose
    from trainer.entry.launcher import WorkerFailed, one_forkserver
    from trainer.entry.launcher import run as launch
    from trainer.entry.run import train_here
    from trainer.errors import Preempted, TrainerExit
    from trainer.parallel.backend import available_cores

    tmp = Path(tempfile.mkdtemp(prefix="trainer-check-"))
    try:
        corpus = tmp / "corpus.txt"
        corpus.write_bytes(Path(json.__file__).read_bytes() + Path(subprocess.__file__).read_bytes())
        os.environ.setdefault("TRAINER_CACHE_DIR", str(tmp / "cache"))
        base = [*CHECK_SETTINGS, f"data.path={corpus}", *argv]
        # GPU kernels are not bitwise deterministic; on the CPU everything here is.
        tol_equiv, tol_exact = (1e-3, 1e-3) if torch.cuda.is_available() else (1e-5, 0.0)

        def run_here(name: str, *extra: str) -> Path:
            run_dir = tmp / name
            with contextlib.redirect_stdout(io.StringIO()):  # the inner runs' own summary lines
                train_here(compose([*base, *extra]), run_dir)  # (this process: the 1-rank reference)
            return run_dir

        def run_procs(name: str, *extra: str) -> tuple[Path, str | None]:
            """Launched from this process, as `python -m trainer` would launch them (one forkserver for all)."""
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    launch(compose([*base, *extra]), tmp / name)
            except WorkerFailed as wf:
                return tmp / name, f"worker rank {wf.rank} failed (exit code {wf.exitcode}):\n{wf.text.strip()}"
            except Preempted:  # (the whole command was stopped: not a failure of this item)
                raise
            except TrainerExit as err:
                return tmp / name, str(err)
            return tmp / name, None

        print(f"trainer check: tiny GPT, 12 steps, in {tmp} (removed afterwards)", flush=True)
        ref = _losses(run_here("big", "data.batch_size=8"))
        results = [_compare("accumulation 2 x 4 equals batch 8",
                            _losses(run_here("acc", "data.batch_size=4", "trainer.grad_accum_steps=2")), ref, tol_equiv)]
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        # Tensor parallelism on 4 processes (fsdp 2 x tp 2) where there are 4 cores or GPUs, else tp 2 alone.
        four = (torch.cuda.device_count() if torch.cuda.is_available() else available_cores()) >= 4
        tp = ["world=fsdp", "world.nproc_per_node=4", "world.tp=2", "data.batch_size=4"] if four else \
             ["world=ddp", "world.nproc_per_node=2", "world.tp=2", "data.batch_size=8"]
        runs = [(f"2 ranks ({backend}, ddp) x batch 4 equals 1 rank x batch 8", "ddp",
                 ["world=ddp", "world.nproc_per_node=2", "data.batch_size=4"]),
                (f"2 ranks ({backend}, fsdp) x batch 4 equals 1 rank x batch 8", "fsdp",
                 ["world=fsdp", "world.nproc_per_node=2", "data.batch_size=4"]),
                (f"tensor parallel 2 ({backend}{', x fsdp 2' if four else ''}) equals 1 rank x batch 8", "tp", tp),
                (f"pipeline 2 stages ({backend}, 1F1B, 2 microbatches) equals 1 rank x batch 8", "pp",
                 ["world=ddp", "world.nproc_per_node=2", "world.pp=2", "data.batch_size=8"])]
        # (a failed run's other rank is stopped with SIGTERM, which torch logs: the failure is reported below)
        logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
        with one_forkserver(tmp / "workers.log"):  # the workers' own output goes there, not into this report
            launched = [(label, *run_procs(name, *args)) for label, name, args in runs]
        for label, run_dir, failed in launched:
            if failed:
                print(f"FAIL  {label}: the run failed:\n{failed}")
                results.append(False)
            else:
                results.append(_compare(label, _losses(run_dir), ref, tol_equiv))
        resumed = run_here("resumed", "data.batch_size=8", f"resume={tmp / 'big' / 'checkpoints' / 'step_00000006'}")
        results.append(_compare("save at step 6, resume: steps 7-12 continue the loss stream", _losses(resumed),
                                ref[6:], tol_exact))
        print(f"\n{sum(results)} passed, {len(results) - sum(results)} failed")
        return 0 if all(results) else 1
    except (Preempted, KeyboardInterrupt) as e:  # SIGTERM or Ctrl-C: the command stops, and no item is judged failed
        how = "Ctrl-C" if isinstance(e, KeyboardInterrupt) else "SIGTERM"
        print(f"trainer check: stopped by {how} before every check ran (those above are as they say); run it again "
              "to check the rest.", file=sys.stderr, flush=True)
        return 130 if isinstance(e, KeyboardInterrupt) else Preempted.exit_code
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# -- eval and sample: a finished run -------------------------------------------------------------------------
_PATH_OPTIONS = ("out", "checkpoint")  # (checkpoint=latest and best are words, unquoted alike)


def _run_and_options(argv: list[str], usage: str, options: tuple[str, ...]) -> tuple[str, dict[str, str], list[str]]:
    from trainer.errors import ConfigError

    if not argv or "=" in argv[0] or argv[0].startswith("-"):
        raise ConfigError(f"usage: {usage}")
    from trainer.config.compose import path_value

    opts = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv[1:] if a.split("=", 1)[0] in options}
    opts = {k: path_value(k, v) if k in _PATH_OPTIONS else v for k, v in opts.items()}
    rest = [a for a in argv[1:] if a.split("=", 1)[0] not in options]
    return argv[0], opts, rest


def _user_errors(fn):
    """A command's user mistakes are one paragraph and exit 2, as for training."""
    import functools

    @functools.wraps(fn)
    def inner(argv: list[str]) -> int:
        from trainer.entry.launcher import WorkerFailed
        from trainer.errors import TrainerExit, debug_enabled, report

        try:
            return fn(argv)
        except WorkerFailed as wf:  # a worker of `eval` on several processes: its error, once
            if debug_enabled():
                raise
            return wf.report()
        except TrainerExit as err:
            if debug_enabled():
                raise
            report(err)
            return err.exit_code
    return inner


def _replaces(path: Path, run: Path) -> str | None:
    """Why writing the sample to `path` would destroy something (None: it would not): a file of the run dir (its
    export, config, a training sample's image), or any file but a PNG an earlier `sample` wrote (which a regenerated
    sample may replace; it replaced any PNG: another run's training images, a picture of one's own)."""
    if not path.is_file():
        return None
    resolved, samples = path.resolve(), (run / "samples").resolve()
    if resolved.is_relative_to(run.resolve()) and (not resolved.is_relative_to(samples) or
                                                   resolved in _training_images(run)):
        return ("that file is the run's own (its weights, its records, a training sample's image), which the sample "
                "would replace; give a path of its own (outside the run dir, or a new name under it)")
    from trainer.tracking.images import PNG_SIGNATURE, is_sample_png

    with open(path, "rb") as f:
        head = f.read(200)
    if not head.startswith(PNG_SIGNATURE):
        return ("that file exists and is not a PNG image, which the sample would replace; give a new path (or "
                "move the file first)")
    if not is_sample_png(head) and not resolved.is_relative_to(samples):  # (the run's own samples/: as before)
        return ("that PNG was not written by python -m trainer sample (another run's training image, a picture of "
                "your own), and the sample would replace it; give a new path (or move the file first)")
    return None


def _not_png(path: Path) -> str | None:
    """A name whose suffix promises another format (x.jpg held PNG bytes, which viewers that go by the suffix refuse)."""
    if path.suffix.lower() == ".png":
        return None
    return ("out= is where an image sample goes, and it is written as a PNG: give a name ending in .png (a text "
            "sample, the lm task's, is printed: python -m trainer sample RUN_DIR > FILE keeps it)")


def _training_images(run: Path) -> set[Path]:
    """The images the run's evals wrote (samples.jsonl lists them), which a `sample out=` must not replace."""
    import json

    found = set()
    try:
        lines = (run / "samples.jsonl").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        try:
            image = json.loads(line).get("image")
        except (ValueError, AttributeError):
            continue
        if isinstance(image, str):
            found.add((run / image).resolve())
    return found


def _secrets_of(cfg) -> set[str]:
    """What must not be printed, as training redacts it: the environment's secrets and the config's (its values
    resolved where they can be)."""
    from omegaconf import OmegaConf

    from trainer.redaction import secret_values

    try:
        container = OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # an interpolation that does not resolve here: its text, then
        container = OmegaConf.to_container(cfg, resolve=False)
    return secret_values(container)


def _scrub_error(err: Exception, secrets: set[str]) -> None:
    """A user error's message may quote the config's values: its secrets are replaced before it is printed."""
    from trainer.redaction import scrub

    err.args = (scrub(str(err), secrets),)


@_user_errors
def evaluate(argv: list[str]) -> int:
    """`python -m trainer eval RUN_DIR [checkpoint=latest|best|PATH] [OVERRIDES...]`: the val metrics of a run's
    final (or best, or a given) checkpoint, its EMA's too, on any world size (world=ddp world.nproc_per_node=2)
    and eval settings (trainer.eval_samples=null: the whole val split). Prints one JSON line."""
    import shutil

    from omegaconf import open_dict

    from trainer.config.compose import prepare
    from trainer.entry.launcher import WorkerFailed, run
    from trainer.errors import CheckpointError, UserError
    from trainer.inference.device_map import cli_options
    from trainer.inference.finished import (
        checkpoint_of,
        config_of,
        older_checkpoints,
        refuse_relative_data_elsewhere,
    )

    run_dir, opts, overrides = _run_and_options(argv, EVAL_USAGE, ("checkpoint",))
    placement, overrides = cli_options(overrides)
    cfg = config_of(run_dir, overrides)
    secrets = _secrets_of(cfg)
    # Data of the user's choosing is evaluated as named; the run's own is checked against its checkpoint.
    given = any(o.split("=", 1)[0].lstrip("+~").split(".")[0] == "data" for o in overrides)
    try:
        if placement:  # the export placed over devices, on this process (trainer/inference/device_map.py)
            from trainer.config.compose import yaml_value
            from trainer.errors import ConfigError
            from trainer.inference.finished import evaluate_dispatched

            if "checkpoint" in opts:
                raise ConfigError("eval with device_map reads the run's export (its final weights), not a checkpoint: "
                                  "leave out checkpoint=, or leave out device_map, max_memory and offload_dir.")
            world = [o for o in overrides if o.split("=", 1)[0].lstrip("+~").split(".")[0] == "world"]
            if world:  # (they were ignored: one process evaluated, without a word)
                raise ConfigError(f"eval with device_map runs in this one process, the model placed over its devices: "
                                  f"{' '.join(world)} does not apply. Leave out the world overrides, or leave out "
                                  "device_map, max_memory and offload_dir to evaluate on world's processes.")
            task_keys = {a.split("=", 1)[0][len("task."):]: yaml_value(a) for a in overrides if a.startswith("task.")}
            evaluate_dispatched(run_dir, cfg, task_keys, _show(placement), bool(placement.get("show_map")), given)
            return 0
        from trainer.entry.run import EVAL_DATA_GIVEN_ENV, CheckpointVanished
        from trainer.entry.run import evaluate as evaluate_entry

        which = opts.get("checkpoint", "latest")
        for attempt in range(3):  # (latest, of a run still training: its keep_last may prune it before it is read)
            with open_dict(cfg):
                cfg.resume = str(checkpoint_of(run_dir, which))
            scratch = Path(tempfile.mkdtemp(prefix="trainer-eval-"))
            os.environ[EVAL_DATA_GIVEN_ENV] = "1" if given else ""
            try:
                ready = prepare(cfg.copy())
                if not given:
                    refuse_relative_data_elsewhere(run_dir, ready)
                try:
                    run(ready, scratch, entry=evaluate_entry)
                except WorkerFailed as wf:  # (a launched eval's worker refused the checkpoint: its own error, and
                    # the run's others, as for one process)
                    if which == "latest" and wf.exitcode == UserError.exit_code and cfg.resume in wf.text:
                        wf.text = f"{wf.text.rstrip()}{older_checkpoints(Path(cfg.resume))}"
                    raise
                break
            except UserError as e:  # (CheckpointVanished, or prepare's check that resume= exists)
                if Path(cfg.resume).exists():
                    if which != "latest" or not isinstance(e, CheckpointError):  # (a setting's error: no checkpoint's)
                        raise
                    raise type(e)(f"{e}{older_checkpoints(Path(cfg.resume))}") from None
                if which != "latest" or attempt == 2:
                    raise CheckpointVanished.of(cfg.resume) from None
                print(f"note: {cfg.resume} was pruned by the run, which is still training: evaluating its newest "
                      "checkpoint now.", file=sys.stderr, flush=True)
            finally:
                os.environ.pop(EVAL_DATA_GIVEN_ENV, None)
                shutil.rmtree(scratch, ignore_errors=True)
    except UserError as err:
        _scrub_error(err, secrets)
        raise
    return 0


@_user_errors
def sample(argv: list[str]) -> int:
    """`python -m trainer sample RUN_DIR [checkpoint=latest|best|PATH] [ema=true|false] [out=PATH] [task.KEY=VALUE ...]`:
    what the run's task samples from its final weights, or from a checkpoint's (finished or not: a run still
    training, or preempted), the EMA's when the run kept them, with the task's settings changed by
    task.KEY=VALUE (task.sample_tokens=500): text is printed, an image grid is written (default
    RUN_DIR/samples/sample.png), sample metrics are printed. What is printed is redacted as training's output is."""
    import torch

    from trainer.config.compose import yaml_value
    from trainer.errors import CheckpointError, ConfigError, StorageError, UserError
    from trainer.inference.device_map import cli_options
    from trainer.inference.finished import (
        checkpoint_model,
        checkpoint_of,
        config_yaml,
        has_ema,
        load,
        load_task,
        older_checkpoints,
    )
    from trainer.io import atomic_write_bytes
    from trainer.loop.trainer import printable
    from trainer.redaction import scrub, secret_values
    from trainer.tracking.images import SAMPLE_TEXT, is_image, png_bytes

    usage = SAMPLE_USAGE
    run_dir, opts, rest = _run_and_options(argv, usage, ("checkpoint", "ema", "out"))
    placement, rest = cli_options(rest)
    wrong = [a for a in rest if not a.startswith("task.") or "=" not in a]  # (only those: the rest are fine)
    if wrong:
        raise ConfigError(f"python -m trainer sample takes checkpoint=, ema=, out=, device_map=, max_memory.DEVICE=, "
                          f"offload_dir=, show_map= and task.KEY=VALUE, not {' '.join(wrong)}. "
                          f"Usage: {usage}")
    if "checkpoint" in opts and placement:
        raise ConfigError("sample with device_map reads the run's export (its final weights), not a checkpoint: "
                          "leave out checkpoint=, or leave out device_map, max_memory and offload_dir.")
    task_keys = {a.split("=", 1)[0][len("task."):]: yaml_value(a) for a in rest}
    run = Path(run_dir)
    if "out" in opts:  # (before the sampling, not after it)
        from trainer.io import output_file_problem

        problem = output_file_problem(opts["out"]) or _replaces(Path(opts["out"]), run) or _not_png(Path(opts["out"]))
        if problem:
            raise ConfigError(f"out={opts['out']}: {problem}.")
    secrets = _secrets_of(config_yaml(run)) | secret_values(task_keys)
    try:
        from trainer.config.compose import flag_value

        device = "cuda" if torch.cuda.is_available() else "cpu"
        stem = "sample"
        if "checkpoint" in opts:  # the checkpoint's task state too; its EMA where it has one, unless ema= says
            task, chosen = load_task(run, task_keys), checkpoint_of(run, opts["checkpoint"])
            _refuse_another_runs(run, chosen, out_given="out" in opts)
            ema = flag_value("ema", opts["ema"]) if "ema" in opts else None
            try:
                model = checkpoint_model(chosen, ema, task).to(device).eval()
            except CheckpointError as e:  # (latest refused: the run's others, as eval and trainer.load name them)
                if opts["checkpoint"] != "latest":
                    raise
                raise type(e)(f"{e}{older_checkpoints(chosen)}") from None
            stem = f"sample_{chosen.name}"  # (not the final weights' sample.png)
        else:
            ema = flag_value("ema", opts.get("ema", "true" if has_ema(run) else "false"))
            model = load(run, ema=ema, device=device, **_show(placement))
            task = load_task(run, task_keys)
        if placement:
            device = model.device_map.main_device
            if placement.get("show_map"):
                print(model.device_map, file=sys.stderr)
        if not hasattr(task, "sample"):
            raise ConfigError(f"the task of {run} ({type(task).__name__}) has no sample().")
        from omegaconf import OmegaConf

        tokenizer = OmegaConf.select(config_yaml(run), "data.tokenizer", default=None)
        if tokenizer and getattr(task, "sample_tokens", 0):  # (training refuses the same: trainer/recipes/lm/data.py)
            raise ConfigError(f"{run} was trained on token ids of data.tokenizer={tokenizer!r}, but the lm task decodes "
                              "its samples (and encodes its prompt) as bytes, so its text would be garbage. Evaluate "
                              f"the run with `python -m trainer eval {run}`, or load it (trainer.load) and generate "
                              "with the tokenizer yourself.")
        with torch.no_grad():
            out = task.sample(model, torch.device(device))
    except UserError as err:
        _scrub_error(err, secrets)
        raise
    out = out if isinstance(out, dict) else {"sample": out}
    if not any(v != "" for v in out.values()):  # e.g. the lm task with sample_tokens=0 (debug=smoke)
        # The count that asked for nothing, and where it was set: here, or the run's config (not another key given).
        zero = [k for k in ("sample_tokens", "num_samples") if getattr(task, k, None) == 0]
        named = ", ".join(f"task.{k}=0" + ("" if k in task_keys else f" (in {run / 'config.yaml'})") for k in zero)
        print(scrub(f"the task sampled nothing: {named or 'its settings'} ask{'s' if len(zero) == 1 else ''} for no "
                    "output (for lm: add task.sample_tokens=200; for diffusion and gan: task.num_samples=16).",
                    secrets), file=sys.stderr)
        return 0
    images = [name for name, value in out.items() if is_image(value)]
    for name, value in out.items():
        if isinstance(value, str):
            print(printable(scrub(value, secrets)))
        elif is_image(value):
            path = Path(opts.get("out", run / "samples" / f"{stem}.png"))
            if name != "image" and (len(images) > 1 or "out" not in opts):  # (each image a file of its own)
                path = path.with_name(f"{path.stem}_{name}{path.suffix}")
            try:
                atomic_write_bytes(path, png_bytes(value, SAMPLE_TEXT))
            except OSError as e:  # (a read-only run dir, a file named samples: a traceback; out= is checked before)
                raise StorageError(f"the sample image could not be written to {path} ({e.strerror or e}): give "
                                   f"out=PATH.png somewhere writable (python -m trainer sample {run} out=PATH.png)."
                                   ) from None
            print(scrub(f"{name}: {path}", secrets))
        else:
            print(scrub(f"{name}: {value:.4g}" if isinstance(value, float) else f"{name}: {value}", secrets))
    if "out" in opts and not images:  # (the lm task's text: out= was ignored without a word, no file written)
        print(f"note: out={opts['out']} was not written: out= is where an image sample goes, and this task's sample is "
              "text, printed above (to keep it in a file: python -m trainer sample ... > FILE).", file=sys.stderr)
    return 0


def _show(placement: dict) -> dict:
    """trainer.load's placement keywords (show_map is the command's own)."""
    return {k: v for k, v in placement.items() if k != "show_map"}


@_user_errors
def config(argv: list[str]) -> int:
    """`python -m trainer config [KEY=VALUE ...]`: this machine's defaults (trainer/config/machine.py)."""
    from trainer.config.machine import config as machine_config

    return machine_config(argv)


@_user_errors
def tune(argv: list[str]) -> int:
    """`python -m trainer tune batch_size|lr [OVERRIDES]`: finders that agree across ranks (trainer/entry/tuning.py)."""
    from trainer.entry.tuning import command

    return command(argv)


@_user_errors
def launch(argv: list[str]) -> int:
    """`python -m trainer launch [OVERRIDES ...] SCRIPT.py [SCRIPT ARGS ...]`: run your own script (a loop on
    trainer.Runtime) on the processes `world` asks for (world=ddp world.nproc_per_node=2), like `accelerate
    launch`. `trainer.Runtime()` in the script then takes world, precision, trainer.grad_accum_steps and
    trainer.seed from these overrides."""
    import shutil

    from trainer.entry.launcher import WorkerFailed, run
    from trainer.errors import HangDetected

    cfg, script, args = launch_parts(argv)
    from trainer.config.machine import defaults_file, shown_file

    if defaults_file().is_file():  # (composed into the config the script's Runtime() reads, as a run's is)
        print(f"machine defaults: {shown_file()} (python -m trainer config shows them; the command line overrides "
              "them)", flush=True)
    scratch = Path(tempfile.mkdtemp(prefix="trainer-launch-"))  # the launcher's bookkeeping (hang reports)
    os.environ[SCRIPT_ENV] = json.dumps([str(script.resolve()), *args])
    keep = False
    try:
        from trainer.entry.run import script as script_entry

        run(cfg, scratch, entry=script_entry)
    except WorkerFailed as e:
        keep = e.exitcode == HangDetected.exit_code  # (its paragraph names the ranks' stacks file in `scratch`)
        raise
    finally:
        os.environ.pop(SCRIPT_ENV, None)
        if not keep:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


def launch_parts(argv: list[str]):
    """`launch`'s arguments: the overrides' config (composed and checked), the script, the script's arguments."""
    from trainer.config.compose import load, prepare
    from trainer.errors import ConfigError

    usage = LAUNCH_USAGE
    py = next((i for i, a in enumerate(argv) if a.endswith(".py") and not a.startswith("-")), None)
    if py is not None and any(a.startswith("-") for a in argv[:py]):  # accelerate launch --num_processes 2 ...
        from trainer.config.flags import refuse_foreign_flags

        refuse_foreign_flags(argv[:py], command=("launch",), after=tuple(argv[py:]))
    at = next((i for i, a in enumerate(argv) if "=" not in a or a.startswith("-")), None)
    if at is None:
        raise ConfigError(f"usage: {usage} (no script given).")
    overrides, script, args = argv[:at], Path(argv[at]), argv[at + 1:]
    hydra = [o for o in overrides if o.lstrip("+~").startswith("hydra.")]
    if hydra:  # (it was ignored without a word)
        raise ConfigError(f"python -m trainer launch {hydra[0]}: a launched script has no Hydra run dir of its own, so "
                          "hydra.* settings do nothing there. Give your script the directory it writes to (e.g. "
                          "trainer.Runtime(run_dir=DIR) for metrics, rt.save_state(DIR, step) for checkpoints).")
    if not script.is_file():
        raise ConfigError(f"python -m trainer launch: the script {script} is not a file.{_installed_copy(script)} "
                          f"usage: {usage}")
    try:  # (before any worker starts: each would print the same SyntaxError traceback)
        compile(script.read_bytes(), str(script), "exec")
    except (SyntaxError, ValueError) as e:  # (ValueError: null bytes, a binary file)
        where = f", line {e.lineno}" if getattr(e, "lineno", None) else ""
        raise ConfigError(f"python -m trainer launch: {script} is not a Python script that compiles "
                          f"({getattr(e, 'msg', None) or e}{where}). Fix it, or give the script to run "
                          f"(usage: {usage}).") from None
    except OSError as e:
        raise ConfigError(f"python -m trainer launch: the script {script} cannot be read ({e.strerror or e}).") from None
    ignored = [o for o in overrides if not _read_by_launch(o.split("=", 1)[0].lstrip("+~"))]
    if ignored:  # (they were accepted, and did nothing)
        from trainer.errors import suggest

        key = ignored[0].split("=", 1)[0].lstrip("+~")
        typo = suggest(key, READ_BY_LAUNCH) or _section_of(key, ignored[0])
        raise ConfigError(f"python -m trainer launch {' '.join(ignored)}: a launched script's trainer.Runtime() reads "
                          f"{', '.join(READ_BY_LAUNCH[:-1])} from these overrides, and nothing else, so "
                          f"{'these' if len(ignored) > 1 else 'this'} would do nothing.{typo} Give your script its own "
                          f"settings as its arguments, after it: {usage}.")
    theirs = [a for a in args if "=" in a and not a.startswith("-") and _read_by_launch(a.split("=", 1)[0].lstrip("+~"))]
    if theirs:  # (launch precision=fp32 was meant; the script got it in sys.argv and ran at precision=auto)
        one = len(theirs) == 1
        print(f"note: {' '.join(theirs)} {'comes' if one else 'come'} after the script, so the script gets "
              f"{'it as its own argument' if one else 'them as its own arguments'} (sys.argv) and launch does not: "
              f"launch's overrides go before the script ({usage}).", file=sys.stderr, flush=True)
    return prepare(load(overrides)), script, args


# What trainer.Runtime() takes from `launch`'s overrides (trainer/loop/runtime.py), and debug=, which sets some of them.
READ_BY_LAUNCH = ("world", "precision", "trainer.grad_accum_steps", "trainer.seed", "checkpoint.keep_last", "logger",
                  "debug")


def _refuse_another_runs(run: Path, checkpoint: Path, out_given: bool) -> None:
    """`sample RUN checkpoint=` a checkpoint outside RUN: the task is RUN's and the sample goes under RUN by the
    checkpoint's step, so another model's checkpoint sampled with RUN's task (a traceback, or another run's text
    printed as this one's) and wrote over RUN's own samples/sample_step_N.png. Refused where its model differs from
    RUN's; else taken only with out= (where the sample goes is then the user's)."""
    from omegaconf import OmegaConf

    from trainer.checkpoint.store import run_of_checkpoint
    from trainer.errors import CheckpointError, ConfigError
    from trainer.inference.finished import checked_config, config_yaml

    owner = run_of_checkpoint(checkpoint)  # (RUN/checkpoints/step_N as given: its checkpoints/ may be a link elsewhere)
    if checkpoint.resolve().is_relative_to(run.resolve()) or (owner is not None and owner.resolve() == run.resolve()):
        return
    owner = owner or checkpoint
    try:  # (read by the checkpoint reader's limits: the checkpoint is not verified yet)
        theirs = OmegaConf.to_container(checked_config(checkpoint / "config.yaml", "").get("model"), resolve=True)
        ours = OmegaConf.to_container(config_yaml(run).get("model"), resolve=True)
    except (CheckpointError, ConfigError, ValueError):  # (a damaged or missing config: the load below names it)
        return
    own = f"`python -m trainer sample {owner} checkpoint={checkpoint}`"
    if theirs != ours:
        raise ConfigError(f"checkpoint={checkpoint} is another run's ({owner}), whose model differs from {run}'s, and "
                          f"sample takes {run}'s task: sample it from its own run, {own}. Nothing was written.")
    if not out_given:
        raise ConfigError(f"checkpoint={checkpoint} is another run's ({owner}): its sample would go into {run}/samples "
                          f"as {run}'s own step {checkpoint.name}. Sample it from its own run, {own}, or give "
                          "out=FILE for this run's task's sample of it. Nothing was written.")


def _installed_copy(script: Path) -> str:
    """' This trainer's copy of it is ...' for the README's recipes/... scripts run outside the clone (a pip install
    carries the recipes as the package trainer.recipes), else ''."""
    if script.is_absolute() or script.parts[:1] != ("recipes",):
        return ""
    import trainer.recipes

    copy = Path(trainer.recipes.__file__).parent.joinpath(*script.parts[1:])
    return f" This trainer's copy of it is {copy} (the README's recipes/ paths are a clone's)." if copy.is_file() else ""


def _section_of(key: str, given: str) -> str:
    """' Did you mean world.nproc_per_node=2?' for a setting of a section launch reads, given without the section."""
    from trainer.config.compose import load

    if "." in key:
        return ""
    cfg = load([], targets=False)
    for section in ("world", "trainer", "checkpoint"):
        if key in (cfg.get(section) or {}) and _read_by_launch(f"{section}.{key}"):  # (only what launch reads)
            return f" Did you mean {section}.{given.lstrip('+~')}?"
    return ""


def _read_by_launch(key: str) -> bool:
    return any(key == k or key.startswith((k + ".", k + "/")) for k in READ_BY_LAUNCH)


SCRIPT_ENV = "TRAINER_SCRIPT"  # the script and its arguments, for trainer.entry.run.script on every rank

EVAL_USAGE = ("python -m trainer eval RUN_DIR [checkpoint=latest|best|PATH] [device_map=auto max_memory.cpu=SIZE "
              "offload_dir=DIR] [KEY=VALUE ...]")
SAMPLE_USAGE = ("python -m trainer sample RUN_DIR [checkpoint=latest|best|PATH] [ema=true|false] [out=PATH] "
                "[device_map=auto max_memory.cpu=SIZE offload_dir=DIR show_map=true] [task.KEY=VALUE ...]")
LAUNCH_USAGE = "python -m trainer launch [KEY=VALUE ...] SCRIPT.py [ARGS ...]"


def usage(command: str) -> str | None:
    """The usage line `python -m trainer COMMAND --help` prints (env and check print their own)."""
    from trainer.config.machine import USAGE as CONFIG_USAGE
    from trainer.entry.tuning import USAGE as TUNE_USAGE

    return {"eval": EVAL_USAGE, "sample": SAMPLE_USAGE, "launch": LAUNCH_USAGE, "config": CONFIG_USAGE,
            "tune": TUNE_USAGE}.get(command)


COMMANDS = {"env": env, "check": check, "eval": evaluate, "sample": sample, "config": config, "tune": tune,
            "launch": launch}
