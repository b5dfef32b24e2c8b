"""Parallelism strategies, one class per `conf/world/*.yaml` (`world._target_`)."""

from .base import SingleDevice, Strategy, seed_everything, unwrap
from .ddp import DDP
from .fsdp import FSDP

__all__ = ["DDP", "FSDP", "SingleDevice", "Strategy", "seed_everything", "unwrap"]
