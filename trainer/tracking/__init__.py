"""What a run reports: metric loggers (JSONL, wandb, TensorBoard), images for them, the progress display, and
the redaction that keeps secrets out of all of it. Only the main process gets real loggers."""
