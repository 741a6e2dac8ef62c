"""Checkpoints of a ``DistributedModelParallel``: save, resume, reshard, export and import.

Modules (import them by path; this package imports nothing itself):

* ``format``: the on-disk layout, its versioned metadata file and the keys of every tensor;
* ``layout``: what a sharded model holds on this rank, in a plan-independent layout;
* ``tensors``: local pieces of sharded tensors and the ``ShardedTensor``s that are saved / read;
* ``validate``: a checkpoint compared with a model and with its file list, before any load;
* ``train_state``: generator states, hyperparameters, and agreement between ranks;
* ``atomic``: committing a checkpoint with one rename; ``latest`` and pruning of old ones;
* ``save``: atomic (and optionally asynchronous) saves through ``torch.distributed.checkpoint``;
* ``load``: loading under any plan and world size (resharding), all checks first;
* ``reader``: reading one stored value whole, with bounded memory (offline);
* ``export`` / ``import_`` / ``inspect``: offline, single-process tools behind
  ``embshard checkpoint``.
"""
