"""K1 side by side, interleaved in one process: embshard's fused collection vs FBGEMM's TBE
called directly vs per-table ``nn.EmbeddingBag`` + sparse Adagrad, plus effective bandwidth
against a memory copy measured in the same process. ``embshard`` is the collection as a user gets
it (``backend="auto"``: the fused path chosen on this machine, printed); ``embshard_torch`` forces
embshard's torch fast path, the other candidate of that choice.

Each round runs every contender once (A B C A B C ...); figures are medians after warm-up.
Usage: ``python benchmarks/k1_ratios.py [--rounds 15] [--warmup 3] [--threads 1] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch
from k1_contenders import embshard_collection, fbgemm_tbe, fused_path, torch_embedding_bags
from workloads import K1


def _time(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def copy_bandwidth(num_bytes: int = 256 * 2**20, repeat: int = 5) -> float:
    """Bytes per second of a tensor copy (read + write), median of ``repeat``."""
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    samples = [_time(lambda: dst.copy_(src)) for _ in range(repeat)]
    return 2 * num_bytes / statistics.median(samples)


def interleave(
    contenders: dict[str, Callable[[], None]], rounds: int, warmup: int
) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(rounds + warmup):
        for name, fn in contenders.items():
            t = _time(fn)
            if r >= warmup:
                samples[name].append(t)
    return {name: statistics.median(s) for name, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    w = K1()
    es_step, es_fwd = embshard_collection(w)
    et_step, et_fwd = embshard_collection(w, backend="torch")
    fb_step, fb_fwd = fbgemm_tbe(w)
    tb_step, tb_fwd = torch_embedding_bags(w)
    steps = interleave(
        {"embshard": es_step, "embshard_torch": et_step, "fbgemm": fb_step, "torch": tb_step},
        args.rounds,
        args.warmup,
    )
    fwds = interleave(
        {"embshard": es_fwd, "embshard_torch": et_fwd, "fbgemm": fb_fwd, "torch": tb_fwd},
        args.rounds,
        args.warmup,
    )
    bw = copy_bandwidth()
    versions = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": args.threads,
    }
    try:
        import fbgemm_gpu

        versions["fbgemm_gpu"] = fbgemm_gpu.__version__
    except ImportError:
        pass
    result = {
        "workload": "K1",
        "machine": platform.processor() or platform.machine(),
        "versions": versions,
        "embshard_fused_path": fused_path(),
        "step_ms": {k: v * 1e3 for k, v in steps.items()},
        "forward_ms": {k: v * 1e3 for k, v in fwds.items()},
        "ratio_step_embshard_over_fbgemm": steps["embshard"] / steps["fbgemm"],
        "ratio_step_embshard_torch_over_fbgemm": steps["embshard_torch"] / steps["fbgemm"],
        "ratio_step_torch_over_embshard": steps["torch"] / steps["embshard"],
        "ratio_forward_embshard_over_fbgemm": fwds["embshard"] / fwds["fbgemm"],
        "copy_bandwidth_gbs": bw / 1e9,
        "forward_bandwidth_gbs": w.bytes_moved(backward=False) / fwds["embshard"] / 1e9,
        "step_bandwidth_gbs": w.bytes_moved(backward=True) / steps["embshard"] / 1e9,
    }
    print(f"K1 on {result['machine']}, {versions}")
    print(f"embshard's fused path: {result['embshard_fused_path']}")
    print(f"{'':14} {'step ms':>9} {'forward ms':>11}")
    for name in steps:
        print(f"{name:14} {steps[name] * 1e3:9.1f} {fwds[name] * 1e3:11.1f}")
    print(
        f"embshard / FBGEMM step     {result['ratio_step_embshard_over_fbgemm']:.3f}  (target <= 1.10)"
    )
    print(
        f"torch / embshard step      {result['ratio_step_torch_over_embshard']:.2f}  (target >= 2)"
    )
    print(
        f"embshard_torch / FBGEMM step {result['ratio_step_embshard_torch_over_fbgemm']:.3f}  "
        "(the torch fast path forced)"
    )
    print(f"embshard / FBGEMM forward  {result['ratio_forward_embshard_over_fbgemm']:.3f}")
    print(
        f"bandwidth: copy {result['copy_bandwidth_gbs']:.1f} GB/s, forward {result['forward_bandwidth_gbs']:.1f} GB/s "
        f"({result['forward_bandwidth_gbs'] / result['copy_bandwidth_gbs']:.0%}), "
        f"step {result['step_bandwidth_gbs']:.1f} GB/s"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
