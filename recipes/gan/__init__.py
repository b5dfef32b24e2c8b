"""The `gan` recipe: a small conditional GAN on the shipped digits, trained by a task's own training step
(two optimizers, two schedules) inside the Trainer (trainer/loop/custom_step.py)."""
