"""The stop detector and the resync rule (peer/swarm/absence.py) on a hand-driven clock."""
from __future__ import annotations

import pytest

from gasloc.peer.swarm.absence import AbsenceWatch, resync_due


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_ticking_loop_reports_its_tick_interval_and_a_stop_its_length():
    c = Clock()
    w = AbsenceWatch(clock=c)
    for _ in range(10):
        c.t += 0.5
        w.tick()
    assert w.take() == pytest.approx(0.5)
    c.t += 20.0  # stopped: no tick for 20 s
    w.tick()
    c.t += 0.5
    w.tick()
    assert w.take() == pytest.approx(20.0)
    c.t += 0.5
    w.tick()
    assert w.take() == pytest.approx(0.5)  # take() starts a new window


def test_a_stop_counts_before_the_loop_has_ticked_after_it():
    # the training thread may look first after SIGCONT: the time since the last tick is the stop
    c = Clock()
    w = AbsenceWatch(clock=c)
    c.t += 30.0
    assert w.take() == pytest.approx(30.0)


def test_resync_needs_both_the_ttl_and_several_rounds():
    rounds = [2.0, 2.2, 1.8, 25.0]  # the median ignores the round that contained the stop
    assert resync_due(20.0, ttl_s=6.0, recent_round_s=rounds, after_rounds=3)
    assert not resync_due(5.0, ttl_s=6.0, recent_round_s=rounds, after_rounds=3)      # record still alive
    assert not resync_due(20.0, ttl_s=6.0, recent_round_s=[60.0] * 5, after_rounds=3)  # under 3 long rounds
    assert not resync_due(20.0, ttl_s=6.0, recent_round_s=rounds, after_rounds=0)      # disabled
    assert resync_due(20.0, ttl_s=6.0, recent_round_s=[], after_rounds=3)              # no round yet: the TTL



def test_peek_reports_a_stop_without_taking_it():
    c = [0.0]
    w = AbsenceWatch(clock=lambda: c[0])
    c[0] = 20.0
    assert w.peek() == 20.0                          # stopped, the loop has not ticked since
    w.tick()                                         # back: the loop ticks again
    assert w.peek() == 20.0 and w.peek() == 20.0     # the listing asks; the daemon's take still sees the stop
    assert w.take() == 20.0 and w.peek() == 0.0
