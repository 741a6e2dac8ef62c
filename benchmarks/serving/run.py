"""Serving benchmark: latency (p50, p99) and throughput of a DLRM on W2's tables, and peak memory.

Usage (in the environment that has TorchRec: ``nox -s serving``, or after ``nox -s compare --
--help`` ``.nox/compare/bin/python -m benchmarks.serving.run``)::

    python -m benchmarks.serving.run [--batches 1 64 512] [--seconds 10] [--threads 1]

Latency: every variant (``models.VARIANTS``) is built in this process; for each batch size the
variants' forwards run interleaved (one forward of each in turn, starting with a different one
each round) under ``torch.inference_mode``, for about ``--seconds`` per batch size, after a
warm-up; p50 / p99 per forward and throughput = batch / mean. Outputs are compared first:
embshard's and TorchRec's fp32 models must agree exactly, and their INT8 and INT4 models too; a
compiled, scripted or packaged variant (``+compiled``, ``+script``, ``+aoti``, see ``models``)
agrees with its eager model within ``COMPILED_TOLERANCE`` (Inductor fuses and reorders float
operations). A variant that cannot serve (TorchRec's quantized model under ``torch.compile``)
is reported with its error. Each embshard row gives its ratio to TorchRec's eager model of the
same data type and, where measured, to TorchRec's TorchScript one (its own serving form).
Memory: each variant in a fresh process, its peak resident memory (``VmHWM``) growth from
after the imports to after building the model and serving one batch of 64; embshard's quantized
variants are built as a server would, from a quantized export (``embshard checkpoint export
--quantize``), its packaged ones by loading their package, TorchRec's by quantizing its float
model (its own path). Results go to ``benchmarks/results/serving/``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.serving import models

RESULTS = Path(__file__).resolve().parents[1] / "results" / "serving"
COMPILED_TOLERANCE = 1e-4
"""Largest |difference| allowed between a compiled variant's logits and its eager model's."""
DEFAULT_VARIANTS = [
    *models.VARIANTS,
    "embshard-fp32+compiled",
    "embshard-int8+compiled",
    "embshard-int4+compiled",
    "embshard-fp32+aoti",
    "embshard-int8+aoti",
    "embshard-int4+aoti",
    "torchrec-int8+compiled",
    "torchrec-fp32+script",
    "torchrec-int8+script",
    "torchrec-int4+script",
]


def _check_outputs(built: dict[str, Any]) -> dict[str, float]:
    """Largest difference of each pair that must agree, on one batch of 64: embshard and
    TorchRec of one data type, and a compiled variant and its eager model."""
    batch = models.batches(64, 1, seed=99)[0]
    with torch.inference_mode():
        out = {v: model(*inputs(batch)) for v, (model, inputs) in built.items()}
    pairs = {}
    for dtype in ("fp32", "int8", "int4"):
        a, b = f"embshard-{dtype}", f"torchrec-{dtype}"
        if a in out and b in out:
            pairs[f"{a} vs {b}"] = float((out[a] - out[b]).abs().max())
    for v in out:
        eager = models.eager_of(v)
        if v != eager and eager in out:
            pairs[f"{v} vs {eager}"] = float((out[v] - out[eager]).abs().max())
    return pairs


def _build(variants: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """The variants that build and serve a first batch, and why each other one did not."""
    built, errors = {}, {}
    probe = models.batches(8, 1, seed=98)[0]
    for v in variants:
        try:
            model, inputs = models.build(v)
            with torch.inference_mode():
                model(*inputs(probe))
        except Exception as e:  # e.g. TorchRec's quantized model under torch.compile
            lines = str(e).strip().splitlines()
            errors[v] = f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]
            continue
        built[v] = (model, inputs)
    return built, errors


def latency(
    variants: list[str], sizes: list[int], seconds: float, warmup: int = 5
) -> dict[str, Any]:
    built, errors = _build(variants)
    variants = [v for v in variants if v in built]
    agreement = _check_outputs(built)
    results: dict[str, Any] = {"agreement": agreement, "errors": errors, "by_batch": {}}
    for size in sizes:
        requests = models.batches(size, 16, seed=size)
        inputs = {v: [built[v][1](b) for b in requests] for v in variants}
        times: dict[str, list[float]] = {v: [] for v in variants}
        with torch.inference_mode():
            for v in variants:
                for i in range(warmup):
                    built[v][0](*inputs[v][i % len(requests)])
            deadline = time.perf_counter() + seconds
            round_ = 0
            while time.perf_counter() < deadline or round_ < 10:
                order = variants[round_ % len(variants) :] + variants[: round_ % len(variants)]
                for v in order:
                    args = inputs[v][round_ % len(requests)]
                    start = time.perf_counter()
                    built[v][0](*args)
                    times[v].append(time.perf_counter() - start)
                round_ += 1
        results["by_batch"][size] = {
            v: {
                "p50_ms": 1e3 * statistics.median(ts),
                "p99_ms": 1e3 * sorted(ts)[min(len(ts) - 1, int(0.99 * len(ts)))],
                "throughput": size / statistics.fmean(ts),
                "forwards": len(ts),
            }
            for v, ts in times.items()
        }
    return results


_MEMORY = """
import json, re, sys, torch
torch.set_num_threads(1)
from benchmarks.serving import models
variant, export = sys.argv[1], sys.argv[2]
import embshard_dist.models.dlrm, embshard_kernels.quantize, embshard_dist.checkpoint.export
if variant.startswith("torchrec"):
    import torchrec, torchrec.models.dlrm, torchrec.quant.embedding_modules
if variant.endswith(models.AOTI):
    import embshard_kernels.serving, torch._inductor.package
def status(key):
    return int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
batch = models.batches(64, 1)[0]
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = status("VmRSS")
library, dtype = models.eager_of(variant).split("-")
if variant.endswith(models.AOTI):
    from embshard_kernels.serving import load_for_serving
    from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
    model = load_for_serving(f"{export}/{variant}.pt2")
    inputs = lambda b: (b.dense, KeyedJaggedTensor.from_lengths_sync(list(b.keys), b.values, b.lengths))
elif library == "embshard" and dtype != "fp32":
    model = models.embshard_served_from_export(f"{export}/{dtype}", dtype)
    from embshard_types.sparse.keyed_jagged import KeyedJaggedTensor
    inputs = lambda b: (b.dense, KeyedJaggedTensor.from_lengths_sync(list(b.keys), b.values, b.lengths))
else:
    model, inputs = models.build(variant)
with torch.inference_mode():
    model(*inputs(batch))
print(json.dumps({"peak_growth": status("VmHWM") - base, "resident": status("VmRSS") - base}))
"""


def _exports(root: Path, dtypes: list[str]) -> None:
    """Quantized exports of the fp32 model, through a checkpoint (the offline serving path)."""
    from embshard_dist.checkpoint.export import export_checkpoint
    from embshard_dist.checkpoint.import_ import import_state_dict

    model = models.embshard_model("fp32")
    torch.save(model.state_dict(), root / "model.pt")
    del model
    import_state_dict(root / "model.pt", root / "ckpt")
    (root / "model.pt").unlink()
    for dtype in dtypes:
        export_checkpoint(root / "ckpt", root / dtype, optimizer=False, quantize=dtype)


def _packages(root: Path, variants: list[str]) -> None:
    """The ``+aoti`` variants' packages, ``root/<variant>.pt2``, made from the eager models."""
    from embshard_kernels.serving import package_for_serving

    for v in variants:
        model, inputs = models.build(models.eager_of(v))
        package_for_serving(model, inputs(models.batches(64, 1, seed=97)[0]), root / f"{v}.pt2")
        del model


def memory(variants: list[str]) -> dict[str, Any]:
    """Peak memory of each eager and each packaged variant (a compiled one holds the same
    tables as its eager model); a packaged one is loaded from its file, as a server does."""
    variants = [v for v in variants if models.eager_of(v) == v or v.endswith(models.AOTI)]
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(dir=RESULTS) as tmp:
        eager = [v for v in variants if models.eager_of(v) == v]
        dtypes = sorted({v.split("-")[1] for v in eager if v.startswith("embshard")} - {"fp32"})
        _exports(Path(tmp), dtypes)
        _packages(Path(tmp), [v for v in variants if v.endswith(models.AOTI)])
        for v in variants:
            proc = subprocess.run(
                [sys.executable, "-c", _MEMORY, v, tmp],
                capture_output=True,
                text=True,
                check=False,
                cwd=Path(__file__).resolve().parents[2],
            )
            if proc.returncode != 0:
                out[v] = {"error": proc.stderr.strip().splitlines()[-1]}
                continue
            out[v] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def report(result: dict[str, Any]) -> str:
    lines = ["agreement (largest |difference| of outputs, batch 64):"]
    lines += [f"  {pair}: {diff:.3g}" for pair, diff in result["latency"]["agreement"].items()]
    for v, why in result["latency"]["errors"].items():
        lines.append(f"  {v}: could not serve: {why}")
    for size, rows in result["latency"]["by_batch"].items():
        lines.append(f"\nbatch {size}:")
        lines.append(
            "| variant | p50 ms | p99 ms | samples/s | vs TorchRec same dtype (p50) "
            "| vs TorchRec scripted (p50) |"
        )
        lines.append("| --- | --- | --- | --- | --- | --- |")
        for v, r in rows.items():
            peer = models.eager_of(v).replace("embshard", "torchrec")
            ratios = [
                f"{r['p50_ms'] / rows[p]['p50_ms']:.2f}"
                if v.startswith("embshard") and p in rows
                else ""
                for p in (peer, peer + models.SCRIPTED)
            ]
            lines.append(
                f"| {v} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['throughput']:.0f} | "
                + " | ".join(ratios)
                + " |"
            )
    if "memory" in result:
        lines.append("\npeak resident memory growth (MB), build + one batch of 64:")
        fp32 = {
            lib: result["memory"].get(f"{lib}-fp32", {}).get("peak_growth")
            for lib in ("embshard", "torchrec")
        }
        for v, m in result["memory"].items():
            if "error" in m:
                lines.append(f"  {v}: error: {m['error']}")
                continue
            base = fp32.get(v.split("-")[0])
            rel = f" ({m['peak_growth'] / base:.2f} x its fp32)" if base else ""
            lines.append(f"  {v}: {m['peak_growth'] / 2**20:.0f}{rel}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.serving.run",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 512])
    parser.add_argument("--seconds", type=float, default=10.0, help="timed seconds per batch size")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    parser.add_argument("--no-memory", action="store_true", help="skip the memory processes")
    args = parser.parse_args(argv)
    unknown = [v for v in args.variants if not models.is_variant(v)]
    if unknown:
        parser.error(
            f"unknown variants {unknown}; choose from {list(models.VARIANTS)}, each optionally "
            f"with one of {list(models.SERVING_FORMS)}"
        )
    torch.set_num_threads(args.threads)
    RESULTS.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "threads": args.threads,
        "loadavg": os.getloadavg(),
        "latency": latency(args.variants, args.batches, args.seconds),
    }
    if not args.no_memory:
        result["memory"] = memory(args.variants)
    text = report(result)
    print(text)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (RESULTS / f"serving-{stamp}.json").write_text(json.dumps(result, indent=1))
    (RESULTS / f"serving-{stamp}.md").write_text(text + "\n")
    bad = {
        k: v
        for k, v in result["latency"]["agreement"].items()
        if v > (COMPILED_TOLERANCE if any(f in k for f in models.SERVING_FORMS) else 0.0)
    }
    if bad:
        print(f"outputs differ: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["latency", "main", "memory", "report"]
