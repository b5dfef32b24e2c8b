"""Data: the global sample order and loaders (sampling), iterable and streaming datasets (streaming), and local
Hugging Face datasets tokenised once into a memmap (hf_data)."""
