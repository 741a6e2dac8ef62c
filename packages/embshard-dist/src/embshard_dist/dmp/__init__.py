"""DistributedModelParallel and its parts: plan checks, source weights, the data-parallel dense
rest and the 2-D (sharded, then replicated) layout."""
