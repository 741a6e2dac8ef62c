"""TorchRec's DLRM models (``torchrec.models.dlrm``) over embshard's collections: ``DLRM``,
``DLRM_DCN`` and the training wrapper ``DLRMTrain``.

Guarantees: TorchRec's constructor arguments, forward signatures, architecture, parameter names,
registration order and initialisation order (``DLRM_DCN`` first builds, then replaces, DLRM's
over arch, as TorchRec does), so the same torch seed and the same tables give the same
parameters and the same forward as TorchRec. Differences: the forward starts the lookups before
the dense arch, so the embeddings' all-to-alls overlap it (every value is the same); bad
arguments raise ``ValueError`` naming the tables and sizes (TorchRec asserts); and the model
takes embshard's ``EmbeddingBagCollection`` and ``KeyedJaggedTensor``.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import comb
from typing import Protocol, cast

import torch
from torch import nn

from embshard_dist.models.archs import (
    DenseArch,
    InteractionArch,
    InteractionDCNArch,
    OverArch,
    SparseArch,
)
from embshard_dist.models.crossnet import LowRankCrossNet
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

__all__ = [
    "DLRM",
    "DLRMBatch",
    "DLRMTrain",
    "DLRM_DCN",
    "DenseArch",
    "InteractionArch",
    "InteractionDCNArch",
    "OverArch",
    "SparseArch",
]


def _embedding_dim(ebc: EmbeddingBagCollection, dense_arch_layer_sizes: Sequence[int]) -> int:
    """The one embedding dimension of ``ebc``'s tables, checked against the dense arch."""
    configs = ebc.embedding_bag_configs()
    if not configs:
        raise ValueError("DLRM: the EmbeddingBagCollection has no tables; give it at least one")
    dim = configs[0].embedding_dim
    other = [f"{c.name!r} ({c.embedding_dim})" for c in configs if c.embedding_dim != dim]
    if other:
        raise ValueError(
            f"DLRM: all tables need one embedding_dim for the interaction; table "
            f"{configs[0].name!r} has {dim} but {', '.join(other)} differ"
        )
    if not dense_arch_layer_sizes or dense_arch_layer_sizes[-1] != dim:
        raise ValueError(
            f"DLRM: the last dense arch layer size must equal the embedding dim {dim}; got "
            f"dense_arch_layer_sizes={list(dense_arch_layer_sizes)}"
        )
    return dim


class DLRM(nn.Module):
    """Dense MLP, pooled embeddings, pairwise dot interaction, over MLP -> logits ``[B, out]``.

    Args:
        embedding_bag_collection: the tables (one embedding dimension ``D``).
        dense_in_features: width of the dense input.
        dense_arch_layer_sizes: the dense MLP's widths; the last must be ``D``.
        over_arch_layer_sizes: the over MLP's widths (at least two); the last is the logits.
        dense_device: where the dense parameters are built (``meta`` to defer).
    """

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        dense_in_features: int,
        dense_arch_layer_sizes: list[int],
        over_arch_layer_sizes: list[int],
        dense_device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self._cuda_graph_enabled = False
        dim = _embedding_dim(embedding_bag_collection, dense_arch_layer_sizes)
        self.sparse_arch: SparseArch = SparseArch(embedding_bag_collection)
        num_sparse = len(self.sparse_arch.sparse_feature_names)
        self.dense_arch: nn.Module = DenseArch(
            in_features=dense_in_features, layer_sizes=dense_arch_layer_sizes, device=dense_device
        )
        self.inter_arch: nn.Module = InteractionArch(num_sparse_features=num_sparse)
        self.over_arch: nn.Module = OverArch(
            in_features=dim + comb(num_sparse, 2) + num_sparse,
            layer_sizes=over_arch_layer_sizes,
            device=dense_device,
        )

    def compile_dense_path(self, compile_mode: str = "reduce-overhead") -> None:
        """``torch.compile`` the dense, interaction and over arches (once)."""
        if self._cuda_graph_enabled:
            return
        self.dense_arch = cast(nn.Module, torch.compile(self.dense_arch, mode=compile_mode))
        self.inter_arch = cast(nn.Module, torch.compile(self.inter_arch, mode=compile_mode))
        self.over_arch = cast(nn.Module, torch.compile(self.over_arch, mode=compile_mode))
        self._cuda_graph_enabled = True

    def forward(
        self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor
    ) -> torch.Tensor:
        """Logits ``[B, over_arch_layer_sizes[-1]]``.

        The lookups come first and their pooled output is used only after the dense arch: the
        output all-to-all of a sharded collection travels while the dense arch runs. In the
        backward, the gradients' all-to-all starts where the output was first used and is
        waited for by the lookups; autograd runs the ops recorded later first, so the dense
        arch's backward, and DDP's all-reduce of its gradients, run while it travels.
        """
        sparse_arch = self.sparse_arch
        if isinstance(sparse_arch, SparseArch):
            pooled = sparse_arch.pooled(sparse_features)
            embedded_dense = self.dense_arch(dense_features)
            embedded_sparse = sparse_arch.stack(pooled)
        else:  # a user's own sparse arch: called as a module, after the dense arch
            embedded_dense = self.dense_arch(dense_features)
            embedded_sparse = sparse_arch(sparse_features)
        interacted = self.inter_arch(dense_features=embedded_dense, sparse_features=embedded_sparse)
        logits: torch.Tensor = self.over_arch(interacted)
        return logits


class DLRM_DCN(DLRM):
    """DLRM whose interaction is a low-rank cross network (DCN v2) over ``[dense, sparse...]``.

    Args:
        dcn_num_layers: cross layers.
        dcn_low_rank_dim: rank of each cross layer's weight.
        (the others as :class:`DLRM`)
    """

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        dense_in_features: int,
        dense_arch_layer_sizes: list[int],
        over_arch_layer_sizes: list[int],
        dcn_num_layers: int,
        dcn_low_rank_dim: int,
        dense_device: torch.device | None = None,
    ) -> None:
        super().__init__(
            embedding_bag_collection,
            dense_in_features,
            dense_arch_layer_sizes,
            over_arch_layer_sizes,
            dense_device,
        )
        dim = self.sparse_arch.D
        num_sparse = len(self.sparse_arch.sparse_feature_names)
        width = (num_sparse + 1) * dim
        crossnet = LowRankCrossNet(
            in_features=width, num_layers=dcn_num_layers, low_rank=dcn_low_rank_dim
        )
        self.inter_arch = InteractionDCNArch(num_sparse_features=num_sparse, crossnet=crossnet)
        self.over_arch = OverArch(
            in_features=width, layer_sizes=over_arch_layer_sizes, device=dense_device
        )


class DLRMBatch(Protocol):
    """What :class:`DLRMTrain` reads from a batch (TorchRec's ``torchrec.datasets.utils.Batch``)."""

    @property
    def dense_features(self) -> torch.Tensor: ...

    @property
    def sparse_features(self) -> KeyedJaggedTensor: ...

    @property
    def labels(self) -> torch.Tensor: ...


class DLRMTrain(nn.Module):
    """A DLRM with its loss: binary cross-entropy on the logits.

    ``forward(batch)`` returns ``(loss, (loss.detach(), logits.detach(), labels.detach()))``, with
    ``logits`` squeezed to ``[B]``.

    Args:
        dlrm_module: the model (held as ``model``, so parameter names gain ``model.``).
    """

    def __init__(self, dlrm_module: DLRM) -> None:
        super().__init__()
        self.model = dlrm_module
        self.loss_fn: nn.Module = nn.BCEWithLogitsLoss()

    def forward(
        self, batch: DLRMBatch
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        logits = self.model(batch.dense_features, batch.sparse_features).squeeze(-1)
        loss: torch.Tensor = self.loss_fn(logits, batch.labels.float())
        return loss, (loss.detach(), logits.detach(), batch.labels.detach())
