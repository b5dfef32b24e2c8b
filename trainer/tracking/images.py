"""Images as tasks return them (a tensor) to what loggers need: uint8 height x width x channels, and PNG bytes.

PNG is written with the standard library (zlib + struct), so sample grids need no imaging package.
"""

from __future__ import annotations

import struct
import zlib

import torch


def to_hwc_uint8(image: torch.Tensor) -> torch.Tensor:
    """[H, W], [H, W, C] or [C, H, W] (C in 1, 3, 4), uint8 or float in [0, 1], as uint8 [H, W, C]."""
    t = torch.as_tensor(image).detach().cpu()
    if t.dim() == 2:
        t = t[:, :, None]
    elif t.dim() == 3 and t.shape[0] in (1, 3, 4) and t.shape[-1] not in (1, 3, 4):
        t = t.permute(1, 2, 0)
    if t.dim() != 3 or t.shape[-1] not in (1, 3, 4):
        raise ValueError(f"an image must be [H, W], [H, W, C] or [C, H, W] with C in 1, 3, 4; got {tuple(t.shape)}")
    if t.dtype != torch.uint8:
        t = (t.float().clamp(0, 1) * 255).round().to(torch.uint8)
    return t.contiguous()


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"  # (the first 8 bytes of every PNG file)


# The text chunk `python -m trainer sample` writes into its PNGs: a later `sample out=` may replace such a file (a
# sample regenerated), and no other (another run's training images, a photo of one's own).
SAMPLE_TEXT = {"Software": "python -m trainer sample"}


def is_sample_png(head: bytes) -> bool:
    """Whether a PNG file's first bytes carry SAMPLE_TEXT (written right after its header)."""
    key, value = next(iter(SAMPLE_TEXT.items()))
    return head.startswith(PNG_SIGNATURE) and b"tEXt" + f"{key}\0{value}".encode("latin-1") in head[:200]


def png_bytes(image: torch.Tensor, text: dict[str, str] | None = None) -> bytes:
    """The image (any layout `to_hwc_uint8` takes) as a PNG file's bytes (8-bit gray, RGB or RGBA); `text`: tEXt
    chunks (latin-1 keys and values) after the header."""
    t = to_hwc_uint8(image)
    h, w, c = t.shape
    color = {1: 0, 3: 2, 4: 6}[c]
    raw = b"".join(b"\x00" + t[y].numpy().tobytes() for y in range(h))  # filter type 0 on every row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    notes = b"".join(chunk(b"tEXt", f"{k}\0{v}".encode("latin-1")) for k, v in (text or {}).items())
    return (PNG_SIGNATURE + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, color, 0, 0, 0)) + notes
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def is_image(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() in (2, 3)
