"""A conditional GAN for 8x8 digits: an MLP generator and an MLP discriminator, both conditioned on the label.

The two are children of one module, called through its forward (`mode=`), so that DDP and FSDP see every call
(a call to `model.generator` directly would bypass them); each part has its own optimizer (optim.generator,
optim.discriminator).
"""

from __future__ import annotations

import torch
import torch.nn as nn

PIXELS, CLASSES = 64, 10


class Generator(nn.Module):
    def __init__(self, z_dim: int, hidden: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(z_dim + CLASSES, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, hidden),
                                 nn.LeakyReLU(0.2), nn.Linear(hidden, PIXELS))

    def forward(self, z: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        onehot = nn.functional.one_hot(labels, CLASSES).to(z.dtype)
        # Images in [0, 1]. Each part returns a tensor of its own, not a view (FSDP2 warns of a wrapped module's
        # view output, whose in-place use could break its backward): the sigmoid after the reshape, and the logit
        # as a sum over its one column (exact), not a squeeze.
        return torch.sigmoid(self.net(torch.cat([z, onehot], 1)).view(-1, 1, 8, 8))


class Discriminator(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(PIXELS + CLASSES, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, hidden),
                                 nn.LeakyReLU(0.2), nn.Linear(hidden, 1))

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        onehot = nn.functional.one_hot(labels, CLASSES).to(images.dtype)
        return self.net(torch.cat([images.flatten(1) * 2 - 1, onehot], 1)).sum(-1)  # a logit per image


class GAN(nn.Module):
    _no_split_modules = ["Generator", "Discriminator"]  # FSDP units

    def __init__(self, z_dim: int = 32, hidden: int = 256):
        super().__init__()
        bad = [f"model.{k}={v!r}" for k, v in (("z_dim", z_dim), ("hidden", hidden))
               if not isinstance(v, int) or isinstance(v, bool) or v < 1]
        if bad:  # (hidden=0 trained a discriminator of zero-size layers, loss ln 2, without a word)
            raise ValueError(f"{', '.join(bad)}: the GAN's sizes are positive integers")
        self.z_dim = z_dim
        self.generator = Generator(z_dim, hidden)
        self.discriminator = Discriminator(hidden)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Every parameter from the global RNG, in a fixed order (the framework re-runs it on sharded models)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.05)
                nn.init.zeros_(m.bias)

    def forward(self, images: torch.Tensor, labels: torch.Tensor, z: torch.Tensor, mode: str) -> torch.Tensor:
        """Summed losses of the non-saturating GAN: mode="discriminator" (real vs generated, the generator frozen),
        mode="generator" (generated judged real), mode="generate" (the images)."""
        if mode == "generate":
            return self.generator(z, labels)
        if mode == "discriminator":
            with torch.no_grad():
                fake = self.generator(z, labels)
            logits = self.discriminator(torch.cat([images, fake]), torch.cat([labels, labels]))
            real, made = logits[: len(images)], logits[len(images):]
            return (nn.functional.softplus(-real) + nn.functional.softplus(made)).sum()
        if mode == "generator":
            return nn.functional.softplus(-self.discriminator(self.generator(z, labels), labels)).sum()
        raise ValueError(f"mode={mode!r}: expected discriminator, generator or generate")
