"""``DeferrableMetrics``: what ``RecMetricModule.compute()`` returns (TorchRec's type and module name).

TorchRec's container holds either computed metrics or a future of them, so the same code can read
them at once (``resolve()``, dict access) or later (``subscribe(callback)``). embshard computes
metrics in the caller's thread, so the container is always resolved: a ``dict`` (every dict use
keeps working) with TorchRec's ``resolve``, ``subscribe`` and ``is_resolved``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["DeferrableMetrics"]


class DeferrableMetrics(dict[str, Any]):
    """Computed metrics by key, with TorchRec's deferred-access methods (always resolved)."""

    def resolve(self) -> dict[str, Any]:
        """The metrics, as a plain dict (never blocks: they are computed)."""
        return dict(self)

    def subscribe(
        self,
        callback: Callable[[dict[str, Any]], None],
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        """Call ``callback`` with the metrics now (TorchRec calls it at once too when resolved);
        an exception it raises goes to ``on_error`` when given, else propagates."""
        try:
            callback(self.resolve())
        except Exception as error:
            if on_error is None:
                raise
            on_error(error)

    def is_resolved(self) -> bool:
        """Always ``True``: embshard computes metrics before returning them."""
        return True
