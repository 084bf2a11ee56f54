"""The Ray side of the GPU job: the per-GPU worker actor, the placement group and worker pool that host it, the warm
cluster's helper process and the reaper that ends a killed driver's Ray."""
