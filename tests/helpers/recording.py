"""Test-only diffusion task that records, per rank, whether it fitted the normaliser or loaded it."""

import hashlib
import os

from trainer.recipes.diffusion.task import Diffusion


class RecordingDiffusion(Diffusion):
    def __init__(self, log: str, **kwargs):
        super().__init__(**kwargs)
        self.log = log

    def setup(self, train, val, run_dir=None):
        fitted = []
        fit = self.normalizer.fit
        self.normalizer.fit = lambda images: fitted.append(True) or fit(images)
        super().setup(train, val, run_dir)
        stats = hashlib.sha256(b"".join(t.numpy().tobytes() for t in self.normalizer.state_dict().values()))
        with open(self.log, "a") as f:
            f.write(f"rank{os.environ.get('RANK', 0)} {'fitted' if fitted else 'loaded'} {stats.hexdigest()}\n")
