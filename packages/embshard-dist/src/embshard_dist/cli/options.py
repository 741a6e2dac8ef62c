"""What the ``embshard`` sub-commands share on their command lines: argument types, help format.

Each type function takes the option's text and returns its value, or raises
``argparse.ArgumentTypeError``, which argparse prints as ``argument --x: <message>`` with the
usage and exit status 2, before any work (or any process) starts. :class:`DefaultsHelpFormatter`
makes ``--help`` show every option's default.
"""

from __future__ import annotations

import argparse
import math
import textwrap

__all__ = [
    "DefaultsHelpFormatter",
    "check_divides",
    "fraction",
    "non_negative_int",
    "positive_int",
]


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` that names every option's default.

    argparse's ``(default: X)``, unless the help already says ``(default ...)`` or ``default:``;
    ``(required)`` after a required option instead. Lines never break inside a hyphenated word
    (``sparse-dist`` stays whole).
    """

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.required:
            return f"{text} (required)" if action.option_strings else text
        if "(default" in text or "default:" in text:
            return text
        return super()._get_help_string(action)


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def fraction(text: str) -> float:
    """A finite number in ``[0, 1)``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}") from None
    if not math.isfinite(value) or not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text}")
    return value


def check_divides(
    parser: argparse.ArgumentParser, world_size: int | None, local_world_size: int | None
) -> None:
    """Exit through ``parser.error`` unless ``--local-world-size`` divides ``--world-size``."""
    if world_size is not None and local_world_size is not None and world_size % local_world_size:
        parser.error(
            f"--local-world-size {local_world_size} must divide --world-size {world_size} "
            "(ranks per node, every node the same size)"
        )
