"""KeyedJaggedTensor against a plain-Python reference (per key, per sample lists of ids).

Every operation is checked on random inputs: 1-5 keys, stride 0-6 or a variable stride per key
(1-3 ranks of 0-3 samples), bags of 0-5 ids, with and without weights, built from lengths,
offsets or both. Then one test per bad input, checking the message names the key / problem.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from itertools import pairwise

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embshard_types.sparse.jagged import JaggedTensor
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor

SETTINGS = settings(max_examples=60, deadline=None)


@dataclass
class Ref:
    """Per key, per sample bags of ids (and weights); ``per_rank`` set for variable stride."""

    keys: list[str]
    bags: list[list[list[int]]]  # [key][sample] -> ids
    weights: list[list[list[float]]] | None
    per_rank: list[list[int]] | None

    def stride_per_key(self) -> list[int]:
        return [len(b) for b in self.bags]

    def flat_lengths(self) -> list[int]:
        return [len(bag) for key_bags in self.bags for bag in key_bags]

    def flat_values(self) -> list[int]:
        return [v for key_bags in self.bags for bag in key_bags for v in bag]

    def flat_weights(self) -> list[float] | None:
        if self.weights is None:
            return None
        return [w for key_w in self.weights for bag in key_w for w in bag]

    def length_per_key(self) -> list[int]:
        return [sum(len(bag) for bag in key_bags) for key_bags in self.bags]

    def spkpr(self) -> list[list[int]]:
        if self.per_rank is not None:
            return self.per_rank
        return [[s] for s in self.stride_per_key()]

    def select(self, order: list[int]) -> Ref:
        return Ref(
            [self.keys[i] for i in order],
            [self.bags[i] for i in order],
            None if self.weights is None else [self.weights[i] for i in order],
            None if self.per_rank is None else [self.per_rank[i] for i in order],
        )


@st.composite
def refs(draw: st.DrawFn, prefix: str = "", weighted: bool | None = None) -> Ref:
    n = draw(st.integers(1, 5))
    names = draw(
        st.lists(st.text("abcdef", min_size=1, max_size=3), min_size=n, max_size=n, unique=True)
    )
    keys = [prefix + name for name in names]
    per_rank = None
    if draw(st.booleans()):
        ranks = draw(st.integers(1, 3))
        per_rank = [draw(st.lists(st.integers(0, 3), min_size=ranks, max_size=ranks)) for _ in keys]
        strides = [sum(r) for r in per_rank]
    else:
        strides = [draw(st.integers(0, 6))] * n
    sizes = [draw(st.lists(st.integers(0, 5), min_size=s, max_size=s)) for s in strides]
    rng = random.Random(draw(st.integers(0, 2**16)))
    bags = [[[rng.randrange(1000) for _ in range(m)] for m in key_sizes] for key_sizes in sizes]
    if weighted is None:
        weighted = draw(st.booleans())
    weights = None
    if weighted:
        weights = [[[rng.randrange(64) / 8 for _ in bag] for bag in key_bags] for key_bags in bags]
    return Ref(keys, bags, weights, per_rank)


MODES = st.sampled_from(["lengths", "offsets", "both", "stride"])


def build(
    ref: Ref, mode: str = "lengths", lengths_dtype: torch.dtype = torch.int64
) -> KeyedJaggedTensor:
    lengths = torch.tensor(ref.flat_lengths(), dtype=lengths_dtype)
    offsets = torch.cat([torch.zeros(1, dtype=lengths_dtype), lengths.cumsum(0).to(lengths_dtype)])
    flat_w = ref.flat_weights()
    explicit = mode == "stride" and ref.per_rank is None
    return KeyedJaggedTensor(
        ref.keys,
        torch.tensor(ref.flat_values(), dtype=torch.int64),
        weights=None if flat_w is None else torch.tensor(flat_w, dtype=torch.float32),
        lengths=None if mode == "offsets" else lengths,
        offsets=offsets if mode in ("offsets", "both") else None,
        stride=ref.stride_per_key()[0] if explicit else None,
        stride_per_key_per_rank=ref.per_rank,
    )


def assert_matches(kjt: KeyedJaggedTensor, ref: Ref) -> None:
    assert kjt.keys() == ref.keys
    assert kjt.stride_per_key() == ref.stride_per_key()
    assert kjt.variable_stride_per_key() == (ref.per_rank is not None)
    assert kjt.stride_per_key_per_rank() == ref.spkpr()
    assert kjt.lengths().tolist() == ref.flat_lengths()
    offsets = [0]
    for n in ref.flat_lengths():
        offsets.append(offsets[-1] + n)
    assert kjt.offsets().tolist() == offsets
    assert kjt.values().tolist() == ref.flat_values()
    weights = kjt.weights_or_none()
    assert (weights is None) == (ref.weights is None)
    if weights is not None:
        assert weights.tolist() == ref.flat_weights()
    assert kjt.length_per_key() == ref.length_per_key()
    lpk_offsets = [0]
    for n in ref.length_per_key():
        lpk_offsets.append(lpk_offsets[-1] + n)
    assert kjt.offset_per_key() == lpk_offsets
    as_dict = kjt.to_dict()
    for k, key in enumerate(ref.keys):
        if key in ref.keys[:k]:
            continue  # a repeated key (from permute) looks up its first occurrence
        for jt in (kjt[key], as_dict[key]):
            assert [t.tolist() for t in jt.to_dense()] == ref.bags[k]
            dense_w = jt.to_dense_weights()
            if ref.weights is not None:
                assert dense_w is not None and [t.tolist() for t in dense_w] == ref.weights[k]
    assert list(as_dict) == list(dict.fromkeys(ref.keys))


@SETTINGS
@given(refs(), MODES, st.sampled_from([torch.int32, torch.int64]))
def test_layout_lookup_and_to_dict(ref: Ref, mode: str, dtype: torch.dtype) -> None:
    kjt = build(ref, mode, dtype)
    kjt.validate()
    assert kjt.stride() == max(ref.stride_per_key())
    assert_matches(kjt, ref)
    assert kjt.index_per_key() == {key: i for i, key in enumerate(ref.keys)}
    assert kjt.key_to_index(ref.keys[-1]) == len(ref.keys) - 1
    assert kjt.lengths().dtype == dtype and kjt.offsets().dtype == dtype


@SETTINGS
@given(refs(), st.data())
def test_split(ref: Ref, data: st.DataObject) -> None:
    n = len(ref.keys)
    cuts = sorted(data.draw(st.lists(st.integers(0, n), max_size=4)))
    bounds = [0, *cuts, n]
    segments = [b - a for a, b in pairwise(bounds)]
    kjt = build(ref, data.draw(MODES))
    parts = kjt.split(segments)
    assert len(parts) == len(segments)
    for part, a, b in zip(parts, bounds[:-1], bounds[1:], strict=True):
        assert part.stride() == kjt.stride()
        if a == b:
            assert part.keys() == [] and part.values().numel() == 0
        else:
            assert_matches(part, ref.select(list(range(a, b))))
        part.validate()


@SETTINGS
@given(refs(), st.data())
def test_permute_reorders_repeats_and_drops(ref: Ref, data: st.DataObject) -> None:
    n = len(ref.keys)
    order = data.draw(st.lists(st.integers(0, n - 1), max_size=7))
    kjt = build(ref, data.draw(MODES))
    permuted = kjt.permute(order)
    assert permuted.stride() == kjt.stride()
    assert_matches(permuted, ref.select(order))
    permuted.validate()


@SETTINGS
@given(refs(prefix="x_", weighted=True), refs(prefix="y_", weighted=True), MODES)
def test_concat(left: Ref, right: Ref, mode: str) -> None:
    kjt = KeyedJaggedTensor.concat([build(left, mode), build(right, mode)])
    variable = left.per_rank is not None or right.per_rank is not None
    variable = variable or left.stride_per_key()[0] != right.stride_per_key()[0]
    expected = Ref(
        left.keys + right.keys,
        left.bags + right.bags,
        (left.weights or []) + (right.weights or []),
        left.spkpr() + right.spkpr() if variable else None,
    )
    assert_matches(kjt, expected)
    kjt.validate()


@SETTINGS
@given(refs(), MODES)
def test_from_jt_dict_round_trips(ref: Ref, mode: str) -> None:
    kjt = build(ref, mode)
    again = KeyedJaggedTensor.from_jt_dict(kjt.to_dict())
    uniform = len(set(ref.stride_per_key())) == 1
    per_rank = None if uniform else [[s] for s in ref.stride_per_key()]
    assert_matches(again, Ref(ref.keys, ref.bags, ref.weights, per_rank))


@SETTINGS
@given(refs(), st.sampled_from(["lengths", "offsets"]))
def test_sync_constructors(ref: Ref, mode: str) -> None:
    kjt = build(ref, mode)
    flat_w = kjt.weights_or_none()
    spkpr = ref.per_rank
    if mode == "lengths":
        made = KeyedJaggedTensor.from_lengths_sync(
            ref.keys, kjt.values(), kjt.lengths(), weights=flat_w, stride_per_key_per_rank=spkpr
        )
    else:
        made = KeyedJaggedTensor.from_offsets_sync(
            ref.keys, kjt.values(), kjt.offsets(), weights=flat_w, stride_per_key_per_rank=spkpr
        )
    assert made.length_per_key_or_none() == ref.length_per_key()
    assert_matches(made, ref)


def test_caches_and_views() -> None:
    kjt = KeyedJaggedTensor(
        ["a", "b"], torch.arange(5), lengths=torch.tensor([1, 0, 2, 2]), weights=torch.ones(5)
    )
    assert kjt.offsets_or_none() is None and kjt.length_per_key_or_none() is None
    assert kjt.offsets() is kjt.offsets()
    assert kjt.sync().length_per_key_or_none() == [1, 4]
    assert kjt.offset_per_key_or_none() == [0, 1, 5]
    assert kjt.permute([0, 1]).values() is kjt.values()  # identity permute: no copy
    assert kjt.split([2])[0] is kjt
    right = kjt.split([1, 1])[1]
    assert right.values().data_ptr() == kjt.values()[1:].data_ptr()  # split gives views
    assert kjt.to_dict()["b"].values().data_ptr() == right.values().data_ptr()


def test_empty_to_meta_and_text() -> None:
    empty = KeyedJaggedTensor.empty(is_weighted=True)
    empty.validate()
    assert empty.keys() == [] and empty.stride() == 0 and empty.to_dict() == {}
    assert empty.weights().numel() == 0
    assert KeyedJaggedTensor.from_jt_dict({}).keys() == []
    kjt = KeyedJaggedTensor(["f1", "f2"], torch.tensor([7, 8, 9]), lengths=torch.tensor([1, 2]))
    moved = kjt.to("meta")
    assert moved.device().type == "meta" and moved.keys() == ["f1", "f2"]
    assert kjt.to("cpu", dtype=torch.float16).stride() == 1
    assert "'f2': lengths=[2] values=[8, 9]" in str(kjt)
    assert "keys=['f1', 'f2']" in repr(kjt) and "stride=1" in repr(kjt)


def test_inverse_indices_travel_with_the_batch() -> None:
    inverse = (["a"], torch.tensor([[0, 1, 0]]))
    kjt = KeyedJaggedTensor(
        ["a"],
        torch.arange(3),
        lengths=torch.tensor([1, 2]),
        stride_per_key_per_rank=[[2]],
        inverse_indices=inverse,
    )
    assert kjt.inverse_indices()[1] is inverse[1]
    assert kjt.permute([0]).inverse_indices_or_none() is inverse
    with pytest.raises(ValueError, match="no inverse indices"):
        KeyedJaggedTensor.empty().inverse_indices()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for pinned memory/streams")
def test_pin_memory_to_cuda_and_record_stream() -> None:
    kjt = KeyedJaggedTensor(
        ["a", "b"], torch.arange(5), lengths=torch.tensor([1, 0, 2, 2]), weights=torch.ones(5)
    )
    pinned = kjt.pin_memory()
    assert pinned.values().is_pinned() and pinned.weights().is_pinned()
    cuda = pinned.to("cuda", non_blocking=True)
    cuda.record_stream(torch.cuda.current_stream())
    assert cuda.device().type == "cuda"
    assert cuda.permute([1, 0])["b"].values().tolist() == [1, 2, 3, 4]
    cuda.validate()


# ---- bad input ---------------------------------------------------------------------------


def kjt_of(lengths: list[int], n_values: int, keys: tuple[str, ...] = ("f1", "f2"), **kw):
    return KeyedJaggedTensor(
        list(keys), torch.arange(n_values), lengths=torch.tensor(lengths), **kw
    )


def test_too_few_values_names_key_and_amount() -> None:
    kjt = kjt_of([1, 1, 2, 3], 5)
    with pytest.raises(
        ValueError, match=r"add up to 7 but .* 5 entries \(2 too few values\); key 'f2'"
    ):
        kjt.validate()


def test_too_many_values_says_how_many() -> None:
    with pytest.raises(ValueError, match=r"\(3 values not covered by any bag\); the last key 'f2'"):
        kjt_of([1, 1, 0, 0], 5).validate()


def test_negative_length_names_key_and_sample() -> None:
    with pytest.raises(ValueError, match=r"lengths\[3\] = -1 is negative \(key 'f2', sample 1\)"):
        kjt_of([1, 1, 4, -1], 5).validate()


def test_negative_length_with_variable_stride() -> None:
    kjt = kjt_of([1, 1, 0, -1, 4], 5, stride_per_key_per_rank=[[1, 2], [2]])
    with pytest.raises(ValueError, match=r"\(key 'f2', sample 0\)"):
        kjt.validate()


def test_lengths_not_divisible_by_keys() -> None:
    with pytest.raises(
        ValueError, match=r"lengths has 3 entries, which is not a multiple of the 2 keys"
    ):
        kjt_of([1, 1, 1], 3)


def test_lengths_do_not_match_stride() -> None:
    with pytest.raises(ValueError, match=r"lengths has 4 entries but 2 keys x stride 3 = 6"):
        kjt_of([1, 1, 1, 1], 4, stride=3)


def test_stride_per_key_per_rank_mismatch() -> None:
    with pytest.raises(ValueError, match=r"adds up to 5 \(f1: 3, f2: 2\)"):
        kjt_of([1, 1, 1, 1], 4, stride_per_key_per_rank=[[1, 2], [2]])
    with pytest.raises(ValueError, match="has 1 entries but there are 2 keys"):
        kjt_of([1, 1, 1, 1], 4, stride_per_key_per_rank=[[4]])
    with pytest.raises(ValueError, match="key 'f2' has a negative batch size -1 on rank 1"):
        kjt_of([1, 1, 1, 1], 4, stride_per_key_per_rank=[[2, 1], [2, -1]])


def test_weights_of_wrong_length() -> None:
    with pytest.raises(ValueError, match=r"weights has shape \(3,\) but values has 4 entries"):
        kjt_of([1, 1, 1, 1], 4, weights=torch.ones(3))


def test_offsets_must_start_at_zero() -> None:
    kjt = KeyedJaggedTensor(["f1"], torch.arange(3), offsets=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match=r"offsets must start at 0 but offsets\[0\] = 1"):
        kjt.validate()


def test_offsets_must_not_decrease() -> None:
    kjt = KeyedJaggedTensor(["f1", "f2"], torch.arange(3), offsets=torch.tensor([0, 2, 3, 1, 3]))
    with pytest.raises(ValueError, match=r"offsets decrease .* \(key 'f2', sample 0\)"):
        kjt.validate()


def test_lengths_and_offsets_disagree() -> None:
    kjt = KeyedJaggedTensor(
        ["f1", "f2"], torch.arange(3), lengths=torch.tensor([1, 2]), offsets=torch.tensor([0, 2, 3])
    )
    with pytest.raises(
        ValueError, match=r"lengths\[0\] = 1 but offsets give 2 \(key 'f1', sample 0\)"
    ):
        kjt.validate()


def test_length_per_key_disagreeing_with_lengths_names_key() -> None:
    kjt = kjt_of([1, 2, 1, 0], 4, length_per_key=[2, 2])
    with pytest.raises(
        ValueError, match="length_per_key says key 'f1' has 2 values but its lengths add up to 3"
    ):
        kjt.validate()
    with pytest.raises(ValueError, match=r"length_per_key adds up to 5 but values has 4 entries"):
        kjt_of([1, 2, 1, 0], 4, length_per_key=[3, 2])


def test_duplicate_keys() -> None:
    with pytest.raises(ValueError, match="duplicate key 'f1' at positions 0 and 1"):
        kjt_of([1, 1], 2, keys=("f1", "f1"))


def test_float_values_rejected_by_validate() -> None:
    kjt = KeyedJaggedTensor(["f1"], torch.tensor([1.0, 2.0]), lengths=torch.tensor([2]))
    with pytest.raises(ValueError, match=r"values must be integer ids, got torch\.float32"):
        kjt.validate()


def test_values_must_be_1d_and_on_one_device() -> None:
    with pytest.raises(ValueError, match="values must be 1-D ids"):
        KeyedJaggedTensor(["f1"], torch.zeros(2, 2, dtype=torch.long), lengths=torch.tensor([2]))
    with pytest.raises(ValueError, match="different devices"):
        KeyedJaggedTensor(["f1"], torch.arange(2, device="meta"), lengths=torch.tensor([2]))


def test_unknown_key_lookup() -> None:
    with pytest.raises(KeyError, match="key 'zz' is not in this KeyedJaggedTensor"):
        kjt_of([1, 1], 2)["zz"]


def test_bad_split_and_permute_arguments() -> None:
    kjt = kjt_of([1, 1], 2)
    with pytest.raises(
        ValueError, match=r"segments \[1, 2\] must be >= 0 and add up to the 2 keys"
    ):
        kjt.split([1, 2])
    with pytest.raises(IndexError, match=r"indices\[1\] = 2 is out of range for the 2 keys"):
        kjt.permute([0, 2])


def test_concat_and_from_jt_dict_need_consistent_weights() -> None:
    weighted = kjt_of([1, 1], 2, weights=torch.ones(2))
    plain = kjt_of([1], 1, keys=("g",))
    with pytest.raises(ValueError, match=r"kjt_list\[1\] \(keys \['g'\]\) has no weights"):
        KeyedJaggedTensor.concat([weighted, plain])
    with pytest.raises(ValueError, match="kjt_list is empty"):
        KeyedJaggedTensor.concat([])
    jts = {
        "a": JaggedTensor(torch.arange(1), lengths=torch.tensor([1])),
        "b": JaggedTensor(torch.arange(1), weights=torch.ones(1), lengths=torch.tensor([1])),
    }
    with pytest.raises(ValueError, match="key 'a' has no weights but key 'b' has"):
        KeyedJaggedTensor.from_jt_dict(jts)


def test_sync_constructor_validates_eagerly() -> None:
    with pytest.raises(ValueError, match=r"\(key 'f1', sample 1\)"):
        KeyedJaggedTensor.from_lengths_sync(["f1"], torch.arange(3), torch.tensor([4, -1]))
