"""The config: typed schemas and the checks run before anything starts (schema), composition from overrides
without Hydra's run machinery (compose), this machine's defaults (machine), and other launchers' flags (flags).
Torch-free, so `--cfg job` and `--help` stay fast."""
