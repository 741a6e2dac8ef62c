"""Distributed primitives every sharded module is built from.

Modules (import them by path; this package imports nothing itself, so importing it is free):

* ``timeouts``: the time limit of a collective and ``CollectiveError``;
* ``kjt_all_to_all``: two-phase all-to-all of KeyedJaggedTensors (input distribution);
* ``pooled_all_to_all``: differentiable all-to-all of pooled embeddings (output distribution);
* ``reduce_scatter``: differentiable reduce-scatter of pooled embeddings (row-wise output);
* ``collectives``: blocking all-reduce / all-gather helpers, sparse gradient all-reduce, barrier.
"""
