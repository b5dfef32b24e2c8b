"""Test-only stand-in for a Hugging Face model: a GPT with a `config` that has `save_pretrained`."""

import json
import os

from trainer.recipes.lm.model import GPT


class Config:
    def save_pretrained(self, directory: str) -> None:
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump({"model_type": "hf-like"}, f)


class HFLike(GPT):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.config = Config()
