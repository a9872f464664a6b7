"""Noticing that this whole process stopped running for a while (SIGSTOP, a suspended laptop or VM, a host swapping
hard) and deciding whether to resync with the swarm instead of mixing a stale model back in.

Why resync: a peer that was away for several rounds comes back with a model the swarm has left behind. Mixing it
in works, but the outer momentum carries each catch-up correction into the following rounds, so for a while the
returning peer (and each partner it touches) sits far from the rest (measured in the e2e swarm: a peer frozen for
20 s of 2 s rounds came back at ||own - partner|| / ||own|| = 1.5-2.1, against 0.1-0.4 in steady state). A state
download costs one transfer of the model, the same as one exchange, and lands the peer on the swarm at once.

Why only after an absence longer than the record's TTL: by then the swarm has dropped us from its listing, so
coming back is a rejoin in membership terms too. A merely slow peer never stops its event loop, so it never
qualifies: stragglers keep mixing, as the method intends.
"""
from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence


def boottime() -> float:
    """Seconds on a clock that also runs while the machine is suspended (CLOCK_MONOTONIC stops then)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME) if hasattr(time, "CLOCK_BOOTTIME") else time.monotonic()


class AbsenceWatch:
    """`tick()` runs every TICK_S on the peer's event loop; `take()` (any thread) returns the longest interval since
    the previous `take()` during which the loop did not tick: ~TICK_S when all is well, the length of the stop when
    the process was stopped. Also counts a stop that the loop has not yet ticked after (now - last tick)."""

    TICK_S = 0.5

    def __init__(self, clock: Callable[[], float] = boottime):
        self._clock = clock
        self._lock = threading.Lock()
        self._last = clock()
        self._longest = 0.0

    def tick(self) -> None:
        with self._lock:
            now = self._clock()
            self._longest = max(self._longest, now - self._last)
            self._last = now

    def peek(self) -> float:
        """What `take` would return now, without starting a new interval (the listing asks whether we are just back
        from a stop that the daemon has not handled yet)."""
        with self._lock:
            return max(self._longest, self._clock() - self._last)

    def take(self) -> float:
        with self._lock:
            longest = max(self._longest, self._clock() - self._last)
            self._longest = 0.0
            return longest


def resync_due(absent_s: float, *, ttl_s: float, recent_round_s: Sequence[float], after_rounds: float) -> bool:
    """Resync when the absence outlived our DHT record (the swarm dropped us) and lasted longer than `after_rounds`
    of our own recent rounds (the median, so the round that contained the stop does not count itself);
    after_rounds == 0 disables it. With no round finished yet, the TTL alone decides."""
    if after_rounds <= 0 or absent_s <= ttl_s:
        return False
    return not recent_round_s or absent_s > after_rounds * statistics.median(recent_round_s)
