"""Keeping secrets (API keys, tokens, passwords) out of everything a run writes.

A key is secret when one of its words is a secret word (`hf_token`, `WANDB_API_KEY`, `apiKey`,
`client_secret`), not when a word merely contains one (`sample_tokens`, `tokenizer` are fine).
An environment variable is secret by the same rule, or when its name holds TOKEN, SECRET, PASSWORD,
PASSWD or CREDENTIAL inside a word (`MYTOKEN`, `PGPASSWORD`), a word ending in KEY (`MYKEY`,
`AWS_SECRET_ACCESS_KEY`) or the name ends in PAT (`GITHUB_PAT`); not PATH, KEYBOARD, XKB_KEYMAP or
TOKENIZERS_PARALLELISM.

The values of those (of 6 characters or more: shorter ones are too likely to be ordinary words) are
secrets wherever they appear: `redact` (for a config tree) and `redact_text` (for text) replace them, in
whole values and inside longer ones, along with every value of a secret-looking key. Every sink calls one
of the two where config or logged text becomes a file: config.yaml, the checkpoints' config.yaml,
.hydra/*.yaml, run_info.json, wandb, TensorBoard, samples.jsonl, and error messages.
"""

from __future__ import annotations

import os
import re
from typing import Any

SECRET_WORDS = frozenset({"token", "secret", "password", "passwd", "apikey", "credential", "credentials"})
ENV_SECRET_PARTS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL")
MIN_SECRET_LENGTH = 6
REDACTED = "<redacted>"


# A tokenizer's special tokens are text, not credentials: data.eos_token='<|endoftext|>' must reach config.yaml.
SPECIAL_TOKENS = frozenset({"eos_token", "bos_token", "pad_token", "unk_token", "sep_token", "cls_token",
                            "mask_token"})


def is_secret_key(key: Any) -> bool:
    if str(key).rsplit(".", 1)[-1].lower() in SPECIAL_TOKENS:
        return False
    words = re.split(r"[^a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", str(key)).lower())
    return any(w in SECRET_WORDS for w in words) or any(a + b in SECRET_WORDS for a, b in zip(words, words[1:]))


def is_secret_env(name: str) -> bool:
    """Whether an environment variable's name says it holds a secret (see the module docstring)."""
    if is_secret_key(name):
        return True
    upper = name.upper()
    words = [w for w in re.split(r"[^A-Z0-9]+", upper) if w]
    return upper.endswith("PAT") or any(
        w.endswith("KEY") or (any(p in w for p in ENV_SECRET_PARTS) and not w.startswith("TOKENIZER"))
        for w in words
    )


def secret_values(container: Any = None) -> set[str]:
    """Values that must never be written: of secret-looking keys in `container` and in the environment."""
    found = {v for k, v in os.environ.items() if is_secret_env(k) and len(v) >= MIN_SECRET_LENGTH}

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if is_secret_key(k) and isinstance(v, str | int) and len(str(v)) >= MIN_SECRET_LENGTH:
                    found.add(str(v))
                walk(v)
        elif isinstance(node, list | tuple):
            for v in node:
                walk(v)

    walk(container)
    return found


def override_secrets(argv: list[str]) -> set[str]:
    """The values a command line gives secret-looking keys (`model.hf_token=...`, `+hydra.job.env_set.WANDB_API_KEY=
    ...`; each value of a sweep's list), before any config holds them."""
    found = set()
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and not key.startswith("-") and is_secret_key(key):
            for part in (value, *value.split(",")):
                part = part.strip().strip("'\"")
                if len(part) >= MIN_SECRET_LENGTH:
                    found.add(part)
    return found


class ScrubbedStream:
    """A text stream that writes through to `stream` with every secret value replaced: the console of a command
    whose own output (Hydra's job lines, --cfg, --info, a "to continue" command) may quote them."""

    def __init__(self, stream: Any, secrets: set[str]):
        self.stream, self.secrets = stream, secrets

    def write(self, text: str) -> int:
        self.stream.write(scrub(text, self.secrets))
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding, ...: the stream's own
        return getattr(self.stream, name)


def redact(container: Any, secrets: set[str] | None = None) -> Any:
    """A copy of a plain dict/list tree fit to write: the values of secret-looking keys replaced, and every
    secret value (`secret_values(container)` unless given) replaced wherever it appears."""
    secrets = secret_values(container) if secrets is None else secrets

    def clean(node: Any) -> Any:
        if isinstance(node, dict):
            return {scrub(k, secrets) if isinstance(k, str) else k: REDACTED if v and is_secret_key(k) else clean(v)
                    for k, v in node.items()}
        if isinstance(node, list | tuple):
            return [clean(v) for v in node]
        if isinstance(node, str):
            return scrub(node, secrets)
        if isinstance(node, int | float) and not isinstance(node, bool) and str(node) in secrets:
            return REDACTED
        return node

    return clean(container)


def redact_text(text: str, container: Any = None) -> str:
    """`text` fit to write: every secret value (of the environment, and of `container`'s secret keys) replaced."""
    return scrub(text, secret_values(container))


def scrub(text: str, secrets: set[str]) -> str:
    """`text` with every occurrence of a secret value replaced (longest first, so none is left half-done)."""
    for value in sorted(secrets, key=len, reverse=True):
        text = text.replace(value, REDACTED)
    return text
