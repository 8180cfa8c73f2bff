"""The priority worker pool (reader and decode threads) and its failure handling."""

from __future__ import annotations

import heapq
import itertools
import queue
import threading

from zipmoe.errors import ServingError, ZipmoeError

__all__ = ["PriorityWorkers"]


class PriorityWorkers:
    """Threads that run queued jobs, the lowest rank first (ties: first queued first).

    A job that raises does not kill its thread: the exception goes to ``on_error(fn, args,
    exc)`` (the fetcher hands it to the fetch the job was for, so that the layer waiting for
    that fetch learns it at once), or, without a handler, is kept in :attr:`failure` for
    whoever waits to find (:meth:`check`). A thread that stops anyway (the handler itself
    failed) is seen by :meth:`check` too: the layer waits with a timeout and asks.
    """

    def __init__(self, n: int, name: str, on_error=None) -> None:
        # the jobs in a heap under a plain lock, and one token per job in a C-implemented queue
        # that the threads block on: queue.PriorityQueue's Condition (Python code on every put
        # and get, a quarter of the serving thread's issue time on the CPU box) is not needed
        # when every token is one job and whoever takes a token pops the best job there is
        self._heap: list = []
        self._lock = threading.Lock()
        self._tokens = queue.SimpleQueue()
        self._seq = itertools.count()
        self.name = name
        self.on_error = on_error
        self.failure: BaseException | None = None
        self._stopping = False
        self._threads = [threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True) for i in range(n)]
        for th in self._threads:
            th.start()

    def __len__(self) -> int:
        return len(self._threads)

    def submit(self, rank, fn, *args) -> None:
        item = (rank, next(self._seq), fn, args)
        with self._lock:
            heapq.heappush(self._heap, item)
        self._tokens.put(None)

    def _loop(self) -> None:
        take, lock, heap, pop = self._tokens.get, self._lock, self._heap, heapq.heappop
        while True:
            take()
            with lock:
                _, _, fn, args = pop(heap)
            if fn is None:
                return
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 - a job's failure must not stop the thread
                handler = self.on_error
                if handler is None:
                    self.failure = exc
                    continue
                try:
                    handler(fn, args, exc)
                except BaseException as exc2:  # noqa: BLE001
                    self.failure = exc2
                    raise

    def check(self) -> None:
        """Raise :class:`ServingError` if a job failed unhandled or a thread stopped."""
        exc = self.failure
        if exc is not None:
            self.failure = None
            raise ServingError(f"a {self.name} thread failed: {_one_line(exc)}") from None
        if not self._stopping and not all(th.is_alive() for th in self._threads):
            raise ServingError(f"a {self.name} thread stopped; reload the model")

    def shutdown(self) -> None:
        self._stopping = True
        if not any(th.is_alive() for th in self._threads):
            return
        for _ in self._threads:
            self.submit(float("inf"), None)
        for th in self._threads:
            th.join()


def _one_line(exc: BaseException) -> str:
    msg = " ".join(str(exc).split()) or "(no message)"
    return msg if isinstance(exc, ZipmoeError) else f"{type(exc).__name__}: {msg}"

