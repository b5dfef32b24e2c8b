"""The run directory as a place one job owns: its lock (trainer/runlock.py), finding the run `resume=auto`
continues, and the command line that continues a run.

* Cleanup: a job that fails before training removes the run dir only if it holds the lock and the dir holds
  nothing but the records of its own start (`remove_if_unused`); a job refused by the lock touches nothing.
* `resume=auto` without `hydra.run.dir`: the default run dir is new at every start (a timestamp), so
  there is nothing in it to resume. Then the run to continue is the newest unfinished run under the
  same outputs root (`outputs/*/*/`) whose config equals this job's, but for the settings a resume may
  change (`RESUMABLE`, not the optimizer's and schedule's: `FOUND_ALIKE`) and for what is not a setting
  (`resume`, Hydra's, precision=auto's reason); one with
  every setting of this job's comes before a newer one that differs in those. It is said in one line, and the
  job runs there.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from trainer.checkpoint.settings import comparable, flat, read_config, with_added


def refuse_as_run_dir(text: str, key: str, otherwise: str) -> None:
    """A ConfigError for a path no run may write into (`key` named it): empty (the current directory, among the
    user's own files), a checkpoint of a run, or inside a run's checkpoints dir (which that run prunes and moves
    aside). `otherwise` is the way out besides another dir."""
    from trainer.checkpoint.store import run_of_checkpoint
    from trainer.errors import ConfigError

    if not str(text).strip():  # (Path("") is the current directory: the run's files went among the user's own)
        raise ConfigError(f"{key}={str(text)!r} is empty: it would be the current directory, among your own files. "
                          f"Give the run a directory of its own ({key}=DIR), or {otherwise}.")
    run = run_of_checkpoint(Path(text))
    if run is not None:
        raise ConfigError(f"{key}={text} is a checkpoint of the run {run}: a run there would write over it. To "
                          f"continue that run from it: hydra.run.dir={run} resume={text}; for a new run from its "
                          "weights, another hydra.run.dir with resume=PATH or finetune.weights of a run dir.")
    given = Path(text).expanduser().absolute()
    inside = next((p for p in (given, *given.parents) if p.name in ("checkpoints", "checkpoints.prev") or
                   p.name.startswith("checkpoints.prev-")), None)
    run = inside.parent if inside is not None else None
    if run is not None and (run / "config.yaml").is_file() and any((run / f).is_file() for f in ("metrics.jsonl",
                                                                                              "run_info.json")):
        # (a run's own checkpoints dir, or a dir in it)
        raise ConfigError(f"{key}={text} is inside the checkpoints of the run {run}, which that run manages "
                          "(it prunes them and, at a fresh start, moves them aside, and this run's files with them). "
                          f"Give this run a directory of its own ({key}=DIR).")


# -- which run resume=auto continues (what counts as the same run: trainer/checkpoint/settings.py) ------------
def is_finished(run_dir: Path) -> bool:
    try:
        return (run_dir / "export.json").is_file() and "step" in json.loads((run_dir / "export.json").read_text())
    except (OSError, ValueError):
        return False


def find_run_to_continue(run_dir: Path, config: dict[str, Any], depth: int = 2,
                         runs: list[tuple[Path, dict]] | None = None) -> Path | None:
    """The newest run dir `depth` levels under the outputs root of `run_dir` (outputs/DATE/TIME) with a complete
    checkpoint, not finished (or finished short of this job's length), whose config.yaml equals `config` (as saved: resolved, redacted) but for the
    settings a resume may change. `run_dir` itself is one of them when it qualifies: this job has written nothing
    there yet, so a checkpoint in it is an earlier job's, one that started in the same second and was stopped."""
    want = comparable(config, found=True)
    runs = unfinished_runs(run_dir, depth) if runs is None else runs
    found = [(cand, saved) for cand, saved in runs if comparable(saved, found=True) == want]
    if not found:
        return None
    # Of the runs this job may continue, one with all of its settings (two preempted jobs that differ in their
    # periods or length each continue their own), else the newest.
    every = flat(with_added(_settings(config)))
    return max(found, key=lambda r: (flat(with_added(_settings(r[1]))) == every, r[0].stat().st_mtime))[0]


def _settings(config: dict[str, Any]) -> dict[str, Any]:
    """A config's settings: all but `resume`, Hydra's, loggers' and precision=auto's reason (as changed_settings)."""
    out = {k: v for k, v in config.items() if k not in ("resume", "hydra", "logger")}
    if isinstance(out.get("precision"), dict):
        out["precision"] = {k: v for k, v in out["precision"].items() if k != "reason"}
    return out


def unfinished_runs(run_dir: Path, depth: int = 2, trainer: dict[str, Any] | None = None) -> list[tuple[Path, dict]]:
    """(dir, its config) of each run `depth` levels under the outputs root of `run_dir` with a complete checkpoint,
    not finished, or finished short of this job's length (`trainer`: its trainer section): a finished run's command
    rerun with a larger trainer.max_steps (or max_epochs) and resume=auto started a new run from step 0 beside it."""
    from trainer.checkpoint.store import has_complete  # (torch: not at import, which `--help` pays)

    root = run_dir
    for _ in range(depth):
        root = root.parent
    runs = []
    for cand in root.glob("/".join("*" * depth)):
        if not (cand / "checkpoints").is_dir() or not has_complete(cand / "checkpoints"):
            continue
        saved = read_config(cand / "config.yaml")
        if isinstance(saved, dict) and (not is_finished(cand) or _extends(cand, saved, trainer or {})):
            runs.append((cand, saved))
    return runs


def _extends(run_dir: Path, saved: dict[str, Any], trainer: dict[str, Any]) -> bool:
    """Whether this job's length goes past the step (or the epochs) the finished run at `run_dir` ended at."""
    steps, epochs = trainer.get("max_steps"), trainer.get("max_epochs")
    if isinstance(epochs, int):
        before = (saved.get("trainer") or {}).get("max_epochs")
        return isinstance(before, int) and before < epochs
    try:
        exported = json.loads((run_dir / "export.json").read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return isinstance(steps, int) and isinstance(exported, int) and exported < steps


def nearest_other_run(runs: list[tuple[Path, dict]], config: dict[str, Any]) -> str | None:
    """When resume=auto found no run to continue among `runs` (unfinished_runs'): the newest of them, and the
    settings by which it is another run's (a changed seed or model makes a new run, silently but for this)."""
    if not runs:
        return None
    cand, saved = max(runs, key=lambda r: r[0].stat().st_mtime)
    before, now = comparable(saved, found=True), comparable(config, found=True)
    differ = [f"{k}: {before.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(before) | set(now))
              if before.get(k) != now.get(k)]
    listed = "; ".join(differ[:4]) + (f" (and {len(differ) - 4} more)" if len(differ) > 4 else "")
    what = "run this job could extend" if is_finished(cand) else "unfinished run"  # (finished short of this length)
    return (f"resume=auto: the newest {what} under {cand.parent.parent}, {cand}, has other settings ({listed}), "
            "so this starts a new run. To continue that one instead, rerun with its settings (or with "
            f"hydra.run.dir={cand}, which says which of these a resume may change).")


def continue_command(run_dir: Path, argv: list[str] | None = None) -> str:
    """The command line that continues the run in `run_dir`: this one, pinned to the run dir, resume=auto. A
    sweep's point (`-m`) is continued as one job: its own overrides, the swept keys at its values (a sweep's
    command ignores hydra.run.dir, and would run every point again)."""
    point = sweep_point()
    argv = point if point is not None else sys.argv[1:] if argv is None else argv
    kept = [a for a in argv if not a.lstrip("+~").startswith(("resume=", "hydra.run.dir="))]
    return shlex.join(["python", "-m", "trainer", *kept, f"hydra.run.dir={hydra_quoted(str(run_dir))}", "resume=auto"])


def sweep_point() -> list[str] | None:
    """A sweep job's own command line, None outside one: its --config-dir, its hydra.job.* overrides (env_set, ...)
    and its overrides, each swept key at this point's value. Read from Hydra's record of the job, not sys.argv: a
    sweep through a launcher (submitit) runs its jobs under the launcher's own command line."""
    hc = _sweep_job()
    if hc is None:
        return None
    job = [o for o in hc.overrides.hydra if o.lstrip("+~").startswith("hydra.job.")]
    return [*_config_dirs(hc), *job, *hc.overrides.task]


def _sweep_job():
    """Hydra's record of this job when it is a sweep's point (`-m`), else None."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    return HydraConfig.get()


def _config_dirs(hc) -> list[str]:
    """The job's --config-dir flags, as its command line gave them."""
    dirs = [s.path for s in hc.runtime.config_sources if s.provider == "command-line" and s.schema == "file"]
    return [a for d in dirs for a in ("--config-dir", d)]


def sweep_command() -> str | None:
    """The command that continues a whole sweep (`-m`) from one of its jobs, None outside one or when the sweep's
    record cannot be read: the sweep's own overrides (its lists) as `multirun.yaml` in its sweep dir records them,
    pinned to that sweep dir, with resume=auto. Its finished points then say so, the stopped one continues and
    the points after it run; the same command without the sweep dir would start every point anew in a new one."""
    import yaml

    hc = _sweep_job()
    if hc is None:
        return None
    sweep_dir = Path(hc.runtime.cwd) / hc.sweep.dir
    try:
        recorded = yaml.safe_load((sweep_dir / "multirun.yaml").read_text())["hydra"]["overrides"]
        task, hydra = list(recorded["task"] or []), list(recorded["hydra"] or [])
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None
    if not all(isinstance(o, str) for o in [*task, *hydra]):
        return None
    mine = ("hydra.mode=", "hydra.sweep.dir=", "hydra.run.dir=")
    return shlex.join(["python", "-m", "trainer", "-m", *_config_dirs(hc),
                       *(o for o in hydra if not o.lstrip("+~").startswith(mine)),
                       *(o for o in task if not o.lstrip("+~").startswith("resume=")),
                       f"hydra.sweep.dir={hydra_quoted(str(sweep_dir.resolve()))}", "resume=auto"])


def sweep_points_after() -> list[str] | None:
    """The overrides of the sweep's points after this job's, each as one string, where Hydra's basic sweeper and
    launcher run them in turn in this process (a failed point ends the sweep there, so they never run); None outside
    such a sweep or when its record cannot be read. Split as the basic sweeper splits them, from `multirun.yaml`."""
    hc = _sweep_job()
    if hc is None or not str(hc.launcher._target_).endswith("BasicLauncher") \
            or not str(hc.sweeper._target_).endswith("BasicSweeper"):
        return None
    try:
        import yaml
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser

        recorded = yaml.safe_load((Path(hc.runtime.cwd) / hc.sweep.dir / "multirun.yaml").read_text())["hydra"]
        params = [f"{k}={v}" for k, v in (recorded["sweeper"].get("params") or {}).items()]
        overrides = OverridesParser.create().parse_overrides([*params, *(recorded["overrides"]["task"] or [])])
        points = [" ".join(p) for batch in BasicSweeper.split_arguments(overrides, None) for p in batch]
    except Exception:  # noqa: BLE001  (a note after a failure: never a second error in its place)
        return None
    return points[int(hc.job.num) + 1:]


def hydra_quoted(value: str) -> str:
    """`value` as an override's value Hydra reads back unchanged: as it is when it holds only characters Hydra's
    grammar takes bare, else single-quoted (a path with a space, quote, comma, `~` or a non-ASCII letter would not
    parse, or would sweep). Inside quotes Hydra unescapes only the backslashes before a quote or at the end; a
    `${` is escaped for OmegaConf, which would read it as an interpolation."""
    if re.fullmatch(r"[A-Za-z0-9_/.:@+%-]+", value):
        return value
    escaped = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value).replace("${", "\\${")
    return "'" + re.sub(r"(\\+)$", lambda m: m.group(1) * 2, escaped) + "'"


# -- a sweep continued with resume=auto: each point finds its own run ---------------------------------------------
def sweep_overrides() -> list[str] | None:
    """The sweep's own overrides (its lists, and its sweeper's params), as `multirun.yaml` in its sweep dir records
    them; None outside a sweep or when that record cannot be read. A launcher that runs each job in a process of its
    own (submitit) has its own sys.argv there: the swept keys are read from the sweep's record instead."""
    import yaml

    hc = _sweep_job()
    if hc is None:
        return None
    try:
        recorded = yaml.safe_load((Path(hc.runtime.cwd) / hc.sweep.dir / "multirun.yaml").read_text())["hydra"]
        params = [f"{k}={v}" for k, v in (recorded["sweeper"].get("params") or {}).items()]
        task = [*params, *(recorded["overrides"]["task"] or [])]
    except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError):
        return None
    return task if all(isinstance(o, str) for o in task) else None


def swept_keys(argv: list[str]) -> set[str]:
    """The keys a `-m` command line sweeps (`optim.lr=1e-3,3e-4`, `x=range(1,3)`); empty when it cannot tell."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    candidates = [a for a in argv if "=" in a and not a.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(candidates)
    except Exception:  # (Hydra's parser raises its own errors; the job itself parsed these already)
        return set()
    return {o.key_or_group for o in parsed if o.is_sweep_override()}


# Overrides a rerun of a sweep may change without making its points other runs: the run's length and periods,
# checkpoints, loggers, the world it runs on, and what is not a setting.
NOT_THE_POINT = ("resume", "hydra.", "hydra/", "trainer.max_steps", "trainer.max_epochs", "trainer.eval_every",
                 "trainer.log_every", "trainer.progress", "checkpoint.", "logger", "world")


def _point(overrides: Any, swept: set[str]) -> dict[str, str] | None:
    """{key: value} of `overrides` (a job's override strings) but for NOT_THE_POINT's, unless swept: the values
    that make it this point of its sweep (the swept keys, and the fixed ones beside them); None if it is not a list
    of strings."""
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        return None
    from trainer.redaction import REDACTED, is_secret_key

    out = {}
    for o in overrides:
        key, _, value = o.partition("=")
        key = key.lstrip("+~")
        if is_secret_key(key) or REDACTED in value:  # (.hydra/ keeps these redacted: they cannot be compared)
            continue
        if key in swept or not key.startswith(NOT_THE_POINT):
            out[key] = value
    return out


# The job's overrides, from the CLI to whichever process writes run_info.json (a worker, under a launcher too).
JOB_OVERRIDES_ENV = "TRAINER_JOB_OVERRIDES"


def _recorded_point(run_dir: Path, swept: set[str]) -> tuple[str, dict[str, str]] | None:
    """("run", the point) from the overrides the run recorded in run_info.json, which only the run that owns the
    dir writes; else ("hydra", the point) from .hydra/overrides.yaml, which a launcher starting each job in a
    process of its own (submitit) has Hydra write into the job's numbered dir before the job runs, whatever run
    the dir holds; else None."""
    import yaml

    try:
        overrides = json.loads((run_dir / "run_info.json").read_text()).get("overrides")
        if isinstance(overrides, list):
            return "run", _point(overrides, swept)
    except (OSError, ValueError, AttributeError):
        pass
    try:
        return "hydra", _point(yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text()), swept)
    except (OSError, yaml.YAMLError):
        return None


def _config_point(config: Any, keys: set[str]) -> dict[str, Any] | None:
    """{key: the settings under it} of a resolved config for `keys`: a swept key's value, or the group a swept
    choice put there; None when a swept key has nothing in the config (a choice that only changes other keys)."""
    if not isinstance(config, dict):
        return None
    settings = flat(config)
    out = {k: {name: v for name, v in settings.items() if name == k or name.startswith(k + ".")} for k in keys}
    return out if all(out.values()) else None


def sweep_point_dir(run_dir: Path, job_overrides: list[str], argv: list[str], config: dict | None = None) -> Path:
    """Where a sweep's job continues with resume=auto: its numbered dir if that holds this point's run (the same
    values of its overrides, swept or fixed, but for NOT_THE_POINT's) or none; else the sibling that holds it (the
    sweep's values came in another order, or from a sweep in a config file); else, the numbered dir holding another
    point's run, a new `<dir>-2` (then -3, ...).

    A run's point is the settings its config.yaml holds under the point's keys, against `config` (this job's
    resolved config, as config.yaml records it); in a dir without one, its `.hydra/overrides.yaml` (under
    `hydra.output_subdir=null` there is none: then the settings under the command line's swept keys)."""
    keys = swept_keys(argv)
    mine = _point(list(job_overrides), keys)
    mine_set = _config_point(config, keys) if keys else None

    def point_of(d: Path) -> tuple[str, Any] | None:
        recorded = _recorded_point(d, keys)
        if recorded is not None:
            return recorded
        settings = _config_point(read_config(d / "config.yaml"), keys) if mine_set is not None else None
        return ("config", settings) if settings is not None else None

    # A launcher that starts each job in a process of its own (submitit) has Hydra write each job's .hydra/ records
    # into its numbered dir before the job runs: a dir's records may then be another job's of this very sweep,
    # whatever run the dir holds. A run's config.yaml (which only the run writes) says what it is, under each of the
    # point's keys that has settings there (optim.lr; model=, its group). A choice with none of its own (recipe=,
    # debug=, +experiment=: a _global_ package) shows in the records alone: those points need them to agree too.
    def settings(config: Any, names: set[str]) -> dict[str, Any] | None:
        if not isinstance(config, dict):
            return None
        flat_config = flat(config)
        return {k: {n: v for n, v in flat_config.items() if n == k or n.startswith(k + ".")} for k in names}

    point_keys = set(mine or {}) | keys
    everything = settings(config, point_keys) if config is not None else None
    visible = {k for k in point_keys if everything and everything[k]}
    mine_settings = settings(config, visible) if everything is not None else None

    def is_mine(d: Path, found: tuple[str, Any] | None) -> bool:
        saved = settings(read_config(d / "config.yaml"), visible) if mine_settings is not None else None
        if saved is not None and saved != mine_settings:
            return False
        if saved is not None and visible == point_keys:
            return True  # (the run's own settings say it all: its .hydra records may be another job's)
        if found is not None and found[0] == "run":  # (the run's own record, no other job's)
            if saved is None:
                return found[1] == mine
            # The keys config.yaml cannot show (recipe=, +experiment=), as written; the rest it showed alike above
            # (optim.lr=0.001 and 1e-3 are one value there, and a choice that changes nothing is nothing).
            return {k: v for k, v in found[1].items() if k not in visible} == \
                {k: v for k, v in (mine or {}).items() if k not in visible}
        return found is not None and found[1] == (mine if found[0] == "hydra" else mine_set)

    here = point_of(run_dir)
    mine_here = is_mine(run_dir, here)
    if mine_here and (run_dir / "config.yaml").is_file():
        return run_dir
    # A dir that matches by its .hydra records alone may hold no run: a launcher that starts each job in a process
    # of its own (submitit) has Hydra write this job's records into its numbered dir first. A sibling holding this
    # point's run comes before it (a value put in front of the sweep's list renumbered the points).
    siblings = [d for d in run_dir.parent.iterdir() if d.is_dir() and d != run_dir] if run_dir.parent.is_dir() else []
    matching = [d for d in siblings if is_mine(d, point_of(d))]
    holding = [d for d in matching if (d / "config.yaml").is_file()]
    if holding:
        return max(holding, key=lambda d: d.stat().st_mtime)
    if mine_here:
        return run_dir
    if matching:
        return max(matching, key=lambda d: d.stat().st_mtime)
    if here is None:
        return run_dir
    from trainer.io import free_name

    return free_name(run_dir, "")  # (run_dir itself is taken: <dir>-2, -3, ...)
