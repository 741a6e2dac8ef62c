"""KJTChecker: every broken layout, dtype, weight and id is found and named; good ones pass."""

from __future__ import annotations

import pytest
import torch

from embshard_types.sparse.input_problems import (
    IdOutOfRangeError,
    InputProblem,
    InvalidInputTypeError,
    Problem,
)
from embshard_types.sparse.jagged import JaggedTensor
from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
from embshard_types.sparse.kjt_checks import KJTChecker

FEATURES, ROWS, TABLES = ["a", "b"], [10, 5], {"a": "ta", "b": "tb"}
W = torch.ones(4)
V = torch.tensor([1, 2, 3, 4])
L = torch.tensor([1, 1, 1, 1])


def _kjt(**kw: object) -> KeyedJaggedTensor:
    args: dict = {"keys": ["a", "b"], "values": V, "weights": W, "lengths": L}
    args.update(kw)
    if "offsets" in kw and "lengths" not in kw:
        args.pop("lengths")
    return KeyedJaggedTensor(**args)


CASES = {
    "negative length": (
        _kjt(lengths=torch.tensor([1, -1, 3, 1])),
        Problem.NEGATIVE_LENGTH,
        "feature 'a' (table 'ta'), sample 1: lengths[1] = -1 is negative",
    ),
    "too few lengths": (
        _kjt(lengths=torch.tensor([1, 1, 1, 0])),
        Problem.UNCOVERED_VALUES,
        "1 values not in any bag",
    ),
    "too many lengths": (
        _kjt(lengths=torch.tensor([1, 1, 1, 2])),
        Problem.TOO_FEW_VALUES,
        "feature 'b' (table 'tb'): the lengths add up to 5",
    ),
    "offsets from 1": (
        _kjt(offsets=torch.tensor([1, 1, 2, 3, 4])),
        Problem.OFFSETS_NOT_FROM_ZERO,
        "offsets[0] = 1",
    ),
    "decreasing offsets": (
        _kjt(offsets=torch.tensor([0, 2, 1, 3, 4])),
        Problem.OFFSETS_DECREASE,
        "offsets decrease from offsets[1] = 2 to offsets[2] = 1",
    ),
    "lengths and offsets differ": (
        _kjt(offsets=torch.tensor([0, 1, 2, 4, 4]), lengths=L),
        Problem.LENGTHS_OFFSETS_DIFFER,
        "lengths[2] = 1 but the offsets give 2",
    ),
    "nan weight": (
        _kjt(weights=torch.tensor([1.0, 1.0, float("nan"), 1.0])),
        Problem.WEIGHT_NOT_FINITE,
        "feature 'b' (table 'tb'), sample 0: weights[2] is nan",
    ),
    "id too large": (
        _kjt(values=torch.tensor([1, 2, 3, 5])),
        Problem.ID_OUT_OF_RANGE,
        "sample 1: id 5 is not below the table's 5 rows",
    ),
    "negative id": (
        _kjt(values=torch.tensor([1, -2, 3, 4])),
        Problem.ID_OUT_OF_RANGE,
        "id -2 is negative",
    ),
    "float ids": (_kjt(values=V.float()), Problem.IDS_NOT_INTEGER, "float32"),
    "int weights": (
        _kjt(weights=torch.ones(4, dtype=torch.int64)),
        Problem.WEIGHTS_NOT_FLOAT,
        "int64",
    ),
    "missing feature": (
        _kjt(keys=["a", "x"]),
        Problem.MISSING_FEATURE,
        "feature 'b' (table 'tb') is missing from the input",
    ),
    "no weights": (_kjt(weights=None), Problem.WEIGHTS_MISSING, "no weights"),
    "not a kjt": ({"a": 1}, Problem.NOT_A_KJT, "not a KeyedJaggedTensor"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_problem_is_found_and_named(case: str) -> None:
    kjt, code, fragment = CASES[case]
    problem = KJTChecker(FEATURES, ROWS, weighted=True).check(kjt)
    assert problem is not None and problem.code is code
    message = problem.message(FEATURES, TABLES, rank=3)
    assert message.startswith("the input on rank 3: ") and fragment in message, message
    assert InputProblem.decode(problem.encode()) == problem


def test_good_batches_pass_in_any_key_order_and_extra_keys_are_ignored() -> None:
    checker = KJTChecker(FEATURES, ROWS, weighted=True)
    assert checker.check(_kjt()) is None
    assert checker.check(_kjt(offsets=torch.tensor([0, 1, 2, 3, 4]), lengths=L)) is None
    # An unused key may hold anything a layout allows: big or negative ids, nan weights.
    extra = KeyedJaggedTensor(
        ["x", "b", "a"],
        torch.tensor([-7, 2, 3, 4, 1, 1]),
        weights=torch.tensor([float("inf"), 1, 1, 1, 1, 1]),
        lengths=torch.ones(6, dtype=torch.int64),
    )
    assert checker.check(extra) is None
    empty = KeyedJaggedTensor(
        ["a", "b"],
        torch.empty(0, dtype=torch.int64),
        weights=torch.empty(0),
        lengths=torch.zeros(4, dtype=torch.int32),
    )
    assert checker.check(empty) is None


def test_errors_have_the_builtin_types_callers_expect() -> None:
    checker = KJTChecker(FEATURES, ROWS, weighted=True)
    for kjt, kind in ((_kjt(values=V.float()), TypeError), (_kjt(values=V + 10), IndexError)):
        problem = checker.check(kjt)
        assert problem is not None
        error = problem.error(FEATURES, TABLES)
        assert isinstance(error, kind) and isinstance(error, ValueError)
    assert issubclass(IdOutOfRangeError, IndexError)
    assert issubclass(InvalidInputTypeError, TypeError)


def test_jagged_to_dense_names_lengths_that_do_not_fit() -> None:
    with pytest.raises(ValueError, match="1 too few values"):
        JaggedTensor(torch.arange(4), lengths=torch.tensor([2, 3])).to_dense()
    with pytest.raises(ValueError, match=r"lengths\[1\] = -1 is negative"):
        JaggedTensor(torch.arange(4), lengths=torch.tensor([2, -1, 3])).to_dense()


def test_each_key_is_held_to_its_own_table_even_when_a_key_is_empty() -> None:
    # Tables of 100, 5 and 50 rows: an id legal in one table is out of range in another.
    checker = KJTChecker(["a", "b", "c"], [100, 5, 50], weighted=False)

    def batch(values: list[int], lengths: list[int]) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(
            ["a", "b", "c"], torch.tensor(values), lengths=torch.tensor(lengths)
        )

    assert checker.check(batch([99, 4, 49], [1, 0, 1, 0, 1, 0])) is None
    assert checker.check(batch([99, 49], [1, 0, 0, 0, 1, 0])) is None  # 'b' has no ids
    for values, lengths, feature, position, value in (
        ([3, 7, 49], [1, 0, 1, 0, 1, 0], 1, 1, 7),  # 7 fits 'a' and 'c', not 'b'
        ([99, 60], [1, 0, 0, 0, 0, 1], 2, 1, 60),  # 'b' empty, 'c' over
        ([100, 4, 4], [0, 1, 2, 0, 0, 0], 0, 0, 100),  # 'c' empty, 'a' over
    ):
        problem = checker.check(batch(values, lengths))
        assert problem is not None and problem.code is Problem.ID_OUT_OF_RANGE
        assert (problem.feature, problem.position, problem.value) == (feature, position, value)


@pytest.mark.parametrize("per_key", [3, 7_000])  # below and above the per-key-max threshold
def test_large_and_small_batches_hold_each_key_to_its_table(per_key: int) -> None:
    checker = KJTChecker(["a", "b", "c"], [100, 5, 50], weighted=False)
    g = torch.Generator().manual_seed(0)
    good = [torch.randint(0, rows, (per_key,), generator=g) for rows in (100, 5, 50)]
    lengths = torch.tensor([per_key, 0, per_key, 0, per_key, 0])

    def batch(values: list[torch.Tensor]) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(["a", "b", "c"], torch.cat(values), lengths=lengths)

    assert checker.check(batch(good)) is None
    bad_b = good[1].clone()
    bad_b[-1] = 5  # fits 'a' and 'c', not 'b'
    problem = checker.check(batch([good[0], bad_b, good[2]]))
    assert problem is not None and problem.code is Problem.ID_OUT_OF_RANGE
    assert (problem.feature, problem.position, problem.value) == (1, 2 * per_key - 1, 5)
