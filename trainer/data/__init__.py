"""Data: the global sample order and loaders (sampling), iterable and streaming datasets (streaming), local
Hugging Face datasets files tokenised once into a memmap (hf_data), and the local files `data.path` names (files)."""
