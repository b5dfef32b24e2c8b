"""The command line: Hydra at the edge, turning argv into a prepared config and a call to the launcher.

Every job of the command is composed and checked first (`precheck`), so a mistake is one
paragraph with exit code 2 before Hydra creates a run dir; then `hydra.main` runs the job(s), and
`run_job` records the config and starts training here or in worker processes.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from trainer.config.compose import (
    CONFIG_MODULE,
    check_choices,
    check_config_dir,
    check_read,
    check_top_level_adds,
    explain,
    inert_message,
    prepare,
    resolve,
    search_path,
    sweep_jobs,
)
from trainer.config.targets import check_hydra_hooks
from trainer.errors import (
    ConfigError,
    NonFiniteError,
    StorageError,
    TrainerExit,
    UserError,
    debug_enabled,
    report,
)
from trainer.redaction import override_secrets, redact, scrub, secret_values

COMMANDS = ("env", "check", "eval", "sample", "config", "tune", "launch")  # trainer/entry/commands.py


def precheck(argv: list[str]):
    """Compose and check every job of this command up front, so mistakes end here, before any file is written.
    Returns what they composed (`shortcuts.Precomposed`): the `hydra.mode` and, for one job, the config itself,
    which Hydra's own run then takes instead of composing it again (`shortcuts.precomposed_reused`)."""
    import copy

    from hydra._internal.utils import get_args_parser

    from trainer.config.shortcuts import Precomposed

    args, _ = get_args_parser().parse_known_args(argv)
    known = Precomposed()
    if args.shell_completion:
        return known
    if args.hydra_help:  # (Hydra's own options: it composes without the job's config, so a job's key fails there)
        job = [o for o in args.overrides if not o.lstrip("+~").startswith("hydra")]
        if job:
            raise ConfigError(f"--hydra-help shows Hydra's own options and takes none of the job's overrides "
                              f"({' '.join(job)}): run python -m trainer --hydra-help alone, or --help with them.")
        return known
    if args.help or args.info:  # (they compose the config too: a mistake was Hydra's traceback)
        if args.multirun:  # (Hydra composes the help's one config from a sweep's values: its traceback)
            first = sweep_jobs(args.overrides)[0]
            raise ConfigError(f"{'--help' if args.help else '--info'} shows one job's config, so it does not go with -m "
                              f"(a sweep). Drop -m, with each swept key at one of its values: python -m trainer "
                              f"{'--help' if args.help else '--info'} {' '.join(first)}".rstrip() + ".")
        compose_with_hydra(args.overrides, args.config_dir)
        return known
    if args.resolve and not args.cfg:  # (Hydra's own refusal was a ValueError traceback, exit 1)
        raise ConfigError("--resolve resolves the interpolations of the config that --cfg prints, so it goes with --cfg "
                          f"(or --help): python -m trainer --cfg job --resolve {' '.join(args.overrides)}".rstrip())
    if args.config_dir is not None:
        check_config_dir(Path(args.config_dir).expanduser(), args.config_dir)
    if args.multirun and args.cfg:  # (Hydra's own refusal was a traceback)
        first = sweep_jobs(args.overrides)[0]  # (each swept key at its first value, as Hydra parses them)
        raise ConfigError(f"--cfg {args.cfg} shows one job's config, so it does not go with -m (a sweep). Drop -m to "
                          "see a point's config, with each swept key at one of its values (python -m trainer --cfg "
                          f"{args.cfg} {' '.join(first)}).")
    if args.multirun:
        given = next((o for o in args.overrides if o.lstrip("+~").startswith("hydra.run.dir=")), None)
        if given is not None:  # (Hydra would pass over it in silence and write under multirun/DATE/TIME)
            raise ConfigError(f"{given} is not used by a sweep (-m): each point runs in hydra.sweep.dir/"
                              "hydra.sweep.subdir (multirun/DATE/TIME/N by default). Pass hydra.sweep.dir=DIR instead "
                              "(its points go to DIR/0, DIR/1, ...).")
    jobs = sweep_jobs(args.overrides) if args.multirun else [args.overrides]
    inert = []  # (a sweep's points that do not read an ema.* setting given: the EMA off there)
    shared = []  # (each point's logger.tensorboard.dir, where it is one fixed path)
    try:
        for point, overrides in enumerate(jobs):
            cfg, sources = compose_with_hydra(overrides, args.config_dir, sources=True)
            known.mode = cfg.hydra.mode
            known.launcher = str(OmegaConf.select(cfg, "hydra.launcher._target_", default="") or "")
            if not args.multirun:  # (a sweep's jobs are composed by its sweeper, from other overrides)
                known.overrides, known.config = list(overrides), copy.deepcopy(cfg)
                known.sources, known.cwd = sources, os.getcwd()
            check_hydra_hooks(cfg)  # what Hydra itself builds before the job: callbacks, logging, env_set
            check_choices(cfg, overrides, args.config_dir)  # precision=bf16 that a recipe's inline node hides
            inert.append(check_read(cfg, overrides, sweep=args.multirun))  # ema.decay=0.99 with the EMA off
            check_top_level_adds(cfg, overrides)  # +lr=1e-3, which nothing reads
            if not args.cfg:
                check_output_dir(cfg, args.multirun)  # Hydra makes it before the job: a traceback there
                check_logger_dirs(cfg)  # (found once the run dir was set up: an earlier run's files moved aside)
                shared.append(_tensorboard_dir(cfg))
                check_launcher(cfg, args.multirun)
            with hydra_config_of(cfg):  # (${hydra:job.name} in a tracker's name: resolved as the job resolves it)
                with open_dict(cfg):
                    del cfg["hydra"]  # now the config `compose` gives
                # `--cfg job` prints without running: check values, but import nothing (no torch).
                prepare(cfg, targets=not args.cfg)
            if not args.cfg:
                from trainer.config.schema import refuse_one_process_on_nodes

                refuse_one_process_on_nodes(cfg.world)
                if args.multirun and "slurm" not in known.launcher.lower():  # (a cluster's nodes see other files)
                    _check_data_path(cfg, point, len(jobs))
        fixed = next((d for d in shared if d is not None and shared.count(d) > 1), None)
        if fixed is not None:  # (the second point was refused once the first had run: "holds the run .../0")
            raise ConfigError(f"logger.tensorboard.dir={fixed} is one dir for {shared.count(fixed)} points of this sweep: "
                              "TensorBoard shows a dir as one run, so the second point would be refused after the "
                              "first had run. Give each point a dir of its own: "
                              f"'logger.tensorboard.dir={fixed}/${{hydra:job.num}}'. Nothing was run.")
        unread = [given for given in inert if given]
        if unread and len(unread) == len(inert):
            raise ConfigError(inert_message(unread[0], " in every point of the sweep"))
        if unread:
            verb = "do" if len(unread[0]) > 1 else "does"
            print(f"note: {', '.join(unread[0])} {verb} nothing in {len(unread)} of the sweep's {len(inert)} points, "
                  "those with the EMA off (ema.enabled=false).", file=sys.stderr, flush=True)
    except UserError as err:
        # A message quotes config values, and those may come from the environment's secrets.
        err.args = (scrub(str(err), secret_values()),)
        raise
    return known


# The shipped datasets that read the local files data.path names (trainer/data/files.py).
_READS_FILES = ("trainer.recipes.lm.data.text_file", "trainer.recipes.lm.data.text_stream",
                "trainer.recipes.lm.data.hf_text")


def _check_data_path(cfg, point: int, points: int) -> None:
    """A sweep point's data.path that does not exist, found before the first point runs: each point's datasets are
    built when it starts, so a later point's missing file stopped the sweep after the points before it had run."""
    import glob

    from trainer.errors import DataError

    data = cfg.get("data") or {}
    path = data.get("path") if data.get("_target_") in _READS_FILES else None
    if isinstance(path, str) and path.strip() and not glob.has_magic(path) \
            and not os.path.exists(os.path.expanduser(path)):
        raise DataError(f"data.path={path!r} does not exist (point {point} of the sweep's {points}): nothing was "
                        "run. Point data.path at a readable file, a directory of them or a glob pattern.")


@contextlib.contextmanager
def hydra_config_of(cfg: DictConfig) -> Iterator[None]:
    """Hydra's `${hydra:...}` resolver reading `cfg`'s hydra node, as it reads the job's inside the job: checked
    before the job, a tracker's `name: ${hydra:job.name}` was "HydraConfig was not set", exit 2."""
    import copy

    from hydra.core.hydra_config import HydraConfig

    config, before = HydraConfig.instance(), HydraConfig.instance().cfg
    config.set_config(copy.deepcopy(cfg))
    try:
        yield
    finally:
        config.cfg = before


def check_launcher(cfg: DictConfig, multirun: bool) -> None:
    """A SLURM launcher where there is no SLURM: submitit's `Could not detect "srun"` traceback, after the sweep
    dir was made."""
    import shutil

    target = str(OmegaConf.select(cfg, "hydra.launcher._target_", default="") or "")
    if not (multirun and target.endswith(".SlurmLauncher")):
        return
    missing = [c for c in ("sbatch", "srun") if shutil.which(c) is None]  # (submitit checks for srun itself)
    if missing:
        raise ConfigError(f"hydra/launcher=submitit_slurm submits each point with sbatch and srun, and this machine "
                          f"has no {' or '.join(missing)} (no SLURM here): run the sweep on the cluster's login node, "
                          "or try it on this machine with hydra/launcher=submitit_local (the same jobs, run here).")


def check_output_dir(cfg: DictConfig, multirun: bool) -> None:
    """The run (or sweep) dir Hydra is about to make can be made: the first part of its path that exists is a
    directory this process can write. (A file in the way, or a read-only place, was a traceback from Hydra.)"""
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    try:
        text = str(OmegaConf.select(cfg, key, throw_on_missing=True))
    except Exception:  # (an interpolation only Hydra's runtime resolves: left to it)
        return
    from trainer.entry.rundir import refuse_as_run_dir
    from trainer.io import unwritable

    refuse_as_run_dir(text, key, f"leave {key} out for a new dated one")
    why = unwritable(Path(text))
    if why:
        raise ConfigError(f"{key}={text} cannot be made: {why}. Choose another with {key}=DIR (or outputs=DIR for "
                          "the default run dirs).")


def check_logger_dirs(cfg: DictConfig) -> None:
    """A tracker's own directory (`logger.tensorboard.dir`, `logger.wandb.dir`) can be made and written. A file in
    its place was a traceback after the run had started: a finished run's checkpoints and export already moved to
    .prev, and nothing trained in their place."""
    from trainer.io import unwritable

    for name, node in (cfg.get("logger") or {}).items():
        try:
            given = OmegaConf.select(node, "dir", throw_on_missing=True) if isinstance(node, DictConfig) else None
        except Exception:  # (an interpolation only Hydra's runtime resolves: left to the tracker)
            continue
        if given is None:
            continue
        path = Path(str(given)).expanduser()
        why = "it is empty: it would be the current directory" if not str(given).strip() else unwritable(path)
        if not why and (path / "run_info.json").is_file() and not _is_this_run(path, cfg):
            why = (f"it is another run's dir ({path / 'run_info.json'} is there): this run's tracker files would mix "
                   "with that run's files")
        if why:
            raise ConfigError(f"logger.{name}.dir={given} cannot be used: {why}. Give the tracker a directory of its "
                              f"own that it can write (logger.{name}.dir=DIR), or leave it out to write inside the run dir. "
                              "Nothing was written.")


def _tensorboard_dir(cfg: DictConfig) -> str | None:
    """A run's logger.tensorboard.dir where it is a fixed path (not one per job: `${hydra:job.num}`), else None."""
    node = (cfg.get("logger") or {}).get("tensorboard")
    if not isinstance(node, DictConfig) or "${hydra:" in str(OmegaConf.to_container(node).get("dir")):
        return None  # (Hydra's job resolves it, one per job; here its job.num is not the point's yet)
    try:
        given = OmegaConf.select(node, "dir", throw_on_missing=True)
    except Exception:  # noqa: BLE001 - (another interpolation a check cannot resolve: left to the tracker's own)
        return None
    return None if given is None else str(Path(str(given)).expanduser().resolve())


def _is_this_run(path: Path, cfg: DictConfig) -> bool:
    """Whether `path` may be the dir this (single) run will run in: the dir of its own earlier attempt."""
    try:
        run_dir = OmegaConf.select(cfg, "hydra.run.dir", throw_on_missing=True)
    except Exception:  # noqa: BLE001 - (`${hydra:job.name}`, which only Hydra's job resolves: it may be, so no refusal)
        return True
    return run_dir is not None and Path(str(run_dir)).expanduser().resolve() == path.resolve()


def check_weights_outside(cfg: DictConfig, run_dir: Path) -> None:
    """finetune.weights in the run's own dir: its export would replace the weights it starts from (and that its
    checkpoints record), so neither eval nor a resume could rebuild what it trained on."""
    weights = (cfg.get("finetune") or {}).get("weights")
    if weights is None:
        return
    source, here = Path(str(weights)).expanduser().resolve(), run_dir.resolve()
    if source == here or here in source.parents:
        raise ConfigError(f"finetune.weights={weights} is in this run's own dir ({run_dir}): the run's export would "
                          "replace the weights it starts from, and its checkpoints could then not be resumed or "
                          "evaluated. Give the new run a dir of its own (hydra.run.dir=DIR).")


def compose_with_hydra(overrides: list[str], config_dir: str | None, sources: bool = False):
    """`config.compose.load`'s config with the `hydra` node kept (callbacks, logging, env_set), so that the
    config trust model can check Hydra's hooks before Hydra runs them. Errors are explained as by `load`.
    With `sources`, also the config sources it was composed from (`shortcuts.config_sources`)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from trainer.config.shortcuts import config_sources

    full = [*overrides, *search_path(config_dir)]
    try:
        with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
            cfg = hydra_compose("config", overrides=full, return_hydra_config=True)
            return (cfg, config_sources(GlobalHydra.instance().config_loader())) if sources else cfg
    except (Exception, OmegaConfBaseException) as exc:  # hydra raises several unrelated types
        raise explain(exc, overrides, config_dir) from exc


# -- recording the config ------------------------------------------------------------------------
def scrub_hydra_files(run_dir: Path, secrets: set[str], files: list[Path] | None = None) -> None:
    """Hydra records the command line in .hydra/ (and a sweep's in its dir's multirun.yaml, `files`); take secrets
    given there back out."""
    from trainer.io import atomic_write_text

    for f in (files if files is not None else (run_dir / ".hydra").glob("*.yaml")) if secrets else ():
        if not f.is_file():
            continue
        text = f.read_text()
        clean = scrub(text, secrets)
        if clean != text:
            atomic_write_text(f, clean)


_HYDRA_RECORDS: list[tuple[Path, str]] | None = None  # the .hydra/ files of the job Hydra is starting, unwritten


@contextlib.contextmanager
def hydra_records_deferred() -> Iterator[None]:
    """Hydra writes .hydra/config.yaml, hydra.yaml and overrides.yaml into the run dir it starts a job in, before
    the job runs: into another job's dir when two start in the same second (overwriting that job's records, with
    this job's secrets in them). Within this block Hydra's writes are kept instead, and the job writes them,
    scrubbed and atomically, into the run dir it owns (`write_hydra_records`). Hydra's own path where its
    internals differ."""
    import hydra.core.utils as hydra_utils

    global _HYDRA_RECORDS
    original = getattr(hydra_utils, "_save_config", None)
    if original is None:
        yield
        return

    def keep(cfg: Any, filename: str, output_dir: Path) -> None:
        _HYDRA_RECORDS.append((Path(output_dir) / filename, OmegaConf.to_yaml(cfg)))

    hydra_utils._save_config, _HYDRA_RECORDS = keep, []
    try:
        yield
    finally:
        hydra_utils._save_config, _HYDRA_RECORDS = original, None


def take_hydra_records() -> list[tuple[Path, str]] | None:
    """The records Hydra kept for the job now starting (each job of a sweep takes its own); None where Hydra
    wrote them itself."""
    if _HYDRA_RECORDS is None:
        return None
    records = list(_HYDRA_RECORDS)
    _HYDRA_RECORDS.clear()
    return records


def write_hydra_records(records: list[tuple[Path, str]], hydra_dir: Path, run_dir: Path, secrets: set[str]) -> None:
    """Hydra's records of this job, at their place under `run_dir` (Hydra meant them for `hydra_dir`)."""
    from trainer.io import atomic_write_text

    for path, text in records:
        target = run_dir / path.relative_to(hydra_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(target, scrub(text, secrets))


# -- the Hydra task ----------------------------------------------------------------------------------
# A line a point run by submitit ends its error stream with, saying its exit code (submitit keeps only the stream).
_SUBMITIT_EXIT = re.compile(r"^\(exit (\d+)\)$")


def run_job(cfg: DictConfig) -> float | None:
    """Hydra's task function: record the (already checked) config, then train here or launch workers."""
    from hydra.core.hydra_config import HydraConfig

    try:
        return _run_job(cfg)
    except SystemExit as e:
        if e.code not in (0, None) and "submitit" in str(HydraConfig.get().launcher.get("_target_", "")):
            print(f"(exit {e.code if isinstance(e.code, int) else 1})", file=sys.stderr, flush=True)
        raise


def submitit_failures_as_exits() -> None:
    """A sweep's point that a submitit launcher ran and that failed: its own paragraph and exit code, as under the
    basic launcher. Submitit raised UncompletedJobError in this process with the job's error stream inside, and
    Hydra printed it as a traceback (exit 1: a NaN's 3 and a preemption's 75 were lost)."""
    try:
        from submitit.core import core, utils
    except ImportError:
        return
    results = core.Job.results
    if getattr(results, "trainer_exits", False):
        return

    def reported(self):
        try:
            return results(self)
        except utils.UncompletedJobError as e:
            stream = str(e).split("Error stream produced:", 1)[-1]
            lines = [line for line in stream.splitlines()
                     if line.strip() and not line.startswith(("submitit ", "-" * 10))]
            codes = [int(m.group(1)) for line in lines if (m := _SUBMITIT_EXIT.match(line.strip()))]
            print("\n".join(line for line in lines if not _SUBMITIT_EXIT.match(line.strip())), file=sys.stderr)
            print(f"(the point ran as submitit job {self.job_id}; its logs are in {Path(self.paths.stderr).parent})",
                  file=sys.stderr, flush=True)
            raise SystemExit(codes[-1] if codes else 1) from None

    reported.trainer_exits = True
    core.Job.results = reported


def _run_job(cfg: DictConfig) -> float | None:
    import json

    from hydra.core.hydra_config import HydraConfig

    from trainer.entry.rundir import (
        JOB_OVERRIDES_ENV,
        continue_command,
        find_run_to_continue,
        is_finished,
        nearest_other_run,
        unfinished_runs,
    )

    hc = HydraConfig.get()
    run_dir, lock, started, records_after = Path(hc.runtime.output_dir), None, False, None
    try:
        from trainer.parallel.precision import resolve_auto

        # precision=auto is decided once, here, before any worker starts; config.yaml records the choice.
        resolved, chosen = resolve_auto(resolve(cfg))
        if chosen:
            print(chosen, flush=True)
        chosen = _chose_run_dir(hc)
        if resolved.get("resume") == "auto" and not chosen:
            # The default run dir is new at every start: continue the newest unfinished run with this config.
            runs = unfinished_runs(run_dir, trainer=OmegaConf.to_container(resolved.trainer))  # (read once: for the
            found = find_run_to_continue(run_dir, redact(OmegaConf.to_container(resolved)), runs=runs)  # run, or a note)
            if found is not None:
                root = found.parent.parent
                how = (f"run under {root} with this config, which finished short of this job's trainer.max_steps (or "
                       "max_epochs)") if is_finished(found) else f"unfinished run under {root} with this config"
                print(f"resume=auto: continuing {found}, the newest {how} (pass hydra.run.dir=DIR to choose another).",
                      flush=True)
                if found != run_dir:  # (the same dir: an earlier job of the same second stopped in it)
                    _remove_if_free(run_dir)  # this job's fresh timestamped dir (another job's of the same second stays)
                run_dir, chosen = found, True  # (resume=auto chose it: continue it, never a sibling)
            elif str(hc.mode) != "RunMode.MULTIRUN":  # (a sweep's points are found by sweep_point_dir, below)
                other = nearest_other_run(runs, redact(OmegaConf.to_container(resolved)))
                if other:
                    print(scrub(other, secret_values(OmegaConf.to_container(resolved))), flush=True)
        if resolved.get("resume") == "auto" and str(hc.mode) == "RunMode.MULTIRUN":
            from trainer.entry.rundir import sweep_overrides, sweep_point_dir

            # A sweep rerun with its values in another order (or new ones in front): each point continues its own
            # run, not the one its job number had (which would continue another point's checkpoints as its own).
            point = sweep_point_dir(run_dir, list(hc.overrides.task), sweep_overrides() or sys.argv[1:],
                                    redact(OmegaConf.to_container(resolved)))
            if point != run_dir:
                secrets = secret_values(OmegaConf.to_container(resolved))
                this = f"this point ({' '.join(hc.overrides.task)})"
                if _earlier_job_in(run_dir):
                    print(scrub(f"resume=auto: {run_dir} holds another point of the sweep; {this} continues in "
                                f"{point}.", secrets), flush=True)
                else:  # (a dir Hydra made for this job, empty: not left behind)
                    print(scrub(f"resume=auto: {this} continues its run in {point}.", secrets), flush=True)
                    _remove_if_free(run_dir)
                run_dir = point
        check_weights_outside(resolved, run_dir)
        from trainer.entry.launcher import launch_topology

        topology = launch_topology(resolved.world, say=print)  # world's launch keys, typed once for this job
        records = take_hydra_records()
        run_dir, lock = _own_run_dir(run_dir, topology, chosen=chosen, hydra_wrote=records is None)
        secrets, hydra_dir = secret_values(OmegaConf.to_container(resolved)), Path(hc.runtime.output_dir)
        secrets |= override_secrets(sys.argv[1:])  # (+hydra.job.env_set.WANDB_API_KEY=... is in no job config)
        if str(hc.mode) == "RunMode.MULTIRUN":  # the sweep's own record of its command line and config
            scrub_hydra_files(run_dir, secrets, files=[Path(hc.sweep.dir) / "multirun.yaml"])
        if records is None and hydra_dir != run_dir:
            # Hydra recorded this job's command line in .hydra/ of the dir it started in, which this job left
            # (another job's of the same second, or a run resume=auto continues elsewhere): no secret stays there.
            scrub_hydra_files(hydra_dir, secrets)
        if lock.held:  # (the launchers of nodes other than 0 leave the records to node 0's)
            if records is None:  # (Hydra wrote them itself: its internals differ from what main expects)
                scrub_hydra_files(run_dir, secrets)
            elif (run_dir / "config.yaml").exists():
                # An earlier job's records: they stay until this job's resume is accepted (a refused job, say for a
                # changed model, must leave the record of what ran). Training writes config.yaml once it is; the
                # rest follow when this job ends (`finally`, below) if it did.
                records_after = _after_resume(records, hydra_dir, run_dir, secrets)
            else:
                write_hydra_records(records, hydra_dir, run_dir, secrets)
            if records_after is None:
                from trainer.entry.run import save_config

                save_config(resolved, run_dir)
        from trainer.config.machine import defaults_file, shown_file

        if defaults_file().is_file():  # (composed into this config by conf/config.yaml's defaults list)
            print(f"machine defaults: {shown_file()} (python -m trainer config shows them; the command line "
                  "overrides them)", flush=True)
        print(f"run dir: {run_dir}", flush=True)
        from trainer.entry.launcher import WorkerFailed, run

        started = True
        try:
            os.environ[JOB_OVERRIDES_ENV] = json.dumps(list(hc.overrides.task))  # (run_info.json records them)
            final = run(resolved, run_dir, topology=topology)
        except WorkerFailed as wf:
            code = wf.report()
            _say_what_the_sweep_skips()
            if wf.exitcode in (1, UserError.exit_code, StorageError.exit_code) and lock is not None and lock.held:
                remove_if_unused(run_dir)  # a mistake, a crash (or a full disk) before training: the dir goes if it holds
            if wf.exitcode not in (UserError.exit_code, NonFiniteError.exit_code):  # only its records
                _say_how_to_continue(run_dir, continue_command(run_dir))  # (rerunning would not help those)
            sys.exit(code)
        except Exception as e:
            # A crash in code of one's own (a forward, a dataset, a collate_fn) before the first step: its traceback
            # is the user's to read, and the dir goes as a refused run's does if it holds only its start's records.
            if not isinstance(e, TrainerExit) and lock is not None and lock.held:
                remove_if_unused(run_dir)
            raise
        except KeyboardInterrupt:
            print("interrupted: stopped all processes.", file=sys.stderr, flush=True)
            _say_what_the_sweep_skips()
            _say_how_to_continue(run_dir, continue_command(run_dir))
            sys.exit(130)
        print(f"done: {run_dir}", flush=True)
    except TrainerExit as err:
        if debug_enabled():
            raise
        report(err)
        if started:
            _say_what_the_sweep_skips()
        if isinstance(err, UserError):
            if lock is not None and lock.held:  # never a run dir another job holds (or shares, on other nodes)
                remove_if_unused(run_dir)
        elif started and not isinstance(err, NonFiniteError):  # preempted, disk full (a NaN would come back)
            from trainer.entry.launcher import RendezvousFailed

            if isinstance(err, StorageError) and lock is not None and lock.held:  # (a full disk before the first
                remove_if_unused(run_dir)                                          # step: only records there)

            if isinstance(err, RendezvousFailed) and lock is not None and lock.held:  # the nodes never met: a new
                remove_if_unused(run_dir)                                              # run's dir holds only records
            elif isinstance(err, RendezvousFailed):  # another node's launcher, which writes nothing there: the empty
                with contextlib.suppress(OSError):  # dir Hydra made goes (not one node 0 has written into, sharing it)
                    run_dir.rmdir()
            _say_how_to_continue(run_dir, continue_command(run_dir))
        sys.exit(err.exit_code)
    except OSError as e:
        if started or debug_enabled():  # (in training: a crash, reported as one below would be)
            if started:
                _say_how_to_continue(run_dir, continue_command(run_dir))
            raise
        # Setting the run dir up (its lock, the config and Hydra's records): a full disk, a read-only place.
        from trainer.entry.run import setup_failed

        err = setup_failed(run_dir, e, "run the same command again (or give it another dir: hydra.run.dir=DIR)")
        report(err)
        sys.exit(err.exit_code)
    except Exception:
        if started:  # a crash: say how to continue from the newest checkpoint, then the traceback (Hydra records a
            _say_how_to_continue(run_dir, continue_command(run_dir))  # sweep point's crash and runs the next point)
        raise
    finally:
        os.environ.pop(JOB_OVERRIDES_ENV, None)  # (the next job of a sweep in this process sets its own)
        if records_after is not None:
            records_after()
        if lock is not None:
            lock.release()
    return (final or {}).get("val/loss")


def _after_resume(records, hydra_dir: Path, run_dir: Path, secrets: set[str]):
    """A function that writes this job's Hydra records into `run_dir` if training rewrote config.yaml since now (it
    does so once the resume is accepted, with an atomic rename: a new inode)."""
    def identity() -> tuple[int, int] | None:
        try:
            st = (run_dir / "config.yaml").stat()
            return st.st_ino, st.st_mtime_ns
        except OSError:
            return None

    before = identity()

    def write() -> None:
        if identity() not in (before, None):  # (None: the run dir was removed, a run that failed before it trained)
            try:
                write_hydra_records(records, hydra_dir, run_dir, secrets)
            except OSError as e:  # (never in place of what ended the job)
                print(f"warning: could not write this job's .hydra/ records into {run_dir} ({e.strerror or e}).",
                      file=sys.stderr, flush=True)
    return write


def _own_run_dir(run_dir: Path, w, chosen: bool, hydra_wrote: bool = True):
    """The run dir this job may write, and its lock (see trainer/runlock.py). One job per run dir, one lock per
    job: on several nodes the launcher of node 0 takes it for the job, and the others check that the lock they
    find is their job's. Two jobs started in the same second share a default (timestamped) run dir: the later
    one moves to `<dir>-2` (then -3, ...) instead of stopping, since nobody chose that dir; so does a job whose
    default dir holds an earlier job's records (one of the same second that ended or was killed)."""
    import shutil

    from trainer.errors import ConfigError
    from trainer.runlock import RunDirLock

    if w.nnodes > 1:  # (w: world's launch keys, LaunchConfig)
        lock = RunDirLock(run_dir, job=f"rdzv={w.rdzv_endpoint}")
        if w.node_rank != 0:
            lock.check_same_job()
            return run_dir, lock
        return run_dir, lock.acquire()
    if chosen or not _earlier_job_in(run_dir):
        try:
            return run_dir, RunDirLock(run_dir).acquire()
        except ConfigError:
            if chosen:
                raise
    for n in range(2, 100):
        other = run_dir.with_name(f"{run_dir.name}-{n}")
        try:
            other.mkdir(parents=True)  # exclusive: a third job of the same second takes the next number
        except FileExistsError:
            continue
        if hydra_wrote and (run_dir / ".hydra").is_dir():  # (Hydra's records of this job: else they were kept)
            shutil.copytree(run_dir / ".hydra", other / ".hydra")
        print(f"note: {run_dir} is in use by another job started in the same second; this job runs in {other}.",
              flush=True)
        return other, RunDirLock(other).acquire()
    raise ConfigError(f"run dir {run_dir} and 98 numbered siblings are in use; pass hydra.run.dir=DIR.")


def _earlier_job_in(run_dir: Path) -> bool:
    """Whether a default run dir holds what an earlier job of the same second recorded (one that ended, or was
    killed): this job must not write over it, nor finish it as its own run (resume=auto would lose it)."""
    return any((run_dir / name).exists() for name in ("config.yaml", "checkpoints", "metrics.jsonl"))


def _remove_if_free(run_dir: Path) -> None:
    """`remove_if_unused`, unless another job holds the run dir (a job started in the same second shares it)."""
    from trainer.errors import ConfigError
    from trainer.runlock import RunDirLock

    try:
        lock = RunDirLock(run_dir).acquire()
    except ConfigError:
        return
    try:
        remove_if_unused(run_dir)
    finally:
        lock.release()


def _chose_run_dir(hc) -> bool:
    """Whether the user named the run dir (hydra.run.dir=..., or a sweep's dir) rather than the default's timestamp."""
    chosen = [o.split("=", 1)[0].lstrip("+~") for o in hc.overrides.hydra]
    return "hydra.run.dir" in chosen or str(hc.mode) == "RunMode.MULTIRUN"


def _say_what_the_sweep_skips() -> None:
    """A sweep point that stops with an exit code (a refusal, a NaN, an interruption) ends the sweep (Hydra's basic
    launcher runs the points in turn, in this process): the points after it never run, and nothing said so. (A crash,
    an exception, is one Hydra records and goes on from.)"""
    from trainer.entry.rundir import sweep_points_after

    after = sweep_points_after()
    if after:
        print(f"note: the sweep ends at this point, as Hydra's launcher ends a sweep at a failed point; the "
              f"{len(after)} after it did not run: {'; '.join(after)}.", file=sys.stderr, flush=True)


def _say_how_to_continue(run_dir: Path, command: str) -> None:
    """After an interruption: the exact command that continues the run (if it has a checkpoint to continue from)."""
    from trainer.checkpoint.store import has_complete

    if has_complete(run_dir / "checkpoints"):
        from trainer.entry.rundir import sweep_command

        sweep = sweep_command()
        if sweep is not None:  # (a sweep's points after this one never ran: the sweep goes on, in its own dir)
            print("to continue this sweep (this point, then the points after it; the same command without "
                  f"hydra.sweep.dir would start every point anew): {scrub(sweep, secret_values())}",
                  file=sys.stderr, flush=True)
        else:
            print(f"to continue this run: {scrub(command, secret_values())}", file=sys.stderr, flush=True)


def remove_if_unused(run_dir: Path) -> None:
    """A run that failed before it trained leaves no run dir behind (but never touches earlier results: the
    dir goes only if it holds nothing but the records of this attempt's start)."""
    from trainer import runlock

    runlock.remove_if_unused(run_dir, {".hydra", ".lock", "config.yaml", "run_info.json",
                                       f"{Path(sys.argv[0]).stem}.log", "cli.log"})


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--version"]:  # (Hydra's own flag printed "Hydra 1.3.8")
        from trainer import __version__
        from trainer.entry.commands import _version

        print(f"trainer {__version__} (torch {_version('torch')}, hydra-core {_version('hydra-core')}; python -m trainer "
              "env gives the rest)")
        sys.exit(0)
    if argv[:1] and argv[0] not in COMMANDS and "=" not in argv[0] and not argv[0].startswith(("-", "~", "+")):
        from trainer.errors import ConfigError, suggest

        hint = suggest(argv[0], COMMANDS)  # (`evl RUN`: "'evl' is not an override" named no command)
        if hint:
            report(ConfigError(f"{argv[0]!r} is neither a command nor an override (KEY=VALUE).{hint} The commands: "
                               f"{', '.join(COMMANDS)}; training takes overrides alone."))
            sys.exit(ConfigError.exit_code)
    if argv[:1] and argv[0] in COMMANDS:
        from trainer.entry import commands

        # `COMMAND --help` (before a launched script's own arguments): its usage, exit 0
        asked = argv[1:next((i for i, a in enumerate(argv) if a.endswith(".py")), len(argv))]
        if commands.usage(argv[0]) and any(a in ("-h", "--help") for a in asked):
            print(f"usage: {commands.usage(argv[0])}")
            sys.exit(0)
        try:
            code = commands.COMMANDS[argv[0]](argv[1:])
        except UserError as err:  # (a command's own mistakes are one paragraph as the training command's are)
            if debug_enabled():
                raise
            report(err)
            code = err.exit_code
        sys.exit(code)
    from trainer.entry.launcher import follow_torchrun_rank0, is_torchrun_follower

    if is_torchrun_follower():
        sys.exit(follow_torchrun_rank0())
    from trainer.loop.preemption import hold_early

    hold_early()  # (a SIGTERM while this command imports and composes: exit 75, as before the first step)
    from trainer.config.flags import flags_first

    argv = flags_first(argv)
    from trainer.config.machine import secrets as machine_secrets
    from trainer.redaction import ScrubbedStream, override_secrets

    secrets = override_secrets(argv) | secret_values() | machine_secrets()
    streams = sys.stdout, sys.stderr
    if secrets:  # (Hydra prints a sweep's job lines, --cfg and --info itself, secrets and all)
        sys.stdout, sys.stderr = ScrubbedStream(sys.stdout, secrets), ScrubbedStream(sys.stderr, secrets)
    try:
        _compose_and_run(argv)
    except KeyboardInterrupt:  # (Ctrl-C while torch imports or Hydra composes: a traceback and exit -2 before)
        if debug_enabled():
            raise
        print("interrupted: stopped before training started.", file=sys.stderr, flush=True)
        sys.exit(130)
    finally:
        sys.stdout, sys.stderr = streams


def _compose_and_run(argv: list[str]) -> None:
    from trainer.config.machine import HOME_ENV, SHOWN_ENV, defaults_file, home_for
    from trainer.config.shortcuts import composing, precomposed_reused

    replaced, filtered = home_for([a for a in argv if not a.startswith("-")])
    if filtered is not None:  # the command line's group choices win over the machine's, keys and all
        os.environ[SHOWN_ENV] = str(defaults_file())
        print(f"machine defaults: {defaults_file()}'s choice of {', '.join(replaced)} is left out, with its settings "
              f"for options the command line does not choose: the command line chooses {', '.join(replaced)} itself.",
              file=sys.stderr, flush=True)  # (--cfg job: YAML alone)
        os.environ[HOME_ENV] = filtered  # (for every composition of this command: Hydra's sweeps too)

    with composing():  # (the command composes several times: each file read once)
        try:
            from trainer.config.flags import refuse_foreign_flags

            refuse_foreign_flags(argv)  # accelerate's --num_processes 2: world=ddp world.nproc_per_node=2
            known = precheck(argv)
            if "submitit" in known.launcher and (str(known.mode) == "RunMode.MULTIRUN" or {"-m", "--multirun"} & set(argv)):
                refuse_pickled_secrets(argv)  # (a sweep's: one run uses no launcher)
        except UserError as err:
            if debug_enabled():
                raise
            report(err)
            sys.exit(err.exit_code)
        import hydra

        if "submitit" in known.launcher:
            submitit_failures_as_exits()
        sys.argv = [sys.argv[0], *argv]
        if str(known.mode) == "RunMode.MULTIRUN" or {"-m", "--multirun"} & set(argv):
            _stop_if_signalled()  # (a sweep's points run one after another, or elsewhere: each holds its own flag)
        try:
            with precomposed_reused(known), hydra_records_deferred():
                hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name="config", version_base="1.3")(run_job)()
        finally:  # (a run took the flag over and answered the signal itself; --cfg and the like took none)
            _stop_if_signalled()


def refuse_pickled_secrets(argv: list[str]) -> None:
    """Under a submitit launcher, each job's overrides and config are pickled into the sweep's .submitit/ (submitit's
    own files, which the framework does not write and cannot redact): a secret given on the command line was kept
    there in clear. Refused before anything is written; the environment passes it to the jobs instead."""
    given = {v for v in override_secrets(argv) if "${" not in v} | {v for v in secret_values() if any(v in a for a in argv)}
    if given:  # (an interpolation, ${oc.env:HF_TOKEN}, is pickled as written and read in the job: allowed)
        keys = sorted({a.split("=", 1)[0].lstrip("+~") for a in argv if any(v in a for v in given)})
        raise ConfigError(f"{', '.join(keys)} on the command line of a submitit sweep: submitit pickles each job's "
                          "overrides and config into the sweep dir's .submitit/ as they are, so the secret would be "
                          "written there in clear. Set it in the environment the jobs inherit instead (export "
                          "HF_TOKEN=...), and on the command line name it, not its value: KEY='${oc.env:HF_TOKEN}' "
                          "(an environment variable such as WANDB_API_KEY needs no key at all).")


def _stop_if_signalled() -> None:
    """The command's early stop flag released (`preemption.hold_early`); the signal it caught, if any, is exit 75."""
    from trainer.errors import Preempted
    from trainer.loop.preemption import release_early

    signum = release_early()
    if signum is not None:
        report(Preempted(f"stopped by {signal.Signals(signum).name} before training started; nothing to save. Rerun "
                         "the same command to start it."))
        sys.exit(Preempted.exit_code)
