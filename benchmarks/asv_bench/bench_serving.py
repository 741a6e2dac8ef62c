"""asv: serving latency of an unsharded DLRM, float tables against INT8-quantized ones.

The model: ``TABLES`` tables of ``ROWS`` x ``DIM`` (one feature each, 1-``MAX_IDS`` uniform ids
per bag, fixed seed), 13 dense features, dense arch [128, DIM], over arch [128, 1]; one thread.
``int8`` is the same model after ``quantize_embeddings(model, "int8")`` (FBGEMM's IntNBit
kernel, row-wise scale and bias). One graph shows both:

* ``ServingForward.time_forward``: one inference forward (``torch.inference_mode``) of a batch
  of ``BATCH`` samples, dense and sparse features to logits;
* ``ServingForward.track_model_mb``: the model's parameters and buffers in MB (unique
  storages), i.e. what a server holds for it.

A commit without ``quantize_embeddings`` records ``int8`` as skipped.
"""

from __future__ import annotations

from typing import Any

import torch

TABLES = 8
ROWS = 50_000
DIM = 64
MAX_IDS = 20
NUM_DENSE = 13
BATCH = 64


def build(dtype: str) -> Any:
    """The DLRM with ``dtype`` tables, in eval mode."""
    from embshard_dist.models.dlrm import DLRM
    from embshard_kernels.collections import EmbeddingBagCollection
    from embshard_types.configs import EmbeddingBagConfig

    tables = [
        EmbeddingBagConfig(
            name=f"t{t}", num_embeddings=ROWS, embedding_dim=DIM, feature_names=(f"f{t}",)
        )
        for t in range(TABLES)
    ]
    torch.manual_seed(0)
    model: torch.nn.Module = DLRM(
        EmbeddingBagCollection(tables),
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=[128, DIM],
        over_arch_layer_sizes=[128, 1],
    )
    if dtype == "int8":
        try:
            from embshard_kernels import quantize_embeddings
        except ImportError as e:  # asv's convention: NotImplementedError in setup means skipped
            raise NotImplementedError(f"no quantize_embeddings at this commit: {e}") from e
        model = quantize_embeddings(model, "int8")
    return model.eval()


def batch() -> tuple[torch.Tensor, Any]:
    """``BATCH`` samples: dense features and a KeyedJaggedTensor of every table's feature."""
    from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, MAX_IDS + 1, (TABLES * BATCH,), generator=g)
    ids = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
    keys = [f"f{t}" for t in range(TABLES)]
    return torch.randn(BATCH, NUM_DENSE, generator=g), KeyedJaggedTensor(keys, ids, lengths=lengths)


def model_mb(model: torch.nn.Module) -> float:
    """MB of the model's parameters and buffers, each storage counted once."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values()) / 2**20


class ServingForward:
    params = ["fp32", "int8"]
    param_names = ["dtype"]
    timeout = 300

    def setup(self, dtype: str) -> None:
        torch.set_num_threads(1)
        self.model = build(dtype)
        self.dense, self.sparse = batch()
        with torch.inference_mode():
            self.model(self.dense, self.sparse)  # first call: lazy kernel set-up

    def time_forward(self, dtype: str) -> None:
        with torch.inference_mode():
            self.model(self.dense, self.sparse)

    def track_model_mb(self, dtype: str) -> float:
        return model_mb(self.model)

    track_model_mb.unit = "MB"  # type: ignore[attr-defined]
