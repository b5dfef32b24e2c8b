"""The config: typed sections and their validation (schema), `_target_`s judged by the trust model and imported
(targets), composition from overrides without Hydra's run machinery (compose), sections to objects (instantiate),
this machine's defaults (machine), other launchers' flags (flags) and SLURM's topology (slurm). Torch-free at
import, so `--cfg job` and `--help` stay fast."""
