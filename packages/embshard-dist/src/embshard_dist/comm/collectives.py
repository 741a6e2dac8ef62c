"""Small blocking collectives: all-reduce, all-gathers (also of uneven sizes), sparse and dense
all-reduces of gradient rows, and a barrier.

Each takes keyword ``group`` (``None``: the default), ``timeout`` (``None``: the policy of
``timeouts``) and ``name`` (in errors); a dead or hung peer raises ``CollectiveError``. Gathers
are in rank order; row sums are sorted by row, summed in input order, equal on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from embshard_dist.comm import dispatch
from embshard_dist.comm._dtypes import dtype_code, dtype_name
from embshard_dist.comm.gather import start_all_gather
from embshard_dist.comm.timeouts import Timeout, issue
from embshard_kernels.workspace import Workspace

_MAX_DIMS = 8


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where tensors a collective builds for ``group`` must live: the current CUDA device under
    a plain ``nccl`` group (NCCL sends CUDA tensors only), else (gloo, mixed groups) the CPU."""
    if str(dist.get_backend(group)).lower() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(
    tensor: Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    *,
    group: dist.ProcessGroup | None = None,
    timeout: Timeout = None,
    name: str = "all_reduce",
) -> Tensor:
    """Reduce ``tensor`` (the local contribution) in place over the group with ``op``; return it."""
    issue(
        name,
        lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True),
        group=group,
        timeout=timeout,
        device=tensor.device,
    ).wait()
    return tensor


def barrier(
    *, group: dist.ProcessGroup | None = None, timeout: Timeout = None, name: str = "barrier"
) -> None:
    """Wait until every rank of the group reaches this point (with a time limit)."""
    issue(
        name,
        lambda: dist.barrier(group=group, async_op=True),
        group=group,
        timeout=timeout,
    ).wait()


def all_gather_ints(
    values: Sequence[int],
    *,
    group: dist.ProcessGroup | None = None,
    timeout: Timeout = None,
    name: str = "all_gather_ints",
) -> list[list[int]]:
    """Every rank's ``values`` (ints, as many on every rank; e.g. batch sizes), in rank order."""
    world = dist.get_world_size(group)
    device = collective_device(group)
    local = torch.tensor(list(values), dtype=torch.int64, device=device).reshape(-1)
    out = local.new_empty(world * local.numel())
    start_all_gather(name, out, local, group=group, timeout=timeout).wait()
    return [row.tolist() for row in out.reshape(world, -1)]


def all_gather_v(
    tensor: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    timeout: Timeout = None,
    name: str = "all_gather_v",
) -> list[Tensor]:
    """Every rank's ``tensor``, in rank order; only the first dimension may differ per rank.

    Raises:
        ValueError: ranks disagree on the dtype or the trailing dimensions.
    """
    if not 1 <= tensor.dim() <= _MAX_DIMS:
        raise ValueError(
            f"{name}: expected a tensor of 1 to {_MAX_DIMS} dimensions, got {tensor.dim()}"
        )
    trailing = list(tensor.shape[1:])
    meta = all_gather_ints(
        [
            tensor.shape[0],
            dtype_code(tensor.dtype),
            tensor.dim(),
            *trailing,
            *[-1] * (_MAX_DIMS - len(trailing)),
        ],
        group=group,
        timeout=timeout,
        name=f"{name}.sizes",
    )
    if any(m[1:] != meta[0][1:] for m in meta):
        raise ValueError(
            f"{name}: ranks disagree on the dtype or the shape after the first dimension: "
            + ", ".join(
                f"rank {r}: {dtype_name(m[1])} {m[3 : 2 + m[2]]}" for r, m in enumerate(meta)
            )
        )
    rows = [m[0] for m in meta]
    padded_rows = max(rows)
    local = tensor.contiguous()
    if local.shape[0] < padded_rows:
        pad = local.new_zeros((padded_rows - local.shape[0], *trailing))
        local = torch.cat([local, pad])
    out = local.new_empty((len(rows) * padded_rows, *trailing))
    start_all_gather(name, out, local, group=group, timeout=timeout).wait()
    chunks = out.split([padded_rows] * len(rows))
    return [chunk[:n] for chunk, n in zip(chunks, rows, strict=True)]


def sum_rows(
    rows: Tensor,
    grads: Tensor,
    *,
    sources: Tensor | None = None,
    workspace: Workspace | None = None,
) -> tuple[Tensor, Tensor]:
    """Combine the gradients of repeated rows: sorted unique rows and their summed gradients.

    A repeated row's gradients are summed in input order; ``dispatch`` picks the algorithm.

    Args:
        rows: 1-D int64 row ids.
        grads: the gradient rows: one per id, or any rows of which ``sources`` picks one per id.
        sources: per id, its row of ``grads`` (default: id ``i``, row ``i``).
        workspace: where to put the sums (valid until its next use), instead of a new tensor.

    Raises:
        ValueError: ``rows`` is not 1-D or ``grads`` does not have a row per id.
    """
    if (
        rows.dim() != 1
        or grads.dim() != 2
        or (sources is None and grads.shape[0] != rows.shape[0])
        or (sources is not None and sources.shape != rows.shape)
    ):
        raise ValueError(
            f"sum_rows: expected 1-D row ids and one 2-D gradient row per id, got rows "
            f"{tuple(rows.shape)} and grads {tuple(grads.shape)}"
        )
    return dispatch.row_sum(rows, grads)(rows, grads, sources, workspace)


def _gather_padded(
    rows: Tensor,
    grads: Tensor,
    group: dist.ProcessGroup | None,
    timeout: Timeout,
    name: str,
    workspace: Workspace | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(rows, sources, gathered)``: all ranks' row ids in rank order and, per id, its row of
    the gathered gradients (``[world * largest count, dim]``, each rank's block padded)."""
    out_rows, out_grads, counts = _gather_blocks(rows, grads, group, timeout, name, workspace)
    most = max(counts)
    if all(c == most for c in counts):
        return out_rows, torch.arange(out_rows.numel(), device=rows.device), out_grads
    sources = torch.cat(
        [torch.arange(r * most, r * most + c, device=rows.device) for r, c in enumerate(counts)]
    )
    return out_rows.index_select(0, sources), sources, out_grads


def _gather_blocks(
    rows: Tensor,
    grads: Tensor,
    group: dist.ProcessGroup | None,
    timeout: Timeout,
    name: str,
    workspace: Workspace | None = None,
) -> tuple[Tensor, Tensor, list[int]]:
    """``(rows, gathered, counts)``: every rank's block of ids and gradient rows in rank order,
    each padded to the largest block with row 0 and zero gradients, and the blocks' true sizes.

    Two rounds: the counts, then the ids and the gradient rows (issued at once), each rank's
    block written straight into its slot of the output.
    """
    if rows.dim() != 1 or grads.dim() != 2 or grads.shape[0] != rows.shape[0]:
        raise ValueError(
            f"{name}: expected 1-D row ids and one 2-D gradient row per id, got rows "
            f"{tuple(rows.shape)} and grads {tuple(grads.shape)}"
        )
    width = grads.shape[1]
    meta = all_gather_ints(
        [rows.shape[0], width, dtype_code(grads.dtype)],
        group=group,
        timeout=timeout,
        name=f"{name}.sizes",
    )
    if any(m[1:] != meta[0][1:] for m in meta):
        raise ValueError(
            f"{name}: ranks disagree on the gradient width or dtype: "
            + ", ".join(f"rank {r}: {dtype_name(m[2])} x {m[1]}" for r, m in enumerate(meta))
        )
    counts = [m[0] for m in meta]
    world, most, n = len(counts), max(counts), rows.shape[0]
    at = dist.get_rank(group) * most
    space = workspace or Workspace()
    out_rows = rows.new_empty(world * most, dtype=torch.int64)
    out_grads = space.take("gathered", (world * most, width), grads.dtype, grads.device)
    mine_rows, mine_grads = out_rows[at : at + most], out_grads[at : at + most]
    mine_rows[:n] = rows
    mine_rows[n:] = 0
    mine_grads[:n] = grads
    mine_grads[n:] = 0
    pending = [
        start_all_gather(f"{name}.rows", out_rows, mine_rows, group=group, timeout=timeout),
        start_all_gather(f"{name}.grads", out_grads, mine_grads, group=group, timeout=timeout),
    ]
    for work in pending:
        work.wait()
    return out_rows, out_grads, counts


def sparse_all_gather(
    rows: Tensor,
    grads: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    timeout: Timeout = None,
    name: str = "sparse_all_gather",
    workspace: Workspace | None = None,
    zero_padding: bool = False,
) -> tuple[Tensor, Tensor]:
    """Every rank's ``rows`` (1-D int64 ids) and ``grads`` (``[len(rows), dim]``, ``dim`` and
    dtype equal on every rank), concatenated in rank order.

    Args:
        workspace: reused buffer for the gathered gradients (valid until its next use).
        zero_padding: each rank's block comes padded to the largest block with entries of row
            0 and a zero gradient, as it travelled (no compacting copy): for a consumer that
            sums each row's entries, to which a zero adds nothing.

    Raises:
        ValueError: shapes do not fit, or ranks disagree on ``dim`` or the dtype.
    """
    if zero_padding:
        padded_rows, gathered, _ = _gather_blocks(rows, grads, group, timeout, name, workspace)
        return padded_rows, gathered
    all_rows, sources, gathered = _gather_padded(rows, grads, group, timeout, name, workspace)
    return all_rows, gathered.index_select(0, sources)


def sparse_all_reduce(
    rows: Tensor,
    grads: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    timeout: Timeout = None,
    name: str = "sparse_all_reduce",
    workspace: Workspace | None = None,
) -> tuple[Tensor, Tensor]:
    """Sum sparse gradient rows over the group (data-parallel tables): ``(unique_rows, summed)``,
    the rows touched anywhere, sorted, with their gradients summed in rank order.

    Args:
        rows: 1-D int64 row ids touched on this rank (repeats allowed).
        grads: ``[len(rows), dim]`` their gradients.
        workspace: reused buffers for the gathered and summed gradients (the sums are valid until
            its next use); ``None``: fresh tensors.
    """
    all_rows, sources, gathered = _gather_padded(rows, grads, group, timeout, name, workspace)
    return sum_rows(all_rows, gathered, sources=sources, workspace=workspace)


def dense_row_all_reduce(
    rows: Tensor,
    grads: Tensor,
    num_rows: int,
    *,
    group: dist.ProcessGroup | None = None,
    timeout: Timeout = None,
    name: str = "dense_row_all_reduce",
    workspace: Workspace | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`sparse_all_reduce` for a small block of rows (summed in the backend's order).

    Each rank writes its rows' gradients into a zeroed ``[num_rows, dim + 1]`` buffer whose last
    column marks the rows it touched; the buffer is summed over the group and the rows marked
    anywhere come out. Every rank must choose it alike, from ``num_rows`` and ``dim`` alone.

    Args:
        rows: 1-D distinct row ids (below ``num_rows``) touched on this rank.
        grads: ``[len(rows), dim]`` float32 gradients.
        num_rows: rows of the block.
        workspace: reused buffer for the block (results are valid until its next use).
    """
    if rows.dim() != 1 or grads.dim() != 2 or grads.shape[0] != rows.shape[0]:
        raise ValueError(
            f"{name}: expected 1-D row ids and one 2-D gradient row per id, got rows "
            f"{tuple(rows.shape)} and grads {tuple(grads.shape)}"
        )
    width = grads.shape[1]
    shape = (num_rows, width + 1)
    space = workspace or Workspace()
    block = space.take("block", shape, grads.dtype, grads.device).zero_()
    index = rows.to(torch.int64)
    block[:, :width].index_copy_(0, index, grads)
    block[:, width].index_fill_(0, index, 1.0)
    issue(
        name,
        lambda: dist.all_reduce(block, group=group, async_op=True),
        group=group,
        timeout=timeout,
        device=grads.device,
    ).wait()
    touched = torch.nonzero(block[:, width]).view(-1)
    return touched, block[:, :width].index_select(0, touched)
