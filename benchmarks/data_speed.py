"""How fast the Criteo NumPy reader feeds a rank, against what ``embshard train`` consumes.

Usage (the workspace environment)::

    uv run python benchmarks/data_speed.py [--rows 200000] [--steps 40] [--nproc 2]

It writes generated Criteo TSV days (``embshard data synth``), preprocesses them to TorchRec's
NumPy format with W2's table sizes (Criteo's 26 hash sizes capped at 200,000 rows,
``embshard data preprocess``), then measures

* the reader: one rank's ``CriteoIterDataset(NpySource(...), 512)`` of ``--nproc`` ranks,
  iterated to the end in this process (samples per second of that rank);
* the consumer: ``embshard train --data criteo-npy:DIR --tables W2.json`` on ``--nproc``
  processes, batch 512 per rank, 128-wide tables (its summary's steps per second, checkpoint-
  and evaluation-free, times 512: samples per second per rank).

The ratio reader / consumer is what issue 18 asks to be at least 5.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

W2_SIZES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
CAP = 200_000
BATCH = 512


def _embshard(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "embshard_dist.cli", *args], check=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000, help="rows per generated day")
    parser.add_argument("--steps", type=int, default=40, help="training steps to time")
    parser.add_argument("--nproc", type=int, default=2, help="training processes")
    args = parser.parse_args()
    sizes = [min(s, CAP) for s in W2_SIZES]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _embshard("data", "synth", "--out", str(root / "tsv"), "--days", "2",
                  "--rows-per-day", str(args.rows), "--vocab-size", "100000")  # fmt: skip
        _embshard("data", "preprocess", "--in", str(root / "tsv"), "--out", str(root / "npy"),
                  "--num-embeddings", ",".join(map(str, sizes)))  # fmt: skip
        reader = _reader_rate(root / "npy", sizes, args.nproc)
        spec = {
            "batch_size": BATCH,
            "tables": [
                {"name": f"t{i}", "rows": rows, "dim": 128, "features": [f"cat_{i}"]}
                for i, rows in enumerate(sizes)
            ],
        }
        (root / "w2.json").write_text(json.dumps(spec))
        summary = root / "summary.json"
        _embshard("train", "--data", f"criteo-npy:{root / 'npy'}", "--tables", str(root / "w2.json"),
                  "--nproc", str(args.nproc), "--batch-size", str(BATCH), "--steps",
                  str(args.steps), "--eval-every", "0", "--run-dir", str(root / "run"),
                  "--json", str(summary))  # fmt: skip
        result = json.loads(summary.read_text())
    steps_per_s = float(result["steps_per_s"])
    consumer = steps_per_s * BATCH
    print(
        f"reader: {reader:,.0f} samples/s per rank; embshard train on W2-sized tables "
        f"({args.nproc} ranks): {steps_per_s:.2f} steps/s = {consumer:,.0f} samples/s per rank; "
        f"reader / consumer = {reader / consumer:.1f}"
    )
    return 0


def _reader_rate(folder: Path, sizes: list[int], world: int) -> float:
    from embshard_dist.data.criteo_dataset import CriteoIterDataset
    from embshard_dist.data.criteo_npy import NpySource

    source = NpySource(folder, days=[0], num_embeddings_per_feature=sizes)
    dataset = CriteoIterDataset(source, BATCH, rank=0, world_size=world)
    for _ in zip(range(4), dataset, strict=False):  # warm the page cache and the code paths
        pass
    dataset = CriteoIterDataset(source, BATCH, rank=0, world_size=world)
    samples, start = 0, time.perf_counter()
    for batch in dataset:
        samples += int(batch.labels.numel())
    return samples / (time.perf_counter() - start)


if __name__ == "__main__":
    sys.exit(main())
