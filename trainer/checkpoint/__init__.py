"""Checkpoints: the manager handed the stateful parts (save, load, prune, the resume policy), the store that
writes and verifies step directories (store), state trees <-> JSON + named tensors (snapshot), safetensors files
with their sha256 (tensorfile), RNG capture (rng) and the finished run's export (export). Free of pickle."""
