"""The critic model: backbone config, value head, packed attention and RoPE, losses, packing."""
