"""Models from elsewhere: Hugging Face causal LMs and their plans (hf), pretrained weights (pretrained),
fine-tuning (finetune) and LoRA adapters (lora)."""
