"""Capture and restore every random number generator of this process (for exact resume)."""

from __future__ import annotations

import contextlib
import random
import sys
from typing import Any

import torch


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:  # numpy's global generator, where the process uses numpy (as Accelerate keeps it)
        state["numpy"] = numpy_state()
    return state


def numpy_state() -> dict[str, Any]:
    """numpy's global RandomState as plain values (JSON, no pickle): the MT19937 key, position and cached gaussian."""
    import numpy as np

    kind, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {"kind": str(kind), "key": [int(k) for k in key], "pos": int(pos), "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached)}


def set_numpy_state(state: dict[str, Any], generator=None) -> None:
    import numpy as np

    values = (state["kind"], np.asarray(state["key"], dtype=np.uint32), int(state["pos"]), int(state["has_gauss"]),
              float(state["cached_gaussian"]))
    (generator or np.random).set_state(values)


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        set_numpy_state(state["numpy"])


@contextlib.contextmanager
def kept():
    """Every generator of this process as it was before the block, after it: what runs inside (an eval, its samples,
    on the main rank alone) leaves training's random streams (dropout, augmentation) where they were, so a run's
    numbers do not depend on how often it evaluates, and a resume from a checkpoint saved after an eval is exact."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)
