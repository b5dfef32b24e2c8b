"""Test-only task whose eval sample is an image (used through `task._target_=image_task.ImageSamples`)."""

import torch

from trainer.recipes.lm.task import LanguageModeling


def pattern() -> torch.Tensor:
    """A fixed 3 x 6 x 8 float image in [0, 1], channels first: red rises along x, green along y."""
    y, x = torch.meshgrid(torch.linspace(0, 1, 6), torch.linspace(0, 1, 8), indexing="ij")
    return torch.stack([x, y, torch.full_like(x, 0.25)])


class ImageSamples(LanguageModeling):
    def sample(self, model, device):
        return {"image": pattern()}
