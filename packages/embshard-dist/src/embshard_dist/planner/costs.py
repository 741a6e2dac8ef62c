"""The planner's cost model: memory and step time each shard puts on the rank that holds it.

A shard's step time is its holder's cost (ids in, lookup, update, output out), every rank's
cost of feeding it a batch, and the per-type overheads of the topology's calibration; storage
is weights, optimizer state and one step's buffers, split between device and host memory by
kernel. Time is compute plus comms with no overlap; a plan's step time is its slowest rank's.

Guarantees: pure, deterministic functions; :func:`sharding_costs` of an option's
``ParameterSharding`` gives exactly the costs the partitioner balanced.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from embshard_dist.planner.cost_model import (
    ID_BYTES,
    STATE_BYTES,
    ZERO,
    Cost,
    CostModel,
    LoadedTable,
)
from embshard_dist.planner.topology import SPARSE_UPDATE, KernelThroughput, Topology
from embshard_dist.planner.traffic import distinct_rows
from embshard_types.parameter_sharding import ParameterSharding
from embshard_types.vocab import ComputeKernel, ShardingType

__all__ = [
    "batch_cost",
    "collective_overhead",
    "compute_scale",
    "holder_cost",
    "mixing_cost",
    "replica_cost",
    "sharding_costs",
    "table_overhead",
]

DENSE_PASSES = 10
"""Passes over a ``dense``-kernel shard per step (zeroed gradient, torch optimizer step): the
dense gradient and the torch optimizer's step each sweep the whole shard at memory bandwidth."""

_LENGTH_BYTES = 4
QUANT_ROW_BYTES = 4
"""A row-wise quantized row's fp16 scale and bias, as FBGEMM packs them."""
_COLLECTIVES_PER_TYPE = 4  # per type, a collective per: ids splits, ids values, output, gradient
_COLLECTIVES_DATA_PARALLEL = 2

_ROW_FAMILY = (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE, ShardingType.GRID_SHARD)
_NODE_REDUCED = (ShardingType.TABLE_ROW_WISE, ShardingType.GRID_SHARD)


def _touched(lt: LoadedTable, rows: float, global_ids: float) -> float:
    """Distinct rows of a ``rows``-row block of ``lt`` touched by ``global_ids`` ids."""
    t = lt.table.rows
    return distinct_rows(t, global_ids, lt.workload.zipf_exponent) * min(1.0, rows / t)


def _update_bytes(touched: float, cols: int, eb: float, state_row: int) -> float:
    """Bytes the fused update reads and writes: touched rows, their gradient and state."""
    return touched * (cols * (2 * eb + 8) + 2 * state_row)


def _update_s(nbytes: float, model: CostModel) -> float:
    """Seconds of the update of the touched rows of a data-parallel table on each replica."""
    fused = model.topology.throughput(ComputeKernel.FUSED)
    if fused.update_bytes_per_s is not None and not model.fused_on_torch:
        return nbytes / fused.update_bytes_per_s
    return nbytes / model.topology.throughput(SPARSE_UPDATE).bwd_bytes_per_s


def _spread(nbytes: float, topo: Topology) -> float:
    """Seconds to exchange ``nbytes`` spread evenly over all ranks (own share is free)."""
    n, m = topo.world_size, topo.ranks_per_node
    return nbytes * ((m - 1) / n / topo.intra_node_bw + (n - m) / n / topo.inter_node_bw)


def _reduced_within_node(nbytes: float, topo: Topology) -> float:
    """Seconds of a reduce-scatter / all-gather moving ``nbytes`` within one node."""
    m = topo.ranks_per_node
    return nbytes * (m - 1) / m / topo.within_node_reduce_bw


def _across_nodes(nbytes: float, topo: Topology) -> float:
    nodes = topo.num_nodes
    return nbytes * (nodes - 1) / nodes / topo.inter_node_bw


def _split_storage(
    kernel: ComputeKernel, table_bytes: float, buffers: float, lt: LoadedTable, model: CostModel
) -> tuple[int, int]:
    """(device, host) bytes of a shard whose weights + state take ``table_bytes``."""
    if model.topology.compute_device != "cuda":
        return math.ceil(table_bytes + buffers), 0
    cache = lt.constraints.cache_params
    lf = cache.load_factor if cache is not None and cache.load_factor else model.cache_load_factor
    if kernel is ComputeKernel.FUSED_UVM:
        return math.ceil(buffers), math.ceil(table_bytes)
    if kernel is ComputeKernel.FUSED_UVM_CACHING:
        return math.ceil(buffers + lf * table_bytes), math.ceil(table_bytes)
    if kernel is ComputeKernel.KEY_VALUE:
        return math.ceil(buffers + lf * table_bytes), 0
    return math.ceil(table_bytes + buffers), 0


def _forward_s(thr: KernelThroughput, fwd_bytes: float, distinct_bytes: float) -> float:
    """Seconds of a lookup moving ``fwd_bytes`` whose distinct rows take ``distinct_bytes``."""
    miss = 0.0 if thr.miss_bytes_per_s is None else distinct_bytes / thr.miss_bytes_per_s
    return fwd_bytes / thr.fwd_bytes_per_s + miss


def _backward_s(
    kernel: ComputeKernel,
    fwd_bytes: float,
    rows: int,
    cols: int,
    touched: float,
    lt: LoadedTable,
    model: CostModel,
) -> float:
    topo = model.topology
    eb = lt.table.element_bytes
    state_row = model.state_bytes_per_row(cols)
    if kernel is ComputeKernel.DENSE:
        whole = DENSE_PASSES * rows * cols * 4
        return 2 * fwd_bytes / topo.throughput(kernel).bwd_bytes_per_s + whole / topo.memory_bw
    if model.fused_on_torch and kernel in (ComputeKernel.FUSED, ComputeKernel.DEFAULT):
        update = _update_bytes(touched, cols, eb, state_row)
        return (
            2 * fwd_bytes / topo.throughput(ComputeKernel.DENSE).bwd_bytes_per_s
            + update / topo.throughput(SPARSE_UPDATE).bwd_bytes_per_s
        )
    thr = topo.throughput(kernel)
    if thr.update_bytes_per_s is None:
        return (2 * fwd_bytes + 2 * touched * state_row) / thr.bwd_bytes_per_s
    update = _update_bytes(touched, cols, eb, state_row)
    return 2 * fwd_bytes / thr.bwd_bytes_per_s + update / thr.update_bytes_per_s


def holder_cost(
    lt: LoadedTable,
    sharding_type: ShardingType,
    kernel: ComputeKernel,
    rows: int,
    cols: int,
    model: CostModel,
    *,
    column_blocks: int = 1,
) -> Cost:
    """Cost, on the rank holding it, of one ``rows x cols`` shard of a sharded table.

    Args:
        column_blocks: number of column blocks the table is cut into.
    """
    topo = model.topology
    n = topo.world_size
    w = lt.workload
    global_bags = n * w.bags
    global_outputs = n * w.output_rows
    ids_in = n * w.ids * rows / lt.table.rows
    touched = _touched(lt, rows, n * w.ids)
    in_bytes = ids_in * lt.id_bytes + global_bags * _LENGTH_BYTES
    out_bytes = global_outputs * cols * lt.output_bytes
    comms = _spread(in_bytes, topo)
    if kernel is ComputeKernel.QUANT and sharding_type is ShardingType.ROW_WISE:
        # Row fetching (sharded quantized inference): every id's stored row goes back.
        comms += _spread(ids_in * (cols * lt.table.element_bytes + QUANT_ROW_BYTES), topo)
    elif sharding_type in _NODE_REDUCED:
        comms += _reduced_within_node(4 * out_bytes, topo)
        comms += _across_nodes(2 * out_bytes / topo.ranks_per_node, topo)
    elif sharding_type is ShardingType.ROW_WISE:
        # Reduce-scatter over every rank: the node's share at the reduce-scatter bandwidth.
        n, m = topo.world_size, topo.ranks_per_node
        inter = 4 * out_bytes * (n - m) / n / topo.inter_node_bw
        comms += 4 * out_bytes * (m - 1) / n / topo.within_node_reduce_bw + inter
    else:
        comms += _spread(2 * out_bytes, topo)
    if column_blocks > 1 and model.rowwise_state():
        comms += _spread(2 * STATE_BYTES * touched * column_blocks, topo)
    eb = lt.table.element_bytes
    fwd_bytes = ids_in * cols * eb + global_outputs * cols * lt.output_bytes
    compute = _forward_s(topo.throughput(kernel), fwd_bytes, touched * cols * eb)
    if kernel is ComputeKernel.QUANT:
        # Inference: no backward and no optimizer state; each packed row keeps its fp16
        # scale and bias.
        row_extra = QUANT_ROW_BYTES if lt.table.data_type.is_quantized else 0
        table_bytes = rows * (cols * eb + row_extra)
    else:
        compute += _backward_s(kernel, fwd_bytes, rows, cols, touched, lt, model)
        table_bytes = rows * (cols * eb + model.state_bytes_per_row(cols))
    compute *= compute_scale(sharding_type, model)
    buffers = in_bytes + 2 * out_bytes
    if kernel is ComputeKernel.DENSE:
        buffers += rows * cols * 4
    storage, host = _split_storage(kernel, table_bytes, buffers, lt, model)
    return Cost(compute, comms, storage, host)


def batch_cost(
    lt: LoadedTable, sharding_type: ShardingType, model: CostModel, *, column_blocks: int = 1
) -> Cost:
    """Cost, on every rank, of feeding a sharded table its own batch and getting rows back.

    Args:
        column_blocks: number of column blocks (column-wise, table-column-wise, grid).
    """
    topo = model.topology
    w = lt.workload
    m, n = topo.ranks_per_node, topo.world_size
    copies, lengths = {
        ShardingType.TABLE_WISE: (1, 1),
        ShardingType.COLUMN_WISE: (column_blocks, column_blocks),
        ShardingType.TABLE_COLUMN_WISE: (column_blocks, column_blocks),
        ShardingType.ROW_WISE: (1, n),
        ShardingType.TABLE_ROW_WISE: (1, m),
        ShardingType.GRID_SHARD: (column_blocks, column_blocks * m),
    }[sharding_type]
    in_bytes = copies * w.ids * lt.id_bytes + lengths * w.bags * _LENGTH_BYTES
    out_bytes = w.output_rows * lt.table.dim * lt.output_bytes
    comms = _spread(in_bytes, topo) + table_overhead(sharding_type, model)
    if sharding_type not in _ROW_FAMILY:
        comms += _spread(2 * out_bytes, topo)
    compute = 2 * w.ids * lt.id_bytes / topo.memory_bw
    return Cost(compute, comms, math.ceil(in_bytes + 2 * out_bytes), 0)


def replica_cost(lt: LoadedTable, kernel: ComputeKernel, model: CostModel) -> Cost:
    """Cost, on every rank, of a data-parallel table (looked up locally, sparse all-reduce)."""
    topo = model.topology
    n = topo.world_size
    rows, dim = lt.table.rows, lt.table.dim
    w = lt.workload
    eb = lt.table.element_bytes
    state_row = model.state_bytes_per_row(dim)
    local_rows = _touched(lt, rows, w.ids)
    global_rows = _touched(lt, rows, n * w.ids)
    thr = topo.throughput(kernel)
    fwd_bytes = w.ids * dim * eb + w.output_rows * dim * lt.output_bytes
    compute = _forward_s(thr, fwd_bytes, local_rows * dim * eb)
    compute += 2 * fwd_bytes / thr.bwd_bytes_per_s
    compute += 2 * n * local_rows * dim * 4 / topo.memory_bw
    compute += _update_s(_update_bytes(global_rows, dim, eb, state_row), model)
    compute *= compute_scale(ShardingType.DATA_PARALLEL, model)
    chunk = local_rows * (dim * 4 + ID_BYTES)
    comms = _spread(2 * n * chunk, topo) + table_overhead(ShardingType.DATA_PARALLEL, model)
    table_bytes = rows * (dim * eb + state_row)
    buffers = w.ids * lt.id_bytes + 2 * w.output_rows * dim * lt.output_bytes + n * chunk
    storage, host = _split_storage(kernel, table_bytes, buffers, lt, model)
    return Cost(compute, comms, storage, host)


def collective_overhead(sharding_type: ShardingType, model: CostModel) -> Cost:
    """What using ``sharding_type`` at all adds to every rank per step.

    The calibrated overhead's ``step_s`` when the topology has one, else its collectives' latency.
    """
    if model.topology.world_size == 1:
        return ZERO
    measured = model.topology.overhead(sharding_type)
    if measured is not None:
        return Cost(0.0, measured.step_s, 0, 0)
    count = (
        _COLLECTIVES_DATA_PARALLEL
        if sharding_type is ShardingType.DATA_PARALLEL
        else _COLLECTIVES_PER_TYPE
    )
    return Cost(0.0, count * model.topology.collective_latency_s, 0, 0)


def mixing_cost(tables: Sequence[LoadedTable], model: CostModel) -> Cost:
    """What a plan of more than one sharding type adds to every rank per step.

    One more copy of the collection's output and of its gradient, to put the types' outputs in
    the caller's column order (sequence tables copy nothing).
    """
    out_bytes = sum(
        lt.workload.output_rows * lt.table.dim * lt.output_bytes
        for lt in tables
        if not lt.table.sequence
    )
    return Cost(4 * out_bytes / model.topology.memory_bw, 0.0, 0, 0)


def compute_scale(sharding_type: ShardingType, model: CostModel) -> float:
    """The calibrated factor on the compute time of ``sharding_type``'s shards (1 without)."""
    measured = model.topology.overhead(sharding_type)
    return 1.0 if measured is None or model.topology.world_size == 1 else measured.compute_scale


def table_overhead(sharding_type: ShardingType, model: CostModel) -> float:
    """Seconds each table of ``sharding_type`` adds per step (0 without a calibration)."""
    if model.topology.world_size == 1:
        return 0.0
    measured = model.topology.overhead(sharding_type)
    return 0.0 if measured is None else measured.per_table_s


def _column_blocks(ps: ParameterSharding) -> int:
    if not ps.shards:
        return 1
    return len({s.offsets[1] for s in ps.shards})


def sharding_costs(lt: LoadedTable, ps: ParameterSharding, model: CostModel) -> list[Cost]:
    """Per-rank cost of one table sharded as ``ps`` (without the per-type latency).

    Raises:
        ValueError: a sharded table without shard specs.
    """
    n = model.topology.world_size
    costs = [ZERO] * n
    kernel = ps.compute_kernel
    if ps.sharding_type is ShardingType.DATA_PARALLEL:
        replica = replica_cost(lt, kernel, model)
        for r in ps.ranks or range(n):
            costs[r] = costs[r] + replica
        return costs
    if not ps.shards:
        raise ValueError(
            f"table {lt.table.key!r}: a {ps.sharding_type.value} sharding needs shard specs"
        )
    blocks = _column_blocks(ps)
    batch = batch_cost(lt, ps.sharding_type, model, column_blocks=blocks)
    costs = [batch] * n
    for shard in ps.shards:
        rows, cols = shard.sizes[0], shard.sizes[1]
        holder = holder_cost(lt, ps.sharding_type, kernel, rows, cols, model, column_blocks=blocks)
        costs[shard.rank] = costs[shard.rank] + holder
    return costs
