"""Where one training step's time goes, phase by phase, for either library.

A profiled step drives the sharded collection through TorchRec's ``ShardedModule`` methods, which
both libraries implement, timing each forward phase to its end (the awaitables waited at once):

* ``input_dist``: routing the features (bucketize, permute) and their all-to-all;
* ``lookup``: the local TBE lookups (``compute``);
* ``output_dist``: the pooled all-to-all / reduce-scatter until the ``KeyedTensor`` is whole;

then the loss and the backward, under ``torch.profiler``, whose autograd nodes are split into

* ``backward_comms``: the nodes of collectives (the output dist's reverse exchange);
* ``fused_update``: the lookups' backward, in which the optimizer runs (a data-parallel table's
  exchange of touched rows happens inside it);
* ``rest``: the loss, the other nodes, what autograd itself spends, and any optimizer step
  outside the backward (TorchRec's data-parallel tables).

The phases add up to ``total``, the profiled step's wall time; the profiler makes the backward a
little slower than an unprofiled one. Skipping the ``DistributedModelParallel`` wrapper, a
profiled step runs the same collectives in the same order on every rank.
"""

from __future__ import annotations

import itertools
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn
from torch.profiler import ProfilerActivity, profile

PHASES = ("input_dist", "lookup", "output_dist", "backward_comms", "fused_update", "rest")

_NODE = "autograd::engine::evaluate_function: "
_COMMS = re.compile(
    r"all2all|alltoall|all_to_all|reducescatter|reduce_scatter|allgather|all_gather|"
    r"^_start|^_finish|_req|_wait|collective",
    re.IGNORECASE,
)
_UPDATE = re.compile(r"lookup|split_embedding|embeddingbag|fused|tbe", re.IGNORECASE)


def sharded_collection(model: nn.Module) -> Any:
    """The first submodule of ``model`` with ``input_dist`` / ``compute`` / ``output_dist``.

    Raises:
        ValueError: ``model`` holds no sharded module.
    """
    for module in model.modules():
        if all(
            callable(getattr(module, name, None))
            for name in ("create_context", "input_dist", "compute", "output_dist")
        ):
            return module
    raise ValueError(
        f"{type(model).__name__} holds no sharded module (one with create_context, input_dist, "
        "compute and output_dist); profile a DistributedModelParallel model"
    )


def node_kind(name: str) -> str:
    """``backward_comms``, ``fused_update`` or ``rest`` for an autograd node's name."""
    if _COMMS.search(name):
        return "backward_comms"
    if _UPDATE.search(name):
        return "fused_update"
    return "rest"


def profile_step(
    model: nn.Module,
    features: Any,
    loss_of: Callable[[Any], Tensor],
    after: Callable[[], None] | None = None,
) -> tuple[dict[str, float], dict[str, float]]:
    """One training step of ``model``'s sharded collection on ``features``, phase by phase.

    Args:
        model: a ``DistributedModelParallel`` (either library's) or the sharded module itself.
        features: this library's ``KeyedJaggedTensor``.
        loss_of: the loss of the output ``KeyedTensor``.
        after: what the step does after the backward (a dense optimizer's step), in ``rest``.

    Returns:
        ms per phase of :data:`PHASES` plus ``total``, and ms per backward node name.
    """
    sharded = sharded_collection(model)
    marks = [time.perf_counter()]
    ctx = sharded.create_context()
    dist_input = sharded.input_dist(ctx, features).wait().wait()
    marks.append(time.perf_counter())
    output = sharded.compute(ctx, dist_input)
    marks.append(time.perf_counter())
    pooled = sharded.output_dist(ctx, output).wait()
    marks.append(time.perf_counter())
    loss = loss_of(pooled)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss.backward()
    if after is not None:
        after()
    marks.append(time.perf_counter())
    nodes: dict[str, float] = {}
    for event in prof.events():
        if event.name.startswith(_NODE) and event.cpu_parent is None:
            name = event.name[len(_NODE) :]
            nodes[name] = nodes.get(name, 0.0) + event.cpu_time_total / 1e3
    ms = [(b - a) * 1e3 for a, b in itertools.pairwise(marks)]
    phases = dict(zip(("input_dist", "lookup", "output_dist"), ms, strict=False))
    for kind in ("backward_comms", "fused_update"):
        phases[kind] = sum(v for n, v in nodes.items() if node_kind(n) == kind)
    phases["rest"] = ms[3] - phases["backward_comms"] - phases["fused_update"]
    phases["total"] = sum(ms)
    return phases, nodes


def median_phases(samples: list[dict[str, float]]) -> dict[str, float]:
    """Per phase (and ``total``), the median over profiled steps."""
    return {key: statistics.median(s[key] for s in samples) for key in (*PHASES, "total")}
