"""The plain-text table formatter used to print plans."""

from __future__ import annotations

import pytest

from embshard_types.text_table import tabulate


def test_columns_are_as_wide_as_their_widest_cell() -> None:
    text = tabulate([["a", 1], ["longer", [0, 1]]], ["x", "y"])
    assert text.splitlines() == [
        "  x    |   y",
        "------ | ------",
        "a      | 1",
        "longer | [0, 1]",
    ]


def test_empty_table_prints_headers() -> None:
    assert tabulate([], ["param", "ranks"]) == "param | ranks\n----- | -----"


def test_row_of_the_wrong_length() -> None:
    with pytest.raises(ValueError, match="table row 1 has 1 cells but there are 2 headers"):
        tabulate([["a", "b"], ["c"]], ["x", "y"])
