"""Train pipelines (TorchRec's ``torchrec.distributed.train_pipeline``).

:class:`TrainPipelineSparseDist` overlaps the next batch's input distribution with the current
batch's forward, backward and optimizer step, with results equal to the plain training loop's;
:class:`EvalPipelineSparseDist` does the same for forwards only; :class:`TrainPipelineBase` is
the plain loop behind the same interface (only the next batch's copy overlapped);
:class:`TrainPipelineFusedSparseDist` starts each batch's lookup before its forward (results
equal the plain loop's); :class:`TrainPipelineSemiSync` also overlaps the next batch's lookup
and output dist with this batch's backward, one step stale (not equal to the plain loop);
:class:`GradientAccumulationWrapper` makes any of them step once per cycle of micro-batches,
the fused tables included; :class:`TrainPipelinePT2` is the plain loop with the model compiled
from a chosen step, and :class:`DataLoadingThread` loads batches ahead in a thread;
:class:`StagedTrainPipeline` runs user-defined stages (:class:`PipelineStage`, and
:class:`SparseDataDistUtil`'s input-dist stage) on the next batches while the loop trains.
"""

from embshard_dist.train_pipeline.base import TrainPipelineBase
from embshard_dist.train_pipeline.batch import Pipelineable, move_batch
from embshard_dist.train_pipeline.data_loading_thread import DataLoadingThread
from embshard_dist.train_pipeline.fused_sparse_dist import TrainPipelineFusedSparseDist
from embshard_dist.train_pipeline.gradient_accumulation import (
    GradientAccumulationConfig,
    GradientAccumulationWrapper,
)
from embshard_dist.train_pipeline.interface import In, Out, TrainPipeline
from embshard_dist.train_pipeline.pipeline_stage import PipelineStage, SparseDataDistUtil, StageOut
from embshard_dist.train_pipeline.pt2 import TorchCompileConfig, TrainPipelinePT2
from embshard_dist.train_pipeline.semi_sync import TrainPipelineSemiSync
from embshard_dist.train_pipeline.sparse_dist import EvalPipelineSparseDist, TrainPipelineSparseDist
from embshard_dist.train_pipeline.sparse_inputs import SparseOf, find_sharded_modules
from embshard_dist.train_pipeline.staged import StagedTrainPipeline

__all__ = [
    "DataLoadingThread",
    "EvalPipelineSparseDist",
    "GradientAccumulationConfig",
    "GradientAccumulationWrapper",
    "In",
    "Out",
    "PipelineStage",
    "Pipelineable",
    "SparseDataDistUtil",
    "SparseOf",
    "StageOut",
    "StagedTrainPipeline",
    "TorchCompileConfig",
    "TrainPipeline",
    "TrainPipelineBase",
    "TrainPipelineFusedSparseDist",
    "TrainPipelinePT2",
    "TrainPipelineSemiSync",
    "TrainPipelineSparseDist",
    "find_sharded_modules",
    "move_batch",
]
