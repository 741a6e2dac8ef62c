"""Data sources: synthetic clicks, Criteo-format days (TSV and NumPy) and TorchRec's random data."""

from embshard_dist.data.criteo_dataset import CriteoIterDataset
from embshard_dist.data.criteo_npy import NpySource
from embshard_dist.data.criteo_tsv import TsvSource
from embshard_dist.data.random_rec import RandomRecDataset
from embshard_dist.data.synthetic import Batch, SyntheticClicks

__all__ = [
    "Batch",
    "CriteoIterDataset",
    "NpySource",
    "RandomRecDataset",
    "SyntheticClicks",
    "TsvSource",
]
