"""Plan quality: the planner's estimates against measured steps, and its plans against TorchRec's.

Run it with ``python -m benchmarks.plan_quality.run`` from the repository root, in an environment
holding embshard (and TorchRec 1.8.0 for the TorchRec planner's plan: the ``compare`` nox
environment). Modules: ``tables`` (W1 / W2 as the planner sees them), ``plans`` (single sharding
types, embshard's planner, TorchRec's planner, all as embshard ``ShardingPlan``s), ``measure``
(spawned gloo ranks executing every plan interleaved in the same processes), ``run`` (the
driver: calibrate, estimate, measure, print).
"""
