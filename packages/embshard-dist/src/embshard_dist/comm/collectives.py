"""Small blocking collectives with time limits: all-reduce, all-gather (also of uneven sizes),
a sparse all-reduce of gradient rows, and a barrier.

Guarantees:
    * every call waits with the limit of ``timeouts`` and raises ``CollectiveError`` naming the
      collective (the ``name`` argument, or the function's name) when a peer dies or hangs;
    * gathered results are in rank order of the group;
    * ``sum_rows`` and ``sparse_all_reduce`` are deterministic: rows come out sorted, and the
      gradients of a repeated row are summed in input order (rank order, then each rank's own
      order), so every rank obtains bit-identical results;
    * uneven all-gathers pad to the largest size and trim: no backend support for uneven
      gathers is needed (gloo has none);
    * helpers that build their own tensors (``all_gather_ints``) put them where the group's
      backend can send them (:func:`collective_device`: this rank's GPU under NCCL, else CPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from embshard_dist.comm._dtypes import dtype_code, dtype_name
from embshard_dist.comm.gather import start_all_gather
from embshard_dist.comm.timeouts import Timeout, issue
from embshard_kernels.row_sums import group_rows, sparse_product
from embshard_kernels.workspace import Workspace

_MAX_DIMS = 8


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where tensors a collective builds for ``group`` must live.

    NCCL sends CUDA tensors only: under a plain ``nccl`` group this is the current CUDA device
    (``torch.cuda.set_device`` picks it); under any other backend (gloo, or a mixed
    ``cpu:gloo,cuda:nccl`` group) it is the CPU.

    Args:
        group: the process group (``None``: the default group).
    """
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
    """Reduce ``tensor`` in place over the group and return it.

    Args:
        tensor: the local contribution; holds the result afterwards.
        op: the reduction (``dist.ReduceOp.SUM`` by default).
        group: the process group (``None``: the default group).
        timeout: time limit in seconds (``None``: the policy of ``timeouts``).
        name: the collective's name in errors.
    """
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
    """Wait until every rank of the group reaches this point (with a time limit).

    Args:
        group: the process group (``None``: the default group).
        timeout: time limit in seconds (``None``: the policy of ``timeouts``).
        name: the collective's name in errors.
    """
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
    """Gather a same-length list of ints from every rank (e.g. batch sizes).

    Args:
        values: this rank's ints; every rank must pass the same number of them.
        group: the process group (``None``: the default group).
        timeout: time limit in seconds (``None``: the policy of ``timeouts``).
        name: the collective's name in errors.

    Returns:
        One list per rank, in rank order.
    """
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
    """Gather tensors whose first dimension differs per rank.

    Args:
        tensor: this rank's tensor; trailing dimensions and dtype must be the same on all ranks.
        group: the process group (``None``: the default group).
        timeout: time limit in seconds (``None``: the policy of ``timeouts``).
        name: the collective's name in errors.

    Returns:
        Every rank's tensor, in rank order.

    Raises:
        ValueError: ranks disagree on the trailing dimensions.
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

    Args:
        rows: 1-D int64 row ids.
        grads: the gradient rows: one per id, or (with ``sources``) any rows of which
            ``sources`` picks one per id.
        sources: per id, the row of ``grads`` holding its gradient (default: id ``i``, row
            ``i``).
        workspace: where to put the sums (valid until its next use), instead of a new tensor.

    Returns:
        ``(unique_rows, summed)``; a repeated row's gradients are summed in input order.

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
    on_cpu = grads.device.type == "cpu" and grads.dtype == torch.float32 and rows.numel() > 0
    # int32 indices where they fit: faster sparse products
    index = torch.int32 if on_cpu and grads.shape[0] < 2**31 else torch.int64
    unique, crow, order = group_rows(rows, index)
    picked = order if sources is None else sources.index_select(0, order)
    if on_cpu:
        # A sparse [unique x grads] matrix of ones (each row's ids in input order) times the
        # gradient rows: one pass, no per-id scatter.
        shape = (unique.numel(), grads.shape[1])
        summed = (
            grads.new_empty(shape)
            if workspace is None
            else workspace.take("summed", shape, grads.dtype, grads.device)
        )
        sparse_product(crow, picked.to(index), torch.ones(rows.numel()), grads, summed)
        return unique, summed
    inverse = torch.repeat_interleave(
        torch.arange(unique.numel(), device=rows.device), crow.diff(), output_size=rows.numel()
    )
    summed = grads.new_zeros(unique.shape[0], grads.shape[1])
    # index_add_ adds in index order (on the CPU), which is the input order here.
    summed.index_add_(0, inverse, grads.index_select(0, picked))
    return unique, summed


def _gather_padded(
    rows: Tensor,
    grads: Tensor,
    group: dist.ProcessGroup | None,
    timeout: Timeout,
    name: str,
    workspace: Workspace | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Every rank's rows, where each one's gradient sits in the padded gathered gradients.

    Two rounds: the counts, then the row ids and the gradient rows (both issued at once, as
    all-to-alls on the CPU: see :mod:`~embshard_dist.comm.gather`), each rank's block padded
    to the largest count and written straight into its slot of the output.

    Returns:
        ``(rows, sources, gathered)``: all ranks' row ids in rank order, per id its row of
        ``gathered`` (``[world * largest count, dim]``; padding rows are never referenced).
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
    if all(c == most for c in counts):
        return out_rows, torch.arange(out_rows.numel(), device=rows.device), out_grads
    sources = torch.cat(
        [torch.arange(r * most, r * most + c, device=rows.device) for r, c in enumerate(counts)]
    )
    return out_rows.index_select(0, sources), sources, out_grads


def sparse_all_gather(
    rows: Tensor,
    grads: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    timeout: Timeout = None,
    name: str = "sparse_all_gather",
) -> tuple[Tensor, Tensor]:
    """Gather every rank's ``(row ids, gradient rows)`` and concatenate them in rank order.

    Args:
        rows: 1-D int64 row ids touched on this rank.
        grads: ``[len(rows), dim]`` their gradients; ``dim`` and dtype equal on every rank.
        group: the process group (``None``: the default group).
        timeout: time limit in seconds (``None``: the policy of ``timeouts``).
        name: the collective's name in errors.

    Raises:
        ValueError: shapes do not fit, or ranks disagree on ``dim`` or the dtype.
    """
    all_rows, sources, gathered = _gather_padded(rows, grads, group, timeout, name)
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
    """Sum sparse gradient rows over the group (for data-parallel tables).

    Args:
        rows: 1-D int64 row ids touched on this rank (repeats allowed).
        grads: ``[len(rows), dim]`` their gradients.
        group: the process group (``None``: the default group).
        timeout: time limit in seconds (``None``: the policy of ``timeouts``).
        name: the collective's name in errors.
        workspace: reused buffers for the gathered and the summed gradients (the sums are then
            valid until the workspace's next use); ``None``: fresh tensors.

    Returns:
        ``(unique_rows, summed)``, identical on every rank: the rows touched anywhere, sorted,
        and their gradients summed in rank order.
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
    """:func:`sparse_all_reduce` for a small block of rows: one all-reduce of the whole block.

    Every rank writes its rows' gradients into a zeroed ``[num_rows, dim + 1]`` buffer whose
    last column marks the rows it touched, the buffer is summed over the group, and the rows
    marked anywhere come out with their summed gradients. One collective instead of three: the
    better choice when the block is small (every rank must choose alike, from ``num_rows`` and
    ``dim`` alone).

    Args:
        rows: 1-D distinct row ids (below ``num_rows``) touched on this rank.
        grads: ``[len(rows), dim]`` float32 gradients.
        num_rows: rows of the block.
        group: the process group (``None``: the default group).
        timeout: time limit in seconds (``None``: the policy of ``timeouts``).
        name: the collective's name in errors.
        workspace: reused buffer for the block (results are valid until its next use).

    Returns:
        ``(unique_rows, summed)``, identical on every rank (summed in the backend's order).
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
