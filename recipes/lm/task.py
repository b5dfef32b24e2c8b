"""Next-byte prediction: the loss, the eval metrics and a generated sample for the `lm` recipe."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer.errors import ConfigError, DataError


class LanguageModeling:
    """The task object the Trainer calls. See `trainer.task.Task` for the protocol."""

    target_unit = "tokens"  # num_targets counts bytes: train/tokens_per_s

    def __init__(self, sample_prompt: str = "def ", sample_tokens: int = 200, temperature: float = 0.8,
                 top_k: int | None = 40, vocab_size: int | None = None, seq_len: int | None = None,
                 data_seq_len: int | None = None, tokenizer: str | None = None, seed: int = 0):
        # The recipe passes the model's vocab_size and seq_len and the data's seq_len (interpolations), so
        # mismatches are one paragraph at start instead of an IndexError in the middle of a step.
        if vocab_size is not None and vocab_size < 256 and not tokenizer:  # (a tokenizer's size: the data checks it)
            raise ConfigError(f"model.vocab_size={vocab_size} is smaller than the data's 256 byte values. "
                              "Use model.vocab_size=256 (the lm recipe's tokens are bytes; with data.tokenizer, at "
                              "least the tokenizer's vocabulary size).")
        if seq_len is not None and data_seq_len is not None and seq_len < data_seq_len:
            raise ConfigError(f"model.seq_len={seq_len} is shorter than data.seq_len={data_seq_len}: the model has no "
                              "positions for the later tokens. Set model.seq_len >= data.seq_len (the default follows it); to "
                              f"evaluate a trained model, data.seq_len={seq_len} (or less).")
        _check_sampling(sample_prompt, sample_tokens, temperature, top_k)
        self.sample_prompt, self.sample_tokens = sample_prompt, sample_tokens
        self.temperature, self.top_k = temperature, top_k
        self.seed = seed  # the sampler's own generator: every eval's sample draws alike (`sample task.seed=N`: others)

    def num_targets(self, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
        return _tokens(batch)[1].numel()

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = _tokens(batch)
        logits = model(x)
        # Summed, not averaged: the trainer divides by the number of targets in the global batch.
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1), reduction="sum")

    def eval_metrics(self, loss: float) -> dict[str, float]:
        # One token is one byte, so nats per token / ln 2 is bits per byte.
        return {"bpb": loss / math.log(2)}

    def sample(self, model: nn.Module, device: torch.device) -> str:
        if self.sample_tokens <= 0:
            return ""
        prompt = torch.tensor([list(self.sample_prompt.encode())], dtype=torch.long, device=device)
        g = torch.Generator(device=device).manual_seed(self.seed)
        out = model.generate(prompt, self.sample_tokens, temperature=self.temperature, top_k=self.top_k, generator=g)
        return bytes(out[0].tolist()).decode("utf-8", errors="replace")


def _tokens(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch as (x, y), token ids; a dataset of other samples (dicts, lone tensors, floats) is one paragraph,
    not a KeyError or an unpacking error in the middle of a step."""
    if (isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch)
            and not any(t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool for t in batch)):
        return batch[0].long(), batch[1].long()  # (int32 or uint8 ids, a memmap's: the embedding takes int64; a no-op
        # for int64)
    if isinstance(batch, dict):
        what = f"dicts with keys {', '.join(map(str, batch))}"
    elif isinstance(batch, (tuple, list)):
        what = f"{type(batch).__name__}s of {len(batch)}: " + ", ".join(
            f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__ for t in batch)
    elif isinstance(batch, torch.Tensor):
        what = f"single {batch.dtype} tensors of shape {tuple(batch.shape)}"
    else:
        what = type(batch).__name__
    raise DataError(f"the lm task takes batches (x, y) of token ids (two integer tensors, inputs and next-token "
                    f"targets, as data=text's samples are), and this data's batches are {what}. Make the dataset "
                    "yield (x, y) pairs of token ids, or give a task of your own (task._target_=...; see \"Your own "
                    "model, data and loss\" in the README).")


def _check_sampling(prompt, tokens, temperature, top_k) -> None:
    """The sampling settings (task.KEY=VALUE, also on `python -m trainer sample`), each one paragraph when wrong: a
    text prompt, a count of tokens, a temperature > 0 (0: the likeliest token each time) and top_k >= 1 or null."""
    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    problems = []
    if not isinstance(prompt, str):
        problems.append(f"task.sample_prompt={prompt!r} is not text (quote a number: task.sample_prompt=\"'123'\")")
    elif not prompt and isinstance(tokens, int) and tokens > 0:  # (a reshape of 0 elements at the first eval's sample)
        problems.append("task.sample_prompt is empty: the model continues a prompt, at least one character (its "
                        "tokens are bytes, with no start-of-text token to begin from); give one, e.g. "
                        "task.sample_prompt=The, or task.sample_tokens=0 for no sample")
    if not (isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0):
        problems.append(f"task.sample_tokens={tokens!r} is not an integer >= 0 (0: no sample)")
    if not (number(temperature) and temperature >= 0):
        problems.append(f"task.temperature={temperature!r} is not a number >= 0 (0: always the likeliest token)")
    if not (top_k is None or (isinstance(top_k, int) and not isinstance(top_k, bool) and top_k >= 1)):
        problems.append(f"task.top_k={top_k!r} is not an integer >= 1 or null (null: every token)")
    if problems:
        raise ConfigError("; ".join(problems) + ".")

