"""Imported by the workers' forkserver before anything else it preloads (trainer/entry/worker.py's PRELOAD), and by
nothing else: the forkserver dies with the launcher that started it (prctl PR_SET_PDEATHSIG, as each worker does
with the forkserver), so a SIGKILLed launcher takes the forkserver, and with it the workers, at once. Left to
itself the forkserver noticed its launcher gone only once it was done preloading torch and then shut its
interpreter down; the workers trained on for another 2-4 s meanwhile."""

from trainer.parallel.backend import die_with_parent

die_with_parent()
