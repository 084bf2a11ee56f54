"""What runs on the Ray cluster: critic model, packing, losses, training step, checkpoint IO.

Imports core, torch, megatron-core and ray; never dagster.
"""
