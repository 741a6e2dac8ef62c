"""Several keyed optimizers (fused and dense) driven as one.

:class:`CombinedOptimizer` steps, zeroes, saves and loads them together under
``"{prefix}.{name}"``; names are unique, ``state`` is a live view and ``param_groups`` are the
children's own dicts (a learning-rate change reaches the child).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

from embshard_optim.keyed import KeyedOptimizer, MergedState


class CombinedOptimizer(KeyedOptimizer):
    """One keyed optimizer made of several.

    Args:
        optims: the children, each a ``KeyedOptimizer`` or a ``(prefix, KeyedOptimizer)`` pair.

    Raises:
        ValueError: two children give a parameter the same combined name.
    """

    def __init__(self, optims: Sequence[KeyedOptimizer | tuple[str, KeyedOptimizer]]) -> None:
        self._optims: list[tuple[str, KeyedOptimizer]] = []
        for item in optims:
            prefix, optimizer = ("", item) if isinstance(item, KeyedOptimizer) else item
            if not isinstance(optimizer, KeyedOptimizer):
                raise TypeError(
                    f"CombinedOptimizer takes KeyedOptimizers, got {type(optimizer).__name__} "
                    f"(prefix {prefix!r}); wrap torch.optim optimizers in KeyedOptimizerWrapper"
                )
            self._optims.append((prefix, optimizer))
        params = {}
        for prefix, optimizer in self._optims:
            for name, param in optimizer.params.items():
                key = self.prepend_opt_key(name, prefix)
                if key in params:
                    raise ValueError(
                        f"CombinedOptimizer: parameter name {key!r} is used twice; give the "
                        "optimizers distinct prefixes"
                    )
                params[key] = param
        super().__init__(
            params,
            MergedState([optimizer.state for _, optimizer in self._optims]),
            [group for _, optimizer in self._optims for group in optimizer.param_groups],
        )

    @staticmethod
    def prepend_opt_key(name: str, opt_key: str) -> str:
        """The combined name of parameter ``name`` of the child with prefix ``opt_key``."""
        if not name:
            return opt_key
        return f"{opt_key}.{name}" if opt_key else name

    @property
    def optimizers(self) -> list[tuple[str, KeyedOptimizer]]:
        """The ``(prefix, optimizer)`` children."""
        return list(self._optims)

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Step every child."""
        for _, optimizer in self._optims:
            optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every child's gradients (fused children push their learning rate)."""
        for _, optimizer in self._optims:
            optimizer.zero_grad(set_to_none=set_to_none)

    def init_state(self, sparse_grad_parameter_names: Collection[str] | None = None) -> None:
        """Every child's ``init_state``, with sparse names given in combined form."""
        names = set(sparse_grad_parameter_names or ())
        unknown = sorted(names - set(self.params))
        if unknown:
            raise ValueError(f"init_state: unknown sparse parameters {unknown}")
        for prefix, optimizer in self._optims:
            mine = {n for n in optimizer.params if self.prepend_opt_key(n, prefix) in names}
            optimizer.init_state(mine)

    def post_load_state_dict(self) -> None:
        """Let every child react to the load."""
        for _, optimizer in self._optims:
            optimizer.post_load_state_dict()

    def save_param_groups(self, save: bool) -> None:
        """Set on this optimizer and every child."""
        self._save_param_groups = save
        for _, optimizer in self._optims:
            optimizer.save_param_groups(save)

    def set_optimizer_step(self, step: int) -> None:
        """Pass the step to every child that keeps one (fused optimizers)."""
        for _, optimizer in self._optims:
            setter: Any = getattr(optimizer, "set_optimizer_step", None)
            if setter is not None:
                setter(step)
