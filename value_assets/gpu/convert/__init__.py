"""Checkpoint formats: Hugging Face and Megatron bootstrap, export."""
