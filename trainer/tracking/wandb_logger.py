"""Weights & Biases logger: `logger=wandb` (conf/logger/wandb.yaml).

wandb is imported only when the run starts, so `--help` and configs without it never pay for the
import. The run starts lazily, at the first `log_*` call (the framework's first is `log_config`), so
that a resumed job can `load_state_dict` the previous run id before and continue the same wandb run.

It never prompts and never fails for lack of credentials or network: without an API key (or when
the server cannot be reached) it logs offline into the run dir and, at the end, prints the
`wandb sync` command that uploads the run later. wandb's own system metrics (CPU, memory, GPU)
and machine info are left on.
"""

from __future__ import annotations

import json
import netrc
import os
import secrets
import shlex
import string
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from trainer.errors import ConfigError
from trainer.redaction import redact, redact_text, scrub, secret_values
from trainer.tracking.loggers import NullLogger

MODES = (None, "online", "offline", "disabled")
# What a rollback (a resume from a checkpoint older than the run's last step) logs to. wandb ignores a step below the
# run's last, so continuing the same run would drop the new branch's steps up to there and show the old branch's.
ON_ROLLBACK = ("new_run", "fork", "rewind")
# In <run dir>/wandb/ (the run dir's own, wherever logger.wandb.dir puts wandb's files): {"run_id": the run the last
# attempt logged to, "from": [run id, step] of the checkpoint it started from, or null, "how": null, or how it
# branched there (new_run, fork, rewind), "first": the first step that run holds of this run dir's line (a branch's
# run starts after its checkpoint), "settings": settings_digest of its config}. A rollback's new run is in no
# checkpoint until the branch saves one; killed before that, the next resume loads the same checkpoint and its id,
# the old run's, where wandb would drop the branch's steps. "run_dir": the run dir that wrote it, by which a copy of
# the run dir (cp -r), continued beside its original, logs to a run of its own.
LAST_RUN = "trainer_last_run.json"
# Settings that change no number a run logs, nor the steps it logs them at (where it saves and logs to, how it shows
# progress, timeouts), or change them by rounding only (threads, kernels, compilation, loader workers, the eval's
# batch; timings and MFU differ between any two attempts anyway): two attempts that differ only in these log the same
# rows. Every other difference makes the rows an earlier attempt logged past the checkpoint another branch's, since
# wandb cannot put a row below a run's last (trainer.log_every and eval_every change which steps have rows).
# {section: its keys of that kind, or None for all of them}.
SAME_NUMBERS = {"logger": None, "checkpoint": None, "resume": None, "hydra": None,
                "trainer": ("progress", "peak_tflops", "eval_batch_size", "compile", "compile_backend", "compile_mode",
                            "compile_options"),
                "world": ("hang_timeout", "max_restarts", "rdzv_timeout", "threads"),
                "data": ("num_workers", "cache_dir"), "optim": ("fused", "foreach"), "precision": ("reason",)}


class WandbLogger(NullLogger):
    """Logs metrics, the resolved config, eval samples and the final summary to one wandb run.

    Args:
        project, entity, name, group, tags: passed to `wandb.init`.
        mode: "online" | "offline" | "disabled", or None: $WANDB_MODE if set, else online when
            credentials exist (WANDB_API_KEY, or a ~/.netrc entry from `wandb login`), else offline.
        dir: where wandb writes its `wandb/` folder; None = the run dir.
        on_rollback: where a rollback's new branch logs, the old run keeping the branch it leaves: "new_run" (a
            run of its own, its notes naming the old run and step), "fork" (wandb's `fork_from`: a new run holding
            the old one's history up to the step) or "rewind" (wandb's `resume_from`: the same run, cut at the
            step, the cut history archived by the server). fork and rewind are preview features of W&B's server.
        run_dir: the run's output directory (passed by the framework).
    """

    def __init__(self, *, run_dir: str | os.PathLike, project: str | None = "trainer",
                 entity: str | None = None, name: str | None = None, group: str | None = None,
                 tags: list[str] | None = None, mode: str | None = None, dir: str | None = None,
                 on_rollback: str = "new_run"):
        if mode not in MODES:
            raise ConfigError(f"logger.wandb.mode={mode!r} is invalid: expected one of "
                              "online, offline, disabled, or null (online with credentials, else offline).")
        if on_rollback not in ON_ROLLBACK:
            raise ConfigError(f"logger.wandb.on_rollback={on_rollback!r} is invalid: expected new_run (the rollback's "
                              "branch logs to a run of its own), fork or rewind (W&B's preview features).")
        self.on_rollback = on_rollback
        named = {"project": project, "entity": entity, "name": name, "group": group}
        for key, value in [*named.items(), *(("tags", t) for t in tags or ())]:  # (wandb.init's pydantic traceback,
            if not (value is None or isinstance(value, (str, int, float))) or isinstance(value, bool):  # a run dir left)
                raise ConfigError(f"logger.wandb.tags holds {value!r}: expected a list of words (tags=[a,b])."
                                  if key == "tags" else
                                  f"logger.wandb.{key}={value!r} is invalid: expected a name (a string) or null.")
        self.init_kwargs = {**{k: None if v is None else str(v) for k, v in named.items()},
                            "tags": [str(t) for t in tags or ()] or None}
        self.mode = mode
        self.dir = Path(dir if dir is not None else run_dir)
        self.metrics = Path(run_dir) / "metrics.jsonl"  # what a resume logs again where the run lost it
        self.record = Path(run_dir) / "wandb" / LAST_RUN
        self.run_id = new_run_id()  # known before the run starts, so state_dict() works at any time
        self.run = None
        self.offline = False  # set when the run starts
        self._sync_hint: str | None = None  # why we logged offline, when the user did not ask to
        self._config: dict[str, Any] | None = None  # the run's config, as given to log_config
        self._loaded = False  # whether run_id came from a checkpoint (load_state_dict)
        # The run this one branches from, when it does: {"run": id, "step": the rollback's step or None (another run's
        # checkpoint), "how": new_run | fork | rewind}.
        self._branch: dict[str, Any] | None = None
        self._resumed_from: list | None = None  # [run id, step] of the checkpoint this attempt continues (rewind)
        # Resuming the same run: the last step it holds from an attempt with this one's settings. Those steps are not
        # logged again (wandb would drop them, warning each time: the run keeps a step's first value).
        self._held: int | None = None
        self._first = 0  # the first step the run continued holds of this line (LAST_RUN's "first")

    # -- starting the run --------------------------------------------------------------------------
    def _start(self, config: dict[str, Any] | None = None) -> None:
        import wandb

        mode = self.mode or os.environ.get("WANDB_MODE") or "online"
        # The server wandb will use: $WANDB_BASE_URL, or the host saved by `wandb login --host`.
        if mode in ("online", "run") and not has_credentials(wandb.setup().settings.base_url):
            mode, self._sync_hint = "offline", "no W&B credentials: set WANDB_API_KEY or run `wandb login`"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._check_what_the_run_holds(config)
        try:
            self.run = self._init(mode, config)
        except Exception as exc:  # noqa: BLE001 - wandb raises several types for a bad key or no network
            if mode not in ("online", "run"):
                raise
            self._sync_hint = f"could not start an online run: {type(exc).__name__}: {str(exc).splitlines()[0]}"
            mode = "offline"
            self.run = self._init_offline_after_failure(config)
        self.offline = mode in ("offline", "dryrun")
        self._say_where_the_branch_logs()
        self._log_what_the_run_lost(mode)
        self._record_the_run(config)

    def _check_what_the_run_holds(self, config: dict[str, Any] | None) -> None:
        """Resuming the run the checkpoint names: the steps it holds past the checkpoint (an attempt that stopped
        without saving at its last step: a crash, a kill -9, a lost node) are that attempt's. With the same settings
        they are this attempt's numbers too, and stay; with others they are another branch's, and this attempt logs
        where a rollback's would (on_rollback), since continuing the run would show them instead of its own."""
        if self._resumed_from is None or self._branch is not None:
            return
        from trainer.tracking.wandb_files import logged_up_to

        step, self._held = self._resumed_from[1], logged_up_to(self.dir / "wandb", self.run_id)
        if self._held is None or self._held <= step:
            return
        last = self._last_run()
        if last.get("run_id") != self.run_id or last.get("settings") in (None, settings_digest(config)):
            return  # the same settings, or not known (a run dir from before the record held them): continued
        self._branch = {"run": self.run_id, "step": step, "how": self.on_rollback, "held": self._held}
        self._held = None
        if self.on_rollback != "rewind":
            self.run_id = new_run_id()

    def _log_what_the_run_lost(self, mode: str) -> None:
        """Resuming the same run: log again, from metrics.jsonl, the steps up to the checkpoint that the run does not
        hold. A process killed at once (kill -9, the OOM killer, a lost node) takes the records wandb's service had
        not written yet with it, often many steps before the checkpoint. Online, what the run holds is the server's
        word (the step a resumed run starts at); offline, the files a sync uploads. Scalars only: the text and images
        of eval samples of those steps are in samples.jsonl and samples/."""
        if self._resumed_from is None or self._branch is not None or mode == "disabled":
            return
        if not self.offline:  # (and what attempts logged offline, whose files `wandb sync` is to upload)
            from trainer.tracking.wandb_files import logged_up_to

            start = self.run.starting_step  # (0: a run the server does not have)
            offline = logged_up_to(self.dir / "wandb", self.run_id, offline=True)
            self._held = max(start - 1 if start else -1, -1 if offline is None else offline)
        elif self._held is None:
            return  # no file of the run here: its earlier attempts logged elsewhere (online, or another wandb dir)
        held = self._held
        rows: dict[int, dict[str, Any]] = {}
        try:
            lines = self.metrics.read_text().splitlines() if self.metrics.is_file() else []
        except OSError:
            return
        for line in lines:
            try:
                event = json.loads(line)
                step = int(event.pop("step"))
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # (a torn line: the rewind keeps none, but a file from elsewhere may have one)
            if max(held, self._first - 1) < step <= self._resumed_from[1]:
                rows.setdefault(step, {}).update(event)
        for step in sorted(rows):
            self.run.log(rows[step], step=step)
        if rows:
            print(f"wandb: run {self.run_id} did not hold {_steps(min(rows), self._resumed_from[1])} (up to the "
                  "checkpoint's): a process stopped at once loses the records wandb had not written yet. They are "
                  f"logged again from metrics.jsonl ({len(rows)} rows).", file=sys.stderr, flush=True)

    def _record_the_run(self, config: dict[str, Any] | None) -> None:
        from trainer.io import atomic_write_bytes

        branch = self._branch
        if branch is not None and branch["step"] is not None:
            start, how = [branch["run"], branch["step"]], branch["how"]
            first = self._first if how == "rewind" else branch["step"] + 1
        else:
            start, how, first = self._resumed_from, None, self._first
        record = {"run_id": self.run_id, "from": start, "how": how, "first": first, "settings": settings_digest(config),
                  "run_dir": str(self.record.parent.parent.resolve())}  # (a copy of the run dir is told by it)
        try:
            atomic_write_bytes(self.record, json.dumps(record).encode())
        except OSError:
            pass  # (wandb itself has just written there; a resume without the record continues the checkpoint's run)

    def _last_run(self) -> dict[str, Any]:
        try:
            record = json.loads(self.record.read_text())
        except (OSError, ValueError):
            return {}
        return record if isinstance(record, dict) else {}

    def _init(self, mode: str, config: dict[str, Any] | None):
        import wandb

        settings = wandb.Settings(
            # Offline, wandb's own banner ("run `wandb online`...") is noise; we print the sync command.
            silent=mode in ("offline", "dryrun", "disabled"),
            quiet=True,
            # Our own run object, never wandb's global one: an unfinished earlier run (another
            # logger, a notebook) is neither returned nor finished by this init.
            reinit="create_new",
        )
        # wandb records the name, group and tags, and sys.argv as the run's metadata: secrets taken out.
        secrets = secret_values(self._config)  # of the environment and the config as given (unredacted)
        argv, sys.argv = sys.argv, [scrub(arg, secrets) for arg in sys.argv]
        try:
            return wandb.init(
                **redact(self.init_kwargs, secrets), dir=str(self.dir), mode=mode, config=config, id=self.run_id,
                settings=settings, **self._branch_kwargs(),
            )
        finally:
            sys.argv = argv

    def _branch_kwargs(self) -> dict[str, Any]:
        """wandb.init's arguments for where this run's history starts (one of resume, fork_from, resume_from)."""
        branch = self._branch
        if branch is None:
            # "allow": continue the run with this id if it exists (a resumed job), else create it.
            return {"resume": "allow"}
        moment = f"{branch['run']}?_step={branch['step']}"
        if branch["how"] == "fork" and branch["step"] is not None:
            return {"fork_from": moment}
        if branch["how"] == "rewind" and branch["step"] is not None:
            return {"resume_from": moment}
        # A run of its own: its notes (the Overview tab) say where it comes from.
        return {"resume": "allow", "notes": (
            f"Continued from step {branch['step']} of run {branch['run']} in a copy of its run dir "
            f"({branch['copy_of']}), where that run goes on." if branch.get("copy_of") is not None else
            f"Rolled back to step {branch['step']} of run {branch['run']}, which keeps the branch this run left."
            if branch["step"] is not None else f"Started from a checkpoint of run {branch['run']}.")}

    def _init_offline_after_failure(self, config: dict[str, Any] | None):
        import wandb

        # wandb's service keeps the failed run's id reserved; a fresh service frees it, so the offline
        # run keeps the id (and a resumed job still continues the same run once synced).
        wandb.teardown()
        try:
            return self._init("offline", config)
        except Exception:  # noqa: BLE001 - a service shared with a parent process ($WANDB_SERVICE) keeps it
            self.run_id = new_run_id()
            if self._branch is not None and self._branch["how"] == "rewind":  # (a rewind keeps the id it lost)
                self._branch["how"] = "new_run"
            return self._init("offline", config)

    def _say_where_the_branch_logs(self) -> None:
        branch = self._branch
        if branch is None:
            return
        old, step, how = branch["run"], branch["step"], branch["how"]
        what = f"the rollback to step {step}"
        if branch.get("copy_of") is not None:
            what = f"this copy of the run dir {branch['copy_of']}, resumed from step {step},"
        elif branch.get("held") is not None:  # (a resume of the same checkpoint with other settings)
            what = (f"run {old} holds {_steps(step + 1, branch['held'])} of an attempt with other settings than this "
                    f"job's, which stopped before it saved a checkpoint there: this resume from step {step}")
        if step is None:
            say = (f"wandb: this run starts from a checkpoint of wandb run {old}, another run's record: it logs to a run "
                   f"of its own, {self.run_id}.")
        elif how == "rewind":
            say = (f"wandb: {what} rewinds run {old} to that step (logger.wandb.on_rollback=rewind, "
                   "a preview feature of W&B's server, which archives the history it cuts).")
        elif how == "fork":
            say = (f"wandb: {what} logs to run {self.run_id}, forked from run {old} at that step "
                   f"(logger.wandb.on_rollback=fork, a preview feature of W&B's server); run {old} keeps the branch "
                   "it leaves.")
        else:
            say = (f"wandb: {what} logs to a new run, {self.run_id}; run {old} keeps the branch it "
                   "leaves (wandb ignores a step below a run's last, so continuing it would drop this branch's "
                   f"first steps). logger.wandb.on_rollback=fork starts the new run with {old}'s history up to step "
                   f"{step}, on a W&B server with that preview feature.")
        print(say, file=sys.stderr, flush=True)

    def _ensure_started(self) -> None:
        if self.run is None:
            self._start()

    # -- the logger interface ----------------------------------------------------------------------
    def log_config(self, config: dict[str, Any]) -> None:
        self._config = config  # its secret keys' values are secrets in logged text too
        config = redact(config)
        if self.run is None:
            self._start(config)
        else:
            self.run.config.update(config, allow_val_change=True)

    def _held_already(self, step: int) -> bool:
        """Whether the run holds `step` from an attempt with these settings (resuming it): not logged again."""
        self._ensure_started()
        return self._held is not None and step <= self._held

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self._held_already(step):
            return
        self.run.log(dict(metrics), step=step)

    def log_text(self, key: str, text: str, step: int) -> None:
        """Shown as a preformatted HTML panel with a step slider; whitespace is kept as generated."""
        import html

        import wandb

        if self._held_already(step):
            return
        text = redact_text(text, self._config)
        panel = wandb.Html(f'<pre style="white-space: pre-wrap">{html.escape(text)}</pre>', inject=False)
        self.run.log({key: panel}, step=step)

    def log_image(self, key: str, image, step: int) -> None:
        import wandb

        from trainer.tracking.images import to_hwc_uint8

        if self._held_already(step):
            return
        self.run.log({key: wandb.Image(to_hwc_uint8(image).numpy())}, step=step)

    def finish(self, summary: dict[str, Any], exit_code: int = 0) -> None:
        if self.run is None:
            if not summary:
                return
            self._start()
        run, self.run = self.run, None
        run.summary.update(dict(summary))
        run.finish(exit_code=exit_code)
        if self.offline:
            why = f" ({self._sync_hint})" if self._sync_hint else ""
            sync_dir = shlex.quote(str(self.dir / "wandb"))
            print(f"wandb: run {self.run_id} was logged offline{why}; upload it with: wandb sync {sync_dir}",
                  file=sys.stderr, flush=True)

    # -- resume --------------------------------------------------------------------------------------
    def start_fresh(self) -> None:
        """A run dir's run starting over; given another run's checkpoint, its run id is that run's record."""
        if self._loaded and self.run is None:
            self._branch = {"run": self.run_id, "step": None, "how": "new_run"}
            self.run_id, self._loaded = new_run_id(), False

    def keep_copy(self) -> list[Path]:
        """A rollback: the old run keeps the branch it leaves (wandb's own record of it; no file to copy), this
        one logs where `on_rollback` says, from the step `rewind` names."""
        if self._loaded and self.run is None:
            self._branch = {"run": self.run_id, "step": None, "how": self.on_rollback}
            if self.on_rollback != "rewind":
                self.run_id = new_run_id()
            self._loaded = False
        return []

    def rewind(self, step: int) -> None:
        """The events after `step` are logged again: by a rollback's new run (keep_copy) or, resuming, by the run
        the checkpoint names, unless the last attempt from this same checkpoint logged to another (a rollback's,
        killed before its branch saved a checkpoint): then that one."""
        if self.run is not None:
            return
        last = self._last_run()
        if self._branch is not None and self._branch["step"] is None:
            self._branch["step"] = step
            self._first = self._first_of(last)  # (a rewind's run keeps its history up to the step)
        elif self._branch is None and self._loaded and (copy_of := self._copy_of(last)) is not None:
            # A copy of a run dir (cp -r) continued beside the original, which goes on logging to the run both
            # checkpoints name: both branches' steps went into one run, and wandb dropped one's. The copy's is a
            # run of its own, as a rollback's is (never a rewind of the original's run).
            self._branch = {"run": self.run_id, "step": step, "how": "fork" if self.on_rollback == "fork" else "new_run",
                            "copy_of": str(copy_of)}
            self.run_id, self._loaded = new_run_id(), False
        elif self._branch is None and self._loaded:
            self._resumed_from = [self.run_id, step]
            if last.get("from") == self._resumed_from and isinstance(last.get("run_id"), str) and last["run_id"]:
                if last.get("how") == "rewind" and last["run_id"] == self.run_id:
                    # A rewind killed before its checkpoint: the server cut the run at `step` and holds what that
                    # attempt logged after it; the run's files from before the cut still hold the branch it left.
                    # Rewinding again cuts both.
                    self._branch = {"run": self.run_id, "step": step, "how": "rewind"}
                self.run_id = last["run_id"]
            self._first = self._first_of(last)

    def _copy_of(self, last: dict[str, Any]) -> Path | None:
        """The run dir this one is a copy of, where the record came from one that is still there and still logs to
        the same run (a run dir moved, or copied and its original deleted, continues that run)."""
        from trainer.io import same_dir

        other, here = last.get("run_dir"), self.record.parent.parent
        if not isinstance(other, str) or same_dir(other, here):  # (by identity: a path through a link too)
            return None
        try:
            theirs = json.loads((Path(other) / "wandb" / LAST_RUN).read_text())
        except (OSError, ValueError):
            return None
        same = isinstance(theirs, dict) and theirs.get("run_id") == last.get("run_id") and theirs.get("run_dir") == other
        return Path(other) if same else None

    def _first_of(self, last: dict[str, Any]) -> int:
        """The first step the run this attempt logs to holds of the line (0: not recorded, the run's start)."""
        first = last.get("first")
        return first if last.get("run_id") == self.run_id and isinstance(first, int) else 0

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        run_id = state.get("run_id")
        if not run_id or run_id == self.run_id:
            return
        if self.run is not None:
            raise RuntimeError(
                f"WandbLogger.load_state_dict(run_id={run_id!r}) after wandb run {self.run_id!r} started: "
                "restore logger state before the first log_config/log_metrics call."
            )
        self.run_id, self._loaded = run_id, True


# Words that make a config key secret: "hf_token", "apiKey", "db_password", but not "sample_tokens".
def has_credentials(base_url: str) -> bool:
    """Whether wandb can authenticate to `base_url` without asking: a key in the environment or ~/.netrc."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(base_url).hostname
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        entry = netrc.netrc(path).authenticators(host) if host else None
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


def _steps(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first} to {last}"


def settings_digest(config: dict[str, Any] | None) -> str | None:
    """A digest of the settings that shape a run's numbers (all but `SAME_NUMBERS`); None without a config."""
    import hashlib

    if config is None:
        return None
    shaping = {}
    for section, value in config.items():
        left_out = SAME_NUMBERS.get(section, ())
        if left_out is None:
            continue
        shaping[section] = ({k: v for k, v in value.items() if k not in left_out} if isinstance(value, dict)
                            else value)
    return hashlib.sha256(json.dumps(shaping, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def new_run_id() -> str:
    """A fresh wandb run id: 8 lowercase letters and digits, like the ids wandb makes itself."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
