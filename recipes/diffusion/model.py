"""A tiny class-conditional U-Net for 8 x 8 x 1 images: (x_t [B,1,8,8], t [B], label [B]) -> [B,1,8,8].

Two resolutions (8 x 8 with `channels`, 4 x 4 with 2 x `channels`), one residual block per level on
each side plus one in the middle, skips by concatenation. The diffusion time enters through a
sinusoidal embedding and an MLP, the class through an embedding table with one extra row, the "no
label" class `num_classes` (for classifier-free guidance); their sum modulates every block's second
normalisation (scale and shift, as in ADM). At channels=32 it has 446,113 parameters.

The model predicts a velocity for flow matching (see `task.py` for why flow matching): it is only a
function of its inputs, so the same network would serve an epsilon-prediction DDPM objective.
Why convolutions: in the probe behind the recipe's defaults, a residual MLP over the 64 pixels ran
about twice as many steps per second, but with 4.5x the parameters (2 M) it reached a higher training
loss after 2,000 steps of 128 images (0.56 vs 0.53), and its samples sat closer to the training images
(nearest-neighbour distance 0.92 vs 0.99; real held-out digits: 1.03), a first sign of copying. The
U-Net shares its weights across positions, which suits strokes that can sit anywhere in the image.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10_000.0) -> torch.Tensor:
    """Sinusoidal features [B, dim] of times t [B] in [0, 1] (scaled by 1000, as for DDPM step indices)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = 1000.0 * t.float()[:, None] * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=1)
    return F.pad(emb, (0, dim % 2))


def _groups(channels: int) -> int:
    return math.gcd(channels, 8)


class ResBlock(nn.Module):
    """GroupNorm-SiLU-conv twice, the conditioning as scale and shift after the second norm."""

    def __init__(self, cin: int, cout: int, emb_dim: int):
        super().__init__()
        self.norm1 = nn.GroupNorm(_groups(cin), cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.emb = nn.Linear(emb_dim, 2 * cout)
        self.norm2 = nn.GroupNorm(_groups(cout), cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        scale, shift = self.emb(emb)[:, :, None, None].chunk(2, dim=1)
        h = self.norm2(h) * (1 + scale) + shift
        h = self.conv2(F.silu(h))
        return self.skip(x) + h


class UNet(nn.Module):
    """The denoiser. `forward(x, t, y)`: y in 0..num_classes-1, or num_classes for "no label"."""

    # Its repeated blocks: what trainer.activation_checkpointing recomputes and world=fsdp shards unit by unit.
    _no_split_modules = ["ResBlock"]

    def __init__(self, channels: int = 32, num_classes: int = 10, time_dim: int = 64, emb_dim: int = 128,
                 in_channels: int = 1, image_size: int = 8):
        super().__init__()
        sizes = {"channels": channels, "num_classes": num_classes, "time_dim": time_dim, "emb_dim": emb_dim,
                 "in_channels": in_channels, "image_size": image_size}
        bad = [f"model.{k}={v!r}" for k, v in sizes.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1]
        if bad:  # (0 classes or channels failed in the first step, or trained a model of nothing)
            raise ValueError(f"{', '.join(bad)}: the UNet's sizes are positive integers")
        if image_size % 2:
            raise ValueError(f"model.image_size={image_size} must be even (one 2x downsampling)")
        c, c2 = channels, 2 * channels
        self.num_classes, self.time_dim, self.image_size = num_classes, time_dim, image_size
        self.time_mlp = nn.Sequential(nn.Linear(time_dim, emb_dim), nn.SiLU(), nn.Linear(emb_dim, emb_dim))
        self.class_emb = nn.Embedding(num_classes + 1, emb_dim)
        self.inp = nn.Conv2d(in_channels, c, 3, padding=1)
        self.down1 = ResBlock(c, c, emb_dim)                      # 8 x 8
        self.downsample = nn.Conv2d(c, c2, 3, stride=2, padding=1)
        self.down2 = ResBlock(c2, c2, emb_dim)                    # 4 x 4
        self.mid = ResBlock(c2, c2, emb_dim)
        self.up2 = ResBlock(2 * c2, c2, emb_dim)                  # concat with down2's output
        self.upsample = nn.Conv2d(c2, c, 3, padding=1)           # after nearest 2x upsampling
        self.up1 = ResBlock(2 * c, c, emb_dim)                    # concat with down1's output
        self.out_norm = nn.GroupNorm(_groups(c), c)
        self.out = nn.Conv2d(c, in_channels, 3, padding=1)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter from torch's global RNG, in module order, with torch.nn.init only.

        Xavier-uniform weights and zero biases; the last conv of each residual branch and the output conv
        start at zero, so every block starts as the identity and the first prediction is 0 (ADM's choice).
        """
        for name, m in self.named_modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                if name == "out" or name.endswith(".conv2"):
                    nn.init.zeros_(m.weight)
                else:
                    nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, mean=0.0, std=1.0)
            elif isinstance(m, nn.GroupNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        emb = self.time_mlp(timestep_embedding(t, self.time_dim).to(x.dtype)) + self.class_emb(y)
        h1 = self.down1(self.inp(x), emb)
        h2 = self.down2(self.downsample(h1), emb)
        h = self.up2(torch.cat([self.mid(h2, emb), h2], dim=1), emb)
        h = self.upsample(F.interpolate(h, scale_factor=2.0, mode="nearest"))
        h = self.up1(torch.cat([h, h1], dim=1), emb)
        return self.out(F.silu(self.out_norm(h)))
