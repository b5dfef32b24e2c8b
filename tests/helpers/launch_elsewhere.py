"""`python -m launch_elsewhere RUN_DIR OUT OVERRIDES...`: launch the run of OVERRIDES (several processes) with
this process's stdout and stderr sent to the file OUT for the launch, as `trainer check` sends them to its log.
Run through conftest.run_cli, the launch forks its workers from a forkserver that was started before, with the
original stdout and stderr (tests/helpers/forked_cli.py): the workers must write to OUT all the same."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from trainer.config.compose import load
from trainer.entry import launcher


def main() -> None:
    run_dir, out, *overrides = sys.argv[1:]
    cfg = load(overrides)
    saved = [os.dup(1), os.dup(2)]
    with open(out, "wb") as f:
        for fd in (1, 2):
            os.dup2(f.fileno(), fd)
    try:
        launcher.run(cfg, Path(run_dir))
    finally:
        sys.stdout.flush()
        for copy, fd in zip(saved, (1, 2)):
            os.dup2(copy, fd)
    print("launched", flush=True)


if __name__ == "__main__":
    main()
