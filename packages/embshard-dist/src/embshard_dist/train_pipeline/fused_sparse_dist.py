"""``TrainPipelineFusedSparseDist``: this batch's lookup starts before its forward.

TorchRec's pipeline of that name. Each :meth:`~TrainPipelineFusedSparseDist.progress` call
runs :class:`~embshard_dist.train_pipeline.sparse_dist.TrainPipelineSparseDist`'s step with one
stage moved: batch ``i``'s embedding lookup and output dist start at the beginning of the step
(``embedding_lookup_after_data_dist=True``: once batch ``i+1``'s input dist has started), before
the model's forward reaches the sharded modules, which then take the started lookup. The fused
optimizer updated the tables in batch ``i-1``'s backward and the previous step has ended, so
the lookup reads the same tables as the plain loop: results are the plain loop's, bit for bit.
Keep the tables' optimizer fused (the DistributedModelParallel default): TorchRec notes the same
assumption, and a feature processor before the tables breaks it there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from embshard_dist.train_pipeline.interface import In, Out
from embshard_dist.train_pipeline.pipelined_forward import StartedLookup
from embshard_dist.train_pipeline.sparse_dist import TrainPipelineSparseDist, _InFlight
from embshard_dist.train_pipeline.sparse_inputs import SparseOf

__all__ = ["TrainPipelineFusedSparseDist"]

_OWNER = "TrainPipelineFusedSparseDist"
LOOKUP_STREAMS = ("new", "current", "data_dist")


class TrainPipelineFusedSparseDist(TrainPipelineSparseDist[In, Out]):
    """Starts each batch's lookup and output dist before its forward (see the module
    docstring); results equal the plain loop's.

    Args:
        model, optimizer, device, execute_all_batches, apply_jit, pipeline_postproc,
            custom_model_fwd, enable_inplace_copy_batch, enqueue_batch_after_forward,
            free_features_storage_early, clear_data_dist_inputs, sparse_of: as
            :class:`TrainPipelineSparseDist`'s, in TorchRec's order for this class.
        strict: TorchRec's (unused there too).
        emb_lookup_stream: TorchRec's stream choice for the lookup, ``"data_dist"`` (default),
            ``"current"`` or ``"new"``; the lookup runs on the current stream here, after its
            input dist is handed over from the input-dist stream, whichever is named.
        embedding_lookup_after_data_dist: start the lookup after batch ``i+1``'s input dist
            and the copy of batch ``i+2`` have started, instead of first.

    Raises:
        ValueError: as :class:`TrainPipelineSparseDist`; an unknown ``emb_lookup_stream``.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device | str,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        pipeline_postproc: bool = True,
        custom_model_fwd: Callable[[In], tuple[Tensor, Out]] | None = None,
        strict: bool = False,
        emb_lookup_stream: str = "data_dist",
        embedding_lookup_after_data_dist: bool = False,
        enable_inplace_copy_batch: bool = False,
        enqueue_batch_after_forward: bool = False,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        *,
        sparse_of: SparseOf | None = None,
    ) -> None:
        if emb_lookup_stream not in LOOKUP_STREAMS:
            raise ValueError(
                f"{_OWNER}: emb_lookup_stream must be one of {list(LOOKUP_STREAMS)}, got "
                f"{emb_lookup_stream!r}"
            )
        super().__init__(
            model,
            optimizer,
            device,
            execute_all_batches,
            apply_jit=apply_jit,
            pipeline_postproc=pipeline_postproc,
            custom_model_fwd=custom_model_fwd,
            enable_inplace_copy_batch=enable_inplace_copy_batch,
            enqueue_batch_after_forward=enqueue_batch_after_forward,
            free_features_storage_early=free_features_storage_early,
            clear_data_dist_inputs=clear_data_dist_inputs,
            sparse_of=sparse_of,
        )
        self._strict = strict
        self._emb_lookup_stream = emb_lookup_stream
        self._lookup_after_dist = embedding_lookup_after_data_dist

    def _at_start(self, current: _InFlight) -> None:
        if not self._lookup_after_dist:
            self._start_lookups(current)

    def _before_forward(self, current: _InFlight) -> None:
        if self._lookup_after_dist:
            self._start_lookups(current)

    def _stand_ins(self, flight: _InFlight) -> dict[str, Any]:
        return {
            path: StartedLookup(path, flight.inputs[path].features, lookup, _OWNER)
            for path, lookup in flight.lookups.items()
        }
