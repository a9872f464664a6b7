"""A stop signal repeated at once is the same request (a dying multi-threaded parent sends its death signal once
per thread); one repeated later forces the exit."""
from gasloc.runtime.procs import StopSignals


def test_first_repeat_and_force():
    now = [100.0]
    s = StopSignals(same_within_s=1.0, clock=lambda: now[0])
    assert s.classify() == "first"
    now[0] += 0.001
    assert s.classify() == "repeat"
    now[0] += 0.5
    assert s.classify() == "repeat"   # still within a second of the first
    now[0] += 0.6
    assert s.classify() == "force"
    assert s.first_at == 100.0
