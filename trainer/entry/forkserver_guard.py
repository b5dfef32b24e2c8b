"""Imported by the workers' forkserver before anything else it preloads (trainer/entry/worker.py's PRELOAD), and by
nothing else: the forkserver dies with the launcher that started it (prctl PR_SET_PDEATHSIG, as each worker does
with the forkserver), so a SIGKILLed launcher takes the forkserver, and with it the workers, at once. Left to
itself the forkserver noticed its launcher gone only once it was done preloading torch and then shut its
interpreter down; the workers trained on for another 2-4 s meanwhile.

It ignores the stop signals a whole process group gets (SIGTERM from `timeout`, `kill -- -PGID`, SLURM's
`--signal=TERM@120` to every process of the job step; SIGUSR1, SIGHUP): killed by them, it took every worker with it
at once (their parent-death signal), before they could save the checkpoint the signal asks for. The launcher and the
workers take them as before (each worker puts their default back: trainer/entry/worker.py), and the forkserver still
dies with its launcher."""

import os
import signal

from trainer.parallel.backend import die_with_parent

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)


def _defaults() -> None:
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)


die_with_parent()
for _signum in STOP_SIGNALS:
    signal.signal(_signum, signal.SIG_IGN)
# (each process it forks, a worker or anything else, takes them as a fresh process does from its first instruction)
os.register_at_fork(after_in_child=_defaults)
