"""KeyedTensor against a plain dict of per-key blocks, plus one test per bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embshard_types.sparse.keyed_tensor import KeyedTensor

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def keyed_inputs(draw: st.DrawFn) -> tuple[list[KeyedTensor], dict[str, torch.Tensor], int]:
    """1-3 KeyedTensors with 1-4 distinct keys each (widths 0-4), batch 0-4, key_dim 0 or 1."""
    batch = draw(st.integers(0, 4))
    key_dim = draw(st.sampled_from([0, 1]))
    n_inputs = draw(st.integers(1, 3))
    names = draw(
        st.lists(
            st.text("abcdefgh", min_size=1, max_size=2), min_size=n_inputs, max_size=12, unique=True
        )
    )
    reference: dict[str, torch.Tensor] = {}
    kts: list[KeyedTensor] = []
    per_input = max(1, len(names) // n_inputs)
    for i in range(n_inputs):
        keys = (
            names[i * per_input : (i + 1) * per_input]
            if i < n_inputs - 1
            else names[i * per_input :]
        )
        if not keys:
            continue
        blocks = []
        for key in keys:
            width = draw(st.integers(0, 4))
            shape = (batch, width) if key_dim == 1 else (width, batch)
            block = torch.randn(shape)
            reference[key] = block
            blocks.append(block)
        kts.append(KeyedTensor.from_tensor_list(keys, blocks, key_dim=key_dim, cat_dim=key_dim))
    return kts, reference, key_dim


@SETTINGS
@given(keyed_inputs())
def test_lookup_to_dict_and_offsets(case) -> None:
    kts, reference, key_dim = case
    for kt in kts:
        assert kt.key_dim() == key_dim
        keys = kt.keys()
        widths = [reference[k].shape[key_dim] for k in keys]
        assert kt.length_per_key() == widths
        assert kt.offset_per_key() == [sum(widths[:i]) for i in range(len(widths) + 1)]
        blocks = kt.to_dict()
        assert list(blocks) == kt.keys()
        for key in keys:
            assert torch.equal(kt[key], reference[key])
            assert torch.equal(blocks[key], reference[key])
        assert kt.index_per_key() == {k: i for i, k in enumerate(kt.keys())}


@SETTINGS
@given(keyed_inputs(), st.data())
def test_regroup_matches_reference(case, data: st.DataObject) -> None:
    kts, reference, key_dim = case
    all_keys = list(reference)
    groups = data.draw(st.lists(st.lists(st.sampled_from(all_keys), max_size=5), max_size=4))
    out = KeyedTensor.regroup(kts, groups)
    assert len(out) == len(groups)
    for got, group in zip(out, groups, strict=True):
        batch = kts[0].values().shape[1 - key_dim]
        if group:
            expected = torch.cat([reference[k] for k in group], dim=key_dim)
        else:
            expected = torch.empty((batch, 0) if key_dim == 1 else (0, batch))
        assert got.shape == expected.shape and torch.equal(got, expected)
    names = [f"g{i}" for i in range(len(groups))]
    as_dict = KeyedTensor.regroup_as_dict(kts, groups, names)
    assert list(as_dict) == names
    for name, got in zip(names, out, strict=True):
        assert torch.equal(as_dict[name], got)


def test_regroup_keeps_autograd() -> None:
    a = torch.randn(2, 3, requires_grad=True)
    b = torch.randn(2, 2, requires_grad=True)
    kt1 = KeyedTensor(["x", "y"], [1, 2], a)
    kt2 = KeyedTensor(["z"], [2], b)
    first, second = KeyedTensor.regroup([kt1, kt2], [["z", "x", "y"], ["y"]])
    (first.sum() + 2 * second.sum()).backward()
    assert a.grad is not None and b.grad is not None
    assert a.grad.tolist() == [[1.0, 3.0, 3.0]] * 2
    assert b.grad.tolist() == [[1.0, 1.0]] * 2


def test_devices_and_text() -> None:
    kt = KeyedTensor(["x", "y"], [1, 2], torch.arange(6.0).view(2, 3))
    assert kt.to("meta").device().type == "meta"
    assert "length_per_key=[1, 2]" in repr(kt) and "'y': (2, 2)" in str(kt)
    assert KeyedTensor(["x"], [3], torch.zeros(2, 3), key_dim=-1).key_dim() == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for pinned memory/streams")
def test_pin_memory_and_record_stream() -> None:
    kt = KeyedTensor(["x", "y"], [1, 2], torch.arange(6.0).view(2, 3)).pin_memory()
    assert kt.values().is_pinned()
    cuda = kt.to("cuda", non_blocking=True)
    cuda.record_stream(torch.cuda.current_stream())
    assert cuda["y"].tolist() == [[1.0, 2.0], [4.0, 5.0]]


# ---- bad input ---------------------------------------------------------------------------


def test_regroup_unknown_key_is_named() -> None:
    kt = KeyedTensor(["x", "y"], [1, 2], torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"key 'nope' in groups\[1\] is not in any of the keyed"):
        KeyedTensor.regroup([kt], [["x"], ["y", "nope"]])


def test_regroup_key_in_two_inputs() -> None:
    kt1 = KeyedTensor(["x"], [1], torch.zeros(2, 1))
    kt2 = KeyedTensor(["x"], [1], torch.zeros(2, 1))
    with pytest.raises(
        ValueError, match=r"key 'x' is in keyed_tensors\[0\] and keyed_tensors\[1\]"
    ):
        KeyedTensor.regroup([kt1, kt2], [["x"]])


def test_regroup_inputs_must_line_up() -> None:
    kt1 = KeyedTensor(["x"], [1], torch.zeros(2, 1))
    kt2 = KeyedTensor(["y"], [1], torch.zeros(3, 1))
    with pytest.raises(ValueError, match=r"keyed_tensors\[1\] has values \(3, 1\)"):
        KeyedTensor.regroup([kt1, kt2], [["x", "y"]])
    with pytest.raises(ValueError, match="keyed_tensors is empty"):
        KeyedTensor.regroup([], [["x"]])


def test_regroup_as_dict_needs_one_name_per_group() -> None:
    kt = KeyedTensor(["x"], [1], torch.zeros(2, 1))
    with pytest.raises(ValueError, match="1 keys for 2 groups"):
        KeyedTensor.regroup_as_dict([kt], [["x"], ["x"]], ["only"])


def test_lengths_must_add_up_to_values() -> None:
    with pytest.raises(
        ValueError,
        match=r"values has 3 entries along key_dim 1 but length_per_key adds up to 4 \(x: 1, y: 3\)",
    ):
        KeyedTensor(["x", "y"], [1, 3], torch.zeros(2, 3))


def test_one_length_per_key() -> None:
    with pytest.raises(ValueError, match=r"1 entries in length_per_key for 2 keys \['x', 'y'\]"):
        KeyedTensor(["x", "y"], [3], torch.zeros(2, 3))


def test_negative_length_and_duplicate_key() -> None:
    with pytest.raises(ValueError, match="length_per_key for key 'y' is negative"):
        KeyedTensor(["x", "y"], [4, -1], torch.zeros(2, 3))
    with pytest.raises(ValueError, match="duplicate key 'x'"):
        KeyedTensor(["x", "x"], [1, 2], torch.zeros(2, 3))


def test_key_dim_out_of_range() -> None:
    with pytest.raises(ValueError, match="key_dim 2 is not a dimension of values"):
        KeyedTensor(["x"], [3], torch.zeros(2, 3), key_dim=2)


def test_unknown_key_lookup_and_from_tensor_list_counts() -> None:
    kt = KeyedTensor(["x"], [3], torch.zeros(2, 3))
    with pytest.raises(KeyError, match="key 'q' is not in this KeyedTensor"):
        kt["q"]
    with pytest.raises(ValueError, match="got 2 keys and 1 tensors"):
        KeyedTensor.from_tensor_list(["a", "b"], [torch.zeros(2, 1)])
