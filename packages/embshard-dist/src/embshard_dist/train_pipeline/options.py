"""TorchRec's pipeline constructor arguments that are not about the schedule, checked once.

TorchRec's pipelines take, besides the model, optimizer and device, arguments that tune how it
rewrites the model and manages memory. embshard's pipelines take the same arguments in the same
order, so a TorchRec call ports unchanged, and give each its meaning here:

* ``dmp_collection_sync_interval_batches``: with a :class:`~embshard_dist.dmp.collection.
  DMPCollection` model, its replicas are synced (``model.sync()``) after the backward of every
  optimizer step whose index (from 0; one step per batch unless gradients accumulate) is a
  multiple of it, before ``optimizer.step()`` (default 1; ``None``: never), as TorchRec does;
* ``enqueue_batch_after_forward``: take the batch after next once this batch's forward is done
  instead of before it (TorchRec's choice to keep the copy off the lookup's bandwidth);
* ``pipeline_postproc``, ``enable_inplace_copy_batch``, ``free_features_storage_early``,
  ``clear_data_dist_inputs``: memory and rewrite hints of TorchRec's; results never depend on
  them, and here they change nothing (a sharded module fed by a postproc module distributes its
  own input inside the forward; batches are copied to fresh tensors);
* ``apply_jit=True`` and a ``context_type`` are refused with what to use instead: embshard runs
  the model eagerly and keeps no per-batch context object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from embshard_dist.dmp.collection import DMPCollection

__all__ = ["PipelineOptions"]


@dataclass(frozen=True)
class PipelineOptions:
    """TorchRec's optional pipeline arguments (see the module docstring)."""

    apply_jit: bool = False
    context_type: Any = None
    pipeline_postproc: bool = False
    dmp_collection_sync_interval_batches: int | None = 1
    enqueue_batch_after_forward: bool = False
    enable_inplace_copy_batch: bool = False
    free_features_storage_early: bool = False
    clear_data_dist_inputs: bool = False

    def check(self, owner: str) -> PipelineOptions:
        """These options, or a ``ValueError`` naming the one embshard cannot honour and what to
        use instead."""
        if self.apply_jit:
            raise ValueError(
                f"{owner}: apply_jit=True scripts the model's unsharded modules with torch.jit; "
                "embshard's pipelines run the model eagerly: pass apply_jit=False and compile "
                "the dense modules with torch.compile if you want them compiled"
            )
        if self.context_type is not None:
            raise ValueError(
                f"{owner}: context_type={self.context_type!r}: embshard's pipelines keep no "
                "per-batch TrainPipelineContext to subclass; leave context_type unset"
            )
        interval = self.dmp_collection_sync_interval_batches
        if interval is not None and (
            isinstance(interval, bool) or not isinstance(interval, int) or interval < 1
        ):
            raise ValueError(
                f"{owner}: dmp_collection_sync_interval_batches must be an int >= 1 or None, "
                f"got {interval!r}"
            )
        return self

    def syncs_replicas(self, model: nn.Module, step: int) -> bool:
        """Whether optimizer step ``step`` (counted from 0; one per batch unless gradients
        accumulate) syncs ``model``'s replicas after its backward (a ``DMPCollection`` only)."""
        interval = self.dmp_collection_sync_interval_batches
        if interval is None or not isinstance(model, DMPCollection):
            return False
        return step % interval == 0
