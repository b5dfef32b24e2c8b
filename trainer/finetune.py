"""Fine-tuning: a run that starts from pretrained weights (`finetune.weights=PATH`), optionally training LoRA
adapters only (`finetune.lora.rank=8 finetune.lora.targets=[qkv,proj]`).

Three moments of a run, each a function here, so that run.py calls one line at each:

* `factory(build, cfg)`: the model as the strategy builds it (on the meta device under sharding): cast to
  `finetune.dtype`, then frozen with adapters added (lora.py). Before any strategy splits or wraps it, so DDP
  buckets only the adapters, FSDP shards them with their unit, and tensor parallelism splits them with their
  layer.
* `check(model, cfg)`: in the launcher, on the model built on the meta device: the weights' files exist, are
  safetensors, and fit the model key by key and shape by shape (pretrained.py), and the LoRA targets exist. A
  mistake is one paragraph before any worker starts.
* `start(model, cfg, seed, is_main)`: after the strategy built the model: every rank reads its part of the
  weights, the adapters are drawn from the seed (every strategy draws the same), and the main rank returns what
  run_info.json records of the source (its path and its files' sha256).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from .config import FinetuneConfig, typed

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def settings(node: Any) -> FinetuneConfig:
    """The run's `finetune` section (defaults for a config written before it existed)."""
    return typed(FinetuneConfig, node)


def factory(build: Callable[[], nn.Module], node: Any) -> Callable[[], nn.Module]:
    cfg = settings(node)

    def make() -> nn.Module:
        model = build()
        if cfg.dtype is not None:
            model.to(DTYPES[cfg.dtype])
        if cfg.lora.rank:
            from . import lora

            model._lora_targets = lora.inject(model, list(cfg.lora.targets), cfg.lora.rank, cfg.lora.alpha,
                                              cfg.lora.dropout)
        return model

    return make


def _adapter_keys(model: nn.Module) -> set[str]:
    from .lora import ADAPTER_KEYS

    return {k for k in model.state_dict() if k.rsplit(".", 1)[-1] in ADAPTER_KEYS}


def check(model: nn.Module, node: Any) -> None:
    """Config mistakes visible on the model built on the meta device (its LoRA adapters injected by `factory`)."""
    cfg = settings(node)
    if cfg.weights is None:
        return
    from .pretrained import match, open_weights

    weights = open_weights(cfg.weights)
    try:
        match(model, weights, skip=_adapter_keys(model))
    finally:
        weights.close()


def start(model: nn.Module, node: Any, seed: int, is_main: bool) -> dict | None:
    """Load the pretrained weights into the built (wrapped, maybe sharded) model and draw its adapters. Returns the
    source's record for run_info.json on the main rank."""
    from .strategies import seed_everything, unwrap

    cfg = settings(node)
    raw = unwrap(model)
    record = None
    if cfg.weights is not None:
        from .pretrained import load_into, match, open_weights

        weights = open_weights(cfg.weights)
        try:
            load_into(raw, weights, match(raw, weights, skip=_adapter_keys(raw)))
            record = weights.record(is_main)
            if record is not None and cfg.dtype is not None:
                record["dtype"] = cfg.dtype
        finally:
            weights.close()
    names = getattr(raw, "_lora_targets", None)
    if names:
        from . import lora

        lora.init(raw, names, seed, seed_everything)
    return record
