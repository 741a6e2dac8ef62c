"""Sparse input and output types (JaggedTensor, KeyedJaggedTensor, KeyedTensor); torch only.

Importing this package registers the three types as pytree nodes (``sparse.pytree``), so that
``torch.export`` and ``torch.compile`` take them as inputs and outputs; nothing else happens.
"""

from embshard_types.sparse.jagged import JaggedTensor
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.sparse.keyed_tensor import KeyedTensor
from embshard_types.sparse.pytree import register_sparse_pytrees

register_sparse_pytrees()

__all__ = ["JaggedTensor", "KeyedJaggedTensor", "KeyedTensor", "register_sparse_pytrees"]
