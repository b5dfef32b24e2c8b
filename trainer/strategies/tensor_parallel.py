"""Tensor parallelism (`world.tp=N`) on torch's DTensor machinery, and the 2-D device mesh (dp x tp).

A model declares its plan beside its definition, in the Hugging Face style: a class attribute
`_tp_plan` mapping module paths (with `*` wildcards) to "colwise", "rowwise" or "sequence_parallel".
Column-wise layers shard their weight's output features across the `tp` ranks, row-wise ones their
input features (and sum the partial outputs), so a colwise-rowwise pair (attention's qkv and output
projections, an MLP's two layers) needs one all-reduce in forward and one in backward.
`parallelize_module` applies it on the `tp` dimension of the mesh; data parallelism (DDP's gradient
averaging or FSDP's sharding) runs on the `dp` dimension. Tensor-parallel peers see the same batch.
"""

from __future__ import annotations

import torch.nn as nn

from ..errors import ConfigError
from .materialize import retie, tied_parameters

HOW_TO = ("Give the model class a `_tp_plan` dict of module paths to 'colwise' / 'rowwise', e.g. "
          "{'blocks.*.mlp.0': 'colwise', 'blocks.*.mlp.2': 'rowwise'} (see trainer/recipes/lm/model.py), "
          "or run without world.tp.")


def plan_of(model: nn.Module) -> dict[str, str]:
    plan = getattr(model, "_tp_plan", None)
    if not isinstance(plan, dict) or not plan:
        raise ConfigError(f"world.tp needs a tensor-parallel plan, and {type(model).__name__} has none. {HOW_TO}")
    return plan


def planned_modules(model: nn.Module, plan: dict[str, str]) -> list[tuple[str, str, nn.Module]]:
    """(path, style, module) for every module a plan key matches; a ConfigError for a key that matches none."""
    from fnmatch import fnmatch

    names = dict(model.named_modules())
    out = []
    for key, style in plan.items():
        if style not in ("colwise", "rowwise", "sequence_parallel"):
            raise ConfigError(f"{type(model).__name__}._tp_plan['{key}'] = {style!r}: expected 'colwise', 'rowwise' "
                              "or 'sequence_parallel'.")
        parts = key.split(".")
        found = [(n, style, m) for n, m in names.items() if n and len(n.split(".")) == len(parts)
                 and all(fnmatch(a, b) for a, b in zip(n.split("."), parts))]
        if not found:
            raise ConfigError(f"{type(model).__name__}._tp_plan names '{key}', which matches no module of the model "
                              f"(its modules: {', '.join(list(names)[1:8])}, ...). Fix the path in _tp_plan.")
        out += found
    return out


def check_plan(model: nn.Module, tp: int) -> None:
    """Everything the plan splits must split evenly into `tp` parts: heads, and the sharded features."""
    for name, module in model.named_modules():
        heads = getattr(module, "n_head", None)
        if isinstance(heads, int) and heads % tp:
            raise ConfigError(f"world.tp={tp} must divide the number of attention heads ({name or 'model'}.n_head="
                              f"{heads}). Pick a tp that divides model.n_head.")
    for name, style, module in planned_modules(model, plan_of(model)):
        if isinstance(module, nn.Linear):
            size = module.out_features if style == "colwise" else module.in_features
            if style != "sequence_parallel" and size % tp:
                raise ConfigError(f"world.tp={tp} must divide the features {name} splits ({size}, {style}).")


def parallelize(model: nn.Module, tp_mesh) -> None:
    """Apply the model's plan on `tp_mesh`, keeping weights that were tied tied."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "sequence_parallel": SequenceParallel}
    plan = plan_of(model)
    planned_modules(model, plan)  # a key that matches nothing is an error, not torch's warning
    tied = tied_parameters(model)
    # src_data_rank=None: each rank keeps its own chunk, no broadcast (the weights are set after, from the seed).
    parallelize_module(model, tp_mesh, {k: styles[v]() for k, v in plan.items()}, src_data_rank=None)
    # parallelize_module replaces the parameters it shards; one that was shared (an embedding tied to the
    # output head) would silently become two.
    retie(model, tied)
