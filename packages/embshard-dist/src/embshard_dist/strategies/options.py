"""``ShardingOptions``: where a strategy runs and how it builds kernels and collectives."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from embshard_kernels.fused_params import FusedParams
from embshard_optim.sharded_state import StateFormat
from embshard_types.comm_codec import QuantizedCommCodecs
from embshard_types.vocab import CommOp

__all__ = ["ShardingOptions"]


@dataclass(frozen=True)
class ShardingOptions:
    """Where a strategy runs and how it builds its kernels and collectives.

    Args:
        pg: the process group the shard placements refer to.
        qcomm_codecs_registry: quantized comm codecs per ``CommOp`` value.
    """

    device: torch.device
    pg: Any
    fused_params: FusedParams
    is_weighted: bool
    state_format: StateFormat
    world_size: int
    rank: int
    qcomm_codecs_registry: Mapping[str, QuantizedCommCodecs] = field(default_factory=dict)

    def codecs(self, op: CommOp) -> QuantizedCommCodecs | None:
        return self.qcomm_codecs_registry.get(op.value)
