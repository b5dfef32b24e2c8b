"""Randomness that belongs to samples, not to processes: the same noise for a sample however the global
batch is split across ranks and micro-steps.

A task that draws noise in its loss (diffusion: the noise and the time of each image) from the
process's generator gets other noise for the same sample at another world size or accumulation, so
world size would no longer be a pure performance knob. Here each value is a hash of (seed, the
sample's position in the global sample stream, which draw, which element) — a counter-based
generator, like Philox — computed with integer tensor ops on the batch's device, so it costs a few
elementwise kernels and needs no per-sample state.

The Trainer sets the positions around every `task.loss` call (`for_samples`); a task calls
`randn_like(x)` / `rand(n, ...)` in it. Outside such a block (a task used on its own) they fall back
to torch's global generator.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

_M32 = 0xFFFFFFFF
_state: dict = {"positions": None, "seed": 0, "draws": 0}


class for_samples:
    """Within the block, draws for row i of a batch depend only on (seed, positions[i]).

    A class, not a generator: the Trainer enters one every micro-step. (`positions` stays a tensor, built outside
    any compiled code: a compiled forward that draws noise takes it as an input, where a Python range or int would
    be a constant it recompiles for at every micro-step.)"""

    __slots__ = ("state", "previous")

    def __init__(self, positions: torch.Tensor, seed: int):
        self.state = {"positions": positions, "seed": seed, "draws": 0}
        self.previous: list[dict] = []  # (a stack: the same block may be entered again inside itself)

    def __enter__(self) -> None:
        self.previous.append(dict(_state))
        _state.update(self.state)

    def __exit__(self, *exc) -> None:
        _state.update(self.previous.pop())


def replayed_in_recompute() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """torch.utils.checkpoint's `context_fn` (activation checkpointing, trainer/parallel/strategy.py): the block's
    recomputation in backward draws what its forward drew. torch restores its own generators there; this counter it
    did not, so a model drawing `randn_like` in a checkpointed block got other noise in backward, which then
    differentiated another function than the forward computed (other gradients than without checkpointing)."""
    at_forward = dict(_state)  # (called as the block's forward starts)
    return contextlib.nullcontext(), _replay(at_forward)


@contextlib.contextmanager
def _replay(state: dict) -> Iterator[None]:
    previous = dict(_state)
    _state.update(state)
    try:
        yield
    finally:
        _state.update(previous)


@contextlib.contextmanager
def rows(rows: torch.Tensor) -> Iterator[None]:
    """Within a `for_samples` block: draws for these rows of its batch alone (a pipeline's microbatch), the same
    values the whole batch's draws give them. Outside one, nothing changes."""
    positions = _state["positions"]
    if positions is None:
        yield
        return
    with for_samples(positions[rows.to(positions.device)], _state["seed"]):
        yield


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) of int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _uniform(shape: tuple[int, ...], device, dtype) -> torch.Tensor:
    """Uniform (0, 1) values [len(positions), *shape] for the next draw of the current block."""
    positions = _state["positions"].to(device=device, dtype=torch.int64)
    draw, seed = _state["draws"], _state["seed"]
    _state["draws"] += 1
    elems = torch.arange(math.prod(shape), device=device, dtype=torch.int64)
    h = _hash32(positions & _M32)
    h = _hash32(h ^ ((positions >> 32) & _M32))
    h = _hash32(h ^ (seed & _M32))
    h = _hash32(h ^ draw)[:, None]
    h = _hash32((h + elems[None, :] * 0x9E3779B9) & _M32)
    h = _hash32(h ^ 0x85EBCA6B)  # a second round over the element mix
    return ((h.double() + 0.5) / 2.0**32).to(dtype).view(len(positions), *shape)


def _active(n: int) -> bool:
    positions = _state["positions"]
    if positions is None:
        return False
    if len(positions) != n:
        raise ValueError(f"trainer.noise: a draw for {n} samples in a batch of {len(positions)}; draw one row "
                         "per sample of the batch task.loss received.")
    return True


def rand(n: int, *shape: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """Uniform [0, 1) values [n, *shape], one independent row per sample of the current batch."""
    if not _active(n):
        return torch.rand(n, *shape, device=device, dtype=dtype)
    return _uniform(tuple(shape), device or "cpu", torch.float64).to(dtype)


def randn(n: int, *shape: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """Standard normal values [n, *shape] (Box-Muller over two uniform draws), one row per sample."""
    if not _active(n):
        return torch.randn(n, *shape, device=device, dtype=dtype)
    u1 = _uniform(tuple(shape), device or "cpu", torch.float64)
    u2 = _uniform(tuple(shape), device or "cpu", torch.float64)
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)).to(dtype)


def randn_like(x: torch.Tensor) -> torch.Tensor:
    return randn(x.shape[0], *x.shape[1:], device=x.device, dtype=x.dtype)


def rand_like(x: torch.Tensor) -> torch.Tensor:
    return rand(x.shape[0], *x.shape[1:], device=x.device, dtype=x.dtype)
