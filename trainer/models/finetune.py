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

from trainer.config.schema import FinetuneConfig, typed

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
            from trainer.models import lora

            model._lora_targets = lora.inject(model, list(cfg.lora.targets), cfg.lora.rank, cfg.lora.alpha,
                                              cfg.lora.dropout)
        return model

    return make


def _adapter_keys(model: nn.Module) -> set[str]:
    from trainer.models.lora import ADAPTER_KEYS

    return {k for k in model.state_dict() if k.rsplit(".", 1)[-1] in ADAPTER_KEYS}


def check(model: nn.Module, node: Any) -> None:
    """Config mistakes visible on the model built on the meta device (its LoRA adapters injected by `factory`)."""
    cfg = settings(node)
    if cfg.weights is None:
        return
    from trainer.models.pretrained import check_config, match, open_weights

    weights = open_weights(cfg.weights)
    try:
        check_config(model, cfg.weights)  # (first: a size that differs is clearer named than as missing keys)
        match(model, weights, skip=_adapter_keys(model))
    finally:
        weights.close()


def start(model: nn.Module, node: Any, seed: int, is_main: bool) -> dict | None:
    """Load the pretrained weights into the built (wrapped, maybe sharded) model and draw its adapters. Returns the
    source's record for run_info.json on the main rank."""
    from trainer.parallel import seed_everything, unwrap

    cfg = settings(node)
    raw = unwrap(model)
    record = None
    if cfg.weights is not None:
        from trainer.models.pretrained import check_config, load_into, match, open_weights

        weights = open_weights(cfg.weights)
        try:
            check_config(raw, cfg.weights)  # (a single process has no preflight: `check` has not run)
            load_into(raw, weights, match(raw, weights, skip=_adapter_keys(raw)))
            record = weights.record(is_main)
            if record is not None and cfg.dtype is not None:
                record["dtype"] = cfg.dtype
        finally:
            weights.close()
    names = getattr(raw, "_lora_targets", None)
    if names:
        from trainer.models import lora

        lora.init(raw, names, seed, seed_everything)
    return record


def frozen_keys(model: nn.Module) -> frozenset[str]:
    """The state_dict keys of a LoRA run's frozen base weights. Checkpoints leave them out: a resume rebuilds them
    exactly (from finetune.weights, or from the seed without it), so each checkpoint holds the adapters, the
    buffers and the optimizer's state only. Empty for any other model: a parameter a user froze by hand may have
    been set by anything, so it is saved."""
    from trainer.parallel import unwrap

    raw = unwrap(model)
    if not getattr(raw, "_lora_targets", None):
        return frozenset()
    return frozenset(n for n, p in raw.named_parameters(remove_duplicate=False) if not p.requires_grad)


def after_load(model: nn.Module) -> None:
    """After a checkpoint's tensors are loaded into `model`: LoRA adapters keep this run's scale (finetune.lora.alpha
    / rank, which their forward uses), not the checkpoint's buffer, which the export would otherwise merge with."""
    from trainer.models.lora import keep_configured_scales

    keep_configured_scales(model)


class Source:
    """The pretrained files a LoRA run's checkpoints rest on (their sha256), a stateful part of the checkpoint: a
    resume that would rebuild the frozen weights from other bytes stops, naming the files, instead of training
    adapters on a base they were not trained with."""

    def __init__(self, record: dict):
        self.record = record  # pretrained.Weights.record: {"path", "files": {name: {"bytes", "sha256"}}}

    def digests(self) -> dict[str, str]:
        return {name: f["sha256"] for name, f in self.record["files"].items()}

    def state_dict(self) -> dict[str, Any]:
        return {"sha256": self.digests()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass  # nothing to restore: the check is all

    def check_state(self, state: dict[str, Any], where: str) -> None:
        from trainer.errors import CheckpointError

        saved, now = dict(state["sha256"]), self.digests()
        if saved != now:
            changed = sorted(n for n in set(saved) | set(now) if saved.get(n) != now.get(n))
            raise CheckpointError(
                f"{where} holds LoRA adapters trained on other pretrained weights than finetune.weights="
                f"{self.record['path']} holds now ({', '.join(changed)} differ by sha256): its checkpoints leave the "
                "frozen base weights out and a resume reads them from that path again. Restore the files the run "
                "started from, or start a new run (resume=null) from these.")
