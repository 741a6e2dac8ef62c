"""embshard-optim: optimizers whose state is keyed by name and sharded like the tables.

Depends on torch and embshard-types only; never imports FBGEMM.
"""

from __future__ import annotations

from embshard_optim.clipping import GradientClipping, GradientClippingOptimizer
from embshard_optim.combined import CombinedOptimizer
from embshard_optim.embedding_fused import EmbeddingFusedOptimizer, FusedKernelLike, TableShardInfo
from embshard_optim.fused import EmptyFusedOptimizer, FusedOptimizer, FusedOptimizerModule
from embshard_optim.in_backward import (
    apply_optimizer_in_backward,
    in_backward_optimizer,
    in_backward_optimizer_filter,
    in_backward_spec,
)
from embshard_optim.keyed import (
    KeyedOptimizer,
    KeyedOptimizerWrapper,
    MergedState,
    OptimizerWrapper,
)
from embshard_optim.rowwise_adagrad import RowWiseAdagrad
from embshard_optim.sharded_state import (
    StateFormat,
    check_tiling,
    make_dtensor,
    make_mesh,
    make_sharded_tensor,
    pointwise_state_layout,
    rowwise_state_layout,
    state_layout,
)
from embshard_optim.sparse_rules import SparseUpdateRule, aggregate, rule_for
from embshard_optim.specs import OptimizerSpec, OptimType, WeightDecayMode
from embshard_optim.warmup import WarmupOptimizer, WarmupPolicy, WarmupStage

__all__ = [
    "OptimType",
    "WeightDecayMode",
    "OptimizerSpec",
    "MergedState",
    "KeyedOptimizer",
    "KeyedOptimizerWrapper",
    "OptimizerWrapper",
    "CombinedOptimizer",
    "FusedOptimizer",
    "EmptyFusedOptimizer",
    "FusedOptimizerModule",
    "FusedKernelLike",
    "TableShardInfo",
    "EmbeddingFusedOptimizer",
    "StateFormat",
    "check_tiling",
    "pointwise_state_layout",
    "rowwise_state_layout",
    "state_layout",
    "make_sharded_tensor",
    "make_dtensor",
    "make_mesh",
    "RowWiseAdagrad",
    "WarmupPolicy",
    "WarmupStage",
    "WarmupOptimizer",
    "GradientClipping",
    "GradientClippingOptimizer",
    "SparseUpdateRule",
    "aggregate",
    "rule_for",
    "apply_optimizer_in_backward",
    "in_backward_optimizer",
    "in_backward_optimizer_filter",
    "in_backward_spec",
]
