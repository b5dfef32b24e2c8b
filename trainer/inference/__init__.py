"""Using a finished run: its model with weights, its task, its config (finished), and big-model inference
placed over GPUs, CPU and disk (device_map)."""
