"""The parts of ``DistributedModelParallel`` (``embshard_dist.model_parallel``), one job each.

Modules (import them by path; this package imports nothing itself):

* ``checks``: the plan checked against the model and the world, before any collective;
* ``weights``: every rank holds the same source weights (checksums), materialising the
  dense rest of a meta-device model, moving it to the device;
* ``dense``: the data-parallel wrapper (DDP) of the dense rest and its default optimizer;
* ``collection``: ``DMPCollection``, the 2D layout (tables sharded over a group of ranks, the
  group replicated) and ``replicas``, which keeps the replicas in sync at a chosen interval.
"""
