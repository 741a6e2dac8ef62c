"""Models used by the main job, the tests and the benchmarks."""

from embshard_dist.models.dlrm import DLRM, DLRMConfig

__all__ = ["DLRM", "DLRMConfig"]
