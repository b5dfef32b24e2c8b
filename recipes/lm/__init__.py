"""The `lm` recipe: a byte-level decoder-only transformer trained on a local text corpus."""
