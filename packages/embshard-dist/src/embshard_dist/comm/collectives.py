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

import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from embshard_dist.comm._dtypes import dtype_code, dtype_name
from embshard_dist.comm.timeouts import Timeout, issue

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
    issue(
        name,
        lambda: dist.all_gather_single(out, local, group=group, async_op=True),
        group=group,
        timeout=timeout,
        device=device,
    ).wait()
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
    issue(
        name,
        lambda: dist.all_gather_single(out, local, group=group, async_op=True),
        group=group,
        timeout=timeout,
        device=tensor.device,
    ).wait()
    chunks = out.split([padded_rows] * len(rows))
    return [chunk[:n] for chunk, n in zip(chunks, rows, strict=True)]


def sum_rows(rows: Tensor, grads: Tensor) -> tuple[Tensor, Tensor]:
    """Combine the gradients of repeated rows: sorted unique rows and their summed gradients.

    Args:
        rows: 1-D int64 row ids.
        grads: ``[len(rows), dim]`` gradient rows.

    Returns:
        ``(unique_rows, summed)``; a repeated row's gradients are summed in input order.

    Raises:
        ValueError: ``rows`` is not 1-D or ``grads`` does not have one row per id.
    """
    if rows.dim() != 1 or grads.dim() != 2 or grads.shape[0] != rows.shape[0]:
        raise ValueError(
            f"sum_rows: expected 1-D row ids and one 2-D gradient row per id, got rows "
            f"{tuple(rows.shape)} and grads {tuple(grads.shape)}"
        )
    keys, order = torch.sort(rows, stable=True)
    unique, counts = torch.unique_consecutive(keys, return_counts=True)
    if grads.device.type == "cpu" and grads.dtype == torch.float32 and rows.numel():
        # A sparse [unique x ids] matrix of ones (each row's ids in input order) times the
        # gradient rows: one pass, no per-id scatter.
        crow = torch.zeros(unique.numel() + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=crow[1:])
        with warnings.catch_warnings():  # "sparse CSR support is in beta", once per process
            warnings.simplefilter("ignore", UserWarning)
            pattern = torch.sparse_csr_tensor(
                crow,
                order,
                torch.ones(rows.numel()),
                (unique.numel(), rows.numel()),
                check_invariants=False,
            )
            return unique, torch.mm(pattern, grads)
    inverse = torch.empty_like(order)
    inverse[order] = torch.repeat_interleave(
        torch.arange(unique.numel(), device=rows.device), counts, output_size=rows.numel()
    )
    summed = grads.new_zeros(unique.shape[0], grads.shape[1])
    # index_add_ on CPU adds in index order, which is the input order here.
    summed.index_add_(0, inverse, grads)
    return unique, summed


def sparse_all_gather(
    rows: Tensor,
    grads: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    timeout: Timeout = None,
    name: str = "sparse_all_gather",
) -> tuple[Tensor, Tensor]:
    """Gather every rank's ``(row ids, gradient rows)`` and concatenate them in rank order.

    Two collectives whatever the sizes: the row counts, then one message per rank holding the
    row ids' bytes beside the gradient rows' bytes (padded to the largest count).

    Args:
        rows: 1-D int64 row ids touched on this rank.
        grads: ``[len(rows), dim]`` their gradients; ``dim`` and dtype equal on every rank.
        group: the process group (``None``: the default group).
        timeout: time limit in seconds (``None``: the policy of ``timeouts``).
        name: the collective's name in errors.

    Raises:
        ValueError: shapes do not fit, or ranks disagree on ``dim`` or the dtype.
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
    most = max(counts)
    n = rows.shape[0]
    id_bytes = rows.to(torch.int64).contiguous().view(torch.uint8).view(n, 8)
    grad_bytes = grads.contiguous().view(torch.uint8).view(n, width * grads.element_size())
    row_bytes = 8 + grad_bytes.shape[1]
    local = grads.new_zeros((most, row_bytes), dtype=torch.uint8)
    local[:n, :8] = id_bytes
    local[:n, 8:] = grad_bytes
    out = local.new_empty((len(counts) * most, row_bytes))
    issue(
        name,
        lambda: dist.all_gather_single(out, local, group=group, async_op=True),
        group=group,
        timeout=timeout,
        device=grads.device,
    ).wait()
    if all(c == most for c in counts):
        received = out
    else:
        received = torch.cat([out[r * most : r * most + c] for r, c in enumerate(counts)])
    total = received.shape[0]
    all_rows = received[:, :8].contiguous().view(torch.int64).view(total)
    all_grads = received[:, 8:].contiguous().view(grads.dtype).view(total, width)
    return all_rows, all_grads


def sparse_all_reduce(
    rows: Tensor,
    grads: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    timeout: Timeout = None,
    name: str = "sparse_all_reduce",
) -> tuple[Tensor, Tensor]:
    """Sum sparse gradient rows over the group (for data-parallel tables).

    Args:
        rows: 1-D int64 row ids touched on this rank (repeats allowed).
        grads: ``[len(rows), dim]`` their gradients.
        group: the process group (``None``: the default group).
        timeout: time limit in seconds (``None``: the policy of ``timeouts``).
        name: the collective's name in errors.

    Returns:
        ``(unique_rows, summed)``, identical on every rank: the rows touched anywhere, sorted,
        and their gradients summed in rank order.
    """
    all_rows, all_grads = sparse_all_gather(rows, grads, group=group, timeout=timeout, name=name)
    return sum_rows(all_rows, all_grads)
