"""LoRA: low-rank adapters on named linear layers (`finetune.lora.rank=8 finetune.lora.targets=[...]`).

A targeted `nn.Linear` keeps its weight W (frozen, as every other parameter of the model) and gets two new
parameters beside it, `lora_A` [rank, in] and `lora_B` [out, rank], and a forward hook that adds
`scale * x A^T B^T` (scale = alpha / rank) to its output. B starts at zero, so the adapted model starts as the
pretrained one. Keys stay the model's own (`blocks.0.attn.qkv.weight`, `...qkv.lora_A`, `...qkv.lora_B`), so
pretrained weights load by their names, the tensor-parallel plan still names the linear layers (its styles
split the adapter with the weight: tensor_parallel.py), and FSDP shards the adapter with its unit.

Built in rather than through peft (measured: README, Fine-tuning; the speed is the same): peft replaces each targeted layer by a
wrapper (`qkv.base_layer.weight`, `qkv.lora_A.default.weight`), which renames every adapted weight, so
pretrained files, checkpoints and the model's tensor-parallel plan (which then names a wrapper that torch's
styles cannot split) would all need translating. The export still speaks peft's format: `adapter_model.safetensors`
and `adapter_config.json` in `RUN_DIR/adapter/` load with `peft.PeftModel.from_pretrained(model, RUN_DIR/adapter)`.
"""

from __future__ import annotations

import math
from fnmatch import fnmatch

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer.errors import ConfigError

ADAPTER_KEYS = ("lora_A", "lora_B", "lora_scale")


def _hook(module: nn.Linear, args, output):
    x = args[0].to(module.lora_A.dtype)  # (fp32 adapters beside weights kept in bf16: finetune.dtype)
    if module.lora_dropout and module.training:
        x = F.dropout(x, module.lora_dropout)
    delta = F.linear(F.linear(x, module.lora_A), module.lora_B) * module.lora_scale_value
    return output + delta.to(output.dtype)


def targets_of(model: nn.Module, patterns: list[str]) -> list[str]:
    """The names of the linear layers `patterns` name: a full name, a glob (`blocks.*.attn.qkv`), or a name's last
    parts (`qkv`, `attn.proj`: peft's target_modules). A pattern that names none is an error listing them."""
    linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    found: list[str] = []
    for pattern in patterns:
        hits = [n for n in linear if n == pattern or n.endswith("." + pattern) or fnmatch(n, pattern)]
        if not hits:
            shown = ", ".join(sorted({n.split(".")[-1] for n in linear})[:12])
            raise ConfigError(f"finetune.lora.targets names {pattern!r}, which is no linear layer of "
                              f"{type(model).__name__} (LoRA adapts nn.Linear layers; theirs end in: {shown}). Give "
                              "a name's last parts (qkv), a glob (blocks.*.attn.qkv) or a full name.")
        found += [n for n in hits if n not in found]
    return found


def inject(model: nn.Module, patterns: list[str], rank: int, alpha: float, dropout: float) -> list[str]:
    """Freeze the model and add an adapter to each linear layer `patterns` name. Returns their names. Called on the
    model as built (the meta device's too), before any strategy splits or wraps it; the adapters' values are set by
    `init` once the model is materialised."""
    from trainer.parallel.materialize import tied_parameters

    names = targets_of(model, patterns)
    shared = {n.rsplit(".", 1)[0] for group in tied_parameters(model) for n in group}
    tied = [n for n in names if n in shared]
    if tied:
        raise ConfigError(f"finetune.lora.targets adapts {', '.join(tied)}, whose weight is shared with another "
                          "layer (a tied embedding and output head): a merged adapter would change both. Leave it "
                          "out of finetune.lora.targets.")
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        layer = model.get_submodule(name)
        w = layer.weight
        layer.lora_A = nn.Parameter(torch.empty(rank, layer.in_features, device=w.device, dtype=torch.float32))
        layer.lora_B = nn.Parameter(torch.empty(layer.out_features, rank, device=w.device, dtype=torch.float32))
        # The scale as state too, so that the export can merge it (trainer/models/export.py) and a checkpoint says it.
        layer.register_buffer("lora_scale", torch.tensor(alpha / rank, device=w.device, dtype=torch.float32))
        layer.lora_scale_value, layer.lora_dropout = alpha / rank, dropout
        layer.register_forward_hook(_hook)
    return names


@torch.no_grad()
def init(model: nn.Module, names: list[str], seed: int, seed_everything) -> None:
    """A from the seed as nn.Linear draws its weight (kaiming uniform, as peft), B zero: the adapted model starts as
    the model. Drawn whole and kept per shard under FSDP or tensor parallelism, so every strategy starts alike."""
    from trainer.parallel.materialize import ShardedInit

    seed_everything(seed)
    with ShardedInit():
        for name in names:
            layer = model.get_submodule(name)
            nn.init.kaiming_uniform_(layer.lora_A, a=math.sqrt(5))
            nn.init.zeros_(layer.lora_B)
            scale = layer.get_buffer("lora_scale")
            scale.fill_(layer.lora_scale_value)


@torch.no_grad()
def keep_configured_scales(model: nn.Module) -> None:
    """After a checkpoint is loaded: each adapter's scale buffer is this run's (finetune.lora.alpha / rank), the
    one its forward uses. A checkpoint's (an earlier alpha: a setting a resume may change, and says so) would have
    the export merge the adapters at another scale than they were trained at."""
    for m in model.modules():
        if hasattr(m, "lora_scale_value"):
            m.get_buffer("lora_scale").fill_(m.lora_scale_value)


def adapters_in(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The layers with an adapter in a state dict (`<layer>.lora_A`), by name."""
    return [k[: -len(".lora_A")] for k in tensors if k.endswith(".lora_A")]


def merge(tensors: dict[str, torch.Tensor], base: str | None = None
          ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """(the weights with every adapter merged, W + scale B A, keyed as the plain model; the adapter alone in peft's
    layout; peft's adapter_config.json, naming `base`, the weights the adapters were trained on, as
    base_model_name_or_path) of a whole state dict on the CPU."""
    layers = adapters_in(tensors)
    merged = {k: v for k, v in tensors.items() if k.rsplit(".", 1)[-1] not in ADAPTER_KEYS}
    adapter, ranks, alphas = {}, set(), set()
    for layer in layers:
        a, b, scale = tensors[f"{layer}.lora_A"], tensors[f"{layer}.lora_B"], float(tensors[f"{layer}.lora_scale"])
        w = merged[f"{layer}.weight"]
        merged[f"{layer}.weight"] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
        adapter[f"base_model.model.{layer}.lora_A.weight"] = a.contiguous()
        adapter[f"base_model.model.{layer}.lora_B.weight"] = b.contiguous()
        ranks.add(a.shape[0])
        alphas.add(scale * a.shape[0])
    config = {"peft_type": "LORA", "r": max(ranks, default=0), "lora_alpha": max(alphas, default=0.0),
              "target_modules": layers, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "inference_mode": True, "base_model_name_or_path": base, "task_type": None}
    return merged, adapter, config
