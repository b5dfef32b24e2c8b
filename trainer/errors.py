"""User-facing errors: one paragraph that names the key or path and says what to do.

Anything raised as a `UserError` is printed without a traceback and exits with `exit_code`
(2 for usage errors, as argparse does). Set HYDRA_FULL_ERROR=1 or TRAINER_DEBUG=1 for the traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class UserError(Exception):
    """A mistake the user can fix: bad config, missing file, unusable checkpoint."""

    exit_code = 2


class ConfigError(UserError):
    pass


class DataError(UserError):
    pass


class CheckpointError(UserError):
    pass


class NonFiniteError(UserError):
    """Training hit a NaN/inf; the last complete checkpoint is left untouched."""

    exit_code = 3


def suggest(name: str, choices: Iterable[str], n: int = 3) -> str:
    """' Did you mean a, b?' for the closest names, or '' when nothing is close."""
    close = difflib.get_close_matches(name, list(choices), n=n, cutoff=0.6)
    return f" Did you mean {', '.join(close)}?" if close else ""
