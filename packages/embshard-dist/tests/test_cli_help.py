"""``--help`` of every ``embshard`` sub-command names every option's default (or says it is required)."""

from __future__ import annotations

import re

import pytest

from embshard_dist.cli import _COMMANDS, main
from embshard_dist.planner.cost_model import DEFAULT_RESERVE_FRACTION

HELP_COMMANDS = [
    ["info"],
    ["train"],
    ["plan"],
    ["calibrate"],
    ["checkpoint"],
    ["checkpoint", "inspect"],
    ["checkpoint", "export"],
    ["checkpoint", "import"],
    ["data"],
    ["data", "synth"],
    ["data", "preprocess"],
]


def _option_entries(help_text: str) -> dict[str, str]:
    """Option -> its help (whitespace joined) from the ``options:`` section of ``--help``."""
    section = help_text.split("\noptions:\n", 1)[1].split("\n\n", 1)[0]
    entries: dict[str, str] = {}
    for block in re.split(r"\n(?=  -)", section):
        words = block.split()
        entries[words[0].rstrip(",")] = " ".join(words)
    return entries


def test_every_command_has_its_help_checked() -> None:
    assert {argv[0] for argv in HELP_COMMANDS} == set(_COMMANDS)


@pytest.mark.parametrize("argv", HELP_COMMANDS, ids=" ".join)
def test_help_names_every_default(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    entries = _option_entries(capsys.readouterr().out)
    assert "-h" in entries
    for option, text in entries.items():
        if option != "-h":
            assert "(default" in text or "default:" in text or "(required)" in text, text


def test_defaults_are_the_parsers_and_not_repeated(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    entries = _option_entries(capsys.readouterr().out)
    assert entries["--search"].endswith("(default: auto)")
    assert entries["--reserve"].endswith(f"(default: {DEFAULT_RESERVE_FRACTION})")
    assert entries["--out"].endswith("(required)")
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    run_dir = _option_entries(capsys.readouterr().out)["--run-dir"]
    assert run_dir.count("default") == 1  # the help's own default, not argparse's "None" too
