"""The plain-text table style of every printed table (plans, planner stats, checkpoints)."""

from __future__ import annotations

import pytest

from embshard_types.text_table import tabulate


def test_columns_are_as_wide_as_their_widest_cell_and_numbers_align_right() -> None:
    text = tabulate(
        [["a", 1, "1.5 KiB", [0, 1]], ["longer", 120, "-", "x"]],
        ["x", "count", "memory", "y"],
        title="title:",
    )
    assert text.splitlines() == [
        "title:",
        "x      | count |  memory | y",
        "------ | ----- | ------- | ------",
        "a      |     1 | 1.5 KiB | [0, 1]",
        "longer |   120 |       - | x",
    ]


def test_numbers_with_units_align_right_but_text_with_digits_does_not() -> None:
    lines = tabulate([["2.00 ms", "0,1", True], ["13.50 ms", "rank:0/cpu", False]], ["a", "b", "c"])
    assert lines.splitlines()[2:] == [
        " 2.00 ms | 0,1        | True",
        "13.50 ms | rank:0/cpu | False",
    ]


def test_a_table_without_rows_is_one_line_instead() -> None:
    assert tabulate([], ["param", "ranks"]) == "none"
    assert tabulate([], ["param", "ranks"], title="per table:", empty="no tables") == (
        "per table: no tables"
    )


def test_row_of_the_wrong_length() -> None:
    with pytest.raises(ValueError, match="table row 1 has 1 cells but there are 2 headers"):
        tabulate([["a", "b"], ["c"]], ["x", "y"])
