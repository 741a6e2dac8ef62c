"""Key-value kernels need CUDA; on the CPU they say what to use instead."""

from __future__ import annotations

import pytest
from kernel_testing import one_group, table

from embshard_kernels.collections import EmbeddingBagCollection
from embshard_kernels.key_value import KeyValueEmbedding, KeyValueEmbeddingBag
from embshard_types.configs import EmbeddingBagConfig


@pytest.mark.parametrize(
    "cls,pooling", [(KeyValueEmbeddingBag, "sum"), (KeyValueEmbedding, "none")]
)
def test_key_value_on_cpu_names_the_alternative(cls: type, pooling: str) -> None:
    config = one_group(table("kv", 100, 8, pooling=pooling, kernel="key_value"))
    with pytest.raises(ValueError) as info:
        cls(config, device="cpu")
    message = str(info.value)
    assert "'key_value'" in message and "['kv']" in message
    assert "only on CUDA" in message and "'fused'" in message


def test_collection_with_key_value_on_cpu_is_refused() -> None:
    tables = [EmbeddingBagConfig(name="kv", num_embeddings=100, embedding_dim=8)]
    with pytest.raises(ValueError, match="only on CUDA"):
        EmbeddingBagCollection(tables, compute_kernel="key_value")
