"""The 8 x 8 handwritten digits (UCI optdigits, 1,797 images shipped as `digits.csv.gz`; see DATA.md).

`digits()` returns a stratified, seeded (train, val) split of `DigitImages`; `Normalizer` holds the
per-pixel mean and std of the training images (tensors only, so checkpoints and exports never pickle).
"""

from __future__ import annotations

import csv
import gzip
import os
import zlib
from pathlib import Path

import torch
from torch.utils.data import Dataset

from trainer.errors import DataError

SHIPPED = Path(__file__).with_name("digits.csv.gz")
SIDE, NUM_PIXELS, MAX_PIXEL, NUM_CLASSES = 8, 64, 16, 10


def already_batched(batch):
    """`collate_fn` for datasets whose __getitems__ returns a whole batch."""
    return batch


class DigitImages(Dataset):
    """Images [N, 1, 8, 8] float32 in [0, 1] and labels [N] int64; sample i is (images[i], labels[i])."""

    collate_fn = staticmethod(already_batched)

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        # One gather for the whole batch instead of one index and a stack per sample.
        idx = torch.as_tensor(indices, dtype=torch.long)
        return self.images[idx], self.labels[idx]


def _open_text(p: Path):
    """The file as text, gunzipped when it starts with gzip's magic bytes (any name works)."""
    with open(p, "rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    return gzip.open(p, "rt", newline="") if gzipped else open(p, newline="")


def read_digits(path: str | os.PathLike | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """All rows of a digits CSV: 64 pixel counts 0..16 then a label 0..9 per row, gzipped or not.

    Returns images [N, 1, 8, 8] float32 scaled to [0, 1] (count / 16) and labels [N] int64.
    UCI's own `optdigits.tra` / `optdigits.tes` files have the same layout and load as they are.
    """
    shown = "null (the shipped digits.csv.gz)" if path is None else repr(str(path))
    p = SHIPPED if path is None else Path(os.path.expanduser(str(path)))
    hint = ("Set data.path to a CSV (optionally gzipped) with 65 comma-separated integers per row: "
            "64 pixel counts 0..16, then the label 0..9; data.path=null uses the shipped file.")
    if not p.exists():
        extra = f" ({p} is missing from this installation)" if path is None else ""
        raise DataError(f"data.path={shown} does not exist{extra}. {hint}")
    if p.is_dir():
        raise DataError(f"data.path={shown} is a directory, not a file. {hint}")
    rows: list[list[int]] = []
    try:
        with _open_text(p) as f:
            for line_no, fields in enumerate(csv.reader(f), start=1):
                if not fields or not "".join(fields).strip():
                    continue  # blank lines (a trailing newline) are not rows
                if len(fields) != NUM_PIXELS + 1:
                    raise DataError(f"data.path={shown}, line {line_no}: {len(fields)} fields, expected "
                                    f"{NUM_PIXELS + 1}. {hint}")
                try:
                    row = [int(v) for v in fields]
                except ValueError:
                    raise DataError(f"data.path={shown}, line {line_no}: a field is not an integer. "
                                    f"{hint}") from None
                if min(row[:NUM_PIXELS]) < 0 or max(row[:NUM_PIXELS]) > MAX_PIXEL:
                    raise DataError(f"data.path={shown}, line {line_no}: a pixel value is outside "
                                    f"0..{MAX_PIXEL}. {hint}")
                if not 0 <= row[NUM_PIXELS] < NUM_CLASSES:
                    raise DataError(f"data.path={shown}, line {line_no}: label {row[NUM_PIXELS]} is "
                                    f"outside 0..{NUM_CLASSES - 1}. {hint}")
                rows.append(row)
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise DataError(f"data.path={shown} cannot be read: its gzip stream is truncated or corrupt "
                        f"({type(e).__name__}: {e}). {hint}") from None
    except OSError as e:  # permissions, I/O errors
        reason = e.strerror or str(e) or type(e).__name__
        raise DataError(f"data.path={shown} cannot be read ({reason}). {hint}") from None
    except (UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"data.path={shown} cannot be read as CSV text ({type(e).__name__}: {e}). "
                        f"{hint}") from None
    if not rows:
        raise DataError(f"data.path={shown} is empty: it has no rows. {hint}")
    table = torch.tensor(rows, dtype=torch.int64)
    images = (table[:, :NUM_PIXELS].to(torch.float32) / MAX_PIXEL).reshape(-1, 1, SIDE, SIDE)
    return images.contiguous(), table[:, NUM_PIXELS].contiguous()


def stratified_split(labels: torch.Tensor, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (train, val), both sorted: round(n_c * val_fraction) of each class c go to val.

    The choice inside each class is a permutation from `torch.Generator().manual_seed(seed)`, so the
    split depends only on the labels, the fraction and the seed (never on the global RNG).
    """
    g = torch.Generator().manual_seed(seed)
    val = []
    for c in range(NUM_CLASSES):
        members = (labels == c).nonzero().flatten()
        n_val = round(len(members) * val_fraction)
        val.append(members[torch.randperm(len(members), generator=g)[:n_val]])
    is_val = torch.zeros(len(labels), dtype=torch.bool)
    is_val[torch.cat(val)] = True
    return (~is_val).nonzero().flatten(), is_val.nonzero().flatten()


def digits(path: str | None = None, val_fraction: float = 0.1, seed: int = 0
           ) -> tuple[DigitImages, DigitImages | None]:
    """The digits as (train, val) datasets; val is None when val_fraction is 0.

    `path=None` reads the shipped copy (1,797 images). The split is stratified by class and seeded
    by `seed` (data.seed), so every process and every run with the same arguments gets the same one.
    """
    shown = "null" if path is None else repr(str(path))
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"data.val_fraction={val_fraction} must be in [0, 1) (data.path={shown}); "
                        "0.1 holds out 10% of each class.")
    images, labels = read_digits(path)
    train_idx, val_idx = stratified_split(labels, val_fraction, seed)
    if len(train_idx) == 0:
        raise DataError(f"data.path={shown} has {len(labels)} rows: too few to keep any for training "
                        f"with data.val_fraction={val_fraction}. Use a larger file or a smaller fraction.")
    train = DigitImages(images[train_idx], labels[train_idx])
    val = DigitImages(images[val_idx], labels[val_idx]) if len(val_idx) else None
    return train, val


class Normalizer:
    """Per-pixel standardisation: (x - mean) / std with the mean and std of the training images.

    Pixels that are (almost) always 0, such as the corners, have std ~0; it is clamped to `min_std`
    so that the rare nonzero value there does not become a huge input.
    """

    def __init__(self, min_std: float = 0.1):
        self.min_std = min_std
        self.mean: torch.Tensor | None = None
        self.std: torch.Tensor | None = None

    def fit(self, images: torch.Tensor) -> Normalizer:
        """Statistics over the batch dimension of `images` [N, ...] (computed in float64, stored float32)."""
        x = images.detach().to(torch.float64)
        self.mean = x.mean(0).to(torch.float32)
        self.std = x.std(0, correction=0).clamp_min(self.min_std).to(torch.float32)
        return self

    def _stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mean is None or self.std is None:
            raise RuntimeError("Normalizer used before fit() or load_state_dict()")
        if self.mean.device != like.device:  # follow the data once, not a copy per batch
            self.mean, self.std = self.mean.to(like.device), self.std.to(like.device)
        return self.mean.to(like.dtype), self.std.to(like.dtype)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        mean, std = self._stats(x)
        return (x - mean) / std

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        mean, std = self._stats(x)
        return x * std + mean

    def state_dict(self) -> dict[str, torch.Tensor]:
        self._stats(torch.empty(0))
        return {"mean": self.mean.clone(), "std": self.std.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if set(state) != {"mean", "std"}:
            raise KeyError(f"Normalizer state needs exactly the keys 'mean' and 'std', got {sorted(state)}")
        mean, std = state["mean"], state["std"]
        if mean.shape != std.shape:
            raise ValueError(f"Normalizer state: mean {tuple(mean.shape)} and std {tuple(std.shape)} differ")
        self.mean, self.std = mean.detach().to(torch.float32).clone(), std.detach().to(torch.float32).clone()
