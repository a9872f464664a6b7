"""The peer's event loop: uvloop in its own thread, so DHT calls, announcements and exchanges never wait on the
training step and the training step never waits on the network (except where a round explicitly asks).

The training thread hands coroutines over with `run()` (blocking, with a timeout) or `submit()` (a
concurrent.futures.Future); everything else stays on the loop.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

log = logging.getLogger(__name__)
T = TypeVar("T")
POLL_S = 0.5


class Stopped(Exception):
    """The wait was given up because its `stop` event was set (a stop signal): the coroutine was cancelled."""


class LoopThread:
    def __init__(self, name: str = "gasloc-aio"):
        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        # cancel what is left (background tasks) so the loop closes without "Task was destroyed" noise
        pending = asyncio.all_tasks(self.loop)
        for task in pending:
            task.cancel()
        if pending:
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None,
            stop: threading.Event | None = None) -> T:
        """Run `coro` on the loop and wait for it. After `timeout` seconds of waiting the coroutine is cancelled and
        TimeoutError raised; once `stop` is set (checked every POLL_S) it is cancelled and Stopped raised.

        Time while this process was frozen (SIGSTOP, a suspended laptop) does not count: the wait advances in
        steps of at most POLL_S * 2, so after a resume the coroutine's own deadlines decide, not this safety net.
        """
        return self.wait(self.submit(coro), timeout, stop)

    def wait(self, fut: concurrent.futures.Future[T], timeout: float | None = None,
             stop: threading.Event | None = None) -> T:
        """Wait for a submitted coroutine's result, as `run()` does (same timeout, stop and frozen-time rules)."""
        waited = 0.0
        while True:
            t = time.monotonic()
            try:
                return fut.result(POLL_S)
            except concurrent.futures.TimeoutError:
                waited += min(time.monotonic() - t, 2 * POLL_S)
                if stop is not None and stop.is_set():
                    fut.cancel()
                    raise Stopped("stop requested") from None
                if timeout is not None and waited >= timeout:
                    fut.cancel()
                    raise TimeoutError(f"coroutine did not finish within {timeout} s") from None

    def stop(self, timeout: float = 5.0) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("event_loop_stuck timeout_s=%.1f", timeout)
