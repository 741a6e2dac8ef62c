"""TorchRec 1.8.0's remaining ``torchrec.sparse.jagged_tensor`` names, against expected values.

Values marked "TorchRec 1.8.0" were produced once by running TorchRec itself on the same inputs
(torchrec is not importable here); the rest are computed by hand or checked against embshard's
own methods (``KeyedTensor.regroup``, ``to_dict``, ``from_jt_dict``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import embshard_types.sparse as sparse
from embshard_types.sparse import (
    ComputeJTDictToKJT,
    ComputeKJTToJTDict,
    JaggedTensor,
    KeyedJaggedTensor,
    KeyedTensor,
    KJTFlatContext,
    flatten_kjt_list,
    jt_is_equal,
    kjt_is_equal,
    permute_multi_embedding,
    regroup_kts,
    unflatten_kjt_list,
)

SETTINGS = settings(max_examples=40, deadline=None)

KEYS = ["f1", "f2"]
V = torch.arange(8)
W = torch.arange(1, 9, dtype=torch.float32)
L = torch.tensor([2, 0, 1, 1, 1, 3], dtype=torch.int32)
OFFSETS = torch.tensor([0, 2, 2, 3, 4, 5, 8], dtype=torch.int32)


def make_kjt(**overrides: object) -> KeyedJaggedTensor:
    """f1: [0, 1], [], [2]; f2: [3], [4], [5, 6, 7]; weights 1..8."""
    args: dict[str, object] = {"keys": KEYS, "values": V, "weights": W, "lengths": L}
    args.update(overrides)
    return KeyedJaggedTensor(**args)  # type: ignore[arg-type]


def make_jt(**overrides: object) -> JaggedTensor:
    args: dict[str, object] = {"values": V, "lengths": torch.tensor([3, 5])}
    args.update(overrides)
    return JaggedTensor(**args)  # type: ignore[arg-type]


def two_kts() -> list[KeyedTensor]:
    a = KeyedTensor(["a", "b"], [2, 3], torch.arange(10.0).view(2, 5))
    c = KeyedTensor(["c"], [1], torch.arange(100.0, 102.0).view(2, 1))
    return [a, c]


def test_exported_from_sparse() -> None:
    for name in (
        "regroup_kts",
        "permute_multi_embedding",
        "jt_is_equal",
        "kjt_is_equal",
        "flatten_kjt_list",
        "unflatten_kjt_list",
        "ComputeKJTToJTDict",
        "ComputeJTDictToKJT",
    ):
        assert name in sparse.__all__
        assert getattr(sparse, name) is not None


# ---- regroup_kts / permute_multi_embedding ------------------------------------------------


@pytest.mark.parametrize("fn", [regroup_kts, permute_multi_embedding])
def test_regroup_values_match_torchrec(fn) -> None:
    # TorchRec 1.8.0 on the same inputs.
    out = fn(two_kts(), [["c", "a"], ["b"]])
    assert [o.tolist() for o in out] == [
        [[100.0, 0.0, 1.0], [101.0, 5.0, 6.0]],
        [[2.0, 3.0, 4.0], [7.0, 8.0, 9.0]],
    ]
    repeated = fn(two_kts(), [["c", "a"], ["a", "b"]])
    assert repeated[1].tolist() == [[0.0, 1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0, 9.0]]
    empty = fn(two_kts(), [[], ["a"]])
    assert empty[0].shape == (2, 0)
    assert empty[1].tolist() == [[0.0, 1.0], [5.0, 6.0]]
    assert fn(two_kts(), []) == []


@pytest.mark.parametrize("fn", [regroup_kts, permute_multi_embedding])
def test_regroup_keeps_autograd_and_never_aliases(fn) -> None:
    values = torch.randn(3, 4, requires_grad=True)
    kt = KeyedTensor(["x", "y"], [1, 3], values)
    (out,) = fn([kt], [["x", "y"]])
    assert out.data_ptr() != values.data_ptr()
    (out * torch.arange(4.0)).sum().backward()
    assert values.grad is not None
    assert values.grad.tolist() == [[0.0, 1.0, 2.0, 3.0]] * 3


@st.composite
def kts_and_groups(draw: st.DrawFn) -> tuple[list[KeyedTensor], list[list[str]]]:
    batch = draw(st.integers(0, 3))
    key_dim = draw(st.sampled_from([0, 1]))
    names = draw(st.lists(st.sampled_from("abcdefg"), min_size=1, max_size=7, unique=True))
    cut = draw(st.integers(1, len(names)))
    kts = []
    for keys in (names[:cut], names[cut:]):
        if not keys:
            continue
        widths = [draw(st.integers(0, 3)) for _ in keys]
        blocks = [torch.randn((batch, w) if key_dim == 1 else (w, batch)) for w in widths]
        kts.append(KeyedTensor.from_tensor_list(keys, blocks, key_dim=key_dim, cat_dim=key_dim))
    groups = draw(st.lists(st.lists(st.sampled_from(names), max_size=5), max_size=4))
    return kts, groups


@SETTINGS
@given(kts_and_groups())
def test_regroup_functions_equal_keyed_tensor_regroup(case) -> None:
    kts, groups = case
    expected = KeyedTensor.regroup(kts, groups)
    for fn in (regroup_kts, permute_multi_embedding):
        got = fn(kts, groups)
        assert len(got) == len(expected)
        for g, e in zip(got, expected, strict=True):
            assert torch.equal(g, e)


def test_regroup_bad_inputs_name_the_problem() -> None:
    with pytest.raises(ValueError, match=r"regroup_kts: key 'z' in groups\[1\] is not in any"):
        regroup_kts(two_kts(), [["a"], ["z"]])
    with pytest.raises(ValueError, match="permute_multi_embedding: key 'z'"):
        permute_multi_embedding(two_kts(), [["z"]])
    with pytest.raises(ValueError, match="regroup_kts: keyed_tensors is empty"):
        regroup_kts([], [["a"]])
    with pytest.raises(TypeError, match="got one KeyedTensor; give a list"):
        regroup_kts(two_kts()[0], [["a"]])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"keyed_tensors\[1\] is a Tensor"):
        regroup_kts([two_kts()[0], torch.zeros(2, 1)], [["a"]])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"groups\[0\] is the string 'ab'"):
        regroup_kts(two_kts(), ["ab"])
    duplicate = KeyedTensor(["a"], [1], torch.zeros(2, 1))
    with pytest.raises(
        ValueError, match=r"key 'a' is in keyed_tensors\[0\] and keyed_tensors\[1\]"
    ):
        regroup_kts([two_kts()[0], duplicate], [["a"]])
    other_batch = KeyedTensor(["c"], [1], torch.zeros(3, 1))
    with pytest.raises(ValueError, match=r"keyed_tensors\[1\] has values \(3, 1\)"):
        permute_multi_embedding([two_kts()[0], other_batch], [["a", "c"]])
    # The method keeps its own name in messages.
    with pytest.raises(ValueError, match=r"KeyedTensor.regroup: key 'z'"):
        KeyedTensor.regroup(two_kts(), [["z"]])


# ---- size_in_bytes ------------------------------------------------------------------------


def test_size_in_bytes_matches_torchrec() -> None:
    # TorchRec 1.8.0: 40 and 24 (KeyedTensor), 120 then 148 once offsets are cached (KJT),
    # 80 then 104 (JaggedTensor).
    kts = two_kts()
    assert kts[0].size_in_bytes() == 40
    assert KeyedTensor(["x"], [3], torch.zeros(4, 3, dtype=torch.float16)).size_in_bytes() == 24
    kjt = make_kjt()
    assert kjt.size_in_bytes() == 8 * 8 + 8 * 4 + 6 * 4 == 120
    kjt.offsets()
    assert kjt.size_in_bytes() == 148
    jt = make_jt()
    assert jt.size_in_bytes() == 80
    jt.offsets()
    assert jt.size_in_bytes() == 104
    assert KeyedJaggedTensor.empty().size_in_bytes() == 0
    # Variable strides are host-side lists here, not counted (TorchRec counts its int32 tensor).
    assert make_kjt(stride_per_key_per_rank=[[1, 2], [2, 1]]).size_in_bytes() == 120


# ---- kjt_is_equal / jt_is_equal -------------------------------------------------------------

# (name, first, second, TorchRec 1.8.0's answer)
KJT_CASES = [
    ("same", make_kjt, make_kjt, True),
    ("lengths_vs_offsets", make_kjt, lambda: make_kjt(lengths=None, offsets=OFFSETS), True),
    ("weighted_vs_not", make_kjt, lambda: make_kjt(weights=None), False),
    ("keys_swapped", make_kjt, lambda: make_kjt(keys=["f2", "f1"]), False),
    ("keys_renamed", make_kjt, lambda: make_kjt(keys=["f1", "g"]), False),
    ("weights_within_tolerance", make_kjt, lambda: make_kjt(weights=W + 1e-7), True),
    ("weights_off", make_kjt, lambda: make_kjt(weights=W + 1e-3), False),
    ("values_differ", make_kjt, lambda: make_kjt(values=V.flip(0)), False),
    (
        "lengths_differ_same_total",
        make_kjt,
        lambda: make_kjt(lengths=torch.tensor([1, 1, 1, 1, 1, 3], dtype=torch.int32)),
        False,
    ),
    (
        "stride_vs_per_rank_same_sizes",
        make_kjt,
        lambda: make_kjt(stride_per_key_per_rank=[[1, 2], [2, 1]]),
        True,
    ),
    (
        "per_rank_differ_same_per_key",
        lambda: make_kjt(stride_per_key_per_rank=[[3, 0], [3, 0]]),
        lambda: make_kjt(stride_per_key_per_rank=[[1, 2], [2, 1]]),
        True,
    ),
    (
        "per_key_strides_differ",
        lambda: make_kjt(stride_per_key_per_rank=[[2, 0], [4, 0]]),
        lambda: make_kjt(stride_per_key_per_rank=[[1, 2], [2, 1]]),
        False,
    ),
    (
        "inverse_indices_only_one",
        lambda: make_kjt(inverse_indices=(KEYS, torch.zeros(2, 3, dtype=torch.long))),
        make_kjt,
        True,
    ),
    (
        "nan_weights",
        lambda: make_kjt(weights=W * float("nan")),
        lambda: make_kjt(weights=W * float("nan")),
        False,
    ),
    ("empty_empty", KeyedJaggedTensor.empty, KeyedJaggedTensor.empty, True),
    (
        "empty_vs_empty_weighted",
        KeyedJaggedTensor.empty,
        lambda: KeyedJaggedTensor.empty(is_weighted=True),
        False,
    ),
    ("not_a_kjt", make_kjt, lambda: None, False),
]


@pytest.mark.parametrize(("name", "first", "second", "expected"), KJT_CASES)
def test_kjt_is_equal_follows_torchrec(name, first, second, expected) -> None:
    a, b = first(), second()
    assert kjt_is_equal(a, b) is expected, name
    assert kjt_is_equal(b, a) is expected, name


JT_CASES = [
    ("same", make_jt, make_jt, True),
    (
        "lengths_vs_offsets",
        make_jt,
        lambda: make_jt(lengths=None, offsets=torch.tensor([0, 3, 8])),
        True,
    ),
    ("weighted_vs_not", make_jt, lambda: make_jt(weights=W), False),
    ("lengths_differ", make_jt, lambda: make_jt(lengths=torch.tensor([4, 4])), False),
    (
        "values_2d",
        lambda: make_jt(values=torch.ones(8, 2)),
        lambda: make_jt(values=torch.ones(8, 2)),
        True,
    ),
    (
        "values_2d_vs_1d",
        lambda: make_jt(values=torch.ones(8, 2)),
        lambda: make_jt(values=torch.ones(8)),
        False,
    ),
    ("not_a_jt", make_jt, lambda: "x", False),
]


@pytest.mark.parametrize(("name", "first", "second", "expected"), JT_CASES)
def test_jt_is_equal_follows_torchrec(name, first, second, expected) -> None:
    a, b = first(), second()
    assert jt_is_equal(a, b) is expected, name
    assert jt_is_equal(b, a) is expected, name


def test_equality_with_different_dtypes_is_false() -> None:
    # TorchRec 1.8.0 raises RuntimeError ("Int did not match Long") from torch.allclose here.
    assert not kjt_is_equal(make_kjt(), make_kjt(lengths=L.long()))
    assert not kjt_is_equal(make_kjt(), make_kjt(values=V.int()))
    assert not jt_is_equal(make_jt(), make_jt(lengths=torch.tensor([3, 5], dtype=torch.int32)))


# ---- empty_like / copy_ -------------------------------------------------------------------


def test_kjt_empty_like_without_device_matches_torchrec() -> None:
    # TorchRec 1.8.0: stride 3, no keys, empty int32 lengths, int64 values, float weights.
    e = KeyedJaggedTensor.empty_like(make_kjt())
    assert e.keys() == []
    assert e.stride() == 3
    assert e.values().shape == (0,) and e.values().dtype == torch.int64
    assert e.weights().shape == (0,) and e.weights().dtype == torch.float32
    assert e.lengths().dtype == torch.int32 and e.lengths().numel() == 0
    assert KeyedJaggedTensor.empty_like(make_kjt(weights=None)).weights_or_none() is None
    # From offsets only: the lengths take the offsets' dtype, nothing is derived.
    src = make_kjt(lengths=None, offsets=OFFSETS.long())
    assert KeyedJaggedTensor.empty_like(src).lengths().dtype == torch.int64
    assert src.lengths_or_none() is None
    # Variable stride: no keys to hold per-rank sizes; the stride stays.
    var = KeyedJaggedTensor.empty_like(make_kjt(stride_per_key_per_rank=[[1, 2], [2, 1]]))
    assert var.stride() == 3 and not var.variable_stride_per_key()


def test_kjt_empty_like_with_device_matches_torchrec() -> None:
    inverse = (KEYS, torch.zeros(2, 3, dtype=torch.long))
    src = make_kjt(inverse_indices=inverse, length_per_key=[3, 5])
    e = KeyedJaggedTensor.empty_like(src, torch.device("cpu"))
    # TorchRec 1.8.0: same keys and stride, lengths [6], values [8], length_per_key [3, 5].
    assert e.keys() == KEYS and e.stride() == 3
    assert e.values().shape == (8,) and e.lengths().shape == (6,)
    assert e.offsets_or_none() is None
    assert e.length_per_key_or_none() == [3, 5]
    assert e.weights().dtype == torch.float32
    inverse = e.inverse_indices()
    assert inverse[0] == KEYS and inverse[1].shape == (2, 3)
    assert inverse[1].data_ptr() != src.inverse_indices()[1].data_ptr()
    var = make_kjt(stride_per_key_per_rank=[[1, 2], [2, 1]])
    assert KeyedJaggedTensor.empty_like(var, "cpu").stride_per_key_per_rank() == [[1, 2], [2, 1]]


def test_kjt_copy_fills_in_place() -> None:
    src = make_kjt(inverse_indices=(KEYS, torch.tensor([[0, 1, 2], [2, 1, 0]])))
    src.offsets()
    dst = KeyedJaggedTensor.empty_like(src, "cpu")
    buffers = [dst.values(), dst.weights(), dst.lengths(), dst.offsets(), dst.inverse_indices()[1]]
    assert dst.copy_(src, non_blocking=False) is dst
    assert kjt_is_equal(dst, src)
    # Same tensors as before, now holding the source's data.
    after = [dst.values(), dst.weights(), dst.lengths(), dst.offsets(), dst.inverse_indices()[1]]
    assert all(a is b for a, b in zip(buffers, after, strict=True))
    assert dst.inverse_indices()[1].tolist() == [[0, 1, 2], [2, 1, 0]]
    assert dst["f2"].values().tolist() == [3, 4, 5, 6, 7]
    assert dst.length_per_key() == [3, 5]


def test_kjt_copy_derives_what_the_source_lacks_and_takes_its_layout() -> None:
    lengths = torch.tensor([4, 0, 0, 4, 0, 0], dtype=torch.int32)
    dst = make_kjt(values=torch.zeros(8, dtype=torch.int64), lengths=lengths)
    dst.offsets()
    assert dst.length_per_key() == [4, 4]
    dst.to_dict()  # cached views and sizes must not survive the copy
    src = make_kjt(lengths=None, offsets=OFFSETS, stride_per_key_per_rank=[[1, 2], [2, 1]])
    dst.copy_(src)
    assert dst.lengths().tolist() == L.tolist()
    assert dst.offsets().tolist() == OFFSETS.tolist()
    assert dst.stride_per_key_per_rank() == [[1, 2], [2, 1]]
    assert {k: jt.values().tolist() for k, jt in dst.to_dict().items()} == {
        "f1": [0, 1, 2],
        "f2": [3, 4, 5, 6, 7],
    }


def test_kjt_copy_bad_inputs() -> None:
    with pytest.raises(ValueError, match=r"source has keys \['f2', 'f1'\] but this one has"):
        make_kjt().copy_(make_kjt(keys=["f2", "f1"]))
    with pytest.raises(ValueError, match="this one has weights but the source has none"):
        make_kjt().copy_(make_kjt(weights=None))
    with pytest.raises(ValueError, match="the source has weights but this one has none"):
        make_kjt(weights=None).copy_(make_kjt())
    short = make_kjt(values=V[:7], weights=W[:7], lengths=torch.tensor([2, 0, 1, 1, 1, 2]))
    dst = make_kjt(values=torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"values has shape \(8,\) here but \(7,\) in the source"):
        dst.copy_(short)
    assert dst.values().tolist() == [0] * 8  # nothing copied
    with pytest.raises(ValueError, match="the source has inverse indices but this one has none"):
        make_kjt().copy_(make_kjt(inverse_indices=(KEYS, torch.zeros(2, 3, dtype=torch.long))))
    with pytest.raises(TypeError, match="expected a KeyedJaggedTensor, got JaggedTensor"):
        make_kjt().copy_(make_jt())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="empty_like: expected a KeyedJaggedTensor"):
        KeyedJaggedTensor.empty_like(make_jt())  # type: ignore[arg-type]


def test_jt_empty_like_and_copy() -> None:
    src = JaggedTensor(torch.arange(16.0).view(8, 2), weights=W, lengths=torch.tensor([3, 5]))
    # TorchRec 1.8.0 with a device: values [8, 2], lengths [2], no offsets.
    dst = JaggedTensor.empty_like(src, torch.device("cpu"))
    assert dst.values().shape == (8, 2) and dst.lengths().shape == (2,)
    assert dst.offsets_or_none() is None
    assert dst.copy_(src) is dst
    assert jt_is_equal(dst, src)
    # Without a device: no samples, same dtypes (TorchRec's values are [0]; here [0, 2]).
    empty = JaggedTensor.empty_like(src)
    assert empty.values().shape == (0, 2) and empty.values().dtype == torch.float32
    assert empty.lengths().dtype == torch.int64 and empty.lengths().numel() == 0
    assert empty.weights().shape == (0,)
    assert empty.to_dense() == []
    # Offsets-only destination: filled from the source's derived offsets.
    target = JaggedTensor(
        torch.zeros(8, 2), weights=torch.zeros(8), offsets=torch.zeros(3, dtype=torch.int64)
    )
    target.copy_(src)
    assert target.offsets().tolist() == [0, 3, 8]
    with pytest.raises(ValueError, match=r"lengths has shape \(3,\) here but \(2,\) in the source"):
        JaggedTensor(torch.zeros(8, 2), weights=W, lengths=torch.tensor([1, 2, 5])).copy_(src)
    with pytest.raises(ValueError, match="the source has weights but this one has none"):
        JaggedTensor(torch.zeros(8, 2), lengths=torch.tensor([3, 5])).copy_(src)
    with pytest.raises(TypeError, match=r"JaggedTensor\.copy_: expected a JaggedTensor"):
        dst.copy_(make_kjt())  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for a host-to-device copy")
def test_staging_a_batch_on_cuda() -> None:
    src = make_kjt(inverse_indices=(KEYS, torch.tensor([[0, 1, 2], [2, 1, 0]]))).pin_memory()
    dst = KeyedJaggedTensor.empty_like(src, "cuda")
    assert dst.device().type == "cuda" and dst.inverse_indices()[1].device.type == "cuda"
    dst.copy_(src, non_blocking=True)
    torch.cuda.current_stream().synchronize()
    assert kjt_is_equal(dst.to("cpu"), src)
    assert not kjt_is_equal(dst, src)  # different devices
    jt = JaggedTensor.empty_like(make_jt(), "cuda").copy_(make_jt(), non_blocking=True)
    assert jt_is_equal(jt.to("cpu"), make_jt())
    before = torch.cuda.memory_allocated()
    assert dst.clear_storage() == 120
    assert torch.cuda.memory_allocated() < before


# ---- flatten_lengths / unsync / clear_storage ----------------------------------------------


def test_flatten_lengths_matches_torchrec() -> None:
    # TorchRec 1.8.0: same keys and lengths, no offsets, length_per_key [3, 5], no inverse
    # indices, stride 3; variable strides kept.
    src = make_kjt(inverse_indices=(KEYS, torch.zeros(2, 3, dtype=torch.long)))
    src.offsets()
    f = src.flatten_lengths()
    assert f.keys() == KEYS and f.stride() == 3
    assert f.lengths().tolist() == L.tolist()
    assert f.offsets_or_none() is None
    assert f.length_per_key_or_none() == [3, 5]
    assert f.inverse_indices_or_none() is None
    assert f.values() is src.values() and f.weights() is src.weights()
    var = make_kjt(stride_per_key_per_rank=[[1, 2], [2, 1]]).flatten_lengths()
    assert var.variable_stride_per_key() and var.stride_per_key_per_rank() == [[1, 2], [2, 1]]


def test_unsync_forgets_per_key_sizes() -> None:
    kjt = make_kjt().sync()
    assert kjt.length_per_key_or_none() == [3, 5]
    assert kjt.unsync() is kjt
    assert kjt.length_per_key_or_none() is None and kjt.offset_per_key_or_none() is None
    assert kjt.length_per_key() == [3, 5]


def test_clear_storage_frees_and_counts() -> None:
    kjt = make_kjt(values=V.clone(), weights=W.clone(), lengths=L.clone())
    # TorchRec 1.8.0 returns 120 here and leaves storages of size 0.
    assert kjt.clear_storage() == 120
    for t in (kjt.values(), kjt.weights(), kjt.lengths()):
        assert t.untyped_storage().nbytes() == 0


# ---- flatten_kjt_list / unflatten_kjt_list ------------------------------------------------


def test_flatten_and_unflatten_kjt_list_round_trip() -> None:
    plain = make_kjt(weights=None)
    var = make_kjt(
        stride_per_key_per_rank=[[1, 2], [2, 1]],
        inverse_indices=(["f1"], torch.zeros(1, 3, dtype=torch.long)),
    )
    duplicated = make_kjt(keys=["f1", "f1"], allow_duplicate_keys=True)
    empty = KeyedJaggedTensor.empty_like(make_kjt())
    kjts = [plain, var, duplicated, empty]
    tensors, contexts = flatten_kjt_list(kjts)
    assert len(tensors) == 4 * len(kjts)
    assert tensors[1] is None and tensors[3] is None  # plain: no weights, no inverse indices
    assert tensors[4] is var.values() and tensors[7] is var.inverse_indices()[1]
    assert all(isinstance(c, KJTFlatContext) for c in contexts)
    assert contexts[1].stride_per_key_per_rank == ((1, 2), (2, 1))
    back = unflatten_kjt_list(tensors, contexts)
    assert len(back) == len(kjts)
    for original, rebuilt in zip(kjts, back, strict=True):
        assert kjt_is_equal(original, rebuilt)
        assert rebuilt.stride_per_key_per_rank() == original.stride_per_key_per_rank()
    assert back[1].inverse_indices()[0] == ["f1"]
    assert back[3].stride() == 3
    assert flatten_kjt_list([]) == ([], [])
    assert unflatten_kjt_list([], []) == []


def test_unflatten_kjt_list_bad_inputs() -> None:
    tensors, contexts = flatten_kjt_list([make_kjt()])
    with pytest.raises(ValueError, match="5 tensors for 1 contexts; flatten_kjt_list gives 4"):
        unflatten_kjt_list([*tensors, None], contexts)
    with pytest.raises(TypeError, match=r"contexts\[0\] is a list, not a KJTFlatContext"):
        unflatten_kjt_list(tensors, [KEYS])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="the lengths of KeyedJaggedTensor 0"):
        unflatten_kjt_list([tensors[0], tensors[1], None, None], contexts)
    with pytest.raises(
        ValueError, match="has inverse indices tensor but its context says it has none"
    ):
        unflatten_kjt_list([*tensors[:3], torch.zeros(2, 3, dtype=torch.long)], contexts)
    with pytest.raises(TypeError, match=r"kjt_arr\[0\] is a JaggedTensor"):
        flatten_kjt_list([make_jt()])  # type: ignore[list-item]


# ---- ComputeKJTToJTDict / ComputeJTDictToKJT ------------------------------------------------


def test_compute_modules_match_torchrec() -> None:
    kjt = make_kjt()
    jts = ComputeKJTToJTDict()(kjt)
    assert isinstance(ComputeKJTToJTDict(), torch.nn.Module)
    # TorchRec 1.8.0: {'f1': ([0, 1, 2], [2, 0, 1]), 'f2': ([3, 4, 5, 6, 7], [1, 1, 3])}.
    assert {k: (jt.values().tolist(), jt.lengths().tolist()) for k, jt in jts.items()} == {
        "f1": ([0, 1, 2], [2, 0, 1]),
        "f2": ([3, 4, 5, 6, 7], [1, 1, 3]),
    }
    assert all(jt_is_equal(jts[k], kjt.to_dict()[k]) for k in KEYS)
    rebuilt = ComputeJTDictToKJT()(jts)
    assert kjt_is_equal(rebuilt, kjt)
    assert kjt_is_equal(rebuilt, KeyedJaggedTensor.from_jt_dict(jts))
    assert ComputeKJTToJTDict()(KeyedJaggedTensor.empty()) == {}
    with pytest.raises(TypeError, match="ComputeKJTToJTDict: expected a KeyedJaggedTensor"):
        ComputeKJTToJTDict()(jts)
    with pytest.raises(TypeError, match=r"jt_dict\['f1'\] is a Tensor"):
        ComputeJTDictToKJT()({"f1": V})
