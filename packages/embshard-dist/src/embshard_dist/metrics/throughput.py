"""Throughput across ranks: examples per second over the job, this attempt and a sliding window.

``ThroughputMetric`` is a ``torchmetrics.Metric`` whose states are all summed over the ranks
(``compute()`` is a collective over ``group``). Each rank counts, as TorchRec's
``ThroughputMetric``: ``total_examples`` (warm-up included), ``warmup_examples`` and
``time_lapse_after_warmup`` (its seconds from the end of warm-up to its latest update) over the
job's life; these three are checkpointed (``state_dict``), so the lifetime rate carries over a
restart. ``attempt_examples``, ``attempt_warmup_examples`` and
``attempt_time_lapse_after_warmup`` count the same since construction (or ``reset``) and are
not saved. The first ``warmup_steps`` updates of an attempt only count examples (none here; see
:class:`~embshard_dist.metrics.warmup_throughput.WarmupThroughputMetric`). A rank's rates are
states too: lifetime and attempt (its examples after warm-up over its seconds after warm-up)
and window (the updates of its last ``window_seconds`` before its latest, over that span,
shorter while the attempt is younger), so the job's rate is the sum of its ranks' rates and
holds with unequal batch sizes. Keys are TorchRec's: ``throughput-throughput|total_examples``
and ``|attempt_examples`` always; ``|lifetime_throughput`` and ``|window_throughput`` once the
lifetime rate is not 0; ``|attempt_throughput`` once this attempt's is not 0.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torchmetrics import Metric

from embshard_dist.metrics.reduce import all_reduce_states

DEFAULT_WINDOW_SECONDS = 100.0
_PREFIX = "throughput-throughput|"
CHECKPOINTED = ("total_examples", "warmup_examples", "time_lapse_after_warmup")
"""The states ``state_dict()`` saves (TorchRec's persistent buffers)."""
ATTEMPT = ("attempt_examples", "attempt_warmup_examples", "attempt_time_lapse_after_warmup")
RATES = ("lifetime_rate", "attempt_rate", "window_rate")
STATES = CHECKPOINTED + ATTEMPT + RATES


def _check_world_size(world_size: int | None, group: dist.ProcessGroup | None) -> None:
    """TorchRec's ``world_size`` multiplies each rank's count; here every rank's own count is
    summed over ``group``, so a given ``world_size`` must be that group's size (1 outside a
    process group).

    Raises:
        ValueError: it is not.
    """
    if world_size is None:
        return
    ranks = dist.get_world_size(group) if dist.is_initialized() else 1
    if world_size != ranks:
        raise ValueError(
            f"throughput: world_size={world_size!r}, but the metrics sum the counts of "
            f"{ranks} rank(s) ({'the group' if dist.is_initialized() else 'no process group'}); "
            "pass the group's size or leave world_size out"
        )


def _rate(examples: torch.Tensor, warmup: torch.Tensor, seconds: torch.Tensor) -> float:
    return float(examples - warmup) / float(seconds) if float(seconds) > 0 else 0.0


class ThroughputMetric(Metric):
    """Counts examples; rates in examples per second (see the module doc).

    Args:
        batch_size: examples per ``update()`` on this rank when none are given.
        world_size: TorchRec's argument, checked: the size of ``group`` (1 without a process
            group), since each rank's own count is summed over the group instead of multiplied.
        window_seconds: how far back the window reaches.
        warmup_steps: updates left out of the rates (TorchRec's default is 100; here 0).
        batch_size_stages: TorchRec's per-step batch sizes; refused (give ``update`` its
            ``num_examples``).
        group: the process group to reduce over (default: the default group, if any).
        clock: seconds, monotonic (a parameter for tests).

    Raises:
        ValueError: a size, window or warm-up out of range, a ``world_size`` that is not the
            group's, or ``batch_size_stages``.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False
    total_examples: torch.Tensor
    warmup_examples: torch.Tensor
    time_lapse_after_warmup: torch.Tensor
    attempt_examples: torch.Tensor
    attempt_warmup_examples: torch.Tensor
    attempt_time_lapse_after_warmup: torch.Tensor
    lifetime_rate: torch.Tensor
    attempt_rate: torch.Tensor
    window_rate: torch.Tensor

    def __init__(
        self,
        batch_size: int,
        *,
        world_size: int | None = None,
        window_seconds: float = DEFAULT_WINDOW_SECONDS,
        warmup_steps: int = 0,
        batch_size_stages: Sequence[Any] | None = None,
        group: dist.ProcessGroup | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if batch_size <= 0 or window_seconds <= 0:
            raise ValueError(
                f"throughput: batch_size and window_seconds must be positive, got {batch_size}, "
                f"{window_seconds}"
            )
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"throughput: warmup_steps must be an int >= 0, got {warmup_steps!r}")
        if batch_size_stages is not None:
            raise ValueError(
                "throughput: batch_size_stages (TorchRec's batch size per step range) is not "
                "taken: give each update() its num_examples instead"
            )
        _check_world_size(world_size, group)
        # No cached result: every compute() reduces on every rank (see RecMetricComputation).
        super().__init__(
            process_group=group, dist_sync_fn=all_reduce_states, compute_with_cache=False
        )
        self.batch_size, self.window_seconds, self.group = batch_size, window_seconds, group
        self.warmup_steps = warmup_steps
        self.steps = 0
        self._clock = clock
        for state in STATES:
            self.add_state(
                state,
                torch.zeros((), dtype=torch.float64),
                dist_reduce_fx="sum",
                persistent=state in CHECKPOINTED,
            )
        self._window: deque[tuple[float, int]] = deque()
        self._window_examples = 0
        self._previous = self._clock()

    def reset(self) -> None:
        """Start counting again from now, every counter included."""
        super().reset()
        self.steps = 0
        self._window.clear()
        self._window_examples = 0
        self._previous = self._clock()

    def update(self, num_examples: int | None = None) -> None:
        """Count a step of ``num_examples`` (default ``batch_size``) on this rank."""
        n = self.batch_size if num_examples is None else int(num_examples)
        if n < 0:
            raise ValueError(f"throughput: num_examples must be >= 0, got {n}")
        now = self._clock()
        self.steps += 1
        self.total_examples += n
        self.attempt_examples += n
        if self.steps <= self.warmup_steps:
            self.warmup_examples += n
            self.attempt_warmup_examples += n
            self._previous = now  # the rates' clock starts at the last warm-up update
            return
        lapse = now - self._previous
        self._previous = now
        self.time_lapse_after_warmup += lapse
        self.attempt_time_lapse_after_warmup += lapse
        self._window.append((now, n))
        self._window_examples += n
        while self._window[0][0] <= now - self.window_seconds:
            self._window_examples -= self._window.popleft()[1]
        self._refresh_rates()

    def _refresh_rates(self) -> None:
        """This rank's rates from its counters; 0 until this attempt is past warm-up."""
        past_warmup = self.steps > self.warmup_steps
        lifetime = _rate(self.total_examples, self.warmup_examples, self.time_lapse_after_warmup)
        attempt = _rate(
            self.attempt_examples,
            self.attempt_warmup_examples,
            self.attempt_time_lapse_after_warmup,
        )
        span = min(self.window_seconds, float(self.attempt_time_lapse_after_warmup))
        window = self._window_examples / span if span > 0 else 0.0
        self.lifetime_rate.fill_(lifetime if past_warmup else 0.0)
        self.attempt_rate.fill_(attempt if past_warmup else 0.0)
        self.window_rate.fill_(window if past_warmup else 0.0)

    def compute(self) -> dict[str, torch.Tensor]:
        """The counts and, where not 0, the rates of every rank (a collective)."""
        out = {
            f"{_PREFIX}total_examples": self.total_examples.clone(),
            f"{_PREFIX}attempt_examples": self.attempt_examples.clone(),
        }
        if float(self.lifetime_rate) != 0.0:
            out[f"{_PREFIX}lifetime_throughput"] = self.lifetime_rate.clone()
            out[f"{_PREFIX}window_throughput"] = self.window_rate.clone()
        if float(self.attempt_rate) != 0.0:
            out[f"{_PREFIX}attempt_throughput"] = self.attempt_rate.clone()
        return out

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every state's shape: all are scalars."""
        return dict.fromkeys(STATES, ())

    def local_states(self) -> dict[str, torch.Tensor]:
        """Copies of this rank's states, by name."""
        return {name: getattr(self, name).detach().clone() for name in STATES}

    def load_states(self, states: Mapping[str, torch.Tensor]) -> None:
        """Replace every state by a float64 copy of ``states[name]`` (checked by the caller:
        every name of :data:`STATES`, one value each)."""
        device = self.total_examples.device
        for name in STATES:
            value = states[name].detach().reshape(())
            setattr(self, name, value.to(device=device, dtype=torch.float64, copy=True))

    def checkpoint_problems(self, state_dict: Mapping[str, Any], prefix: str) -> list[str]:
        """What in ``state_dict`` cannot load into the checkpointed counters (empty: all fit)."""
        problems = []
        for name in CHECKPOINTED:
            value = state_dict.get(prefix + name)
            if value is not None and (not isinstance(value, torch.Tensor) or value.numel() != 1):
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
                problems.append(f"{prefix}{name}: want a tensor of one value, got {got}")
        return problems

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """Load the checkpointed counters as float64 copies (a missing one is reported
        missing); this attempt's counters keep counting; the rates follow the loaded counters."""
        problems = self.checkpoint_problems(state_dict, prefix)
        if problems:
            raise RuntimeError(
                f"ThroughputMetric.load_state_dict: nothing loaded ({'; '.join(problems)})"
            )
        device = self.total_examples.device
        for name in CHECKPOINTED:
            key = prefix + name
            if key not in state_dict:
                missing_keys.append(key)
                continue
            value = state_dict[key].detach().reshape(())
            state_dict[key] = value.to(device=device, dtype=torch.float64, copy=True)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        self._refresh_rates()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "throughput: call update() per step and compute() for the values; forward() would "
            "restart the clock"
        )
