"""Parallelism strategies, one class per `conf/world/*.yaml` (`world._target_`)."""

from .base import SingleDevice, Strategy, seed_everything, unwrap
from .ddp import DDP

__all__ = ["DDP", "SingleDevice", "Strategy", "seed_everything", "unwrap"]
