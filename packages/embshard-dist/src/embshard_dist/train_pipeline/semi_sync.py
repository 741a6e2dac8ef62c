"""``TrainPipelineSemiSync``: batch ``i+1``'s embedding lookup runs before batch ``i``'s backward.

TorchRec's semi-synchronous pipeline. Each :meth:`~TrainPipelineSemiSync.progress` call, for the
batch ``i`` whose lookup and output dist the previous call started: start batch ``i+2``'s input
dist (phase 1), run batch ``i``'s forward on its looked-up embeddings, detached (the dense
backward stops at them), start batch ``i+1``'s lookup and output dist, then batch ``i+2``'s
phase 2, then the backward (the dense part, then the embeddings' own backward into the sharded
modules, which applies the fused sparse update) and the optimizer step. Batch ``i+1``'s output
all-to-all is thus in flight during batch ``i``'s backward, but it is looked up in tables that
do not yet hold batch ``i``'s update: every prediction uses embeddings last updated by batch
``i-1``, so the results are not the plain loop's. Before ``start_batch`` the lookup waits for
the backward and the pipeline is :class:`TrainPipelineSparseDist`'s step, bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from embshard_dist.train_pipeline.interface import In, Out, total_loss
from embshard_dist.train_pipeline.pipelined_forward import check_call, serving
from embshard_dist.train_pipeline.sparse_dist import TrainPipelineSparseDist, _InFlight
from embshard_dist.train_pipeline.sparse_inputs import SparseOf
from embshard_types.awaitables import LazyAwaitable
from embshard_types.sparse.jagged import JaggedTensor
from embshard_types.sparse.keyed_tensor import KeyedTensor

__all__ = ["TrainPipelineSemiSync", "detach_embeddings"]

logger = logging.getLogger(__name__)

_OWNER = "TrainPipelineSemiSync"


class TrainPipelineSemiSync(TrainPipelineSparseDist[In, Out]):
    """Overlaps the next batch's lookup and output dist with this batch's backward, one step
    stale (see the module docstring); not bit-equal to the plain loop once semi-synchronous.

    Args:
        model, optimizer, device, execute_all_batches, custom_model_fwd, sparse_of and
            TorchRec's other arguments (``apply_jit``, ``pipeline_postproc``,
            ``dmp_collection_sync_interval_batches``, ...): as
            :class:`TrainPipelineSparseDist`'s, in TorchRec's order.
        start_batch: the first batch (counted from 0 over the pipeline's life) whose lookup runs
            before the previous batch's backward; the batches before it train synchronously
            (TorchRec's default, 900: a short synchronous start lowers early loss).
        stash_gradients: also keep the dense update one step behind: each optimizer step applies
            the previous batch's dense gradients (the first semi-synchronous step applies none);
            ``False``: the dense update uses this batch's gradients at once.
        strict: raise instead of warning when ``optimizer`` steps a parameter of a sharded
            module with a gradient (a non-fused update would then read the stale lookup's
            gradient).

    Raises:
        ValueError: as :class:`TrainPipelineSparseDist`; ``start_batch`` not an int >= 0.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device | str,
        execute_all_batches: bool = True,
        apply_jit: bool = False,
        start_batch: int = 900,
        stash_gradients: bool = False,
        pipeline_postproc: bool = True,
        custom_model_fwd: Callable[[In], tuple[Tensor, Out]] | None = None,
        strict: bool = False,
        dmp_collection_sync_interval_batches: int | None = 1,
        enable_inplace_copy_batch: bool = False,
        free_features_storage_early: bool = False,
        clear_data_dist_inputs: bool = False,
        *,
        sparse_of: SparseOf | None = None,
    ) -> None:
        if isinstance(start_batch, bool) or not isinstance(start_batch, int) or start_batch < 0:
            raise ValueError(
                f"{_OWNER}: start_batch must be an int >= 0 (the first batch trained "
                f"semi-synchronously), got {start_batch!r}"
            )
        super().__init__(
            model,
            optimizer,
            device,
            execute_all_batches,
            apply_jit=apply_jit,
            pipeline_postproc=pipeline_postproc,
            custom_model_fwd=custom_model_fwd,
            dmp_collection_sync_interval_batches=dmp_collection_sync_interval_batches,
            enable_inplace_copy_batch=enable_inplace_copy_batch,
            free_features_storage_early=free_features_storage_early,
            clear_data_dist_inputs=clear_data_dist_inputs,
            sparse_of=sparse_of,
        )
        self._start_batch = start_batch
        self._stash_gradients = stash_gradients
        self._strict = strict
        self._gradients: dict[str, Tensor] = {}
        self._check_optimizer()

    def progress(self, dataloader_iter: Iterator[In]) -> Out:
        """Run one step on the oldest batch in flight and return its output.

        Raises:
            StopIteration: every batch has been run (or, with ``execute_all_batches=False``,
                the iterator has ended).
        """
        current = self._oldest(dataloader_iter)
        semi_sync = current.index >= self._start_batch
        training = self._model.training
        if training:
            self._optimizer.zero_grad()
        if len(self._batches) > 2:
            self._start_dist(self._batches[2])
        with serving(self._modules, self._stand_ins_of(current), _OWNER), self._learning(current):
            losses, output = self._model_fwd(current.batch)
        self._batches.popleft()
        self._enqueue(dataloader_iter)
        following = self._batches[0] if self._batches else None
        if following is not None and semi_sync:
            self._start_lookups(following)
        if len(self._batches) > 1:
            self._start_values(self._batches[1])
        if training:
            total_loss(losses).backward()
            _embedding_backward(current.embeddings)
            if semi_sync and self._stash_gradients:
                self._swap_gradients()
            self._sync_replicas()
            if not (self._stash_gradients and current.index == self._start_batch):
                self._optimizer.step()
        current.embeddings.clear()
        if following is not None and not semi_sync:
            self._start_lookups(following)
        return output

    def _fill(self, dataloader_iter: Iterator[In]) -> None:
        """At the start (or after the end of an iterator): batch 0 looked up, batch 1
        distributed, batch 2 copied."""
        if self._batches:
            return
        self._exhausted = False
        if not self._enqueue(dataloader_iter):
            return
        first = self._batches[0]
        self._start_dist(first)
        self._start_values(first)
        self._start_lookups(first)
        if not self._enqueue(dataloader_iter):
            return
        self._start_dist(self._batches[1])
        self._start_values(self._batches[1])
        self._enqueue(dataloader_iter)

    def _stand_ins_of(self, flight: _InFlight) -> dict[str, LookedUpForward]:
        return {
            path: LookedUpForward(path, flight.inputs[path].features, lookup, flight.embeddings)
            for path, lookup in flight.lookups.items()
        }

    def _swap_gradients(self) -> None:
        """Put the previous step's dense gradients in place and keep this step's."""
        for name, param in self._model.named_parameters():
            previous = self._gradients.pop(name, None)
            if param.grad is not None:
                self._gradients[name] = param.grad.clone()
            param.grad = previous

    def _check_optimizer(self) -> None:
        """Warn (``strict``: raise) when the optimizer steps a sharded module's parameter that
        gets a gradient: its update would come from a lookup one step stale."""
        stepped = {id(p) for group in self._optimizer.param_groups for p in group["params"]}
        shared = sorted(
            path
            for path, module in self._modules.items()
            if any(p.requires_grad and id(p) in stepped for p in module.parameters())
        )
        if not shared:
            return
        message = (
            f"{_OWNER}: the optimizer steps parameters of the sharded modules {shared} that get "
            "gradients; with one-step-stale lookups their update reads the stale lookup's "
            "gradient: fuse their optimizer into the tables (the DistributedModelParallel "
            "default) instead"
        )
        if self._strict:
            raise ValueError(message)
        logger.warning(message)


class LookedUpForward:
    """Stands in for a sharded module's ``forward`` in a semi-synchronous step.

    Called once, with the prepared KeyedJaggedTensor, it waits for the lookup started earlier
    and returns its output with the embedding tensors detached into leaves that require grad;
    each (tensor in the lookup's graph, leaf) pair is appended to ``sink`` for the embeddings'
    backward.
    """

    def __init__(
        self,
        path: str,
        features: Any,
        lookup: LazyAwaitable[Any],
        sink: list[tuple[Tensor, Tensor]],
    ) -> None:
        self._path = path
        self._features = features
        self._lookup: LazyAwaitable[Any] | None = lookup
        self._sink = sink

    @property
    def consumed(self) -> bool:
        return self._lookup is None

    def __call__(self, *input: Any, **kwargs: Any) -> Any:
        lookup = self._lookup
        check_call(self._path, None if lookup is None else self._features, input, kwargs, _OWNER)
        assert lookup is not None
        self._lookup = None
        output, pairs = detach_embeddings(lookup.wait(), self._path)
        self._sink.extend(pairs)
        return output


def detach_embeddings(output: Any, path: str = "") -> tuple[Any, list[tuple[Tensor, Tensor]]]:
    """``output`` (a ``KeyedTensor``, a ``{key: JaggedTensor}`` mapping or a tensor) with each
    embedding tensor that requires grad replaced by a detached leaf requiring grad, and the
    (original, leaf) pairs.

    Raises:
        TypeError: another output type (``path`` names the module).
    """
    if isinstance(output, KeyedTensor):
        values, pairs = _leaf(output.values())
        keyed = KeyedTensor(output.keys(), output.length_per_key(), values, output.key_dim())
        return keyed, pairs
    if isinstance(output, Tensor):
        return _leaf(output)
    if isinstance(output, Mapping) and all(isinstance(v, JaggedTensor) for v in output.values()):
        detached: dict[str, JaggedTensor] = {}
        pairs = []
        for key, jagged in output.items():
            values, one = _leaf(jagged.values())
            detached[key] = JaggedTensor(
                values,
                weights=jagged.weights_or_none(),
                lengths=jagged.lengths_or_none(),
                offsets=jagged.offsets_or_none(),
            )
            pairs += one
        return detached, pairs
    raise TypeError(
        f"{_OWNER}: the sharded module {path!r} returned a {type(output).__name__}; the "
        "semi-synchronous pipeline detaches embeddings from a KeyedTensor, a dict of "
        "JaggedTensor or a tensor only: train this model with TrainPipelineSparseDist"
    )


def _leaf(tensor: Tensor) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
    if not tensor.requires_grad:
        return tensor, []
    leaf = tensor.detach().requires_grad_()
    return leaf, [(tensor, leaf)]


def _embedding_backward(pairs: list[tuple[Tensor, Tensor]]) -> None:
    """Send each leaf's gradient into its lookup's graph (leaves the loss did not reach,
    whose gradient is ``None``, are skipped, as a plain loop never backpropagates them)."""
    used = [(tensor, leaf.grad) for tensor, leaf in pairs if leaf.grad is not None]
    if used:
        tensors, grads = zip(*used, strict=True)
        torch.autograd.backward(list(tensors), list(grads))
