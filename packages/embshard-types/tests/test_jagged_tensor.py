"""JaggedTensor against plain-Python lists of bags, plus one test per bad input."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embshard_types.sparse.jagged import JaggedTensor

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def bag_cases(draw: st.DrawFn) -> tuple[list[list[float]], list[list[float]] | None, int, str]:
    """Random bags (0-6 samples of 0-5 values), optional weights, value width, build mode."""
    sizes = draw(st.lists(st.integers(0, 5), min_size=0, max_size=6))
    rng = random.Random(draw(st.integers(0, 2**16)))
    width = draw(st.sampled_from([0, 2]))  # 0: 1-D ids; 2: rows of 2 floats
    bags = [[float(rng.randrange(100)) for _ in range(n)] for n in sizes]
    weights = None
    if draw(st.booleans()):
        weights = [[rng.randrange(16) / 4 for _ in range(n)] for n in sizes]
    mode = draw(st.sampled_from(["lengths", "offsets", "both"]))
    return bags, weights, width, mode


def build(bags: list[list[float]], weights: list[list[float]] | None, width: int, mode: str):
    flat = [v for bag in bags for v in bag]
    values = torch.tensor(flat, dtype=torch.int64)
    if width:
        values = torch.tensor(flat, dtype=torch.float32).unsqueeze(1).repeat(1, width)
    lengths = torch.tensor([len(b) for b in bags], dtype=torch.int32)
    offsets = torch.tensor([0] + [sum(len(b) for b in bags[: i + 1]) for i in range(len(bags))])
    w = None if weights is None else torch.tensor([x for b in weights for x in b])
    return JaggedTensor(
        values,
        weights=w,
        lengths=lengths if mode != "offsets" else None,
        offsets=offsets if mode != "lengths" else None,
    )


def rows(bag: list[float], width: int) -> list:
    return [[v] * width for v in bag] if width else [int(v) for v in bag]


@SETTINGS
@given(bag_cases())
def test_accessors_and_dense(case) -> None:
    bags, weights, width, mode = case
    jt = build(bags, weights, width, mode)
    jt.validate()
    assert jt.lengths().tolist() == [len(b) for b in bags]
    assert jt.offsets().tolist() == [sum(len(b) for b in bags[:i]) for i in range(len(bags) + 1)]
    assert jt.lengths() is jt.lengths()  # derived once, cached
    assert [t.tolist() for t in jt.to_dense()] == [rows(b, width) for b in bags]
    dense_w = jt.to_dense_weights()
    if weights is None:
        assert dense_w is None and jt.weights_or_none() is None
    else:
        assert dense_w is not None and [t.tolist() for t in dense_w] == weights


@SETTINGS
@given(bag_cases(), st.sampled_from([None, 0, 2, 7]), st.sampled_from([0.0, -1.0]))
def test_to_padded_dense(case, desired: int | None, pad: float) -> None:
    bags, weights, width, mode = case
    jt = build(bags, weights, width, mode)
    longest = max((len(b) for b in bags), default=0)
    n = longest if desired is None else desired
    expected = [
        rows(b[:n], width) + [([pad] * width if width else pad)] * (n - len(b[:n])) for b in bags
    ]
    got = jt.to_padded_dense(desired, padding_value=pad)
    assert got.shape[:2] == (len(bags), n)
    assert got.tolist() == expected
    padded_w = jt.to_padded_dense_weights(desired, padding_value=pad)
    if weights is not None:
        assert padded_w is not None
        assert padded_w.tolist() == [w[:n] + [pad] * (n - len(w[:n])) for w in weights]


@SETTINGS
@given(bag_cases())
def test_from_dense_round_trips(case) -> None:
    bags, weights, width, mode = case
    jt = build(bags, weights, width, mode)
    again = JaggedTensor.from_dense(jt.to_dense(), jt.to_dense_weights())
    assert again.lengths().tolist() == jt.lengths().tolist()
    assert torch.equal(again.values(), jt.values()) or not bags
    padded = jt.to_padded_dense()
    w = jt.to_padded_dense_weights()
    back = JaggedTensor.from_dense_lengths(padded, jt.lengths(), weights=w)
    assert torch.equal(back.values(), jt.values())
    if w is not None:
        assert torch.equal(back.weights(), jt.weights())


def test_empty_and_devices() -> None:
    jt = JaggedTensor.empty(is_weighted=True)
    jt.validate()
    assert jt.lengths().numel() == 0 and jt.offsets().tolist() == [0]
    assert jt.to_dense() == [] and jt.to_padded_dense().shape == (0, 0)
    jt = JaggedTensor(torch.arange(3), lengths=torch.tensor([2, 1]))
    meta = jt.to("meta")
    assert meta.device().type == "meta" and meta.values().shape == (3,)
    assert "JaggedTensor" in repr(jt) and "[2, 1]" in str(jt)
    with pytest.raises(ValueError, match="weights_or_none"):
        jt.weights()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for pinned memory/streams")
def test_pin_memory_and_record_stream() -> None:
    jt = JaggedTensor(torch.arange(3), weights=torch.ones(3), lengths=torch.tensor([2, 1]))
    pinned = jt.pin_memory()
    assert pinned.values().is_pinned() and pinned.lengths().is_pinned()
    cuda = pinned.to("cuda", non_blocking=True)
    cuda.record_stream(torch.cuda.current_stream())
    assert cuda.to_dense()[0].tolist() == [0, 1]


# ---- bad input ---------------------------------------------------------------------------


def test_needs_lengths_or_offsets() -> None:
    with pytest.raises(ValueError, match="give lengths or offsets"):
        JaggedTensor(torch.arange(3))


def test_weights_of_wrong_length() -> None:
    with pytest.raises(ValueError, match=r"weights has shape \(2,\) but values has 3"):
        JaggedTensor(torch.arange(3), weights=torch.ones(2), lengths=torch.tensor([3]))


def test_lengths_must_be_integer_1d() -> None:
    with pytest.raises(ValueError, match="lengths must be an integer tensor"):
        JaggedTensor(torch.arange(3), lengths=torch.tensor([3.0]))
    with pytest.raises(ValueError, match="lengths must be 1-D"):
        JaggedTensor(torch.arange(3), lengths=torch.tensor([[3]]))


def test_offsets_and_lengths_count_mismatch() -> None:
    with pytest.raises(ValueError, match="offsets has 2 entries but lengths has 2"):
        JaggedTensor(torch.arange(3), lengths=torch.tensor([1, 2]), offsets=torch.tensor([0, 3]))


def test_validate_negative_length_names_sample() -> None:
    jt = JaggedTensor(torch.arange(3), lengths=torch.tensor([2, 3, -2]))
    with pytest.raises(ValueError, match=r"lengths\[2\] = -2 is negative \(sample 2\)"):
        jt.validate()


def test_validate_sum_mismatch_says_by_how_much() -> None:
    with pytest.raises(ValueError, match=r"add up to 5 but values has 3 entries \(2 too few"):
        JaggedTensor(torch.arange(3), lengths=torch.tensor([2, 3])).validate()
    with pytest.raises(ValueError, match=r"add up to 1 but values has 3 entries \(2 values not"):
        JaggedTensor(torch.arange(3), lengths=torch.tensor([1, 0])).validate()


def test_validate_offsets() -> None:
    with pytest.raises(ValueError, match=r"offsets must start at 0 but offsets\[0\] = 1"):
        JaggedTensor(torch.arange(3), offsets=torch.tensor([1, 3])).validate()
    with pytest.raises(ValueError, match=r"offsets decrease .* \(sample 1\)"):
        JaggedTensor(torch.arange(3), offsets=torch.tensor([0, 3, 2, 3])).validate()
    jt = JaggedTensor(
        torch.arange(3), lengths=torch.tensor([1, 2]), offsets=torch.tensor([0, 2, 3])
    )
    with pytest.raises(ValueError, match=r"lengths\[0\] = 1 but offsets give 2 \(sample 0\)"):
        jt.validate()


def test_float_values_are_fine_for_embeddings() -> None:
    JaggedTensor(torch.rand(3, 4), lengths=torch.tensor([1, 2])).validate()
