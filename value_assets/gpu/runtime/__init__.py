"""What one rank runs under the model: torch.distributed and megatron parallel state, the CPU compatibility layer,
checkpoint IO (loads only bytes checked against the contract, unpickling nothing arbitrary) and the per-rank optimizer
and forward-only steps."""
