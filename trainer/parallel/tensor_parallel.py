"""Tensor parallelism (`world.tp=N`) on torch's DTensor machinery, and the plans that say how to split a model.

A model declares its plan beside its definition, in the Hugging Face style: `_tp_plan` maps module paths
(with `*` wildcards) to a style. Column-wise layers shard their weight's output features across the `tp`
ranks, row-wise ones their input features (and sum the partial outputs), so a colwise-rowwise pair
(attention's projections, an MLP's two layers) needs one all-reduce in forward and one in backward.
`parallelize_module` applies it on the `tp` dimension of the mesh; data parallelism (DDP's gradient averaging
or FSDP's sharding) runs on the `dp` dimension. Tensor-parallel peers see the same batch.

Hugging Face models carry their plan in transformers' vocabulary (`transformers/distributed/tensor_parallel.py`,
`ALL_PARALLEL_STYLES`), merged onto the instance by `post_init` from the class's `_tp_plan`, the config's
`base_model_tp_plan` and the children's plans (`model.layers.*.self_attn.q_proj: colwise`, `lm_head:
colwise_gather_output`, `model.embed_tokens: embedding_rowwise`, ...). `STYLES` maps each style of that
vocabulary that has a DTensor equivalent to torch's style; `UNMAPPED` says why the others have none.
"""

from __future__ import annotations

from fnmatch import fnmatch

import torch.nn as nn

from trainer.errors import ConfigError, a_
from trainer.parallel.materialize import retie, tied_parameters

HOW_TO = ("Give the model class a `_tp_plan` dict of module paths to 'colwise' / 'rowwise', e.g. "
          "{'blocks.*.mlp.0': 'colwise', 'blocks.*.mlp.2': 'rowwise'} (see the module trainer.recipes.lm.model, recipes/lm/model.py in a clone), "
          "or run without world.tp.")

# transformers' style -> (torch style, its keyword arguments). Placements are named, not built, so that this
# table is read without importing torch.distributed. "input"/"output" are the layouts outside the module.
STYLES: dict[str, tuple[str, dict[str, str]] | None] = {
    "colwise": ("colwise", {}),                                  # replicated in, output features sharded
    "colwise_gather_output": ("colwise", {"output": "replicate"}),  # ... and gathered (an LM head)
    "colwise_rep": ("colwise", {"output": "replicate"}),
    "rowwise": ("rowwise", {}),                                  # sharded in, partial sums all-reduced
    "rowwise_split_input": ("rowwise", {"input": "replicate"}),  # a replicated input, split first
    "rowwise_rep": ("rowwise", {"input": "replicate"}),
    "embedding_rowwise": ("rowwise", {"input": "replicate"}),    # vocabulary-parallel lookup, summed
    "embedding_colwise": ("colwise", {"output": "replicate"}),   # hidden-dim slices, gathered
    "sequence_parallel": ("sequence_parallel", {}),
    "all_reduce": ("all_reduce", {}),                            # a module's partial output, summed
    "replicated_with_grad_allreduce": ("replicated_partial_grad", {}),  # per-head norms between colwise/rowwise
    "replicate": None,                                           # every rank keeps the whole tensor: nothing to do
    # transformers 4.5x's names of the same splits (remote-code models still carry them)
    "local_colwise": ("colwise", {}),
    "local_rowwise": ("rowwise", {}),
    "gather": ("all_reduce", {}),
}

UNMAPPED = {
    "packed_colwise": "it splits a fused gate/up projection as two interleaved halves (a strided shard), which "
                      "torch's parallel styles cannot express",
    "packed_rowwise": "it splits a fused projection's input as two interleaved halves (a strided shard), which "
                      "torch's parallel styles cannot express",
    "moe_tp_experts": "it splits mixture-of-experts weights held in one 3-D parameter, with transformers' own "
                      "expert kernels",
    "moe_identity_expert": "it rescales the input of a mixture-of-experts identity expert for moe_tp_experts",
    "mla_kv_a_proj": "it all-reduces the gradient of the rotary part of DeepSeek's MLA projection only",
    "local_params": "it runs a module's forward on its local shards by transformers' own hooks",
    "local_packed_rowwise": "it splits a fused projection's input as interleaved halves (a strided shard)",
    "isolated": "it keeps experts on one rank each (expert parallelism)",
    # expert parallelism's styles (transformers/distributed/expert_parallel.py registers them on import)
    "grouped_gemm": "it shards mixture-of-experts weights by expert (expert parallelism, not tensor parallelism)",
    "ep_dispatch_experts": "it dispatches tokens to whole experts on other ranks (expert parallelism)",
    "local": "it marks parameters as rank-local by transformers' own hooks",
}


def plan_of(model: nn.Module) -> dict[str, str]:
    """The model's plan: its `_tp_plan` (a Hugging Face model's post_init merged its config's and children's plans
    into the instance's), else its config's `base_model_tp_plan` under the base model's prefix."""
    plan = getattr(model, "_tp_plan", None)
    if not plan:
        config = getattr(model, "config", None)
        base = getattr(config, "base_model_tp_plan", None)
        prefix = getattr(model, "base_model_prefix", "")
        if base:
            inner = isinstance(getattr(model, prefix, None), nn.Module) if prefix else False
            plan = {f"{prefix}.{k}" if inner else k: v for k, v in base.items()}
    if not isinstance(plan, dict) or not plan:
        raise ConfigError(f"world.tp needs a tensor-parallel plan, and {type(model).__name__} has none. {HOW_TO}")
    return dict(plan)


def _unmappable(model: nn.Module, key: str, style: str) -> ConfigError:
    why = UNMAPPED.get(style, "it is not a style of transformers' tensor-parallel vocabulary")
    known = ", ".join(s for s in STYLES if not s.startswith(("local_", "gather")))
    return ConfigError(
        f"{type(model).__name__}'s tensor-parallel plan has '{key}': {style!r}, which world.tp cannot apply: {why}. "
        f"The styles it applies (on torch's DTensor styles): {known}. Train this model with world=fsdp and no "
        "world.tp (FSDP needs no plan), or give the model a plan without that entry (on a Hugging Face model, "
        f"`model.tp_plan = {{...}}` in a subclass's __init__ after post_init, e.g. '{key}': 'colwise').")


def planned_modules(model: nn.Module, plan: dict[str, str]) -> list[tuple[str, str, nn.Module]]:
    """(path, style, module) for every module a plan key matches (keys whose style needs nothing left out); a
    ConfigError for a style with no DTensor equivalent or a key that matches nothing."""
    names = dict(model.named_modules())
    params = {n for n, _ in model.named_parameters()}
    out = []
    for key, style in plan.items():
        if style not in STYLES:
            raise _unmappable(model, key, style)
        parts = key.split(".")

        def matches(n: str, parts=parts) -> bool:
            return len(n.split(".")) == len(parts) and all(fnmatch(a, b) for a, b in zip(n.split("."), parts))

        found = [(n, style, m) for n, m in names.items() if n and matches(n)]
        if not found and any(matches(p) for p in params):  # a key naming a parameter (a quantization scale)
            if STYLES[style] is None:
                continue
            raise _unmappable(model, key, style)
        if not found:
            raise ConfigError(f"{type(model).__name__}._tp_plan names '{key}', which matches no module of the model "
                              f"(its modules: {', '.join(list(names)[1:8])}, ...). Fix the path in _tp_plan.")
        if STYLES[style] is not None:
            out += found
    return out


def planned_here(model: nn.Module, plan: dict[str, str]) -> list[tuple[str, str, nn.Module]]:
    """`planned_modules` (a key that matches nothing is an error, not torch's warning) but for the parts of the model
    another pipeline stage holds: in their place a stage has a placeholder with nothing to split (an untied output
    head on the first stage, the embedding on the last: Llama's under world.pp x world.tp was torch's
    NotImplementedError "ColwiseParallel currently only support nn.Linear and nn.Embedding")."""
    from trainer.parallel.pipeline import Elsewhere

    return [(name, style, m) for name, style, m in planned_modules(model, plan) if not isinstance(m, Elsewhere)]


def _heads(model: nn.Module) -> list[tuple[str, int]]:
    """The head counts a plan splits: each module's `n_head`, and a Hugging Face config's query and key/value
    heads (whose projections colwise splits)."""
    found = [(f"{name or 'model'}.n_head", m.n_head) for name, m in model.named_modules()
             if isinstance(getattr(m, "n_head", None), int)]
    config = getattr(model, "config", None)
    for key in ("num_attention_heads", "num_key_value_heads"):
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            found.append((f"config.{key}", value))
    return found


def check_plan(model: nn.Module, tp: int) -> None:
    """Everything the plan splits must split evenly into `tp` parts: heads, and the sharded features."""
    for where, heads in _heads(model):
        if heads % tp:
            raise ConfigError(f"world.tp={tp} must divide the number of attention heads ({where}={heads}): each rank "
                              "computes whole heads. Pick a tp that divides it.")
    for name, style, module in planned_modules(model, plan_of(model)):
        kind = STYLES[style][0]
        if kind not in ("colwise", "rowwise"):
            continue
        if isinstance(module, nn.Linear):
            size = module.out_features if kind == "colwise" else module.in_features
        elif isinstance(module, nn.Embedding):
            size = module.embedding_dim if kind == "colwise" else module.num_embeddings
        else:
            raise ConfigError(f"{type(model).__name__}'s tensor-parallel plan has '{name}': {style!r}, but {name} is "
                              f"{a_(type(module).__name__)}: colwise and rowwise split nn.Linear and nn.Embedding only "
                              "(transformers' GPT-2 Conv1D has no DTensor split). Train it with world=fsdp and no "
                              "world.tp.")
        if size % tp:
            raise ConfigError(f"world.tp={tp} must divide the features {name} splits ({size}, {style}).")


def _torch_styles():
    """The torch ParallelStyle for each kind of STYLES (built on first use: torch.distributed imports)."""
    from torch.distributed.tensor import (
        DTensor,
        Partial,
        Replicate,
        Shard,
        distribute_module,
        distribute_tensor,
    )
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )
    from torch.distributed.tensor.parallel.style import ParallelStyle

    def shard_params(module, mesh, placements: dict[str, object], src_data_rank) -> None:
        for name, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(
                distribute_tensor(p, mesh, [placements.get(name, placements["*"])], src_data_rank=src_data_rank),
                requires_grad=p.requires_grad))

    # A linear layer's LoRA adapter (trainer/models/lora.py: lora_A [rank, in], lora_B [out, rank] beside its weight)
    # is split with it: colwise keeps lora_A whole and splits lora_B's rows as the weight's; rowwise splits
    # lora_A's input columns as the weight's and keeps lora_B whole. torch's styles would shard every
    # parameter of the module alike (colwise) or leave the adapter out (rowwise).
    class Colwise(ColwiseParallel):
        def _partition_linear_fn(self, name, module, mesh):
            shard_params(module, mesh, {"lora_A": Replicate(), "*": Shard(0)}, self.src_data_rank)

    class Rowwise(RowwiseParallel):
        def _partition_linear_fn(self, name, module, mesh):
            shard_params(module, mesh, {"weight": Shard(1), "lora_A": Shard(1), "*": Replicate()}, self.src_data_rank)

    class ReplicatedPartialGrad(ParallelStyle):
        """transformers' replicated_with_grad_allreduce: a norm between a colwise and a rowwise layer (Qwen3's
        per-head q_norm) sees only this rank's heads. Its parameters stay whole (Replicate); its input is this
        rank's part of the activations, along a dimension other than the normalised last one, so each rank's
        gradient is a partial sum that DTensor reduces over the tp ranks."""

        def _apply(self, module, mesh):
            def partition(name, mod, mesh):
                shard_params(mod, mesh, {"*": Replicate()}, None)

            def inputs(mod, args, mesh):
                x = args[0]
                if not isinstance(x, DTensor):
                    x = DTensor.from_local(x, mesh, [Shard(0)], run_check=False)
                return (x, *args[1:])

            def outputs(mod, out, mesh):
                return out.to_local() if isinstance(out, DTensor) else out

            return distribute_module(module, mesh, partition, inputs, outputs)

    layouts = {"replicate": Replicate()}

    def build(kind: str, options: dict[str, str]):
        kwargs = {}
        if "input" in options:
            kwargs["input_layouts"] = layouts[options["input"]]
        if "output" in options:
            kwargs["output_layouts"] = layouts[options["output"]]
        if kind == "colwise":
            return Colwise(**kwargs)
        if kind == "rowwise":
            return Rowwise(**kwargs)
        if kind == "sequence_parallel":
            return SequenceParallel(use_local_output=True)
        if kind == "all_reduce":
            return PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=Replicate())
        if kind == "replicated_partial_grad":
            return ReplicatedPartialGrad()
        raise AssertionError(kind)

    return build


def parallelize(model: nn.Module, tp_mesh) -> None:
    """Apply the model's plan on `tp_mesh`, keeping weights that were tied tied."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan = plan_of(model)
    found = planned_here(model, plan)
    build = _torch_styles()
    tied = tied_parameters(model)
    # Each matched module by its own path (torch's fnmatch-per-level matching would be the same; this way the
    # entries that need nothing, "replicate", never reach torch).
    styles = {name: build(*STYLES[style]) for name, style, _ in found}
    # src_data_rank=None: each rank keeps its own chunk, no broadcast (the weights are set after, from the seed).
    parallelize_module(model, tp_mesh, styles, src_data_rank=None)
    # parallelize_module replaces the parameters it shards; one that was shared (an embedding tied to the
    # output head) would silently become two.
    retie(model, tied)
