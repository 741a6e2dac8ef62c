"""``embshard data``: write synthetic Criteo-format days, and convert TSV days to NumPy.

* ``embshard data synth --out DIR``: ``day_0`` .. ``day_{N-1}`` TSV files whose clicks follow a
  hidden model of the features (deterministic from ``--seed``);
* ``embshard data preprocess --in DIR --out DIR``: every ``day_N`` TSV file of the input folder
  to ``day_N_{dense,sparse,labels}.npy``, streamed.

Exit status: 0 when written; 2 for bad options, missing inputs or malformed lines.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from embshard_dist.cli.options import DefaultsHelpFormatter, non_negative_int, positive_int
from embshard_dist.data.criteo_convert import DEFAULT_CHUNK_ROWS, preprocess_tsv
from embshard_dist.data.criteo_format import CAT_FEATURE_COUNT, HASH_MODES, CriteoTransform
from embshard_dist.data.criteo_synth import write_synthetic_criteo
from embshard_dist.data.criteo_tsv import find_tsv_days


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers separated by commas, got {text!r}"
        ) from None
    if len(sizes) == 1:
        sizes *= CAT_FEATURE_COUNT
    if len(sizes) != CAT_FEATURE_COUNT or min(sizes) <= 0:
        raise argparse.ArgumentTypeError(
            f"expected one positive size or {CAT_FEATURE_COUNT} comma-separated ones, got {text!r}"
        )
    return sizes


def _rate(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a rate in [0, 1), got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``embshard data`` parser with its ``synth`` and ``preprocess`` sub-commands."""
    fmt = DefaultsHelpFormatter
    p = argparse.ArgumentParser(
        prog="embshard data", description=__doc__.split("\n")[0], formatter_class=fmt
    )
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    s = sub.add_parser("synth", help="write synthetic Criteo-format TSV days", formatter_class=fmt)
    s.add_argument("--out", required=True, help="folder to write day_0 .. day_N-1 into")
    s.add_argument("--days", type=positive_int, default=2, help="days (files) to write")
    s.add_argument("--rows-per-day", type=positive_int, default=10_000, help="lines per day")
    s.add_argument(
        "--seed", type=non_negative_int, default=0, help="seed of the data and its hidden model"
    )
    s.add_argument(
        "--missing-rate", type=_rate, default=0.05, help="chance a feature field is empty"
    )
    s.add_argument(
        "--vocab-size",
        type=positive_int,
        default=1000,
        help="category values per feature (at most)",
    )
    c = sub.add_parser(
        "preprocess", help="convert TSV days to the NumPy format", formatter_class=fmt
    )
    c.add_argument("--in", dest="inp", required=True, help="folder of day_N TSV files")
    c.add_argument("--out", required=True, help="folder for day_N_{dense,sparse,labels}.npy")
    c.add_argument(
        "--num-embeddings",
        type=_sizes,
        default=_sizes("100000"),
        help=f"table size: one for all, or {CAT_FEATURE_COUNT} comma-separated (default: "
        "100000 for each)",
    )
    c.add_argument("--hash", choices=HASH_MODES, default="mod", help="how ids map to rows")
    c.add_argument(
        "--frequency-threshold",
        type=non_negative_int,
        default=0,
        help="ids seen fewer times share row 0 (0: off)",
    )
    c.add_argument("--no-log", action="store_true", help="keep dense features raw (no log(x+1))")
    c.add_argument(
        "--chunk-rows", type=positive_int, default=DEFAULT_CHUNK_ROWS, help="rows per write"
    )
    return p


def run(argv: Sequence[str]) -> int:
    """Run the command; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        if args.action == "synth":
            paths = write_synthetic_criteo(
                args.out,
                days=args.days,
                rows_per_day=args.rows_per_day,
                seed=args.seed,
                missing_rate=args.missing_rate,
                vocab_size=args.vocab_size,
            )
            print(f"wrote {len(paths)} days of {args.rows_per_day} rows to {args.out}")
            return 0
        days = find_tsv_days(args.inp)
        if not days:
            print(f"embshard data preprocess: no day_N files in {args.inp!r}", file=sys.stderr)
            return 2
        transform = CriteoTransform(
            args.num_embeddings, hash_mode=args.hash, log_dense=not args.no_log
        )
        preprocess_tsv(
            days,
            args.out,
            transform,
            frequency_threshold=args.frequency_threshold,
            chunk_rows=args.chunk_rows,
            progress=print,
        )
        return 0
    except (OSError, ValueError) as e:
        print(f"embshard data {args.action}: {e}", file=sys.stderr)
        return 2


main = run
