"""A small decoder-only transformer (GPT) over bytes: token ids [B, T] -> logits [B, T, vocab]."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"model.d_model={d_model} must be divisible by model.n_head={n_head}")
        self.n_head, self.head_dim = n_head, d_model // n_head
        # One projection for q, k and v, its outputs ordered head by head ([q k v] of head 0, then of
        # head 1, ...): a tensor-parallel rank's column chunk then holds whole heads.
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1: this rank's heads (all of them without tensor parallelism).
        q, k, v = self.qkv(x).view(B, T, -1, 3, self.head_dim).unbind(3)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model, bias=bias)
        self.attn = CausalSelfAttention(d_model, n_head, dropout, bias)
        self.ln2 = nn.LayerNorm(d_model, bias=bias)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model, bias=bias),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * d_model, d_model, bias=bias),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Pre-norm GPT with learned positions and tied input/output embeddings (as in nanoGPT)."""

    # The repeated unit: each Block becomes one FSDP unit.
    _no_split_modules = ["Block"]
    # Tensor parallelism (world.tp=N): attention heads and the MLP's hidden units split across ranks.
    # Column-wise layers shard their outputs, row-wise ones their inputs and sum the partial results.
    _tp_plan = {
        "blocks.*.attn.qkv": "colwise",
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.mlp.0": "colwise",
        "blocks.*.mlp.2": "rowwise",
    }
    # Pipeline parallelism (world.pp=N): forward(idx) is logits(blocks(embed(idx))); the first stage runs `embed`
    # (with these modules), each stage a run of blocks, the last stage `logits`.
    _pp_plan = {"embed": ["tok_emb", "pos_emb", "drop"], "blocks": "blocks", "logits": ["ln_f", "head"]}

    def __init__(
        self,
        vocab_size: int = 256,
        seq_len: int = 256,
        n_layer: int = 4,
        n_head: int = 4,
        d_model: int = 256,
        dropout: float = 0.0,
        bias: bool = False,
    ):
        super().__init__()
        sizes = {"vocab_size": vocab_size, "seq_len": seq_len, "n_layer": n_layer, "n_head": n_head, "d_model": d_model}
        bad = [f"model.{k}={v!r}" for k, v in sizes.items()
               if not isinstance(v, int) or isinstance(v, bool) or v < (0 if k == "n_layer" else 1)]
        if bad:  # (n_layer=0 is a model of embeddings and head alone: a bigram model)
            raise ValueError(f"{', '.join(bad)}: the GPT's sizes are positive integers (n_layer may be 0)")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"model.dropout={dropout!r} must be in [0, 1)")
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model, bias=bias)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Every parameter from the global RNG, in a fixed order. The framework calls it again after a
        sharded strategy materialises the model built on the meta device (same seed, same weights)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        # Scaled init of residual projections (GPT-2): keeps the residual stream's variance flat in depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * len(self.blocks)))

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 x non-embedding-lookup parameters plus attention (PaLM, appendix B)."""
        n = sum(p.numel() for p in self.parameters()) - self.pos_emb.weight.numel()
        d, L = self.tok_emb.embedding_dim, len(self.blocks)
        return 6 * n + 12 * L * d * self.seq_len

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.seq_len:
            raise ValueError(f"sequence of length {T} is longer than the model's seq_len={self.seq_len}")
        pos = torch.arange(T, device=idx.device)
        return self.drop(self.tok_emb(idx) + self.pos_emb(pos))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.logits(x)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.seq_len :])[:, -1, :].float() / max(temperature, 1e-5)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, -float("inf"))
            probs = torch.softmax(logits, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx
