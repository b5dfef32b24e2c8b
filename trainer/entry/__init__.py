"""How a run starts and ends: the command line (cli, commands), the process launcher and its workers, SLURM
topology, the run directory one job owns, the hang watchdog, and `run`, where a prepared config becomes objects."""
