"""What runs the model on a Ray placement group: parallel state, the CPU compatibility layer, the cluster, the worker actor, checkpoint IO and the per-rank step."""
