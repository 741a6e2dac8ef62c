"""Data sources for embshard's main job and benchmarks."""

from embshard_dist.data.synthetic import Batch, SyntheticClicks

__all__ = ["Batch", "SyntheticClicks"]
