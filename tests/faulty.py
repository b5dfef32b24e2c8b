"""Test-only task that crashes one rank at a chosen micro-step (used through `task._target_`)."""

import os

from recipes.lm.task import LanguageModeling


class CrashOnRank(LanguageModeling):
    def __init__(self, rank: int = 1, at_call: int = 3, **kwargs):
        super().__init__(**kwargs)
        self.rank, self.at_call, self.calls = rank, at_call, 0

    def loss(self, model, batch):
        self.calls += 1
        if int(os.environ.get("RANK", 0)) == self.rank and self.calls == self.at_call:
            raise RuntimeError(f"boom from the faulty task on rank {self.rank}")
        return super().loss(model, batch)
