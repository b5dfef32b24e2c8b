"""Hugging Face causal language models in the framework's recipes: `model._target_=trainer.models.hf.causal_lm`.

    model: {_target_: trainer.models.hf.causal_lm, architecture: LlamaForCausalLM, vocab_size: 256, hidden_size: 64, ...}

builds transformers' `LlamaForCausalLM` from a config of the other keys (`LlamaConfig(vocab_size=256, ...)`),
as a subclass that changes three things and nothing in its weights, keys or config:

* `model(ids)` with token ids alone returns the logits tensor, as the `lm` recipe's task (and any task written
  for a plain model) expects; called with transformers' keywords it is transformers' forward.
* `init_weights()` re-draws every weight from the global RNG, as the framework's contract for `init_weights`
  says: transformers marks what its constructor initialised (`_is_hf_initialized`) and would draw nothing
  again, so one process would keep the constructor's draws while a sharded run (built on the meta device,
  where transformers draws nothing) draws from the seed (materialize.py).
* `generate(ids, max_new_tokens, temperature=, top_k=, generator=)`, the `lm` task's sampling call; any other
  call is transformers' `generate`.

The run's export is transformers' layout (`model.safetensors` keyed by the model's `state_dict`, and
`config.json`), so `LlamaForCausalLM.from_pretrained(RUN_DIR)` and `AutoModelForCausalLM.from_pretrained(RUN_DIR)`
load it; `trainer.load(RUN_DIR)` gives this subclass back. transformers is an optional extra (`pip install
'trainer[hf]'`), imported only when a config names this.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn
from omegaconf import Container, OmegaConf

# (_ALIASES: the lm recipe's size keys, which debug=smoke sets, for configs that name them otherwise)
from trainer.config.schema import HF_SIZE_ALIASES as _ALIASES
from trainer.errors import ConfigError

INSTALL = ("transformers is not installed: it is an optional extra. Install it with pip install 'trainer[hf]' (or "
           "pip install -e '.[hf]' in a checkout), or choose a model of the framework's own (model=gpt_small).")

def import_transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError(INSTALL) from None
    return transformers


def causal_lm(architecture: str, **config: Any) -> nn.Module:
    """transformers' causal LM class `architecture` (a name in the `transformers` package: LlamaForCausalLM,
    GPT2LMHeadModel, Qwen3ForCausalLM, ...), built from its config class with `config`'s keys."""
    transformers = import_transformers()
    cls = getattr(transformers, architecture, None) if isinstance(architecture, str) else None
    config_cls = getattr(cls, "config_class", None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module) and config_cls is not None):
        raise ConfigError(f"model.architecture={architecture!r} is not a model class of transformers "
                          f"{transformers.__version__}: give the name of one, e.g. model.architecture=LlamaForCausalLM.")
    defaults = config_cls()
    settings, given = {}, {}  # (given: the model.* key each setting came from)
    # An alias after the config's own keys, whatever their order (model_config.json sorts them): the lm recipe's
    # size keys come from debug=smoke, which shrinks the model as it shrinks the recipe's own. Where the user gave
    # the model's own key too, the config was made to agree when it was resolved (schema.agree_hf_sizes); runs
    # saved before that recorded the two differing, and were built with the alias, as here.
    for key, value in sorted(config.items(), key=lambda kv: kv[0] in _ALIASES and not hasattr(defaults, kv[0])):
        given_key = key
        if not hasattr(defaults, key) and hasattr(defaults, _ALIASES.get(key, key)):
            key = _ALIASES[key]
        if not hasattr(defaults, key):
            raise ConfigError(f"model.{key} is not a setting of {config_cls.__name__} (the config of {architecture}). "
                              f"Remove it with ~model.{key}, or see {config_cls.__name__}'s documentation for its keys.")
        # (a mapping or a list from the config, rope_parameters={...}, reaches here as OmegaConf's container, which
        # transformers' config classes refuse: as plain Python)
        settings[key], given[key] = OmegaConf.to_container(value) if isinstance(value, Container) else value, given_key
    # Two names of one setting (GPT2Config's hidden_size is n_embd: its attribute_map), differing: the config class
    # would keep whichever came last, and build a model other than one of them asked for, with no word.
    for other, own in getattr(config_cls, "attribute_map", {}).items():
        if other in settings and own in settings and settings[other] != settings[own]:
            a, b = given[other], given[own]
            raise ConfigError(f"model.{a}={config[a]!r} and model.{b}={config[b]!r} set one setting of "
                              f"{config_cls.__name__} ({other} is its other name for {own}) to two values. Give both "
                              f"the same value (model.{a}=V model.{b}=V), or remove model.{b} with ~model.{b}.")
    return adapt(cls)(config_cls(**settings))


_CLASSES: dict[type, type] = {}


def adapt(cls: type) -> type:
    """`cls` (a transformers model class, or one written in its pattern) with the three changes above."""
    if cls not in _CLASSES:
        from trainer.parallel.materialize import forget_initialization

        class Adapted(cls):
            def forward(self, input_ids=None, *args, **kwargs):
                if args or kwargs:  # transformers' own call (its generate, a user's code): its output object
                    return super().forward(input_ids, *args, **kwargs)
                return super().forward(input_ids=input_ids, use_cache=False).logits

            def init_weights(self):
                forget_initialization(self)
                super().init_weights()

            def generate(self, inputs=None, *args, **kwargs):
                if args and isinstance(args[0], int):  # the lm task's call: (ids, max_new_tokens, ...)
                    return sample(self, inputs, args[0], **kwargs)
                return super().generate(inputs, *args, **kwargs)

            # Pipeline stages (world.pp): forward(ids) == pp_logits(layers(pp_embed(ids))) for decoders in Llama's
            # pattern; each stage rebuilds the rotary embeddings and the causal mask from its input's shape.
            def pipeline_plan(self):  # (transformers keeps its own `_pp_plan`, of another format, on the instance)
                return pipeline_plan(self)

            def pp_embed(self, input_ids):
                return self.get_submodule(self.base_model_prefix).embed_tokens(input_ids)

            def pp_logits(self, hidden_states):
                return self.lm_head(self.get_submodule(self.base_model_prefix).norm(hidden_states))

            def pipeline_block(self, layer, hidden_states):
                return decoder_layer(self, layer, hidden_states)

        Adapted.__name__ = Adapted.__qualname__ = cls.__name__
        _CLASSES[cls] = Adapted
    return _CLASSES[cls]


def pipeline_plan(model: nn.Module) -> dict | None:
    """The pipeline plan (as a `_pp_plan` of the framework's format) of a transformers decoder in Llama's pattern (Llama, Mistral, Qwen2/3, ...: a base model with
    `embed_tokens`, `layers`, `norm` and `rotary_emb`, and an `lm_head`), else None (the pipeline refuses it)."""
    base = getattr(model, model.base_model_prefix, None)
    if base is None or not all(hasattr(base, n) for n in ("embed_tokens", "layers", "norm", "rotary_emb")) \
            or not isinstance(getattr(model, "lm_head", None), nn.Module):
        return None
    prefix = model.base_model_prefix
    return {"pp_embed": [f"{prefix}.embed_tokens"], "blocks": f"{prefix}.layers",
            "pp_logits": [f"{prefix}.norm", "lm_head"]}


@functools.cache
def _cache_argument() -> str:
    """create_causal_mask's name for the cache: `cache` from transformers 5.24 on, `past_key_values` before (which
    5.24 warns will be removed in 5.40)."""
    import inspect

    from transformers.masking_utils import create_causal_mask

    return "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


def decoder_layer(model: nn.Module, layer: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """One decoder layer as the base model's forward calls it without a cache or a padding mask: the causal mask
    and the rotary embeddings of positions 0..T-1."""
    from transformers.masking_utils import create_causal_mask

    base = getattr(model, model.base_model_prefix)
    position_ids = torch.arange(hidden_states.shape[1], device=hidden_states.device).unsqueeze(0)
    mask = create_causal_mask(config=model.config, inputs_embeds=hidden_states, attention_mask=None,
                              position_ids=position_ids, **{_cache_argument(): None})
    return layer(hidden_states, attention_mask=mask, position_embeddings=base.rotary_emb(hidden_states, position_ids),
                 position_ids=position_ids, use_cache=False)


@torch.no_grad()
def sample(model: nn.Module, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
           top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Append `max_new_tokens` sampled tokens to `idx` (the lm recipe's GPT.generate, for a transformers model)."""
    limit = getattr(model.config, "max_position_embeddings", None) or idx.shape[1] + max_new_tokens
    for _ in range(max_new_tokens):
        logits = model(idx[:, -limit:])[:, -1, :].float() / max(temperature, 1e-5)
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, [-1]]
            logits = logits.masked_fill(logits < kth, -float("inf"))
        idx = torch.cat([idx, torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)], dim=1)
    return idx
