"""The training loop: the Trainer and the Runtime it runs on (also public, for a loop of your own), the task
contract, per-sample noise, non-finite steps, EMA, callbacks, metrics, optimizers and schedules, preemption and
the finders (batch size, learning rate)."""
