"""embshard's demo click model (``embshard train``): dense MLP, embedding bags, dot interaction,
top MLP. TorchRec's ``DLRM`` / ``DLRM_DCN`` / ``DLRMTrain`` are in :mod:`embshard_dist.models.dlrm`.

Guarantees: the sparse part is the one ``EmbeddingBagCollection`` attribute ``sparse_arch`` (what
``DistributedModelParallel`` shards); tables of different dimensions are refused, naming the
table; the model can be built on ``meta`` for sharding before materialising.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch
from torch import nn

from embshard_kernels.collections import EmbeddingBagCollection
from embshard_types.configs import EmbeddingBagConfig
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor


@dataclass(frozen=True)
class DemoConfig:
    """Shapes of the dense parts of the demo DLRM."""

    num_dense: int = 13
    bottom_mlp: tuple[int, ...] = (64,)
    top_mlp: tuple[int, ...] = (64, 32)


def _mlp(sizes: Sequence[int], *, last_relu: bool, device: torch.device | None) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(pairwise(sizes)):
        layers.append(nn.Linear(a, b, device=device))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DemoDLRM(nn.Module):
    """Predicts a click logit from dense features and sparse ids.

    Args:
        tables: the embedding tables (all of one dimension).
        device: where to build the parameters (``meta`` to defer materialising).
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        config: DemoConfig | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        config = config or DemoConfig()
        if not tables:
            raise ValueError("DemoDLRM needs at least one embedding table")
        dim = tables[0].embedding_dim
        for t in tables:
            if t.embedding_dim != dim:
                raise ValueError(
                    f"DemoDLRM's dot interaction needs one embedding dim: table {t.name!r} has "
                    f"{t.embedding_dim}, table {tables[0].name!r} has {dim}"
                )
        dev = torch.device(device) if device is not None else None
        self.num_features = sum(len(t.feature_names) for t in tables)
        self.dim = dim
        self.dense_arch = _mlp(
            (config.num_dense, *config.bottom_mlp, dim), last_relu=True, device=dev
        )
        self.sparse_arch = EmbeddingBagCollection(tables=list(tables), device=dev)
        n = self.num_features + 1
        self._pairs = torch.triu_indices(
            n, n, offset=1, device=dev if dev and dev.type != "meta" else None
        )
        inter = n * (n - 1) // 2
        self.over_arch = _mlp((dim + inter, *config.top_mlp), last_relu=True, device=dev)
        self.head = nn.Linear(config.top_mlp[-1], 1, device=dev)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """Logits of shape [batch]."""
        d = self.dense_arch(dense)
        pooled = self.sparse_arch(sparse).values()
        stacked = torch.cat(
            [d.unsqueeze(1), pooled.view(d.shape[0], self.num_features, self.dim)], dim=1
        )
        dots = torch.bmm(stacked, stacked.transpose(1, 2))
        pairs = self._pairs.to(dots.device)
        inter = dots[:, pairs[0], pairs[1]]
        out: torch.Tensor = self.head(self.over_arch(torch.cat([d, inter], dim=1))).squeeze(1)
        return out
