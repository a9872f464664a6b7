"""runtime/aio.py: the training thread's wait on a coroutine ends with its result, at its timeout, or at once when
a stop is requested (a stop signal must not wait out a download's deadline), and the coroutine is cancelled."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from gasloc.runtime.aio import LoopThread, Stopped

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def loop():
    lt = LoopThread("test-aio")
    yield lt
    lt.stop()


async def _forever(cancelled: threading.Event) -> None:
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        cancelled.set()
        raise


async def _answer() -> int:
    await asyncio.sleep(0.01)
    return 42


def test_result_and_timeout(loop):
    stop = threading.Event()
    assert loop.run(_answer(), 5, stop=stop) == 42
    cancelled = threading.Event()
    with pytest.raises(TimeoutError):
        loop.run(_forever(cancelled), 0.6)
    assert cancelled.wait(2)


def test_a_stop_ends_the_wait_long_before_the_timeout_and_cancels_the_coroutine(loop):
    stop, cancelled = threading.Event(), threading.Event()
    threading.Timer(0.3, stop.set).start()
    t0 = time.monotonic()
    with pytest.raises(Stopped):
        loop.run(_forever(cancelled), 60, stop=stop)
    assert time.monotonic() - t0 < 3
    assert cancelled.wait(2)


def test_a_stop_set_before_the_wait_still_returns_a_result_that_is_ready(loop):
    """The result wins when it is there within the first poll: a finished download is not thrown away."""
    stop = threading.Event()
    stop.set()
    assert loop.run(_answer(), 5, stop=stop) == 42
