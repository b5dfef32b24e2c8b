"""Test-only task that misbehaves on one rank at a chosen loss call (used through `task._target_`).

It wraps a real task (`base`: the lm recipe's by default; the other keys of `task` go to it).
Actions: raise an exception, SIGKILL / SIGTERM / SIGUSR1 itself, SIGTERM, SIGUSR1 or SIGINT its parent (the
launcher), SIGTERM its whole process group ("sigterm_group": the job run in a session of its own; at every call from
then on: "sigterm_group_repeated"), return a NaN loss once ("nan_once") or from then on ("nan_always"), or SIGTERM itself while
it is being built ("sigterm_at_build": before any training step, in every process that builds it), or
"block": write this process's PID into the FIFO `hold` (the test reads it: the job is now running), then
block forever on `hold + ".release"` (a FIFO nobody writes): a job that is busy until the test acts on it; or
"hang": sleep forever, outside any collective (the rank the others wait for, tests/test_watchdog.py); or
"refuse_in_workers": a ConfigError while the launched workers build it (the launcher's checks pass); or "refuse":
a ConfigError at the chosen call.
Only training calls count (the model is in train mode), so call N is training micro-batch N.
"""

import os
import signal
import time

from hydra.utils import get_class

from trainer.entry.worker import LAUNCHER_ENV


class Faulty:
    def __init__(self, rank: int = 1, at_call: int = 3, action: str = "raise", first_attempt_only: bool = False,
                 base: str = "trainer.recipes.lm.task.LanguageModeling", once: str | None = None,
                 hold: str | None = None, **kwargs):
        self.inner = get_class(base)(**kwargs)
        self.rank, self.at_call, self.action, self.first_attempt_only = rank, at_call, action, first_attempt_only
        self.calls = 0
        self.hold = hold
        self.once = once  # a marker file: act only if it does not exist yet (then create it), so a rerun of the
        # very same command (same config) runs clean
        if action == "sigterm_at_build":
            os.kill(os.getpid(), signal.SIGTERM)
        if action == "refuse_in_workers" and os.environ.get(LAUNCHER_ENV):  # (the launcher's own check passes it)
            from trainer.errors import ConfigError

            raise ConfigError("task.action=refuse_in_workers: a mistake that only the workers find.")

    def __getattr__(self, name):  # num_targets, sample, setup, state_dict, ... of the wrapped task
        if name == "inner":
            raise AttributeError(name)
        if name == "training_step":  # a task with its own step (the gan recipe): each step is one call
            inner_step = self.inner.training_step  # (AttributeError when the task has none: hasattr is False)

            def training_step(step):
                if self._fault(True):
                    raise RuntimeError("the faulty task's nan actions wrap loss(), not training_step()")
                return inner_step(step)
            return training_step
        return getattr(self.inner, name)

    def loss(self, model, batch):
        if self._fault(model.training):
            return self.inner.loss(model, batch) * float("nan")
        return self.inner.loss(model, batch)

    def _fault(self, training: bool) -> bool:
        """Count a training call and act when it is the chosen one; True: this call's loss must be NaN."""
        self.calls += training
        armed = not self.first_attempt_only or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0
        on_rank = int(os.environ.get("RANK", 0)) == self.rank
        # (the chosen rank alone: another rank reaching the call first made the marker, and the fault never fired)
        if self.once is not None and on_rank and self.calls == self.at_call:
            armed = armed and not os.path.exists(self.once)
            if armed:
                open(self.once, "w").close()
        if on_rank and self.action == "nan_always" and self.calls >= self.at_call:
            return True
        if on_rank and self.action == "sigterm_group_repeated" and self.calls >= self.at_call:
            os.killpg(os.getpgrp(), signal.SIGTERM)  # (at every call from then on, training or eval: a user or a
            return False  # scheduler that signals again while the job stops)
        # (a training call's: the eval calls after it leave the count where it is, and fired the action again)
        if armed and on_rank and training and self.calls == self.at_call:
            if self.action == "nan_once":
                return True
            if self.action == "block":
                with open(self.hold, "w") as f:  # blocks until the test opens it for reading
                    f.write(f"{os.getpid()}\n")
                with open(self.hold + ".release") as f:  # blocks: nobody opens it for writing
                    f.read()
            while self.action == "hang":
                time.sleep(3600)
            if self.action == "raise":
                raise RuntimeError(f"boom from the faulty task on rank {self.rank}")
            if self.action == "refuse":  # a user mistake found in the middle of training (exit 2)
                from trainer.errors import ConfigError

                raise ConfigError(f"task.action=refuse: a mistake found at training call {self.calls}.")
            if self.action == "sigterm_group":  # every process of the job, as timeout, kill -- -PGID and SLURM do
                os.killpg(os.getpgrp(), signal.SIGTERM)
                return False
            # "_parent": the launcher, as a user or a scheduler signals it (a worker's parent is its forkserver).
            target = int(os.environ[LAUNCHER_ENV]) if self.action.endswith("_parent") else os.getpid()
            os.kill(target, {"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM, "sigusr1": signal.SIGUSR1,
                             "sigterm_parent": signal.SIGTERM, "sigusr1_parent": signal.SIGUSR1,
                             "sigint_parent": signal.SIGINT}[self.action])
        return False
