"""Awaitables: values that a collective is still producing.

``wait()`` blocks until the value is ready, then applies the callbacks in order. A
``LazyAwaitable`` waits by itself when used as the value (torch functions, operators, indexing,
missing attributes), at most once, caching the result; dunder look-ups, ``bool()``, ``len()``
and iteration never trigger a wait. Importing this module touches no accelerator.
"""

from __future__ import annotations

import abc
import operator
from collections.abc import Callable
from typing import Any, Generic, TypeVar, cast

import torch
from torch.autograd.profiler import record_function
from torch.fx import ProxyableClassMeta
from torch.fx._symbolic_trace import is_fx_symbolic_tracing

__all__ = [
    "Awaitable",
    "DeviceToHostTensorAwaitable",
    "GetItemLazyAwaitable",
    "LazyAwaitable",
    "LazyGetItemMixin",
    "LazyNoWait",
    "NoWait",
]

W = TypeVar("W")
KT = TypeVar("KT")
VT_co = TypeVar("VT_co", covariant=True)
ParentW = TypeVar("ParentW")


class Awaitable(abc.ABC, Generic[W]):
    """A value that becomes available on ``wait()``; subclasses implement ``_wait_impl``."""

    def __init__(self) -> None:
        self._callbacks: list[Callable[[W], W]] = []

    @abc.abstractmethod
    def _wait_impl(self) -> W:
        """Block until the value is ready and return it."""

    def wait(self) -> W:
        """Block until the value is ready, apply the callbacks in order, and return the result."""
        with record_function(f"## {type(self).__name__} wait() ##"):
            result: W = self._wait_impl()
            for callback in self._callbacks:
                result = callback(result)
        return result

    @property
    def callbacks(self) -> list[Callable[[W], W]]:
        """The functions applied, in order, to the waited value (append to add one)."""
        return self._callbacks


class NoWait(Awaitable[W]):
    """An awaitable whose value ``obj`` is already known."""

    def __init__(self, obj: W) -> None:
        super().__init__()
        self._obj = obj

    def _wait_impl(self) -> W:
        return self._obj


def _resolve(obj: Any) -> Any:
    """Replace every ``LazyAwaitable`` in ``obj`` (and its lists, tuples, dicts) by its value."""
    if isinstance(obj, LazyAwaitable):
        return obj.wait()
    if isinstance(obj, list | tuple):
        items = [_resolve(item) for item in obj]
        if all(new is old for new, old in zip(items, obj, strict=True)):
            return obj
        if isinstance(obj, list):
            return items
        if hasattr(obj, "_fields"):  # a namedtuple
            return type(obj)(*items)
        return tuple(items) if type(obj) is tuple else type(obj)(items)
    if isinstance(obj, dict):
        values = {key: _resolve(value) for key, value in obj.items()}
        if all(values[key] is value for key, value in obj.items()):
            return obj
        return values
    return obj


def _unary(op: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def method(self: Any) -> Any:
        return op(_resolve(self))

    method.__name__ = f"__{op.__name__.strip('_')}__"
    return method


def _binary(op: Callable[[Any, Any], Any], name: str) -> Callable[[Any, Any], Any]:
    def method(self: Any, other: Any) -> Any:
        return op(_resolve(self), _resolve(other))

    method.__name__ = f"__{name}__"
    return method


def _reflected(op: Callable[[Any, Any], Any], name: str) -> Callable[[Any, Any], Any]:
    def method(self: Any, other: Any) -> Any:
        return op(_resolve(other), _resolve(self))

    method.__name__ = f"__r{name}__"
    return method


class _LazyAwaitableMeta(abc.ABCMeta, ProxyableClassMeta):
    """ABC behaviour plus torch.fx's: under symbolic tracing, building one from a Proxy records
    the construction in the graph instead of running it."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        # Outside symbolic tracing, construct plainly (torch.fx's own check logs a warning).
        if not is_fx_symbolic_tracing():
            return type.__call__(cls, *args, **kwargs)
        return super().__call__(*args, **kwargs)


_INTERNAL = frozenset({"_callbacks", "_lazy_done", "_lazy_result", "_lazy_waiting"})


class LazyAwaitable(Awaitable[W], metaclass=_LazyAwaitableMeta):
    """An awaitable that waits on its own, once, when its value is used.

    Callbacks added after the wait do not run. Subclasses must call ``super().__init__()`` first.
    """

    def __init__(self) -> None:
        super().__init__()
        self._lazy_done = False
        self._lazy_waiting = False
        self._lazy_result: W | None = None

    def wait(self) -> W:
        """Wait once (running the callbacks) and return the cached result on every call."""
        if not self._lazy_done:
            self._lazy_waiting = True
            try:
                self._lazy_result = super().wait()
            finally:
                self._lazy_waiting = False
            self._lazy_done = True
        return cast(W, self._lazy_result)

    @property
    def is_waited(self) -> bool:
        """Whether the value has been waited for (and is cached)."""
        return self._lazy_done

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Wait on every ``LazyAwaitable`` among the (nested) arguments, then call ``func``."""
        return func(*_resolve(args), **_resolve(kwargs or {}))

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes the awaitable itself lacks.
        if name in _INTERNAL:
            raise RuntimeError(
                f"{type(self).__name__} was not initialised: its __init__ must call "
                "super().__init__() before using the awaitable"
            )
        if (name.startswith("__") and name.endswith("__")) or self._lazy_waiting:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.wait(), name)

    __hash__ = object.__hash__  # identity, although == compares the waited values

    __neg__ = _unary(operator.neg)
    __pos__ = _unary(operator.pos)
    __abs__ = _unary(operator.abs)
    __invert__ = _unary(operator.invert)

    __add__ = _binary(operator.add, "add")
    __sub__ = _binary(operator.sub, "sub")
    __mul__ = _binary(operator.mul, "mul")
    __truediv__ = _binary(operator.truediv, "truediv")
    __floordiv__ = _binary(operator.floordiv, "floordiv")
    __mod__ = _binary(operator.mod, "mod")
    __pow__ = _binary(operator.pow, "pow")
    __matmul__ = _binary(operator.matmul, "matmul")
    __and__ = _binary(operator.and_, "and")
    __or__ = _binary(operator.or_, "or")
    __xor__ = _binary(operator.xor, "xor")
    __lshift__ = _binary(operator.lshift, "lshift")
    __rshift__ = _binary(operator.rshift, "rshift")
    __getitem__ = _binary(operator.getitem, "getitem")

    __radd__ = _reflected(operator.add, "add")
    __rsub__ = _reflected(operator.sub, "sub")
    __rmul__ = _reflected(operator.mul, "mul")
    __rtruediv__ = _reflected(operator.truediv, "truediv")
    __rfloordiv__ = _reflected(operator.floordiv, "floordiv")
    __rmod__ = _reflected(operator.mod, "mod")
    __rpow__ = _reflected(operator.pow, "pow")
    __rmatmul__ = _reflected(operator.matmul, "matmul")
    __rand__ = _reflected(operator.and_, "and")
    __ror__ = _reflected(operator.or_, "or")
    __rxor__ = _reflected(operator.xor, "xor")
    __rlshift__ = _reflected(operator.lshift, "lshift")
    __rrshift__ = _reflected(operator.rshift, "rshift")

    __eq__ = _binary(operator.eq, "eq")
    __ne__ = _binary(operator.ne, "ne")
    __lt__ = _binary(operator.lt, "lt")
    __le__ = _binary(operator.le, "le")
    __gt__ = _binary(operator.gt, "gt")
    __ge__ = _binary(operator.ge, "ge")


class LazyNoWait(LazyAwaitable[W]):
    """A lazy awaitable whose value ``obj`` is already known."""

    def __init__(self, obj: W) -> None:
        super().__init__()
        self._obj = obj

    def _wait_impl(self) -> W:
        return self._obj


class LazyGetItemMixin(Generic[KT, VT_co]):
    """Makes ``awaitable[key]`` a ``GetItemLazyAwaitable`` instead of a wait.

    List this mixin before ``LazyAwaitable`` among the bases so that its ``__getitem__`` wins.
    """

    def __getitem__(self, key: KT) -> LazyAwaitable[VT_co]:
        if not isinstance(self, Awaitable):
            raise TypeError(
                f"LazyGetItemMixin must be combined with an Awaitable, got {type(self).__name__}"
            )
        return GetItemLazyAwaitable(self, key)


class GetItemLazyAwaitable(LazyAwaitable[W], Generic[W, ParentW, KT]):
    """The value ``parent.wait()[key]``, computed when first used."""

    def __init__(self, parent: Awaitable[ParentW], key: KT) -> None:
        super().__init__()
        self._parent = parent
        self._key = key

    def _wait_impl(self) -> W:
        collection: Any = self._parent.wait()
        return cast(W, collection[self._key])


class DeviceToHostTensorAwaitable(LazyAwaitable[torch.Tensor]):
    """A tensor being copied to host memory.

    A CUDA tensor is copied asynchronously into pinned memory and ``wait()`` synchronises on a
    CUDA event; other tensors are copied at once (the result never aliases the input).
    """

    def __init__(self, tensor_on_device: torch.Tensor) -> None:
        super().__init__()
        self._event: torch.cuda.Event | None = None
        if tensor_on_device.device.type == "cuda":
            host = torch.empty(
                tensor_on_device.shape,
                dtype=tensor_on_device.dtype,
                device="cpu",
                pin_memory=True,
            )
            host.copy_(tensor_on_device, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            self._tensor = host
        else:
            self._tensor = tensor_on_device.to("cpu", copy=True)

    def _wait_impl(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
        return self._tensor
