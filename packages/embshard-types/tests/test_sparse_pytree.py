"""JaggedTensor, KeyedJaggedTensor and KeyedTensor as pytree nodes: flatten, unflatten, export."""

from __future__ import annotations

import io

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from embshard_types.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor


def _kjt(weighted: bool = False) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        ["a", "b"],
        torch.tensor([1, 2, 3, 4, 5]),
        weights=torch.tensor([0.5, 1.0, 1.5, 2.0, 2.5]) if weighted else None,
        lengths=torch.tensor([2, 0, 1, 2]),
    )


def _same_kjt(x: KeyedJaggedTensor, y: KeyedJaggedTensor) -> None:
    assert x.keys() == y.keys() and x.stride() == y.stride()
    assert torch.equal(x.values(), y.values()) and torch.equal(x.lengths(), y.lengths())
    wx, wy = x.weights_or_none(), y.weights_or_none()
    assert (wx is None) == (wy is None) and (wx is None or torch.equal(wx, wy))
    assert x.stride_per_key_per_rank() == y.stride_per_key_per_rank()


def test_kjt_leaves_are_tensors_and_round_trip() -> None:
    for weighted in (False, True):
        kjt = _kjt(weighted)
        leaves, spec = pytree.tree_flatten(kjt)
        assert all(isinstance(t, Tensor) for t in leaves)
        assert len(leaves) == (3 if weighted else 2)  # values, [weights,] lengths
        _same_kjt(pytree.tree_unflatten(leaves, spec), kjt)


def test_cached_offsets_do_not_change_the_structure() -> None:
    kjt = _kjt()
    _, before = pytree.tree_flatten(kjt)
    kjt.offsets()  # derived and cached
    _, after = pytree.tree_flatten(kjt)
    assert before == after
    from_offsets = KeyedJaggedTensor(["a", "b"], kjt.values(), offsets=kjt.offsets())
    assert pytree.tree_flatten(from_offsets)[1] == before


def test_variable_stride_is_kept_in_the_context() -> None:
    kjt = KeyedJaggedTensor(
        ["a", "b"],
        torch.tensor([1, 2, 3]),
        lengths=torch.tensor([1, 1, 1]),
        stride_per_key_per_rank=[[2], [1]],
    )
    leaves, spec = pytree.tree_flatten(kjt)
    _same_kjt(pytree.tree_unflatten(leaves, spec), kjt)
    assert spec != pytree.tree_flatten(_kjt())[1]


def test_jagged_and_keyed_tensor_round_trip_with_key_paths() -> None:
    jt = JaggedTensor(torch.arange(6.0).view(3, 2), offsets=torch.tensor([0, 1, 3]))
    kt = KeyedTensor(["x", "y"], [2, 3], torch.arange(10.0).view(2, 5))
    tree = {"jt": jt, "kt": kt}
    leaves, spec = pytree.tree_flatten(tree)
    back = pytree.tree_unflatten(leaves, spec)
    assert torch.equal(back["jt"].values(), jt.values())
    assert torch.equal(back["jt"].lengths(), torch.tensor([1, 2]))
    assert back["kt"].keys() == ["x", "y"] and back["kt"].length_per_key() == [2, 3]
    assert torch.equal(back["kt"]["y"], kt["y"])
    paths = [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(tree)[0]]
    assert paths == ["['jt'].values", "['jt'].lengths", "['kt'].values"]


class _Pool(nn.Module):
    """Sum-pools each key's bags of a small table; returns a KeyedTensor."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.arange(24.0).view(8, 3))

    def forward(self, kjt: KeyedJaggedTensor) -> KeyedTensor:
        offsets = torch.cat([kjt.lengths().new_zeros(1), kjt.lengths().cumsum(0)])
        pooled = nn.functional.embedding_bag(
            kjt.values(), self.table, offsets[:-1], mode="sum", include_last_offset=False
        )
        per_key = pooled.view(len(kjt.keys()), kjt.stride(), 3).transpose(0, 1)
        return KeyedTensor(kjt.keys(), [3] * len(kjt.keys()), per_key.reshape(kjt.stride(), -1))


def test_export_takes_and_returns_sparse_types_and_survives_save_load() -> None:
    kjt = _kjt()
    model = _Pool()
    expected = model(kjt)
    program = torch.export.export(model, (kjt,), strict=False)
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    got = loaded.module()(kjt)
    assert isinstance(got, KeyedTensor)
    assert got.keys() == expected.keys() and got.length_per_key() == expected.length_per_key()
    assert torch.equal(got.values(), expected.values())
