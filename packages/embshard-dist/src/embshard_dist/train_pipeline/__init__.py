"""Train pipelines (TorchRec's ``torchrec.distributed.train_pipeline``).

:class:`TrainPipelineSparseDist` overlaps the next batch's input distribution with the current
batch's forward, backward and optimizer step, with results equal to the plain training loop's.
"""

from embshard_dist.train_pipeline.batch import Pipelineable, move_batch
from embshard_dist.train_pipeline.sparse_dist import TrainPipeline, TrainPipelineSparseDist
from embshard_dist.train_pipeline.sparse_inputs import SparseOf, find_sharded_modules

__all__ = [
    "Pipelineable",
    "SparseOf",
    "TrainPipeline",
    "TrainPipelineSparseDist",
    "find_sharded_modules",
    "move_batch",
]
