"""Sharding planners: decide how every table of a model is split across ranks.

Modules (import them by path; this package imports nothing itself):

* ``planner``: ``EmbeddingShardingPlanner``, the cost-based planner: enumerate every option the
  sharders support on the device (``enumerate``), estimate storage and time per rank from a
  ``Topology`` (``costs``, ``estimate``), place shards minimising the slowest rank's estimated
  step time under the memory limits (``partition``: greedy, then ``search``: beam / exact), and
  print why (``stats``); ``collective_plan`` plans on one rank and broadcasts;
* ``topology``: world size, node size, memory per rank and the bandwidths the estimates use
  (``speeds``: the figures per kernel and per sharding type it holds);
  ``calibrate`` measures them on the machine at hand (``embshard calibrate``), with
  ``probes`` (kernel and memory probes) and ``calibrate_ranks`` (real sharded steps per
  sharding type on the calibrating processes);
* ``auto``: the default plan of ``DistributedModelParallel`` and ``embshard train``: the
  cost-based planner for this run's ranks, node size and memory (``runtime_topology``);
* ``traffic``: distinct rows a batch touches (uniform or Zipf-skewed ids), for the estimates;
* ``constraints``: what a user pins per table (allowed types and kernels, placement, workload);
* ``tables`` / ``spec``: where the tables come from (a model, or a JSON / YAML table spec);
* ``shardable``: find the shardable sub-modules of a model and the shapes of their tables;
* ``agreement``: check with one small all-gather that every rank holds the same plan;
* ``requests``: what a user may ask for (a sharding type per table, one for all, "auto");
* ``simple``: a simple plan (``SimplePlanner``): table bytes balanced greedily across ranks,
  table-wise unless asked otherwise, deterministic.
"""
