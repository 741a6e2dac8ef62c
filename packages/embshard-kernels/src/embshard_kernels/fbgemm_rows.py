"""Touched rows updated by FBGEMM's CPU backward kernels, each row a bag of one id.

The torch fast path sums each touched row's gradient itself; :class:`FbgemmRowUpdate` then hands
the rows and their sums to FBGEMM's fused CPU backward (SGD or RowWiseAdagrad, no decay) as bags
of one id, so FBGEMM's jitted row loop writes the weights and the row-wise state in place
instead of torch's indexed ops. A bag of one id sums nothing, and a row given several times (a
data-parallel table's rows from every rank) has its entries summed in the order given, as
FBGEMM sorts stably: the update is the rule of :mod:`embshard_optim.sparse_rules` on those sums,
rounded as FBGEMM rounds.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from embshard_kernels._fbgemm import EmbeddingLocation, PoolingMode, SparseType
from embshard_optim.specs import OptimizerSpec, OptimType

ROW_UPDATE_OPTIMIZERS = (OptimType.SGD, OptimType.ROWWISE_ADAGRAD)


def row_update_refusal(spec: OptimizerSpec, weight: Tensor | None = None) -> str | None:
    """Why :class:`FbgemmRowUpdate` cannot apply ``spec`` (to ``weight``, if given), or ``None``."""
    if spec.optim_type not in ROW_UPDATE_OPTIMIZERS:
        return f"FBGEMM's row update has no {spec.optim_type.name}"
    if spec.weight_decay > 0.0 or spec.max_norm > 0.0:
        return "FBGEMM's row update applies no weight decay and no max-norm"
    if weight is not None and (weight.device.type != "cpu" or weight.dtype != torch.float32):
        return "FBGEMM's row update runs on float32 CPU weights"
    return None


class FbgemmRowUpdate:
    """Applies one optimizer to touched rows of ``[rows, width]`` blocks of a flat buffer."""

    def __init__(self, spec: OptimizerSpec) -> None:
        refusal = row_update_refusal(spec)
        if refusal is not None:
            raise ValueError(refusal)
        self._sgd = spec.optim_type is OptimType.SGD
        self._placements = torch.tensor([EmbeddingLocation.HOST.value], dtype=torch.int32)
        self._zero = torch.zeros(1, dtype=torch.int64)
        self._no_weights = torch.empty(0)

    def apply(
        self,
        spec: OptimizerSpec,
        weight: Tensor,
        momentum: Tensor | None,
        rows: Tensor,
        grads: Tensor,
    ) -> None:
        """``weight[rows]`` (and RowWiseAdagrad's ``momentum[rows]``) updated in place by
        ``spec`` (its learning rate and eps as they are now) with the summed ``grads``.

        Args:
            weight: a contiguous ``[num_rows, width]`` float32 block.
            momentum: ``[num_rows]`` row-wise state (RowWiseAdagrad), else ``None``.
            rows: int64 rows. A row may repeat: FBGEMM sorts the rows stably and sums a
                row's gradients in the order given (from zero) before its one update.
            grads: ``[len(rows), width]`` float32, one gradient per entry of ``rows``.
        """
        num_rows, width = weight.shape
        count = rows.numel()
        if count == 0:
            return
        d_offsets = torch.tensor([0, width], dtype=torch.int32)
        hash_size_cumsum = torch.tensor([0, num_rows], dtype=torch.int64)
        bits = int(math.log2(max(num_rows, 1))) + 1
        offsets = torch.arange(count + 1, dtype=rows.dtype)
        lr = torch.tensor(spec.learning_rate, dtype=torch.float32)
        common = (
            grads.contiguous(),
            weight.view(-1),
            self._placements,
            self._zero,
            d_offsets,
            width,
            hash_size_cumsum,
            bits,
            rows,
            offsets,
            PoolingMode.SUM.value,
            self._no_weights,
            False,  # stochastic rounding
        )
        if self._sgd:
            torch.ops.fbgemm.split_embedding_backward_codegen_sgd_cpu(
                *common, lr, output_dtype=SparseType.FP32.as_int()
            )
            return
        assert momentum is not None
        torch.ops.fbgemm.split_embedding_backward_codegen_rowwise_adagrad_cpu(
            *common,
            momentum,
            self._placements,
            self._zero,
            lr,
            eps=spec.eps,
            output_dtype=SparseType.FP32.as_int(),
        )
