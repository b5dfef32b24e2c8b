"""Keeping secrets (API keys, tokens, passwords) out of everything a run writes.

A key is secret when one of its words is a secret word (`hf_token`, `WANDB_API_KEY`, `apiKey`,
`client_secret`), not when a word merely contains one (`sample_tokens`, `tokenizer` are fine).
"""

from __future__ import annotations

import os
import re
from typing import Any

SECRET_WORDS = frozenset({"token", "secret", "password", "passwd", "apikey", "credential", "credentials"})
REDACTED = "<redacted>"


def is_secret_key(key: Any) -> bool:
    words = re.split(r"[^a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", str(key)).lower())
    return any(w in SECRET_WORDS for w in words) or any(a + b in SECRET_WORDS for a, b in zip(words, words[1:]))


def redact(container: Any) -> Any:
    """A copy of a plain dict/list tree with the values of secret-looking keys replaced."""
    if isinstance(container, dict):
        return {k: REDACTED if v and is_secret_key(k) else redact(v) for k, v in container.items()}
    if isinstance(container, list):
        return [redact(v) for v in container]
    return container


def secret_values(container: Any = None) -> set[str]:
    """Values that must never be written: of secret-looking keys in `container` and in the environment."""
    found = {v for k, v in os.environ.items() if is_secret_key(k) and len(v) >= 6}

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if is_secret_key(k) and isinstance(v, str | int) and len(str(v)) >= 6:
                    found.add(str(v))
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(container)
    return found


def scrub(text: str, secrets: set[str]) -> str:
    """`text` with every occurrence of a secret value replaced."""
    for value in secrets:
        text = text.replace(value, REDACTED)
    return text
