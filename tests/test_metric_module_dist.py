"""TorchRec's metric module on 2 ranks: ``generate_metric_module`` with each rank's own batches.

Every rank's ``compute()`` equals the one-process metrics of the concatenated predictions,
lifetime and windowed (each rank keeping its latest ``ceil(window / 2)`` samples per task), for
NE, AUC, accuracy and calibration over two tasks read from ``model_out`` by name. Ranks get
unequal batch counts and sizes, and rank 1 no samples of one task after the first
``compute()`` (every ``compute()`` still reduces on both ranks); ``local_compute()`` gives each
rank its own samples' values. With
``compute_on_all_ranks=False`` only rank 0 gets the rec metric values. Each rank's
``state_dict()`` loaded into a fresh module gives the same lifetime values. The adjusted compute
interval is the largest the ranks propose. ``get_pre_compute_states`` gives every rank the sum
of the ranks' own states (a group, a ``DeviceMesh`` or the default), and a module on a group of
one rank that loads them computes what the two ranks compute; ``sync()`` swaps in the same sums
and refuses update and compute until ``unsync()`` gives each rank its own states back.
"""

from __future__ import annotations

import math
import re
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _mp import run_on_ranks, test_device
from test_metrics_dist import windowed
from torch.distributed.device_mesh import init_device_mesh

from embshard_dist.metrics import (
    AccuracyMetric,
    AUCMetric,
    CalibrationMetric,
    MetricsConfig,
    NEMetric,
    RecMetric,
    RecMetricDef,
    RecMetricEnum,
    RecMetricModule,
    RecTaskInfo,
    ThroughputDef,
    generate_metric_module,
)

COMPUTE_BEFORE_UPDATE = "The ``compute`` method of metric"  # torchmetrics: no update since load

WORLD = 2
BATCH = 24
WINDOW = 60  # each rank keeps its latest 30 samples per task
TASKS = [
    RecTaskInfo(name="click", label_name="y_click", prediction_name="p_click", weight_name="w"),
    RecTaskInfo(name="like", label_name="y_like", prediction_name="p_like", weight_name=""),
]
SIZES = {0: [24, 24, 24, 10], 1: [24, 7, 24]}  # per rank, per update
FIRST = 2  # updates before the first compute()
THRESHOLD = 0.6
Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def config(**changes: Any) -> MetricsConfig:
    fields: dict[str, Any] = {
        "rec_tasks": TASKS,
        "rec_metrics": {
            RecMetricEnum.NE: RecMetricDef(rec_task_indices=[0, 1], window_size=WINDOW),
            RecMetricEnum.AUC: RecMetricDef(rec_task_indices=[0, 1], window_size=WINDOW),
            RecMetricEnum.ACCURACY: RecMetricDef(
                rec_tasks=TASKS, window_size=WINDOW, arguments={"threshold": THRESHOLD}
            ),
            RecMetricEnum.CALIBRATION: RecMetricDef(rec_tasks=TASKS, window_size=WINDOW),
        },
        "throughput_metric": ThroughputDef(window_size=100, warmup_steps=1),
        "compute_on_all_ranks": True,
    }
    return MetricsConfig(**{**fields, **changes})


def model_outs(rank: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + rank)
    outs = []
    for step, n in enumerate(SIZES[rank]):
        click = (torch.rand(n, generator=g) * 40).round() / 41 + 0.01  # ties across ranks
        like = torch.rand(n, 1, generator=g)
        if rank == 1 and step >= FIRST:
            like = like[:0]  # rank 1 has no "like" sample after the first compute()
        outs.append(
            {
                "p_click": click,
                "y_click": (torch.rand(n, generator=g) < click).float(),
                "w": torch.rand(n, generator=g) * 2 + 0.1,
                "p_like": like,
                "y_like": (torch.rand(len(like), generator=g) < like.reshape(-1)).float(),
            }
        )
    return outs


def task_batches(rank: int, task: RecTaskInfo, upto: int | None = None) -> list[Batch]:
    out = []
    for o in model_outs(rank)[:upto]:
        p = o[task.prediction_name].reshape(-1)
        w = o[task.weight_name] if task.weight_name else torch.ones(len(p))
        if len(p):
            out.append((p, o[task.label_name], w))
    return out


def one_process(per_task: dict[str, list[Batch]], prefix: str) -> dict[str, float]:
    """One process's metrics (no group) of each task's concatenated batches, under ``prefix``."""
    out: dict[str, float] = {}
    for task, batches in per_task.items():
        p, y, w = (torch.cat([b[i] for b in batches]) for i in range(3))
        metrics: list[RecMetric] = [
            NEMetric([task]),
            AUCMetric([task]),
            AccuracyMetric([task], threshold=THRESHOLD),
            CalibrationMetric([task]),
        ]
        for m in metrics:
            m.update(p, y, w)
            key = f"{m.namespace}-{task}|lifetime_{m.metric_name}"
            out[key.replace("|lifetime_", f"|{prefix}_")] = float(m.compute()[key])
    return out


def expected(upto: int | None = None) -> dict[str, float]:
    local = math.ceil(WINDOW / WORLD)
    lifetime = {t.name: [b for r in range(WORLD) for b in task_batches(r, t, upto)] for t in TASKS}
    window = {
        t.name: [b for r in range(WORLD) for b in windowed(task_batches(r, t, upto), local)]
        for t in TASKS
    }
    return {**one_process(lifetime, "lifetime"), **one_process(window, "window")}


def generate(cfg: MetricsConfig, **kwargs: Any) -> RecMetricModule:
    return generate_metric_module(
        metric_class=RecMetricModule,
        metrics_config=cfg,
        batch_size=BATCH,
        world_size=dist.get_world_size(),
        my_rank=dist.get_rank(),
        state_metrics_mapping={},
        device=test_device(),
        **kwargs,
    )


def floats(values: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in values.items()}


def _on_rank(all_ranks: bool) -> dict[str, dict[str, float]]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", COMPUTE_BEFORE_UPDATE, UserWarning)
        return _run_module(all_ranks)


def _run_module(all_ranks: bool) -> dict[str, dict[str, float]]:
    module = generate(config(compute_on_all_ranks=all_ranks))
    device = test_device()
    results = {}
    for step, out in enumerate(model_outs(dist.get_rank())):
        if step == FIRST:
            results["first"] = floats(module.compute())
        module.update({k: v.to(device) for k, v in out.items()})
    results["final"] = floats(module.compute())
    results["local"] = floats(module.local_compute())  # this rank's samples alone
    restored = generate(config(compute_on_all_ranks=all_ranks))
    restored.load_state_dict(module.state_dict())
    results["restored"] = floats(restored.compute())
    return results


def _close(got: dict[str, float], want: dict[str, float]) -> None:
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_every_rank_gets_the_metrics_of_the_concatenated_predictions() -> None:
    results = run_on_ranks(WORLD, _on_rank, True)
    for rank in range(WORLD):
        own = {t.name: task_batches(rank, t) for t in TASKS}
        _close(results[rank].pop("local"), one_process(own, "local_lifetime"))
    for name, values in results[0].items():  # every rank, the same values (an empty window: NaN)
        other = results[1][name]
        assert values.keys() == other.keys()
        assert all(
            v == other[k] or (math.isnan(v) and math.isnan(other[k])) for k, v in values.items()
        )
    got = results[0]
    want_first, want_final = expected(FIRST), expected()
    assert set(want_final) <= set(got["final"]) and len(want_final) == 16
    _close(got["first"], want_first)
    _close(got["final"], want_final)
    # the batches each rank keeps differ from all batches: the window is a real check
    assert got["final"]["ne-click|window_ne"] != pytest.approx(got["final"]["ne-click|lifetime_ne"])
    steps = sum(len(s) for s in SIZES.values())
    assert got["first"]["throughput-throughput|total_examples"] == WORLD * FIRST * BATCH
    assert got["final"]["throughput-throughput|total_examples"] == steps * BATCH
    assert "throughput-throughput|lifetime_throughput" in got["final"]
    # each rank's state_dict, loaded into a fresh module: the same lifetime values
    _close(got["restored"], {k: v for k, v in want_final.items() if "lifetime" in k})


def test_compute_on_rank_zero_only() -> None:
    results = run_on_ranks(WORLD, _on_rank, False)
    _close(results[0]["final"], expected())
    assert all(k.startswith("throughput-") for k in results[1]["final"])  # rank 1: no rec keys
    assert "throughput-throughput|total_examples" in results[1]["final"]


def _adjust_on_rank() -> int:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", COMPUTE_BEFORE_UPDATE, UserWarning)
        return _adjust()


def _adjust() -> int:
    rank = dist.get_rank()
    now = [50.0]
    module = generate(
        config(compute_interval_steps=10, min_compute_interval=5.0),
        module_kwargs={"clock": lambda: now[0]},
    )
    module.compute()
    now[0] += 1.0 + rank  # 10 steps: 0.1 s a step on rank 0 (60 steps), 0.2 s on rank 1 (30)
    module.compute()
    return module.compute_interval_steps


def test_the_adjusted_compute_interval_is_the_largest_proposed() -> None:
    assert run_on_ranks(WORLD, _adjust_on_rank) == [60, 60]


# ---- pre-compute states and sync across ranks ---------------------------------------------

SMALL_AUC = {RecMetricEnum.AUC: RecMetricDef(rec_task_indices=[0, 1], window_size=WINDOW,
                                             arguments={"num_bins": 1024})}  # fmt: skip
States = dict[str, dict[str, dict[str, torch.Tensor]]]


def small_config() -> MetricsConfig:
    """``config()`` with small AUC tables (they travel back to the test process)."""
    return config(rec_metrics={**config().rec_metrics, **SMALL_AUC})


def cpu(states: States) -> States:
    return {ns: {t: {k: v.cpu() for k, v in s.items()} for t, s in ts.items()} for ns, ts in states.items()}  # fmt: skip


def updated_module() -> RecMetricModule:
    module = generate(small_config())
    for out in model_outs(dist.get_rank()):
        module.update({k: v.to(test_device()) for k, v in out.items()})
    return module


def _pre_compute_on_rank() -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", COMPUTE_BEFORE_UPDATE, UserWarning)
        return _pre_compute()


def _pre_compute() -> dict[str, Any]:
    rank = dist.get_rank()
    singles = [dist.new_group([r]) for r in range(WORLD)]  # every rank joins every new_group
    both = dist.new_group(list(range(WORLD)))
    mesh = init_device_mesh(test_device().type, (WORLD,), mesh_dim_names=("shard",))
    module = updated_module()
    summed = module.get_pre_compute_states(both)
    loader = generate_metric_module(
        metric_class=RecMetricModule,
        metrics_config=small_config(),
        batch_size=BATCH,
        world_size=1,
        my_rank=0,
        state_metrics_mapping={},
        device=test_device(),
        process_group=singles[rank],  # metrics that do not reduce again
    )
    loader.load_pre_compute_states(summed)
    return {
        "own": cpu(module.get_pre_compute_states(singles[rank])),
        "summed": cpu(summed),
        "mesh": cpu(module.get_pre_compute_states(mesh)),
        "default": cpu(module.get_pre_compute_states()),
        "computed": floats(module.compute()),
        "loaded": floats(loader.compute()),
    }


def _leaves(states: States) -> dict[tuple[str, str, str], torch.Tensor]:
    return {(ns, t, k): v for ns, ts in states.items() for t, s in ts.items() for k, v in s.items()}


def _same(a: dict[str, float], b: dict[str, float]) -> bool:
    return a.keys() == b.keys() and all(
        (math.isnan(v) and math.isnan(b[k])) or v == pytest.approx(b[k], rel=1e-12, abs=0)
        for k, v in a.items()
    )


def test_pre_compute_states_are_the_sums_over_the_ranks_and_load_elsewhere() -> None:
    results = run_on_ranks(WORLD, _pre_compute_on_rank)
    own = [_leaves(r["own"]) for r in results]
    assert len(own[0]) == 2 * (2 + 2 + 2 + 2) + 9  # lifetime and window per metric and task
    assert not torch.equal(own[0][("ne", "click", "lifetime")], own[1][("ne", "click", "lifetime")])
    for result in results:
        for name in ("summed", "mesh", "default"):
            got = _leaves(result[name])
            assert got.keys() == own[0].keys()
            for key, value in got.items():  # the sum of each rank's own states, on every rank
                assert torch.allclose(value, own[0][key] + own[1][key], rtol=1e-12, atol=0), key
    throughput = _leaves(results[0]["summed"])
    steps = sum(len(s) for s in SIZES.values())
    assert float(throughput[("throughput", "throughput", "total_examples")]) == steps * BATCH
    assert float(throughput[("throughput", "throughput", "warmup_examples")]) == WORLD * BATCH
    for result in results:  # a module of one rank, loaded, computes what the two ranks do
        assert _same(result["loaded"], result["computed"])
    assert "throughput-throughput|attempt_throughput" in results[0]["loaded"]
    want = expected()
    for key in ("ne-click|lifetime_ne", "calibration-like|window_calibration"):
        assert results[0]["loaded"][key] == pytest.approx(want[key], rel=1e-9)


def _sync_on_rank() -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", COMPUTE_BEFORE_UPDATE, UserWarning)
        return _sync()


def _refusal(call: Any) -> str:
    try:
        call()
    except RuntimeError as e:
        return str(e)
    return "no error"


def _sync() -> dict[str, Any]:
    module = updated_module()
    window = module.rec_metrics[0].computation("click")  # NE of click
    own_window = window.window_table().cpu()
    before = floats(module.compute())
    local = {k: v.cpu().clone() for k, v in module.state_dict().items()}
    module.sync()
    synced = {k: v.cpu().clone() for k, v in module.state_dict().items()}
    synced_window = window.window.cpu().clone()
    out = model_outs(dist.get_rank())[0]
    refusals = [
        _refusal(lambda: module.update({k: v.to(test_device()) for k, v in out.items()})),
        _refusal(module.compute),
        _refusal(module.sync),
        _refusal(module.get_pre_compute_states),
    ]
    module.unsync()
    return {
        "local": local,
        "synced": synced,
        "own_window": own_window,
        "synced_window": synced_window,
        "refusals": refusals,
        "unsynced": {k: v.cpu() for k, v in module.state_dict().items()},
        "before": before,
        "after": floats(module.compute()),  # update and compute work again
    }


def test_sync_swaps_in_the_sums_over_the_ranks_until_unsync() -> None:
    results = run_on_ranks(WORLD, _sync_on_rank)
    local = [r["local"] for r in results]
    for result in results:
        for key, value in result["synced"].items():
            if key.startswith("throughput_metric."):  # not synced, as in TorchRec
                assert torch.equal(value, result["local"][key]), key
            else:
                assert torch.allclose(value, local[0][key] + local[1][key], rtol=1e-12, atol=0)
        own = results[0]["own_window"] + results[1]["own_window"]
        assert torch.allclose(result["synced_window"], own, rtol=1e-12, atol=0)
        assert all(torch.equal(v, result["local"][k]) for k, v in result["unsynced"].items())
        update, compute, sync, states = result["refusals"]
        assert re.search(r"RecMetricModule.update: .*since sync\(\); call unsync\(\) first", update)
        assert re.search(r"RecMetricModule.compute: .*call unsync\(\) first", compute)
        assert "RecMetricModule.sync: already synced" in sync
        assert "RecMetricModule.get_pre_compute_states: " in states
        assert _same(result["after"], result["before"])
    assert not torch.equal(local[0]["rec_metrics.rec_metrics.0.computations.0.lifetime"],
                           local[1]["rec_metrics.rec_metrics.0.computations.0.lifetime"])  # fmt: skip
