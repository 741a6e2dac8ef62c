"""TorchRec's metric module on one process: ``generate_metric_module`` / ``RecMetricModule``.

Values equal embshard's metric classes fed the same tensors directly, and direct formulas; tasks
are read from ``model_out`` by their ``RecTaskInfo`` names; every bad input raises before any
state changes; ``state_dict`` round-trips the lifetime tables; a script written for
``torchrec.metrics`` runs with only its import lines changed.
"""

from __future__ import annotations

import dataclasses
import io
import math
from typing import Any

import pytest
import torch

from embshard_dist.metrics import (
    AccuracyMetric,
    AUCMetric,
    CalibrationMetric,
    DefaultMetricsConfig,
    DeferrableMetrics,
    MetricsConfig,
    NEMetric,
    RecMetric,
    RecMetricDef,
    RecMetricEnum,
    RecMetricException,
    RecMetricList,
    RecMetricModule,
    RecTaskInfo,
    StateMetric,
    StateMetricEnum,
    ThroughputDef,
    ThroughputMetric,
    WarmupThroughputMetric,
    generate_metric_module,
)
from embshard_dist.metrics.ne import cross_entropy_sum

# a metric computed with no update since its reset or load: torchmetrics warns, the values stand
pytestmark = pytest.mark.filterwarnings("ignore:The ``compute`` method of metric:UserWarning")

CLICK = RecTaskInfo(
    name="click", label_name="click_label", prediction_name="click_pred", weight_name="click_w"
)
LIKE = RecTaskInfo(
    name="like", label_name="like_label", prediction_name="like_pred", weight_name=""
)
BATCH = 16
WINDOW = 40  # the window keeps the latest 2 batches of 16 (40 samples would not fit 3)
CPU = torch.device("cpu")


def config(**changes: Any) -> MetricsConfig:
    """NE, AUC, accuracy (threshold 0.4), calibration over two tasks, one by index."""
    base = MetricsConfig(
        rec_tasks=[CLICK, LIKE],
        rec_metrics={
            RecMetricEnum.NE: RecMetricDef(rec_tasks=[CLICK, LIKE], window_size=WINDOW),
            RecMetricEnum.AUC: RecMetricDef(rec_task_indices=[0, 1], window_size=WINDOW),
            RecMetricEnum.ACCURACY: RecMetricDef(
                rec_task_indices=[0, 1], window_size=WINDOW, arguments={"threshold": 0.4}
            ),
            RecMetricEnum.CALIBRATION: RecMetricDef(rec_tasks=[CLICK], window_size=WINDOW),
        },
        compute_interval_steps=2,
    )
    return dataclasses.replace(base, **changes)


def generate(cfg: MetricsConfig | None = None, **kwargs: Any) -> RecMetricModule:
    args: dict[str, Any] = {
        "metric_class": RecMetricModule,
        "metrics_config": config() if cfg is None else cfg,
        "batch_size": BATCH,
        "world_size": 1,
        "my_rank": 0,
        "state_metrics_mapping": {},
        "device": CPU,
    }
    return generate_metric_module(**{**args, **kwargs})


def model_out(seed: int, n: int = BATCH) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    click = torch.rand(n, 1, generator=g)  # [B, 1] predictions with [B] labels, as models give
    like = torch.rand(n, generator=g)
    return {
        "click_pred": click,
        "click_label": (torch.rand(n, generator=g) < click.squeeze(1)).float(),
        "click_w": torch.rand(n, generator=g) + 0.5,
        "like_pred": like,
        "like_label": (torch.rand(n, generator=g) < like).float(),
        "unused": torch.zeros(3),
    }


def direct_metrics(batches: list[dict[str, torch.Tensor]]) -> list[RecMetric]:
    """The same metrics as ``config()``, fed the tensors directly."""
    metrics: list[RecMetric] = [
        NEMetric(["click", "like"], window_size=WINDOW),
        AUCMetric(["click", "like"], window_size=WINDOW),
        AccuracyMetric(["click", "like"], threshold=0.4, window_size=WINDOW),
        CalibrationMetric(["click"], window_size=WINDOW),
    ]
    for out in batches:
        preds = {"click": out["click_pred"], "like": out["like_pred"]}
        labels = {"click": out["click_label"], "like": out["like_label"]}
        weights = {"click": out["click_w"], "like": torch.ones(len(out["like_pred"]))}
        for m in metrics:
            m.update(
                {t: preds[t] for t in m.tasks},
                {t: labels[t] for t in m.tasks},
                {t: weights[t] for t in m.tasks},
            )
    return metrics


def floats(values: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in values.items()}


def close(a: dict[str, float], b: dict[str, float]) -> bool:
    return a.keys() == b.keys() and all(
        (math.isnan(a[k]) and math.isnan(b[k])) or a[k] == pytest.approx(b[k], rel=1e-12, abs=0)
        for k in a
    )


def test_values_equal_the_metric_classes_and_direct_formulas() -> None:
    module = generate()
    batches = [model_out(s) for s in range(5)]
    for out in batches:
        module.update(out)
    got = floats(module.compute())
    expected: dict[str, float] = {}
    for m in direct_metrics(batches):
        expected.update(floats(m.compute()))
    assert close(got, expected)
    assert len(got) == 2 * (2 + 2 + 2 + 1)  # lifetime and window, per metric and task

    # direct formulas, lifetime (all batches) and window (the latest two)
    for prefix, used in (("lifetime", batches), ("window", batches[-2:])):
        p = torch.cat([b["click_pred"].reshape(-1) for b in used]).double()
        y = torch.cat([b["click_label"] for b in used]).double()
        w = torch.cat([b["click_w"] for b in used]).double()
        pos, neg = float((w * y).sum()), float((w * (1 - y)).sum())
        q = pos / (pos + neg)
        ce = float((-w * (y * torch.log2(p) + (1 - y) * torch.log2(1 - p))).sum())
        ne = ce / (-pos * math.log2(q) - neg * math.log2(1 - q))
        assert got[f"ne-click|{prefix}_ne"] == pytest.approx(ne, rel=1e-12)
        cal = float((w * p).sum() / (w * y).sum())
        assert got[f"calibration-click|{prefix}_calibration"] == pytest.approx(cal, rel=1e-12)
        right = ((p >= 0.4).double() == y).double()
        acc = float((w * right).sum() / w.sum())
        assert got[f"accuracy-click|{prefix}_accuracy"] == pytest.approx(acc, rel=1e-12)
    # ``like`` has weight_name "": unit weights
    p = torch.cat([b["like_pred"] for b in batches]).double()
    y = torch.cat([b["like_label"] for b in batches]).double()
    assert got["accuracy-like|lifetime_accuracy"] == pytest.approx(
        float(((p >= 0.4).double() == y).double().mean()), rel=1e-12
    )


def test_local_compute_equals_compute_on_one_process() -> None:
    module = generate()
    for s in range(3):
        module.update(model_out(s))
    got = floats(module.compute())
    local = floats(module.local_compute())
    assert local.keys() == {k.replace("|", "|local_") for k in got}
    assert close(local, {k.replace("|", "|local_"): v for k, v in got.items()})


def test_should_compute_every_interval_and_reset_forgets() -> None:
    module = generate()
    seen = []
    for s in range(5):
        seen.append(module.should_compute())
        module.update(model_out(s))
    assert seen == [True, False, True, False, True]  # trained_batches 0..4, interval 2
    assert module.trained_batches == 5
    module.reset()
    module.update(model_out(9))
    fresh = generate()
    fresh.update(model_out(9))
    assert close(floats(module.compute()), floats(fresh.compute()))


def test_default_config_is_torchrecs() -> None:
    assert RecTaskInfo() == RecTaskInfo("DefaultTask", "label", "prediction", "weight")
    assert RecMetricDef().window_size == 10_000_000
    assert ThroughputDef() == ThroughputDef(window_size=100, warmup_steps=100)
    cfg = MetricsConfig()
    assert (cfg.compute_interval_steps, cfg.compute_on_all_ranks) == (100, False)
    assert (cfg.min_compute_interval, cfg.max_compute_interval) == (0.0, float("inf"))
    assert list(DefaultMetricsConfig.rec_metrics) == [RecMetricEnum.NE]
    assert str(RecMetricEnum.NE) == "ne" and str(StateMetricEnum.OPTIMIZERS) == "optimizers"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.compute_interval_steps = 5  # type: ignore[misc]

    module = generate(DefaultMetricsConfig)
    module.update({"label": torch.ones(BATCH), "prediction": torch.full((BATCH,), 0.75),
                   "weight": torch.ones(BATCH)})  # fmt: skip
    got = module.compute()
    assert set(got) == {
        "ne-DefaultTask|lifetime_ne",
        "ne-DefaultTask|window_ne",
        "throughput-throughput|total_examples",  # rates follow after 100 warm-up steps
        "throughput-throughput|attempt_examples",  # TorchRec 1.8 reports it always
    }
    assert float(got["throughput-throughput|total_examples"]) == BATCH
    assert float(got["throughput-throughput|attempt_examples"]) == BATCH


def test_throughput_warmup_and_rates() -> None:
    module = generate(config(throughput_metric=ThroughputDef(window_size=60, warmup_steps=2)))
    module.update(model_out(0))
    assert "throughput-throughput|lifetime_throughput" not in module.compute()
    module.update(model_out(1))
    module.update(model_out(2))
    got = module.compute()
    assert float(got["throughput-throughput|total_examples"]) == 3 * BATCH
    assert {"throughput-throughput|lifetime_throughput", "throughput-throughput|window_throughput"} <= set(got)  # fmt: skip

    now = [0.0]
    throughput = WarmupThroughputMetric(8, warmup_steps=2, window_seconds=1.5, clock=lambda: now[0])
    for t in (1.0, 2.0, 3.0, 5.0):  # warm-up at 1 s and 2 s; the rates count from 2 s
        now[0] = t
        throughput.update()
    values = floats(throughput.compute())
    assert values["throughput-throughput|total_examples"] == 32
    assert values["throughput-throughput|lifetime_throughput"] == pytest.approx(16 / 3)
    assert values["throughput-throughput|window_throughput"] == pytest.approx(8 / 1.5)


class LearningRate(StateMetric):  # as a TorchRec user subclasses torchrec's StateMetric
    def get_metrics(self) -> dict[str, float]:
        return {"lr": 0.25}


def test_state_metrics_are_reported_under_their_namespace() -> None:
    cfg = config(state_metrics=[StateMetricEnum.OPTIMIZERS])
    module = generate(cfg, state_metrics_mapping={StateMetricEnum.OPTIMIZERS: LearningRate()})
    module.update(model_out(0))
    assert module.compute()["optimizers-optimizers|lr"] == 0.25
    with pytest.raises(ValueError, match=r"state_metrics_mapping has no component for it"):
        generate(cfg)


def test_compute_interval_is_adjusted_once_from_the_measured_step_time() -> None:
    now = [100.0]
    module = generate(
        config(compute_interval_steps=10, min_compute_interval=5.0),
        module_kwargs={"clock": lambda: now[0]},
    )
    module.update(model_out(0))
    module.compute()
    now[0] += 1.0  # 10 steps took 1 s: 0.1 s a step; aim at min + 1 s = 6 s
    module.compute()
    assert module.compute_interval_steps == 60
    now[0] += 100.0
    module.compute()  # adjusted once only
    assert module.compute_interval_steps == 60

    inside = generate(
        config(compute_interval_steps=10, max_compute_interval=50.0),
        module_kwargs={"clock": lambda: now[0]},
    )
    inside.compute()
    now[0] += 20.0  # inside [0, 50]: kept
    inside.compute()
    assert inside.compute_interval_steps == 10


# ---- bad input: a clear error, and nothing changes ----------------------------------------


def snapshot(module: RecMetricModule) -> tuple[int, dict[str, float]]:
    return module.trained_batches, floats(module.local_compute())


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda o: o.pop("like_label"), r"task 'like': model_out has no label 'like_label'.*click_w"),
        (lambda o: o.pop("click_pred"), r"no prediction 'click_pred'"),
        (lambda o: o.pop("click_w"), r"no weight 'click_w'"),
        (lambda o: o.update(like_pred=torch.rand(BATCH + 1)), r"like_pred.*\(17,\).*like_label.*\(16,\)"),
        (lambda o: o.update(click_w=torch.rand(3)), r"click_w'\] \(3,\).*one value per sample"),
        (lambda o: o.update(like_label=torch.full((BATCH,), 2.0)), r"labels must be in \[0, 1\]"),
        (lambda o: o.update(like_pred=[0.5] * BATCH), r"like_pred.*must be a tensor"),
    ],
)  # fmt: skip
def test_bad_model_out_raises_before_any_state_changes(mutate: Any, message: str) -> None:
    module = generate()
    module.update(model_out(0))
    before = snapshot(module)
    out = model_out(1)
    mutate(out)
    with pytest.raises(ValueError, match=message):
        module.update(out)
    assert close(snapshot(module)[1], before[1]) and module.trained_batches == before[0]


def test_a_task_with_empty_tensors_is_left_out_of_that_batch() -> None:
    module = generate()
    out = model_out(0)
    out.update(like_pred=torch.empty(0), like_label=torch.empty(0))
    module.update(out)
    got = floats(module.compute())
    assert math.isnan(got["ne-like|lifetime_ne"])  # no sample yet
    assert not math.isnan(got["ne-click|lifetime_ne"])


@pytest.mark.parametrize(
    ("cfg", "kwargs", "error", "message"),
    [
        (config(rec_metrics={RecMetricEnum.MSE: RecMetricDef(rec_tasks=[CLICK])}), {}, ValueError,
         r"RecMetricEnum.MSE is not computed by embshard; it computes RecMetricEnum.NE, "
         r"RecMetricEnum.AUC, RecMetricEnum.ACCURACY, RecMetricEnum.CALIBRATION"),
        (config(rec_metrics={RecMetricEnum.AUC: RecMetricDef(rec_tasks=[CLICK], arguments={"apply_bin": True})}),
         {}, ValueError, r"\['apply_bin'\] not taken; AUCMetric takes \['num_bins'\]"),
        (config(rec_metrics={RecMetricEnum.NE: RecMetricDef()}), {}, ValueError,
         r"rec_tasks and rec_task_indices are both empty"),
        (config(rec_metrics={RecMetricEnum.NE: RecMetricDef(rec_tasks=[CLICK], rec_task_indices=[0])}),
         {}, ValueError, r"not both"),
        (config(rec_metrics={RecMetricEnum.NE: RecMetricDef(rec_tasks=[dataclasses.replace(CLICK, label_name="y")])}),
         {}, ValueError, r"task 'click' is defined twice, differently"),
        (config(rec_metrics={RecMetricEnum.NE: RecMetricDef(rec_tasks=[CLICK], window_size=10)}),
         {}, ValueError, r"window of 10 samples, less than batch_size 16"),
        (config(should_validate_update=True), {}, ValueError, r"should_validate_update is not supported"),
        (config(), {"batch_size_stages": [object()]}, ValueError, r"batch_size_stages is not supported"),
        (config(), {"world_size": 2, "my_rank": 1}, ValueError,
         r"world_size=2, my_rank=1, but the process group has 1 rank"),
        (config(), {"metric_class": torch.nn.Module}, TypeError, r"metric_class must be"),
    ],
)  # fmt: skip
def test_bad_config_raises_a_clear_error(
    cfg: MetricsConfig, kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        generate(cfg, **kwargs)


def test_config_errors_at_construction() -> None:
    with pytest.raises(ValueError, match=r"refers to rec_tasks\[2\], but rec_tasks has 2 tasks"):
        config(rec_metrics={RecMetricEnum.NE: RecMetricDef(rec_task_indices=[2])})
    MetricsConfig(
        rec_metrics={RecMetricEnum.NDCG: RecMetricDef(rec_tasks=[CLICK])}
    )  # fine until used
    with pytest.raises(ValueError, match=r"metric 'ne' has task 'other', but rec_tasks has no"):
        RecMetricModule(
            BATCH, 1, rec_tasks=[CLICK], rec_metrics=RecMetricList([NEMetric(["other"])])
        )
    with pytest.raises(ValueError, match=r"two metrics would report ne-click"):
        RecMetricList([NEMetric(["click"]), NEMetric(["click", "like"])])


def test_compute_on_rank_zero_only_still_reduces_everywhere() -> None:
    batch = model_out(0)
    lists = {
        rank: RecMetricList([NEMetric(["click"])], my_rank=rank, compute_on_all_ranks=False)
        for rank in (0, 1)
    }
    for metrics in lists.values():
        metrics.update(
            predictions={"click": batch["click_pred"]}, labels={"click": batch["click_label"]}
        )
    assert lists[1].compute() == {}
    assert set(lists[0].compute()) == {"ne-click|lifetime_ne", "ne-click|window_ne"}


# ---- state_dict: the lifetime tables round-trip ------------------------------------------


def test_state_dict_round_trip() -> None:
    saved = generate()
    for s in range(4):
        saved.update(model_out(s))
    state = saved.state_dict()
    assert len(state) == 7 and all(k.endswith(".lifetime") for k in state)  # one per metric/task
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = generate()
    loaded.update(model_out(50))  # replaced by the load, window included
    loaded.load_state_dict(torch.load(buffer))
    lifetime = {k: v for k, v in floats(saved.compute()).items() if "lifetime" in k}
    got = floats(loaded.compute())
    assert close({k: got[k] for k in lifetime}, lifetime)

    saved.update(model_out(7))
    loaded.update(model_out(7))
    after = floats(loaded.compute())
    expected = floats(saved.compute())
    assert close({k: after[k] for k in lifetime}, {k: expected[k] for k in lifetime})
    fresh = generate()
    fresh.update(model_out(7))
    window = {k: v for k, v in floats(fresh.compute()).items() if "window" in k}
    assert close({k: after[k] for k in window}, window)  # a loaded metric starts an empty window


def test_load_state_dict_copies_the_tables() -> None:
    saved = generate()
    saved.update(model_out(0))
    given = {k: v.clone() for k, v in saved.state_dict().items()}
    kept = {k: v.clone() for k, v in given.items()}
    loaded = generate()
    loaded.load_state_dict(given)
    loaded.update(model_out(1))  # torchmetrics would adopt (and so change) the given tensors
    assert all(torch.equal(given[k], kept[k]) for k in given)
    assert not all(torch.equal(v, kept[k]) for k, v in loaded.state_dict().items())


def test_load_state_dict_refuses_a_state_that_does_not_fit() -> None:
    saved = generate()
    saved.update(model_out(0))
    state = saved.state_dict()
    target = generate()
    target.update(model_out(1))
    before = snapshot(target)

    bins = config(
        rec_metrics={RecMetricEnum.AUC: RecMetricDef(rec_tasks=[CLICK], arguments={"num_bins": 8})}
    )
    small = generate(bins)
    key = next(k for k in small.state_dict())
    with pytest.raises(RuntimeError, match=r"want shape \(9, 2\), got \(1048577, 2\)"):
        small.load_state_dict({key: state["rec_metrics.rec_metrics.1.computations.0.lifetime"]})

    partial = dict(state)
    dropped = partial.pop("rec_metrics.rec_metrics.0.computations.1.lifetime")
    with pytest.raises(RuntimeError, match=r"nothing loaded.*missing keys \['rec_metrics"):
        target.load_state_dict(partial)
    with pytest.raises(RuntimeError, match=r"unexpected keys \['extra'\]"):
        target.load_state_dict({**state, "extra": dropped})
    assert close(snapshot(target)[1], before[1])

    result = target.load_state_dict(partial, strict=False)
    assert result.missing_keys == ["rec_metrics.rec_metrics.0.computations.1.lifetime"]


# ---- porting: a torchrec.metrics script with only its imports changed ----------------------

TORCHREC_SCRIPT = """
import torch
from torchrec.metrics.metric_module import generate_metric_module, RecMetricModule
from torchrec.metrics.metrics_config import (
    MetricsConfig,
    RecMetricDef,
    RecMetricEnum,
    RecTaskInfo,
    ThroughputDef,
)

task = RecTaskInfo(
    name="ctr", label_name="label", prediction_name="prediction", weight_name="weight"
)
metrics_config = MetricsConfig(
    rec_tasks=[task],
    rec_metrics={
        RecMetricEnum.NE: RecMetricDef(rec_task_indices=[0], window_size=1024),
        RecMetricEnum.CALIBRATION: RecMetricDef(rec_task_indices=[0], window_size=1024),
        RecMetricEnum.ACCURACY: RecMetricDef(rec_task_indices=[0], window_size=1024),
        RecMetricEnum.AUC: RecMetricDef(rec_task_indices=[0], window_size=1024),
    },
    throughput_metric=ThroughputDef(window_size=60, warmup_steps=2),
    compute_interval_steps=4,
    compute_on_all_ranks=True,
)
metric_module = generate_metric_module(
    metric_class=RecMetricModule,
    metrics_config=metrics_config,
    batch_size=32,
    world_size=1,
    my_rank=0,
    state_metrics_mapping={},
    device=torch.device("cpu"),
)
g = torch.Generator().manual_seed(0)
logged = []
seen = []
subscribed = []
for step in range(8):
    logits = torch.randn(32, 1, generator=g)
    labels = (torch.rand(32, generator=g) < 0.3).float()
    weights = torch.rand(32, generator=g) + 0.5
    model_out = {
        "label": labels,
        "prediction": torch.sigmoid(logits).squeeze(-1),
        "weight": weights,
    }
    seen.append(model_out)
    metric_module.update(model_out)
    if metric_module.should_compute():
        computed = metric_module.compute()  # TorchRec 1.8: DeferrableMetrics
        assert computed.is_resolved()
        computed.subscribe(lambda metrics: subscribed.append(sorted(metrics)))
        logged.append({k: float(v) for k, v in computed.resolve().items()})
metric_module.sync()  # the job's tables (on one process: this process's)
synced = metric_module.state_dict()
metric_module.unsync()
checkpoint = metric_module.state_dict()
metric_module.shutdown()
"""


def test_a_torchrec_metrics_script_runs_with_its_imports_changed() -> None:
    ported = TORCHREC_SCRIPT.replace("from torchrec.metrics.", "from embshard_dist.metrics.")
    changed = [
        (a, b)
        for a, b in zip(TORCHREC_SCRIPT.splitlines(), ported.splitlines(), strict=True)
        if a != b
    ]
    assert len(changed) == 2 and all(a.startswith("from torchrec.") for a, _ in changed)
    namespace: dict[str, Any] = {}
    exec(compile(ported, "torchrec_metrics_script", "exec"), namespace)

    logged, seen = namespace["logged"], namespace["seen"]
    assert len(logged) == 2  # after steps 4 and 8
    assert namespace["subscribed"] == [sorted(log) for log in logged]
    for log, upto in zip(logged, (4, 8), strict=True):
        p = torch.cat([o["prediction"] for o in seen[:upto]]).double()
        y = torch.cat([o["label"] for o in seen[:upto]]).double()
        w = torch.cat([o["weight"] for o in seen[:upto]]).double()
        assert log["calibration-ctr|lifetime_calibration"] == pytest.approx(
            float((w * p).sum() / (w * y).sum()), rel=1e-12
        )
        assert log["accuracy-ctr|lifetime_accuracy"] == pytest.approx(
            float((w * ((p >= 0.5).double() == y)).sum() / w.sum()), rel=1e-12
        )
        assert log["throughput-throughput|total_examples"] == 32 * upto
        assert {"ne-ctr|window_ne", "auc-ctr|lifetime_auc"} <= set(log)
    assert "throughput-throughput|lifetime_throughput" in logged[1]  # past the 2 warm-up steps
    checkpoint = namespace["checkpoint"]
    assert len(checkpoint) == 4 + 3  # a table per metric, and TorchRec's throughput buffers
    assert float(checkpoint["throughput_metric.total_examples"]) == 8 * 32
    assert float(checkpoint["throughput_metric.warmup_examples"]) == 2 * 32
    assert float(checkpoint["throughput_metric.time_lapse_after_warmup"]) > 0
    assert all(torch.equal(v, checkpoint[k]) for k, v in namespace["synced"].items())


# ---- throughput: counters checkpointed, TorchRec's attempt keys ----------------------------

T = "throughput-throughput|"


def clocked(now: list[float]) -> RecMetricModule:
    """Throughput alone: 8 examples a step, 2 warm-up steps, a 1.5 s window."""
    throughput = WarmupThroughputMetric(8, warmup_steps=2, window_seconds=1.5, clock=lambda: now[0])
    return RecMetricModule(8, 1, throughput_metric=throughput)


def test_throughput_counters_are_checkpointed_and_the_lifetime_rate_carries_over() -> None:
    now = [0.0]
    saved = clocked(now)
    for t in (1.0, 2.0, 3.0, 5.0):  # warm-up at 1 s and 2 s; the rates count from 2 s
        now[0] = t
        saved.update({})
    state = saved.state_dict()
    assert floats(state) == {
        "throughput_metric.total_examples": 32,
        "throughput_metric.warmup_examples": 16,
        "throughput_metric.time_lapse_after_warmup": 3.0,
    }
    assert close(
        floats(saved.compute()),
        {f"{T}total_examples": 32, f"{T}attempt_examples": 32, f"{T}lifetime_throughput": 16 / 3,
         f"{T}window_throughput": 8 / 1.5, f"{T}attempt_throughput": 16 / 3},
    )  # fmt: skip

    later = [100.0]
    restarted = clocked(later)
    restarted.load_state_dict(state)
    for t in (110.0, 111.0):  # this attempt's warm-up: no rates yet, as in TorchRec
        later[0] = t
        restarted.update({})
    assert floats(restarted.compute()) == {f"{T}total_examples": 48, f"{T}attempt_examples": 16}
    later[0] = 113.0
    restarted.update({})
    # lifetime: 56 - 32 examples after warm-up over 3 + 2 s; this attempt: 8 over 2 s
    assert close(
        floats(restarted.compute()),
        {f"{T}total_examples": 56, f"{T}attempt_examples": 24, f"{T}lifetime_throughput": 24 / 5,
         f"{T}window_throughput": 8 / 1.5, f"{T}attempt_throughput": 4.0},
    )  # fmt: skip
    assert [float(v) for v in restarted.state_dict().values()] == [56, 32, 5.0]


def test_load_state_dict_checks_the_throughput_counters_before_anything_loads() -> None:
    cfg = config(throughput_metric=ThroughputDef(window_size=60, warmup_steps=1))
    saved = generate(cfg)
    saved.update(model_out(0))
    state = saved.state_dict()
    assert {k for k in state if k.startswith("throughput_metric.")} == {
        "throughput_metric.total_examples",
        "throughput_metric.warmup_examples",
        "throughput_metric.time_lapse_after_warmup",
    }
    target = generate(cfg)
    for s in (1, 2):
        target.update(model_out(s))
    before = snapshot(target)
    counters = {k: v.clone() for k, v in target.state_dict().items()}
    bad = {**state, "throughput_metric.total_examples": torch.zeros(2)}
    with pytest.raises(
        RuntimeError,
        match=r"throughput_metric.total_examples: want a tensor of one value, got \(2,\)",
    ):
        target.load_state_dict(bad)
    partial = {k: v for k, v in state.items() if k != "throughput_metric.warmup_examples"}
    with pytest.raises(RuntimeError, match=r"missing keys \['throughput_metric.warmup_examples'\]"):
        target.load_state_dict(partial)
    assert close(snapshot(target)[1], before[1])
    assert all(torch.equal(v, counters[k]) for k, v in target.state_dict().items())
    result = target.load_state_dict(partial, strict=False)
    assert result.missing_keys == ["throughput_metric.warmup_examples"]
    assert float(target.state_dict()["throughput_metric.total_examples"]) == BATCH


# ---- pre-compute states, sync, async_compute, shutdown --------------------------------------


def with_throughput() -> MetricsConfig:
    return config(throughput_metric=ThroughputDef(window_size=60, warmup_steps=1))


def ne_table(batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """NE's table of task click by hand: [sum of w * cross entropy, positives, negatives]."""
    p = torch.cat([b["click_pred"].reshape(-1) for b in batches]).double()
    y = torch.cat([b["click_label"] for b in batches]).double()
    w = torch.cat([b["click_w"] for b in batches]).double()
    return torch.stack([cross_entropy_sum(p, y, w), (w * y).sum(), (w * (1 - y)).sum()])[None]


def test_pre_compute_states_hold_every_table_and_load_into_another_module() -> None:
    module = generate(with_throughput())
    batches = [model_out(s) for s in range(4)]
    for out in batches:
        module.update(out)
    states = module.get_pre_compute_states()
    assert {ns: sorted(tasks) for ns, tasks in states.items()} == {
        "ne": ["click", "like"], "auc": ["click", "like"], "accuracy": ["click", "like"],
        "calibration": ["click"], "throughput": ["throughput"],
    }  # fmt: skip
    assert set(states["auc"]["like"]) == {"lifetime", "window"}
    ne = states["ne"]["click"]
    assert torch.allclose(ne["lifetime"], ne_table(batches), rtol=1e-12, atol=0)
    assert torch.allclose(ne["window"], ne_table(batches[-2:]), rtol=1e-12, atol=0)
    counters = floats(states["throughput"]["throughput"])
    assert counters["total_examples"] == 4 * BATCH and counters["warmup_examples"] == BATCH
    assert counters["attempt_examples"] == 4 * BATCH and counters["lifetime_rate"] > 0

    loaded = generate(with_throughput())
    loaded.update(model_out(50))  # replaced by the load
    loaded.load_pre_compute_states(states)
    ne["lifetime"].zero_()  # the module holds copies
    expected = floats(module.compute())
    assert close(floats(loaded.compute()), expected)
    assert f"{T}lifetime_throughput" in expected and f"{T}attempt_throughput" in expected

    module.update(model_out(7))  # the loaded window stands until the next update
    loaded.update(model_out(7))
    after, want = floats(loaded.compute()), floats(module.compute())
    lifetime = [k for k in want if "lifetime" in k and not k.startswith(T)]
    assert close({k: after[k] for k in lifetime}, {k: want[k] for k in lifetime})
    fresh = generate()
    fresh.update(model_out(7))
    window = {k: v for k, v in floats(fresh.compute()).items() if "window" in k}
    assert close({k: after[k] for k in window}, window)


def _drop(path: tuple[str, ...]) -> Any:
    def mutate(s: dict[str, Any]) -> None:
        inner = s
        for key in path[:-1]:
            inner = inner[key]
        del inner[path[-1]]

    return mutate


def _set(path: tuple[str, ...], value: Any) -> Any:
    def mutate(s: dict[str, Any]) -> None:
        inner = s
        for key in path[:-1]:
            inner = inner[key]
        inner[path[-1]] = value

    return mutate


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (_set(("mse",), {}), r"source has unknown metrics \['mse'\] \(this module's: \['ne', 'auc', 'accuracy', 'calibration', 'throughput'\]\)"),
        (_drop(("throughput",)), r"source lacks metrics \['throughput'\]"),
        (_drop(("auc", "like")), r"source\['auc'\] lacks tasks \['like'\] \(this module's: \['click', 'like'\]\)"),
        (_set(("ne", "click", "cross_entropy_sum"), torch.zeros(1)),
         r"source\['ne'\]\['click'\] has unknown states \['cross_entropy_sum'\] \(this module's: \['lifetime', 'window'\]\)"),
        (_set(("auc", "click", "window"), torch.zeros(9, 2)),
         r"source\['auc'\]\['click'\]\['window'\] must be a tensor of shape \(1048577, 2\), got shape \(9, 2\)"),
        (_set(("throughput", "throughput", "total_examples"), 5),
         r"\['total_examples'\] must be a tensor of shape \(\), got int"),
        (_set(("calibration",), [torch.zeros(1, 2)]), r"source\['calibration'\] must be a dict of tasks \['click'\], got list"),
    ],
)  # fmt: skip
def test_load_pre_compute_states_refuses_a_source_that_does_not_fit(
    mutate: Any, message: str
) -> None:
    source = generate(with_throughput())
    source.update(model_out(0))
    states: dict[str, Any] = {
        ns: {task: dict(values) for task, values in tasks.items()}
        for ns, tasks in source.get_pre_compute_states().items()
    }
    mutate(states)
    target = generate(with_throughput())
    target.update(model_out(1))
    before = (snapshot(target), floats(target.compute()))
    with pytest.raises(ValueError, match=r"load_pre_compute_states: nothing loaded.*" + message):
        target.load_pre_compute_states(states)
    with pytest.raises(ValueError, match=r"source must be a dict of metrics"):
        target.load_pre_compute_states([])  # type: ignore[arg-type]
    after = (snapshot(target), floats(target.compute()))
    assert after[0][0] == before[0][0] and close(after[0][1], before[0][1])
    assert close(after[1], before[1])


def test_sync_on_one_process_keeps_the_states() -> None:
    module = generate(with_throughput())
    for s in range(3):
        module.update(model_out(s))
    state = {k: v.clone() for k, v in module.state_dict().items()}
    local = floats(module.local_compute())
    module.sync()  # no process group: nothing to sum with
    assert all(torch.equal(v, state[k]) for k, v in module.state_dict().items())
    module.unsync()
    module.unsync()  # unsynced already: nothing to do, as TorchRec
    module.update(model_out(3))
    again = generate(with_throughput())
    for s in range(4):
        again.update(model_out(s))
    assert close(floats(module.local_compute()), floats(again.local_compute()))
    assert not close(floats(module.local_compute()), local)


def test_async_compute_is_refused_and_shutdown_stops_nothing() -> None:
    module = generate()
    module.update(model_out(0))
    with pytest.raises(
        RecMetricException, match=r"async_compute is not supported.*call compute\(\)"
    ):
        module.async_compute()
    module.shutdown()
    module.shutdown()
    module.update(model_out(1))  # the module keeps working
    both = generate()
    for s in (0, 1):
        both.update(model_out(s))
    assert close(floats(module.compute()), floats(both.compute()))


def test_compute_returns_torchrecs_deferrable_metrics_resolved() -> None:
    module = RecMetricModule(8, 1, throughput_metric=ThroughputMetric(8))
    module.update({})
    computed = module.compute()
    assert isinstance(computed, DeferrableMetrics) and isinstance(computed, dict)
    assert computed.is_resolved() and computed.resolve() == dict(computed)
    assert type(computed.resolve()) is dict
    assert float(computed["throughput-throughput|total_examples"]) == 8
    errors: list[Exception] = []

    def failing(metrics: dict[str, Any]) -> None:
        raise KeyError("no such key")

    computed.subscribe(failing, on_error=errors.append)
    assert len(errors) == 1 and isinstance(errors[0], KeyError)
    with pytest.raises(KeyError, match="no such key"):
        computed.subscribe(failing)
    assert isinstance(module.local_compute(), DeferrableMetrics)


def test_throughput_takes_torchrecs_keywords() -> None:
    """``ThroughputMetric(batch_size=, world_size=, window_seconds=, warmup_steps=)`` as TorchRec
    calls it; ``world_size`` must be the group's, ``batch_size_stages`` is refused."""
    now = [0.0]
    metric = ThroughputMetric(
        batch_size=8, world_size=1, window_seconds=60, warmup_steps=2, clock=lambda: now[0]
    )
    for _ in range(4):
        now[0] += 1.0
        metric.update()
    values = metric.compute()
    assert float(values["throughput-throughput|total_examples"]) == 32
    assert float(values["throughput-throughput|lifetime_throughput"]) == 8.0  # 16 in 2 s
    with pytest.raises(ValueError, match=r"world_size=4, but the metrics sum the counts of 1"):
        ThroughputMetric(batch_size=8, world_size=4, window_seconds=60)
    with pytest.raises(ValueError, match=r"batch_size_stages .* num_examples"):
        ThroughputMetric(batch_size=8, window_seconds=60, batch_size_stages=[object()])
    with pytest.raises(ValueError, match=r"warmup_steps must be an int >= 0"):
        ThroughputMetric(batch_size=8, warmup_steps=-1)
