"""The pieces of TorchRec's DLRM (``torchrec.models.dlrm``): ``SparseArch``, ``DenseArch``,
``InteractionArch``, ``InteractionDCNArch`` and ``OverArch``.

Each has TorchRec's constructor, forward signature, parameter names and initialisation order.
``SparseArch`` holds the user's ``EmbeddingBagCollection`` as ``embedding_bag_collection``, the
module ``DistributedModelParallel`` shards; it reads the pooled output by feature name, so the
sharded collection's key order does not matter. Its forward is also offered in two halves,
:meth:`SparseArch.pooled` (a sharded collection's output all-to-all left in flight) and
:meth:`SparseArch.stack` (waits for it), so a model can run dense layers in between.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from embshard_dist.models.mlp import MLP
from embshard_kernels.collections import EmbeddingBagCollection
from embshard_types.awaitables import LazyAwaitable
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.sparse.keyed_tensor import KeyedTensor


class SparseArch(nn.Module):
    """Pooled embeddings of every feature, stacked: ``[batch, F, D]``.

    Args:
        embedding_bag_collection: tables of one dimension ``D``; ``F`` is the number of
            features they read, in config order.
    """

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection) -> None:
        super().__init__()
        configs = embedding_bag_collection.embedding_bag_configs()
        if not configs:
            raise ValueError("SparseArch: the EmbeddingBagCollection has no tables; give it one")
        self.embedding_bag_collection: nn.Module = embedding_bag_collection
        self.D: int = configs[0].embedding_dim
        self._sparse_feature_names: list[str] = [f for c in configs for f in c.feature_names]
        self.F: int = len(self._sparse_feature_names)

    @property
    def sparse_feature_names(self) -> list[str]:
        """The features, in the order of the ``F`` axis."""
        return self._sparse_feature_names

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.stack(self.pooled(features))

    def pooled(self, features: KeyedJaggedTensor) -> KeyedTensor | LazyAwaitable[KeyedTensor]:
        """The collection's pooled output, not yet used: a sharded collection returns it with
        its output all-to-all still in flight, waited for when :meth:`stack` first reads it."""
        out: KeyedTensor | LazyAwaitable[KeyedTensor] = self.embedding_bag_collection(features)
        return out

    def stack(self, pooled: KeyedTensor | LazyAwaitable[KeyedTensor]) -> torch.Tensor:
        """``[batch, F, D]`` from :meth:`pooled`'s output (waiting for it if still in flight).

        Output already in feature order (an unsharded collection's) is reshaped, not copied.
        """
        if (
            pooled.keys() == self._sparse_feature_names
            and pooled.key_dim() == 1
            and pooled.values().dim() == 2
        ):
            return pooled.values().reshape(-1, self.F, self.D)
        by_feature = pooled.to_dict()
        missing = [f for f in self._sparse_feature_names if f not in by_feature]
        if missing:
            raise ValueError(
                f"SparseArch: the embedding collection returned no output for features "
                f"{missing} (it returned {sorted(by_feature)}); the input KeyedJaggedTensor must "
                "carry every feature of the tables"
            )
        values = [by_feature[f] for f in self._sparse_feature_names]
        return torch.cat(values, dim=1).reshape(-1, self.F, self.D)


class DenseArch(nn.Module):
    """An MLP with ReLU after every layer over the dense features: ``[B, in] -> [B, D]``.

    Args:
        in_features: dense input width.
        layer_sizes: the layers' widths; the last must be the embedding dimension.
        device: of the parameters.
    """

    def __init__(
        self, in_features: int, layer_sizes: Sequence[int], device: torch.device | None = None
    ) -> None:
        super().__init__()
        self.model: nn.Module = MLP(
            in_features, list(layer_sizes), bias=True, activation="relu", device=device
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.model(features)
        return out


class InteractionArch(nn.Module):
    """The dense output beside the pairwise dot products of ``[dense, sparse...]``:
    ``[B, D] x [B, F, D] -> [B, D + C(F + 1, 2)]`` (``F == 0``: the dense output alone).

    Args:
        num_sparse_features: ``F``.
    """

    triu_indices: torch.Tensor
    _flat_pairs: torch.Tensor

    def __init__(self, num_sparse_features: int) -> None:
        super().__init__()
        self.F: int = num_sparse_features
        pairs = torch.triu_indices(self.F + 1, self.F + 1, offset=1)
        self.register_buffer("triu_indices", pairs, persistent=False)
        # The same pairs as positions in a flattened [F + 1, F + 1] (one index_select).
        self.register_buffer("_flat_pairs", pairs[0] * (self.F + 1) + pairs[1], persistent=False)

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if self.F <= 0:
            return dense_features
        combined = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)
        dots = torch.bmm(combined, combined.transpose(1, 2))
        flat = dots.flatten(1).index_select(1, self._flat_pairs)
        return torch.cat((dense_features, flat), dim=1)


class InteractionDCNArch(nn.Module):
    """A cross network over ``[dense, sparse...]`` flattened: ``-> [B, (F + 1) * D]``
    (``F == 0``: the dense output alone).

    Args:
        num_sparse_features: ``F``.
        crossnet: maps ``[B, (F + 1) * D]`` to the same shape (e.g. ``LowRankCrossNet``).
    """

    def __init__(self, num_sparse_features: int, crossnet: nn.Module) -> None:
        super().__init__()
        self.F: int = num_sparse_features
        self.crossnet = crossnet

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if self.F <= 0:
            return dense_features
        batch = dense_features.shape[0]
        combined = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)
        out: torch.Tensor = self.crossnet(combined.reshape(batch, -1))
        return out


class OverArch(nn.Module):
    """An MLP with ReLU over all but the last layer, which is a plain linear layer (the logits).

    Args:
        in_features: the interaction's output width.
        layer_sizes: at least two widths; the last is the number of logits.
        device: of the parameters.
    """

    def __init__(
        self, in_features: int, layer_sizes: Sequence[int], device: torch.device | None = None
    ) -> None:
        super().__init__()
        sizes = list(layer_sizes)
        if len(sizes) <= 1:
            raise ValueError(
                f"OverArch needs at least two layer sizes (hidden widths, then the number of "
                f"logits), got {sizes}; e.g. over_arch_layer_sizes=[64, 1]"
            )
        self.model: nn.Module = nn.Sequential(
            MLP(in_features, sizes[:-1], bias=True, activation="relu", device=device),
            nn.Linear(sizes[-2], sizes[-1], bias=True, device=device),
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.model(features)
        return out
