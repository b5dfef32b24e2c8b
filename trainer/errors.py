"""Errors that end a run cleanly: one paragraph naming the key or path and what to do, no traceback.

Anything raised as a `TrainerExit` is printed without a traceback and exits with its `exit_code`
(2 for usage errors, as argparse does). Set HYDRA_FULL_ERROR=1 or TRAINER_DEBUG=1 for the traceback.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Iterable


class TrainerExit(Exception):
    """Ends the run with a message and an exit code instead of a traceback."""

    exit_code = 1


class UserError(TrainerExit):
    """A mistake the user can fix: bad config, missing file, unusable checkpoint."""

    exit_code = 2


class ConfigError(UserError):
    pass


class DataError(UserError):
    pass


class CheckpointError(UserError):
    pass


class StorageError(TrainerExit):
    """Writing failed (disk full, I/O error): not the user's typo, so not exit 2. What was complete is kept."""

    exit_code = 74  # EX_IOERR


class NonFiniteError(TrainerExit):
    """Training hit a NaN/inf; the last complete checkpoint is left untouched."""

    exit_code = 3


class Preempted(TrainerExit):
    """SIGTERM/SIGUSR1 arrived: a checkpoint was saved; rerun the same command with resume=auto."""

    exit_code = 75  # EX_TEMPFAIL: "try again later"


class HangDetected(TrainerExit):
    """No rank made progress for world.hang_timeout seconds: the watchdog (trainer/loop/watchdog.py) collected every
    rank's stack, named the rank the others wait for, and stopped the job."""

    exit_code = 70  # EX_SOFTWARE


def debug_enabled() -> bool:
    """Tracebacks for our errors too: HYDRA_FULL_ERROR=1 (Hydra's own switch) or TRAINER_DEBUG=1."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1" or os.environ.get("TRAINER_DEBUG") == "1"


def report(err: TrainerExit) -> None:
    """Print `err` as the one paragraph a user sees (`error: ...` on stderr)."""
    from trainer.redaction import scrub, secret_values

    # A message may quote config values, and those may come from the environment's secrets.
    print(f"error: {scrub(str(err), secret_values())}", file=sys.stderr, flush=True)


def a_(name: str) -> str:
    """`name` with its article: "a float", "an int" (a message naming what type a value was)."""
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def suggest(name: str, choices: Iterable[str], n: int = 3) -> str:
    """' Did you mean a, b?' for the closest names, or '' when nothing is close.

    A name clearly closer than the rest is offered alone (max_stepz -> max_steps, not also max_epochs):
    a second guess only helps when it is about as likely as the first.
    """
    close = difflib.get_close_matches(name, list(choices), n=n, cutoff=0.6)
    score = {c: difflib.SequenceMatcher(None, c, name).ratio() for c in close}
    close = [c for c in close if score[c] >= score[close[0]] - 0.1] if close else []
    return f" Did you mean {', '.join(close)}?" if close else ""
