"""Blocking work off the trio loop, on a fixed set of threads, for one queue put and one wake-up each way.

`trio.to_thread.run_sync` does more per call than a cached 128 KiB read costs: it names the OS thread for
the job and back (two prctl calls through ctypes, each releasing the GIL to threads that then fight for
it), and builds a cancel scope and a limiter token. FUSE handlers are never cancelled (pyfuse3 lets them
finish), so a plain queue and `run_sync_soon` back to the waiting task are enough. The number of threads
bounds how many calls run at once, as a CapacityLimiter would.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import trio

T = TypeVar("T")
_Job = tuple[Callable[..., Any], tuple[Any, ...], trio.lowlevel.TrioToken, trio.lowlevel.Task]


class WorkerThreads:
    def __init__(self, name: str, count: int) -> None:
        self.name = name
        self.count = count
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on one of the threads; its result or exception here."""
        if not self._threads:
            self._start()
        task = trio.lowlevel.current_task()
        self._jobs.put((fn, args, trio.lowlevel.current_trio_token(), task))
        # The thread's outcome comes back through reschedule(): its value returned, its exception raised.
        result: T = await trio.lowlevel.wait_task_rescheduled(
            lambda _: trio.lowlevel.Abort.FAILED  # a call in flight runs to its end
        )
        return result

    def _start(self) -> None:
        for i in range(self.count):
            thread = threading.Thread(target=self._work, name=f"{self.name}-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args, token, task = job
            result = outcome.capture(fn, *args)
            del fn, args, job  # nothing of the call stays alive in an idle thread
            # If the loop ended (unmounted) while this ran, nobody is waiting.
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(trio.lowlevel.reschedule, task, result)

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)
        self._threads.clear()
