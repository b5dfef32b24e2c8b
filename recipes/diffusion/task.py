"""Class-conditional flow matching on the digits: the loss, a seeded sampler and honest sample metrics.

Why flow matching (rectified flow) rather than DDPM: the path x_t = (1 - t) x0 + t noise is a straight
line, the regression target (noise - x0) has the same scale at every t, and there is no noise schedule
to tune. Its sampling paths are nearly straight, so a few dozen plain Euler steps give clean digits,
where DDPM needs a tuned schedule and a DDIM sampler for the same step count. With a model this small
and a CPU budget of minutes, fewer moving parts and fewer sampling steps win.

Training randomness (noise, times, dropped labels) comes from `trainer.noise`: a function of each image's
place in the global sample stream, so 2 ranks draw what 1 rank draws and a resume continues exactly. Sampling uses its own `torch.Generator` seeded with
`task.seed`, so the samples of every eval start from the same noise and are comparable across evals.
"""

from __future__ import annotations

import math
import numbers
import os
from pathlib import Path

import torch
import torch.nn as nn

from trainer import broadcast_from_main, is_main_process
from trainer import noise as sample_noise
from trainer.errors import ConfigError, DataError, UserError
from trainer.io import atomic_save_safetensors

from .data import NUM_CLASSES, SIDE, Normalizer

NORMALIZER_FILE = "normalizer.safetensors"  # in the run dir: the main process's fit, as a record
THRESHOLD_QUANTILE = 0.95  # a sample counts as a digit if it is as close to the training set as 95% of val


def flow_matching_losses(model: nn.Module, x0: torch.Tensor, y: torch.Tensor, noise: torch.Tensor,
                         t: torch.Tensor) -> torch.Tensor:
    """Per-image losses [B]: the mean over pixels of (model(x_t, t, y) - (noise - x0))^2."""
    tb = t.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    x_t = (1 - tb) * x0 + tb * noise
    v = model(x_t, t, y)
    return (v.float() - (noise - x0).float()).pow(2).flatten(1).mean(1)


@torch.no_grad()
def euler_sample(model: nn.Module, noise: torch.Tensor, y: torch.Tensor, steps: int, guidance: float = 0.0,
                 null_label: int = NUM_CLASSES) -> torch.Tensor:
    """Integrate dx/dt = v from t=1 (noise) to t=0 (data) in `steps` uniform Euler steps.

    With guidance w != 0 the velocity is v(y) + w (v(y) - v(no label)) (classifier-free guidance; the
    model must have been trained with label dropout for the "no label" velocity to mean anything).
    """
    x = noise.float()
    ts = torch.linspace(1.0, 0.0, steps + 1, device=noise.device)
    null = torch.full_like(y, null_label)
    for i in range(steps):
        t = ts[i].expand(len(x))
        if guidance:
            v_c, v_u = model(torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, null])).float().chunk(2)
            v = v_c + guidance * (v_c - v_u)
        else:
            v = model(x, t, y).float()
        x = x - (ts[i] - ts[i + 1]) * v
    return x


def nearest_neighbours(images: torch.Tensor, train_images: torch.Tensor, exclude_self: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(distance, index) of each image's nearest training image, L2 over pixels in [0, 1] units."""
    d = torch.cdist(images.flatten(1).double(), train_images.flatten(1).double().to(images.device))
    if exclude_self:
        d.fill_diagonal_(math.inf)
    dist, idx = d.min(dim=1)
    return dist.float(), idx


def sample_metrics(images: torch.Tensor, labels: torch.Tensor, train_images: torch.Tensor,
                   train_labels: torch.Tensor, threshold: float, num_classes: int = NUM_CLASSES
                   ) -> dict[str, float]:
    """How digit-like and how on-label images [N,1,8,8] in [0, 1] are, judged against the training set.

    * nn_distance: mean L2 distance to the nearest training image. Compare with
      nn_distance_reference (the same for held-out real digits): near it is good; far above it is
      noise or smudges (uniform noise scores ~3.5x the reference); far below it means the model copies
      training images (or draws blurry class averages).
    * class_match: the fraction of images that are recognised as their own label: the nearest training
      image has that label (a 1-NN classifier, ~98% accurate on real digits) and is no farther than
      `threshold` (the 95th percentile of real held-out digits' distances). Noise scores 0.
    * class_coverage: the fraction of the classes with at least one recognised image. Noise scores 0;
      a model that ignores its label and draws only ones scores 0.1.
    * diversity: per label, the mean pairwise distance between the images over that between the training
      images of the class, averaged over labels. Real digits score ~1; repeating one image per class
      (mode collapse, or blurry class averages, which pass the other three) scores ~0.

    Good samples have all four: nn_distance near the reference, class_match near real held-out digits'
    (~0.95), coverage 1 and diversity near 1.
    """
    images, labels = images.cpu(), labels.cpu()
    train_images, train_labels = train_images.cpu(), train_labels.cpu()
    dist, idx = nearest_neighbours(images, train_images)
    recognised = (dist <= threshold) & (train_labels[idx] == labels)
    ratios = []
    for c in labels.unique().tolist():
        mine, real = images[labels == c], train_images[train_labels == c]
        if len(mine) >= 2 and len(real) >= 2:
            ratios.append(_mean_pairwise_distance(mine) / _mean_pairwise_distance(real))
    return {
        "nn_distance": dist.mean().item(),
        "class_match": recognised.float().mean().item(),
        "class_coverage": len(labels[recognised].unique()) / num_classes,
        "diversity": sum(ratios) / len(ratios) if ratios else math.nan,
    }


def _mean_pairwise_distance(x: torch.Tensor) -> float:
    d = torch.cdist(x.flatten(1).double(), x.flatten(1).double())
    return (d.sum() / (len(x) * (len(x) - 1))).item()


def image_grid(images: torch.Tensor, ncols: int, upscale: int = 4, border: int = 128) -> torch.Tensor:
    """A uint8 [H, W] grid of images [N,1,h,w] in [0, 1] (0 black, 1 white), 1-pixel `border` lines."""
    n, _, h, w = images.shape
    pix = (images[:, 0].clamp(0, 1) * 255).round().to(torch.uint8).cpu()
    pix = pix.repeat_interleave(upscale, dim=1).repeat_interleave(upscale, dim=2)
    ch, cw = h * upscale + 1, w * upscale + 1
    rows = max(1, math.ceil(n / ncols))
    grid = torch.full((rows * ch + 1, ncols * cw + 1), border, dtype=torch.uint8)
    for i in range(n):
        r, c = divmod(i, ncols)
        grid[1 + r * ch : (r + 1) * ch, 1 + c * cw : (c + 1) * cw] = pix[i]
    return grid


def check_normalizer_path(path: Path) -> None:
    """Say what to do if a directory is where the normaliser's statistics go, before the run starts."""
    if path.is_dir():  # (os.replace would fail with IsADirectoryError, and so would every rerun)
        raise UserError(f"{path} is a directory, where the diffusion recipe writes its normaliser's statistics. "
                        "Remove it (they are fitted again at every start, so nothing is lost) and run the same "
                        "command again.")


def save_normalizer(path: Path, stats: dict[str, torch.Tensor]) -> None:
    """Write the normaliser's statistics to `path` (atomically)."""
    check_normalizer_path(path)
    atomic_save_safetensors(path, stats, metadata={"format": "pt"})


def _all_samples(dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (image, label) sample of `dataset`, stacked. A dataset of another kind (data=text's token windows, a
    stream) is one paragraph saying what the image recipes train on: it was a TypeError from torch's stacking."""
    if hasattr(dataset, "images") and hasattr(dataset, "labels"):
        return dataset.images, dataset.labels
    given = type(dataset).__name__
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        raise DataError(f"this recipe trains on a dataset of (image, label) samples it can index (data=digits, or a "
                        f"map-style dataset of your own), and got {given}, a stream. Choose data=digits or point "
                        "data._target_ at such a dataset.")
    samples = [dataset[i] for i in range(len(dataset))]
    first = samples[0] if samples else None
    image, label = first if isinstance(first, (tuple, list)) and len(first) == 2 else (None, None)
    if not (isinstance(image, torch.Tensor) and image.is_floating_point() and image.dim() == 3
            and (isinstance(label, numbers.Integral) and not isinstance(label, bool)
                 or isinstance(label, torch.Tensor) and label.numel() == 1 and not label.is_floating_point())):
        def kind(x) -> str:
            return f"a tensor {list(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else f"a {type(x).__name__}"

        shown = (f"({', '.join(kind(x) for x in first)})" if isinstance(first, (tuple, list)) else kind(first))
        raise DataError(f"this recipe trains on (image, label) samples: a float image tensor [channels, height, "
                        f"width] and an integer class (data=digits gives 8x8 digits). {given}'s first sample is "
                        f"{shown}. Choose data=digits or point data._target_ at such a dataset.")
    images, labels = zip(*samples)
    return torch.stack(images), torch.as_tensor(labels)


class Diffusion:
    """The task object the Trainer calls (see `trainer.task.Task`); batches are (images [B,1,8,8], labels [B]).

    num_samples: images drawn at each eval, labels cycling 0..num_classes-1 (one grid column per class).
    sample_steps: Euler steps per sample. guidance: classifier-free guidance weight (0 = plain conditional).
    label_dropout: the probability a training label is replaced by "no label" (needed for guidance).
    seed: seeds the sampler's generator. upscale: pixels per image pixel in the grid.
    num_classes: the model's classes (its "no label" class is this index). min_std: the normaliser's
    floor on per-pixel std (in [0, 1] pixel units).
    """

    target_unit = "images"  # num_targets counts images: train/images_per_s

    def __init__(self, num_samples: int = 64, sample_steps: int = 32, guidance: float = 0.0, seed: int = 0,
                 label_dropout: float = 0.0, num_classes: int = NUM_CLASSES, upscale: int = 4,
                 min_std: float = 0.1):
        if not 0.0 <= label_dropout < 1.0:
            raise ConfigError(f"task.label_dropout={label_dropout} must be in [0, 1); 0.1 is usual with guidance.")
        if guidance and not label_dropout:
            raise ConfigError(f"task.guidance={guidance} needs task.label_dropout > 0 (e.g. 0.1): without it the "
                              "model never learns the unconditional velocity that guidance subtracts.")
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 0:
            raise ConfigError(f"task.num_samples={num_samples!r} must be an integer >= 0 (0: no samples at eval; "
                              "64 is the default).")
        if isinstance(sample_steps, bool) or not isinstance(sample_steps, int) or sample_steps < 1:
            raise ConfigError(f"task.sample_steps={sample_steps!r} must be an integer >= 1 (32 is the default).")
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
            raise ConfigError(f"task.num_classes={num_classes!r} must be an integer >= 1: the model's classes (its "
                              "'no label' class is this index).")
        if isinstance(upscale, bool) or not isinstance(upscale, int) or upscale < 1:
            raise ConfigError(f"task.upscale={upscale!r} must be an integer >= 1 (the sample grid's pixels per pixel).")
        self.num_samples, self.sample_steps, self.guidance, self.seed = num_samples, sample_steps, guidance, seed
        self.label_dropout, self.num_classes, self.upscale = label_dropout, num_classes, upscale
        self.normalizer = Normalizer(min_std=min_std)
        self.train_images: torch.Tensor | None = None
        self.train_labels: torch.Tensor | None = None
        self.reference = math.nan   # mean nn distance of real held-out digits
        self.threshold = math.nan   # their 95th percentile: the "looks like a digit" cut-off

    def write_records(self, run_dir: str | os.PathLike) -> None:
        """`run_dir/normalizer.safetensors`, the main process's fit, once the run is under way (its resume
        accepted): a refused resume (other data) leaves the run dir's record as it was."""
        save_normalizer(Path(run_dir) / NORMALIZER_FILE, self.normalizer.state_dict())

    def setup(self, train, val, run_dir: str | os.PathLike | None = None) -> None:
        """Fit the normaliser on the training split on the main process and send it to every other rank, so
        all ranks share one normaliser, computed once (`write_records` keeps it beside the run's weights). Then the reference distances of the
        sample metrics (every rank: cheap, deterministic)."""
        self.train_images, self.train_labels = _all_samples(train)
        if len(self.train_labels) and int(self.train_labels.max()) >= self.num_classes:  # (an IndexError in a step)
            raise ConfigError(f"task.num_classes={self.num_classes} (model.num_classes, which it follows) is fewer than "
                              f"the data's labels, 0 to {int(self.train_labels.max())}: give the model a class for "
                              f"each, model.num_classes={int(self.train_labels.max()) + 1}.")
        if run_dir is None:
            self.normalizer.fit(self.train_images)
        else:
            stats = None
            if is_main_process():
                stats = self.normalizer.fit(self.train_images).state_dict()
                check_normalizer_path(Path(run_dir) / NORMALIZER_FILE)  # (written once the run is under way)
            # From rank 0 itself, not from the file: whatever happens to the file between rank 0's write
            # and another rank's read (replaced, edited, a stale copy on another node) cannot reach it.
            self.normalizer.load_state_dict(broadcast_from_main(stats))
        if val is not None and len(val) > 0:
            ref, _ = nearest_neighbours(_all_samples(val)[0], self.train_images)
        else:  # no val split: leave-one-out distances within the training set stand in for it
            ref, _ = nearest_neighbours(self.train_images, self.train_images, exclude_self=True)
        self.reference = ref.mean().item()
        self.threshold = ref.quantile(THRESHOLD_QUANTILE).item()

    def num_targets(self, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
        return len(batch[1])

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        images, labels = batch
        x0 = self.normalizer.normalize(images)
        # Per-sample randomness (trainer.noise: each image's draws depend on its place in the global sample
        # stream, so any split of the batch over ranks gives the same noise), in a fixed order: noise,
        # times, then (only with dropout) which labels to drop.
        noise = sample_noise.randn_like(x0)
        t = sample_noise.rand(len(x0), device=x0.device)
        if self.label_dropout:
            drop = sample_noise.rand(len(x0), device=x0.device) < self.label_dropout
            labels = torch.where(drop, torch.full_like(labels, self.num_classes), labels)
        # Summed, not averaged: the trainer divides by the number of images in the global batch.
        return flow_matching_losses(model, x0, labels, noise, t).sum()

    @torch.no_grad()
    def generate(self, model: nn.Module, labels: torch.Tensor, generator: torch.Generator | None = None
                 ) -> torch.Tensor:
        """Images [N,1,8,8] in [0, 1] for `labels`, from noise drawn with `generator` on labels' device."""
        noise = torch.randn((len(labels), 1, SIDE, SIDE), generator=generator, device=labels.device)
        x = euler_sample(model, noise, labels, self.sample_steps, self.guidance, null_label=self.num_classes)
        return self.normalizer.denormalize(x).clamp(0, 1)

    def sample(self, model: nn.Module, device: torch.device) -> dict:
        """{"image": uint8 [H, W] grid (one column per class), and float metrics (see `sample_metrics`)}.

        The metrics need setup() (the training images); without it only the image is returned.
        num_samples=0 returns {}.
        """
        if self.num_samples <= 0:
            return {}
        labels = torch.arange(self.num_samples, device=device) % self.num_classes
        g = torch.Generator(device=device).manual_seed(self.seed)
        images = self.generate(model, labels, g).float().cpu()
        out: dict = {"image": image_grid(images, ncols=min(self.num_classes, self.num_samples), upscale=self.upscale)}
        if self.train_images is not None:
            out.update(sample_metrics(images, labels.cpu(), self.train_images, self.train_labels, self.threshold,
                                      self.num_classes))
            out["nn_distance_reference"] = self.reference
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"normalizer.{k}": v for k, v in self.normalizer.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.normalizer.load_state_dict({k.removeprefix("normalizer."): v for k, v in state.items()})
