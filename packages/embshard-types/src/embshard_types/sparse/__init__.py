"""Sparse input and output types (JaggedTensor, KeyedJaggedTensor, KeyedTensor); torch only.

Also TorchRec's module-level helpers from ``torchrec.sparse.jagged_tensor``: ``regroup_kts``,
``permute_multi_embedding`` (``keyed_tensor``), and equality, KJT-list flattening and the dict
conversion modules (``jagged_utils``).

Importing this package registers the three types as pytree nodes (``sparse.pytree``), so that
``torch.export`` and ``torch.compile`` take them as inputs and outputs; nothing else happens.
"""

from embshard_types.sparse.jagged import JaggedTensor
from embshard_types.sparse.jagged_utils import (
    ComputeJTDictToKJT,
    ComputeKJTToJTDict,
    KJTFlatContext,
    flatten_kjt_list,
    jt_is_equal,
    kjt_is_equal,
    unflatten_kjt_list,
)
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.sparse.keyed_tensor import KeyedTensor, permute_multi_embedding, regroup_kts
from embshard_types.sparse.pytree import register_sparse_pytrees

register_sparse_pytrees()

__all__ = [
    "ComputeJTDictToKJT",
    "ComputeKJTToJTDict",
    "JaggedTensor",
    "KJTFlatContext",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "flatten_kjt_list",
    "jt_is_equal",
    "kjt_is_equal",
    "permute_multi_embedding",
    "regroup_kts",
    "register_sparse_pytrees",
    "unflatten_kjt_list",
]
