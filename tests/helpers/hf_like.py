"""A small model written in Hugging Face's pattern, for tests that must run without transformers installed.

What it reproduces of transformers 5 (`modeling_utils.PreTrainedModel`, `distributed/mixin.py`,
`initialization.py`), because each of these broke a strategy once:

* `post_init()` at the end of the constructor: it merges the parallel plans onto the instance (the class's
  `_tp_plan`, the config's `base_model_tp_plan` for the base model, with `embed_tokens: embedding_rowwise` added,
  and each child's plan under its name) and initialises the weights, unless it runs under a meta-device context.
* `init_weights()` -> `_init_weights(module)` for each module, children first, each module marked
  `_is_hf_initialized` (a second `init_weights()` draws nothing), while the `torch.nn.init` functions are
  replaced by wrappers that check that mark (so a function-level hook on `torch.nn.init.normal_` never sees
  the call under its own name).
* The plan in transformers' vocabulary: colwise, rowwise, colwise_gather_output (the head), embedding_rowwise
  (the input embedding) and replicated_with_grad_allreduce (a per-head norm between colwise and rowwise, as
  Qwen3's q_norm).
* `config.save_pretrained(dir)`, `base_model_prefix`, `_no_split_modules`, an optionally tied head.

`HFLike(...)` takes the lm recipe's model keys (vocab_size, seq_len, n_layer, n_head, d_model, dropout) and
returns the model as `trainer.models.hf.causal_lm` returns transformers' (`trainer.models.hf.adapt`): logits from token ids,
and an `init_weights()` that re-draws everything. `HFLikeForCausalLM` is the class as transformers would ship it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer.models.hf import adapt


class HFLikeConfig:
    model_type = "hf-like"
    base_model_tp_plan = {
        "layers.*.attn.q_proj": "colwise",
        "layers.*.attn.k_proj": "colwise",
        "layers.*.attn.v_proj": "colwise",
        "layers.*.attn.q_norm": "replicated_with_grad_allreduce",
        "layers.*.attn.o_proj": "rowwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }

    def __init__(self, vocab_size=256, max_position_embeddings=64, num_hidden_layers=2, num_attention_heads=2,
                 hidden_size=64, initializer_range=0.02, tie_word_embeddings=False):
        self.vocab_size, self.max_position_embeddings = vocab_size, max_position_embeddings
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.hidden_size, self.initializer_range = hidden_size, initializer_range
        self.tie_word_embeddings = tie_word_embeddings

    def save_pretrained(self, directory: str) -> None:
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump({"model_type": self.model_type, **vars(self)}, f)


# -- transformers.initialization: wrappers that respect the mark, swapped in while weights are initialised
def _guarded(fn):
    def wrapper(tensor, *args, **kwargs):
        return tensor if getattr(tensor, "_is_hf_initialized", False) else fn(tensor, *args, **kwargs)

    wrapper.__name__ = fn.__name__
    wrapper.__module__ = "transformers.initialization"  # (materialize.py knows transformers' wrappers by module)
    return wrapper


@contextlib.contextmanager
def guard_torch_init_functions():
    names = ("normal_", "uniform_", "zeros_", "ones_", "kaiming_uniform_", "trunc_normal_")
    originals = {n: getattr(nn.init, n) for n in names}
    try:
        for n, fn in originals.items():
            setattr(nn.init, n, _guarded(fn))
        yield
    finally:
        for n, fn in originals.items():
            setattr(nn.init, n, fn)


class PreTrainedLike(nn.Module):
    _tp_plan: dict[str, str] | None = None
    base_model_prefix = "model"

    def post_init(self) -> None:
        self.init_parallel_plans()
        self.init_weights()

    def init_parallel_plans(self) -> None:
        self._tp_plan = dict(type(self)._tp_plan or {})
        if getattr(self, self.base_model_prefix, None) is None:  # the base model itself
            self._tp_plan.update(self.config.base_model_tp_plan)
            self._tp_plan = {"embed_tokens": "embedding_rowwise", **self._tp_plan}
        for name, child in self.named_children():
            if plan := getattr(child, "_tp_plan", None):
                self._tp_plan.update({f"{name}.{k}": v for k, v in plan.items()})

    def init_weights(self) -> None:
        if torch.get_default_device() != torch.device("meta"):
            self.initialize_weights()
        if self.config.tie_word_embeddings and hasattr(self, "lm_head"):
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def initialize_weights(self) -> None:
        def apply(module):
            for child in module.children():
                apply(child)
            if not getattr(module, "_is_hf_initialized", False):
                self._init_weights(module)
                module._is_hf_initialized = True

        with guard_torch_init_functions():
            apply(self)

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)  # (the guarded wrapper, while initialising)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, Block):  # GPT-2's scaled residual projections, drawn after the children's
            for p in (module.attn.o_proj.weight, module.mlp.down_proj.weight):
                nn.init.normal_(p, mean=0.0, std=std / math.sqrt(2 * self.config.num_hidden_layers))


class Attention(nn.Module):
    def __init__(self, config: HFLikeConfig):
        super().__init__()
        d, self.head_dim = config.hidden_size, config.hidden_size // config.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.q_norm = nn.LayerNorm(self.head_dim, bias=False)  # per head: sees this rank's heads only under tp
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, -1, self.head_dim))  # -1: this rank's heads
        k, v = (p(x).view(B, T, -1, self.head_dim) for p in (self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config: HFLikeConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, 4 * config.hidden_size, bias=True)
        self.down_proj = nn.Linear(4 * config.hidden_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, config: HFLikeConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(config.hidden_size, bias=False), nn.LayerNorm(config.hidden_size, bias=False)
        self.attn, self.mlp = Attention(config), MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class HFLikeModel(PreTrainedLike):
    def __init__(self, config: HFLikeConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size, bias=False)
        self.post_init()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids) + self.embed_positions(torch.arange(input_ids.shape[1], device=input_ids.device))
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class HFLikeForCausalLM(PreTrainedLike):
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _no_split_modules = ["Block"]

    def __init__(self, config: HFLikeConfig):
        super().__init__()
        self.config = config
        self.model = HFLikeModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids=None, use_cache=None):
        return SimpleNamespace(logits=self.lm_head(self.model(input_ids)))


def HFLike(vocab_size: int = 256, seq_len: int = 64, n_layer: int = 2, n_head: int = 2, d_model: int = 64,
           dropout: float = 0.0, tie: bool = False, plan: dict | None = None) -> nn.Module:
    """The lm recipe's model keys -> the HF-like model, as trainer.models.hf.causal_lm builds transformers' (dropout: none).
    `plan`: entries that replace the merged plan's (as `model.tp_plan = ...` on a transformers model)."""
    assert dropout == 0.0
    model = adapt(HFLikeForCausalLM)(HFLikeConfig(vocab_size, seq_len, n_layer, n_head, d_model,
                                                  tie_word_embeddings=tie))
    model._tp_plan.update(plan or {})
    return model
