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


def png_bytes(image: torch.Tensor) -> bytes:
    """The image (any layout `to_hwc_uint8` takes) as a PNG file's bytes (8-bit gray, RGB or RGBA)."""
    t = to_hwc_uint8(image)
    h, w, c = t.shape
    color = {1: 0, 3: 2, 4: 6}[c]
    raw = b"".join(b"\x00" + t[y].numpy().tobytes() for y in range(h))  # filter type 0 on every row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (PNG_SIGNATURE + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, color, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def is_image(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() in (2, 3)
