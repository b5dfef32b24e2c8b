"""The GAN's task: its own training step (the discriminator's step, then the generator's, each with its own
optimizer and schedule), its val loss, and image grids with the diffusion recipe's sample metrics."""

from __future__ import annotations

import os

import torch
import torch.nn as nn

from trainer import noise
from trainer.errors import ConfigError
from trainer.parallel import unwrap
from trainer.recipes.diffusion.task import (
    THRESHOLD_QUANTILE,
    _all_samples,
    image_grid,
    nearest_neighbours,
    sample_metrics,
)


class GANTask:
    """Batches are (images [B,1,8,8] in [0, 1], labels [B]); each image's latent comes from trainer.noise (its place in
    the global sample stream), so any number of ranks draws the same latents."""

    target_unit = "images"

    def __init__(self, num_samples: int = 40, seed: int = 0):
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 0:
            raise ConfigError(f"task.num_samples={num_samples!r} must be an integer >= 0 (0: no samples at eval; "
                              "40 is the default).")
        self.num_samples, self.seed = num_samples, seed
        self.train_images = self.train_labels = None
        self.threshold = self.reference = float("nan")

    def setup(self, train, val, run_dir: str | os.PathLike | None = None) -> None:
        """The training images, for the sample metrics (every rank: cheap and deterministic)."""
        self.train_images, self.train_labels = _all_samples(train)
        ref_images = _all_samples(val)[0] if val is not None and len(val) else self.train_images
        ref, _ = nearest_neighbours(ref_images, self.train_images, exclude_self=val is None)
        self.reference, self.threshold = ref.mean().item(), ref.quantile(THRESHOLD_QUANTILE).item()

    def num_targets(self, batch) -> int:
        return len(batch[1])

    def _latents(self, model: nn.Module, n: int, device) -> torch.Tensor:
        return noise.randn(n, unwrap(model).z_dim, device=device)

    def training_step(self, step) -> dict[str, torch.Tensor]:
        """The discriminator's step, then the generator's (the same latents: one draw per image and step)."""
        d_loss = g_loss = 0.0
        for images, labels in step.micro_batches():
            with step.autocast():
                loss = step.model(images, labels, self._latents(step.model, len(labels), images.device), "discriminator")
            step.backward(loss)
            d_loss = d_loss + loss.detach()
        step.optimizer_step("discriminator")
        for images, labels in step.micro_batches():
            with step.autocast():
                loss = step.model(images, labels, self._latents(step.model, len(labels), images.device), "generator")
            step.backward(loss)
            g_loss = g_loss + loss.detach()
        step.optimizer_step("generator")
        return {"loss": g_loss, "d_loss": d_loss}  # summed over images: logged per image

    def loss(self, model: nn.Module, batch) -> dict[str, torch.Tensor]:
        """At eval: the generator's loss against the current discriminator, and the discriminator's."""
        images, labels = batch
        z = self._latents(model, len(labels), images.device)
        return {"loss": model(images, labels, z, "generator"), "d_loss": model(images, labels, z, "discriminator")}

    @torch.no_grad()
    def sample(self, model: nn.Module, device: torch.device) -> dict:
        """An image grid (a column per class) and the sample metrics of the diffusion recipe."""
        if self.num_samples <= 0:
            return {}
        labels = torch.arange(self.num_samples, device=device) % 10
        g = torch.Generator(device=device).manual_seed(self.seed)
        z = torch.randn(self.num_samples, model.z_dim, generator=g, device=device)
        images = model(None, labels, z, "generate").float().cpu()
        out: dict = {"image": image_grid(images, ncols=10)}
        if self.train_images is not None:
            out.update(sample_metrics(images, labels.cpu(), self.train_images, self.train_labels, self.threshold))
            out["nn_distance_reference"] = self.reference
        return out
