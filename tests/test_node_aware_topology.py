"""The node arithmetic of the node-aware strategies, in one process (no ranks needed).

* :func:`resolve_local_world_size`: explicit size, then ``LOCAL_WORLD_SIZE``, then one node;
  bad values raise ``ValueError`` saying what to change;
* :class:`NodeTopology`: node-major numbering;
* :func:`padded_boundaries` with :func:`bucketize_kjt`: every id goes to the rank of its unit's
  node that holds its row, as that row's local id (property test);
* :func:`staggered_batches`: the stagger order of :class:`KJTAllToAll` gives each local position
  the samples of its peers on every node.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embshard_dist.comm.kjt_all_to_all import source_order
from embshard_dist.strategies.bucketize import bucketize_kjt
from embshard_dist.strategies.layout import row_wise_boundaries
from embshard_dist.strategies.node_dist import padded_boundaries, staggered_batches
from embshard_dist.strategies.nodes import NodeTopology, resolve_local_world_size
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor


def test_local_world_size_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert resolve_local_world_size(8) == 8
    assert resolve_local_world_size(8, 2) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert resolve_local_world_size(8) == 4
    assert resolve_local_world_size(8, 8) == 8  # explicit wins
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "four")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE='four'"):
        resolve_local_world_size(8)
    with pytest.raises(ValueError, match="do not divide"):
        resolve_local_world_size(6, 4)
    with pytest.raises(ValueError, match="positive int"):
        resolve_local_world_size(6, 0)


def test_topology_numbers_nodes_first() -> None:
    topo = NodeTopology(6, 3, 4)
    assert (topo.num_nodes, topo.node, topo.local_rank) == (2, 1, 1)
    assert topo.node_ranks(1) == [3, 4, 5]
    assert topo.peer_ranks(2) == [2, 5]
    with pytest.raises(ValueError, match="outside"):
        NodeTopology(6, 3, 6)


@settings(max_examples=60, deadline=None)
@given(
    nodes=st.integers(1, 3),
    local=st.integers(1, 3),
    rows=st.integers(1, 12),
    data=st.data(),
)
def test_padded_bucketize_routes_ids_to_the_node(
    nodes: int, local: int, rows: int, data: st.DataObject
) -> None:
    topo = NodeTopology(nodes * local, local, 0)
    node = data.draw(st.integers(0, nodes - 1))
    inner = row_wise_boundaries(rows, local)
    bounds = padded_boundaries(inner, node, topo)
    assert len(bounds) == topo.world_size + 1
    lengths = torch.tensor(data.draw(st.lists(st.integers(0, 4), min_size=1, max_size=5)))
    ids = torch.tensor(
        data.draw(
            st.lists(
                st.integers(0, rows - 1), min_size=int(lengths.sum()), max_size=int(lengths.sum())
            )
        ),
        dtype=torch.long,
    )
    kjt = KeyedJaggedTensor(["f"], ids, lengths=lengths)
    out, _ = bucketize_kjt(kjt, [bounds])
    batch = lengths.numel()
    per_bucket = out.lengths().view(topo.world_size, batch)
    values = out.values().split(per_bucket.sum(1).tolist())
    for rank in range(topo.world_size):
        if topo.node_of(rank) != node:
            assert int(per_bucket[rank].sum()) == 0
            continue
        lr = rank % local
        lo, hi = inner[lr], inner[lr + 1]
        expected = [int(i) - lo for i in ids if lo <= int(i) < hi]
        assert values[rank].tolist() == expected


def test_staggered_batches_follow_the_all_to_all_order() -> None:
    topo = NodeTopology(6, 3, 4)  # node 1, local rank 1
    batches = [10, 11, 12, 13, 14, 15]  # rank r has batch 10 + r
    staggered = [batches[r] for r in source_order(6, topo.num_nodes)]
    stripes, peers = staggered_batches(staggered, topo)
    assert stripes == [10 + 13, 11 + 14, 12 + 15]
    assert peers == [11, 14]
