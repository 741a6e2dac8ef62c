"""Models: TorchRec's DLRM family (``DLRM``, ``DLRM_DCN``, ``DLRMTrain`` and their arches, with
TorchRec's constructors) and embshard's demo model (``DemoDLRM``, used by ``embshard train``)."""

from embshard_dist.models.archs import (
    DenseArch,
    InteractionArch,
    InteractionDCNArch,
    OverArch,
    SparseArch,
)
from embshard_dist.models.crossnet import LowRankCrossNet
from embshard_dist.models.demo import DemoConfig, DemoDLRM
from embshard_dist.models.dlrm import DLRM, DLRM_DCN, DLRMTrain
from embshard_dist.models.mlp import MLP, Perceptron

__all__ = [
    "DLRM",
    "DLRM_DCN",
    "MLP",
    "DLRMTrain",
    "DemoConfig",
    "DemoDLRM",
    "DenseArch",
    "InteractionArch",
    "InteractionDCNArch",
    "LowRankCrossNet",
    "OverArch",
    "Perceptron",
    "SparseArch",
]
