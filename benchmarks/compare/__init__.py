"""Side-by-side harness: embshard against TorchRec on the workloads of ``shared/benchmarks.md``.

Run it with ``nox -s compare`` (or ``python -m benchmarks.compare.run`` in an environment that
holds both libraries). Modules: ``workloads`` (W1 / W2 tables, batches, weights), ``plans``
(one library-neutral plan per sharding type), ``torchrec_side`` / ``embshard_side`` (each
library's model, step and forward), ``worker`` (one rank: check, then interleaved timing),
``run`` (the driver: spawns the ranks), ``report`` (table, JSON, chart); W2-DLRM (plain loops
against ``TrainPipelineSparseDist``): ``dlrm_sides`` (each library's DLRM and loops),
``dlrm_worker`` (one rank) and ``dlrm_run`` (spawn, summary, ratios).
"""
