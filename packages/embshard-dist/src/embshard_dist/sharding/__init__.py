"""Sharding strategies of embedding collections and the pieces they share (import modules by
path; this package imports nothing itself).

Every strategy turns one step into input dist -> lookup -> output dist:

* ``base``: the strategy protocol, the 1/N gradient rule, feature selection;
* pooled (embedding bags), one module per strategy: ``dp`` (data-parallel: touched rows
  exchanged, never whole tables), ``tw`` (table-wise), ``rw`` (row-wise: ids bucketized into row
  blocks by ``bucketize.bucketize_kjt`` in ``RwInputDist``, partial sums reduce-scattered), ``cw``
  (column-wise), ``twrw`` (table-row-wise), ``twcw`` (table-column-wise), ``grid`` (column blocks
  placed table-row-wise); ``_node_dist`` holds the node-aware dists (reduce inside the node, then
  cross nodes) and ``nodes`` the node topology and its process groups;
* sequence (one row per id): ``dp_seq``, ``tw_seq``, ``rw_seq``, ``cw_seq`` reuse the pooled
  strategies' input dists and lookups; ``sequence`` holds their shared output dist;
* ``variable_batch``: features carrying different batch sizes per rank;
* shared halves: ``_lookup`` (grouped kernels over local shards), ``_route`` (routed input dist,
  pooled output dist), ``layout`` (shard sizes and specs per strategy).
"""
