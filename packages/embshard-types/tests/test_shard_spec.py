"""ShardSpec: validation, placement parsing, dict and torch round trips."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embshard_types.shard_spec import ShardSpec


def test_fields_and_placement() -> None:
    spec = ShardSpec([0, 4], [10, 4], "rank:3/cuda:3")  # type: ignore[arg-type]
    assert spec.offsets == (0, 4) and spec.sizes == (10, 4)
    assert spec.rank == 3 and spec.device == "cuda:3"
    assert ShardSpec((0,), (1,), "rank:12").device == "cpu"
    assert hash(spec) == hash(ShardSpec((0, 4), (10, 4), "rank:3/cuda:3"))


def test_on() -> None:
    assert ShardSpec.on(2, "cuda", (0, 0), (1, 1)).placement == "rank:2/cuda:2"
    assert ShardSpec.on(2, "cuda:0", (0, 0), (1, 1)).placement == "rank:2/cuda:0"
    assert ShardSpec.on(1, "cpu", (0, 0), (1, 1)).placement == "rank:1/cpu"


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        (((0,), (1, 2), "rank:0/cpu"), ValueError, "have different lengths"),
        (((-1,), (1,), "rank:0/cpu"), ValueError, "must be non-negative"),
        (((0.5,), (1,), "rank:0/cpu"), TypeError, "shard offsets must be ints"),
        (((0,), (True,), "rank:0/cpu"), TypeError, "shard sizes must be ints"),
        (("00", (1, 1), "rank:0/cpu"), TypeError, "shard offsets must be a sequence of ints"),
        (((0,), (1,), "cuda:0"), ValueError, "is not of the form 'rank:R/DEVICE'"),
        (((0,), (1,), "rank:²/cpu"), ValueError, "is not of the form 'rank:R/DEVICE'"),
        (((0,), (1,), "rank:1/"), ValueError, "is not of the form 'rank:R/DEVICE'"),
        (((0,), (1,), 3), ValueError, "is not of the form 'rank:R/DEVICE'"),
    ],
)
def test_invalid_specs(args: tuple[Any, ...], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        ShardSpec(*args)


def test_from_dict_errors() -> None:
    with pytest.raises(ValueError, match="lacks field 'placement'"):
        ShardSpec.from_dict({"offsets": [0], "sizes": [1]})
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['rank'\]"):
        ShardSpec.from_dict({"offsets": [0], "sizes": [1], "placement": "rank:0/cpu", "rank": 0})
    with pytest.raises(TypeError, match="must be a mapping"):
        ShardSpec.from_dict([0, 1])  # type: ignore[arg-type]


specs = st.integers(1, 3).flatmap(
    lambda n: st.builds(
        ShardSpec,
        st.tuples(*[st.integers(0, 1 << 40)] * n),
        st.tuples(*[st.integers(0, 1 << 40)] * n),
        st.builds(
            lambda r, d: f"rank:{r}/{d}",
            st.integers(0, 4096),
            st.sampled_from(["cpu", "cuda:0", "cuda:7", "mtia:1"]),
        ),
    )
)


@settings(max_examples=80, deadline=None)
@given(specs)
def test_dict_and_torch_round_trips(spec: ShardSpec) -> None:
    assert ShardSpec.from_dict(spec.to_dict()) == spec
    assert ShardSpec.from_torch(spec.to_torch()) == spec
