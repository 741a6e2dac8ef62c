"""``DataLoadingThread``: the next batch loaded and copied to the device by a background thread.

TorchRec's class of that name. A daemon thread takes one batch at a time from the iterator and
copies it to the device (on CUDA on a copy stream of its own), so the training loop's
:meth:`~DataLoadingThread.get_next_batch` finds it ready. One batch is buffered: the thread takes
the next only once the last was handed out. The end of the iterator is ``None`` (or
``StopIteration``); an exception raised while loading is re-raised in the caller's thread by the
next ``get_next_batch``, never lost (TorchRec skips some it deems retriable: here no batch is
skipped).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Generic

import torch

from embshard_dist.train_pipeline.batch import move_batch
from embshard_dist.train_pipeline.interface import In
from embshard_dist.train_pipeline.streams import hand_over, on_stream

__all__ = ["DataLoadingThread"]


class DataLoadingThread(threading.Thread, Generic[In]):
    """Loads batches ahead in a daemon thread (see the module docstring).

    Args:
        device: where batches are copied.
        dataloader_iter: the batches.
        to_device_non_blocking: copy with ``non_blocking`` (CUDA, pinned memory).
        memcpy_stream_priority: priority of the copy stream created on CUDA.
        memcpy_stream: the copy stream to use instead (CUDA).
    """

    def __init__(
        self,
        device: torch.device,
        dataloader_iter: Iterator[In],
        to_device_non_blocking: bool,
        memcpy_stream_priority: int = 0,
        memcpy_stream: torch.cuda.Stream | None = None,
    ) -> None:
        super().__init__(name="DataLoadingThread", daemon=True)
        self._device = torch.device(device)
        self._iter = dataloader_iter
        self._non_blocking = to_device_non_blocking
        if memcpy_stream is None and self._device.type == "cuda":
            memcpy_stream = torch.cuda.Stream(device=self._device, priority=memcpy_stream_priority)
        self._stream = memcpy_stream
        self._stopped = False
        self._ended = False
        self._buffered: In | None = None
        self._error: BaseException | None = None
        self._empty = threading.Event()
        self._filled = threading.Event()
        self._empty.set()

    def run(self) -> None:
        """The thread's loop: fill the one-batch buffer whenever it is empty, until the
        iterator ends, a batch fails to load, or :meth:`stop`."""
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        while True:
            self._empty.wait()
            if self._stopped:
                break
            try:
                batch = next(self._iter)
                with on_stream(self._stream):
                    moved = move_batch(batch, self._device, non_blocking=self._non_blocking)
            except StopIteration:
                break
            except BaseException as error:  # re-raised in the caller's thread
                self._error = error
                break
            self._buffered = moved
            self._empty.clear()
            self._filled.set()
            if self._stopped:  # stop() came after the wait: it may have set _empty before
                break
        self._ended = True
        self._filled.set()

    def stop(self) -> None:
        """Stop after the batch being loaded, if any; :meth:`get_next_batch` then returns what
        is buffered, then ``None``."""
        self._stopped = True
        self._empty.set()
        self._filled.set()

    def get_next_batch(self, none_throws: bool = False) -> In | None:
        """The next batch, on the device (waits for the thread); ``None`` at the end.

        Call it from one thread (the training loop).

        Raises:
            StopIteration: at the end, with ``none_throws``.
            Exception: what loading or copying the batch raised, in this thread.
        """
        if not self.is_alive() and not self._ended and not self._stopped:
            raise RuntimeError("DataLoadingThread.get_next_batch: call start() first")
        self._filled.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        batch = self._buffered
        if batch is None:
            if none_throws:
                raise StopIteration
            return None
        hand_over(batch, self._stream)
        self._buffered = None
        if not self._ended:
            self._filled.clear()
            self._empty.set()
        return batch
