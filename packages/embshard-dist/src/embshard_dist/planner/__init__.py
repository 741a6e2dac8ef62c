"""Sharding planners: decide how every table of a model is split across ranks.

Modules (import them by path; this package imports nothing itself):

* ``shardable``: find the shardable sub-modules of a model and the shapes of their tables;
* ``agreement``: check with one small all-gather that every rank holds the same plan;
* ``requests``: what a user may ask for (a sharding type per table, one for all, "auto");
* ``simple``: the default plan (``SimplePlanner``): table bytes balanced greedily across ranks,
  table-wise unless asked otherwise, deterministic.
"""
