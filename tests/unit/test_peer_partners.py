"""Partner choice and backoff of a live GASLoC peer (pure: times are passed in)."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from gasloc.protocol.partners import Backoff, candidate_weights, pick_partner


def test_failures_back_off_exponentially_up_to_the_cap():
    b = Backoff(min_backoff_s=1.0, max_backoff_s=5.0, busy_cooldown_s=0.5, jitter=0.0)
    rng = random.Random(0)
    assert [b.failed("p", 100.0, rng) for _ in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert b.blocked("p", 104.9) and not b.blocked("p", 105.1)


def test_jitter_stays_within_its_band():
    rng = random.Random(1)
    # a first failure of many different peers: each delay is min_backoff_s +- 20%, and they differ
    delays = [Backoff(10.0, 100.0, 0.5, jitter=0.2).failed("p", 0.0, rng) for _ in range(200)]
    assert min(delays) >= 8.0 and max(delays) <= 12.0 and len(set(delays)) > 100


def test_busy_is_a_short_cooldown_that_does_not_escalate():
    b = Backoff(min_backoff_s=2.0, max_backoff_s=60.0, busy_cooldown_s=0.5)
    for t in range(5):
        b.busy("p", float(t))
    assert b.failures == {}
    assert b.blocked("p", 4.4) and not b.blocked("p", 4.6)


def test_success_clears_and_absent_peers_are_forgotten():
    b = Backoff(min_backoff_s=1.0, max_backoff_s=5.0, busy_cooldown_s=0.5)
    rng = random.Random(0)
    b.failed("p", 0.0, rng)
    b.failed("q", 0.0, rng)
    b.succeeded("p")
    assert not b.blocked("p", 0.1) and b.failures == {"q": 1}
    b.forget_absent(["p"])
    assert b.failures == {} and b.until == {} and b.failed_until == {}


def test_a_busy_after_a_failure_is_a_cooldown_not_a_failure_backoff():
    b = Backoff(min_backoff_s=1.0, max_backoff_s=5.0, busy_cooldown_s=0.5, jitter=0.0)
    b.failed("p", 0.0, random.Random(0))
    assert b.blocked("p", 0.9) and b.backing_off("p", 0.9)
    assert not b.blocked("p", 1.1) and not b.backing_off("p", 1.1)
    b.busy("p", 2.0)                       # the failure is still counted (no success since), its backoff is over
    assert b.failures == {"p": 1} and b.blocked("p", 2.2) and not b.backing_off("p", 2.2)


def test_pick_partner_skips_peers_in_backoff_and_returns_none_when_nobody_is_free():
    b = Backoff(min_backoff_s=10.0, max_backoff_s=60.0, busy_cooldown_s=0.5)
    rng = random.Random(0)
    b.failed("dead", 0.0, rng)
    picks = {pick_partner({"dead": 1.0, "alive": 1.0}, b, 1.0, rng, weighted=False) for _ in range(50)}
    assert picks == {"alive"}
    assert pick_partner({"dead": 1.0}, b, 1.0, rng, weighted=False) is None
    assert pick_partner({}, b, 1.0, rng, weighted=False) is None


def test_uniform_choice_ignores_bandwidth_and_weighted_choice_follows_it():
    b = Backoff(min_backoff_s=1.0, max_backoff_s=5.0, busy_cooldown_s=0.5)
    rng = random.Random(0)
    ready = {"fast": 900e6, "slow": 100e6}
    uni = Counter(pick_partner(ready, b, 0.0, rng, weighted=False) for _ in range(4000))
    wtd = Counter(pick_partner(ready, b, 0.0, rng, weighted=True) for _ in range(4000))
    assert uni["fast"] / 4000 == pytest.approx(0.5, abs=0.04)
    assert wtd["fast"] / 4000 == pytest.approx(0.9, abs=0.03)


def test_unmeasured_bandwidth_gets_the_median_of_the_known_ones():
    assert candidate_weights({"a": 10.0, "b": 30.0, "new": 0.0}, weighted=True) == {"a": 10.0, "b": 30.0,
                                                                                   "new": 20.0}
    assert candidate_weights({"new": 0.0}, weighted=True) == {"new": 1.0}
    assert candidate_weights({"a": 10.0, "new": 0.0}, weighted=False) == {"a": 1.0, "new": 1.0}


def test_recent_partners_are_passed_over_only_early_and_only_when_someone_else_is_due():
    from gasloc.protocol.partners import peers_to_avoid
    live = {"a", "b", "c"}
    assert peers_to_avoid(["a"], live, elapsed_s=0.1, deadline_s=2.0) == {"a"}
    assert peers_to_avoid(["a"], live, elapsed_s=1.0, deadline_s=2.0) == set()   # second half: anyone
    assert peers_to_avoid(["a"], {"a"}, elapsed_s=0.1, deadline_s=2.0) == set()   # a 2-peer swarm
    assert peers_to_avoid(["gone"], live, elapsed_s=0.1, deadline_s=2.0) == set()
    # only while someone else is due in the first half: c computes past it, so waiting for it only costs time
    assert peers_to_avoid(["a"], live, elapsed_s=0.1, deadline_s=2.0, soon={"a"}) == set()
    assert peers_to_avoid(["a"], live, elapsed_s=0.1, deadline_s=2.0, soon={"a", "c"}) == {"a"}
    # a longer memory never covers everyone we could ask: the oldest of them is fair game again
    assert peers_to_avoid(["c", "b", "a"], live, elapsed_s=0.1, deadline_s=2.0) == {"a", "b"}
    assert peers_to_avoid(["c", "b", "a"], live, elapsed_s=0.1, deadline_s=2.0, soon={"a", "b"}) == set()
    # a streak (the whole memory one peer) is passed over in the first half even with nobody else due
    assert peers_to_avoid(["a", "a", "a"], live, elapsed_s=0.1, deadline_s=2.0, soon={"a"}) == {"a"}
    assert peers_to_avoid(["a", "a", "a"], live, elapsed_s=1.0, deadline_s=2.0, soon={"a"}) == set()
    assert peers_to_avoid(["b", "a", "a"], live, elapsed_s=0.1, deadline_s=2.0, soon={"a"}) == set()
    assert peers_to_avoid(["a", "a", "a"], {"a"}, elapsed_s=0.1, deadline_s=2.0, soon={"a"}) == set()  # 2 peers
    b = Backoff(min_backoff_s=1.0, max_backoff_s=5.0, busy_cooldown_s=0.5)
    rng = random.Random(0)
    picks = {pick_partner({"a": 1.0, "b": 1.0}, b, 0.0, rng, weighted=False, avoid={"a"}) for _ in range(50)}
    assert picks == {"b"}


def test_slower_peers_are_passed_over_by_the_faster_side_only_early_and_only_once_met():
    from gasloc.protocol.partners import slower_peers
    links = {"fast": 3e6, "slow": 0.25e6, "new": 0.0, "2x": 1.5e6}
    assert slower_peers(3e6, links, elapsed_s=1.0, window_s=10.0, ratio=3.0) == {"slow"}
    assert slower_peers(3e6, links, elapsed_s=5.0, window_s=10.0, ratio=3.0) == set()    # second half: anyone
    assert slower_peers(0.25e6, links, elapsed_s=1.0, window_s=10.0, ratio=3.0) == set()  # the slow side takes all
    assert slower_peers(0.0, links, elapsed_s=1.0, window_s=10.0, ratio=3.0) == set()     # we have not measured
    assert slower_peers(3e6, links, elapsed_s=1.0, window_s=10.0, ratio=0.0) == set()     # off
    assert slower_peers(3e6, links, elapsed_s=1.0, window_s=10.0, ratio=1.5) == {"slow", "2x"}


def test_unmeasured_peers_are_tried_first_until_a_slower_class_is_in_sight():
    from gasloc.protocol.partners import peers_to_explore
    alike = {"met": 0.25e6, "new": 0.0, "other": 0.0}    # a fast peer that has met only a slow one so far
    assert peers_to_explore(0.25e6, alike, elapsed_s=1.0, window_s=10.0, ratio=3.0) == {"new", "other"}
    assert peers_to_explore(0.25e6, alike, elapsed_s=5.0, window_s=10.0, ratio=3.0) == set()   # second half: anyone
    assert peers_to_explore(0.25e6, alike, elapsed_s=1.0, window_s=10.0, ratio=0.0) == set()   # off
    assert peers_to_explore(0.0, {"a": 0.0, "b": 0.0}, 1.0, 10.0, ratio=3.0) == {"a", "b"}    # nothing measured yet
    # once our best exchange ran over 3x faster than one partner, slower_peers decides: no more exploring
    told_apart = {"slow": 0.25e6, "fast": 3e6, "new": 0.0}
    assert peers_to_explore(3e6, told_apart, elapsed_s=1.0, window_s=10.0, ratio=3.0) == set()
    # within the ratio the rates still look alike: keep exploring
    assert peers_to_explore(0.6e6, {"a": 0.25e6, "new": 0.0}, 1.0, 10.0, ratio=3.0) == {"new"}
