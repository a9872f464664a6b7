"""protocol/claims.py: round claims believed only as far as our own observation allows; "exchanging" and record
expiry capped by age (issue 29)."""
from __future__ import annotations

import pytest

from gasloc.protocol.claims import (
    RoundClaims,
    expiry_cap,
    frozen_records,
    median_cap,
    ready_max_age_s,
    stale_ready,
)

pytestmark = pytest.mark.timeout(30)


def test_a_first_claim_is_believed_up_to_the_median_plus_slack():
    c = RoundClaims(slack=3, speedup=4.0)
    c.observe({"a": 10, "b": 11, "c": 12}, own_round=11)
    assert c.believed({"a": 10, "b": 11, "c": 12}, 11) == {"a": 10, "b": 11, "c": 12}
    c.observe({"liar": 10**9}, own_round=11)                 # arrives later: capped at median(10, 11, 12, 11) + 3
    assert c.plausible("liar", 10**9, 11) == 14


def test_a_claim_grows_at_most_speedup_rounds_per_round_of_ours():
    c = RoundClaims(slack=2, speedup=4.0)
    c.observe({"a": 10}, own_round=10)
    assert c.plausible("a", 10**9, 10) == 12
    assert c.plausible("a", 10**9, 15) == 12 + 20            # 5 rounds of ours: at most 20 more
    assert c.plausible("a", 13, 15) == 13                    # an honest claim is believed as it is
    assert c.plausible("a", -5, 15) == 0


def test_time_without_our_rounds_counts_in_units_of_our_round_time():
    """A peer stopped for 20 s (SIGSTOP, suspend) made no rounds while the swarm went on: the swarm's claims may
    have grown by speedup x 20 s / our round time meanwhile (the e2e frozen peer resynced to round 5 from 9 when
    only our rounds counted)."""
    c = RoundClaims(slack=2, speedup=4.0)
    c.observe({"a": 9}, own_round=9, now=100.0, round_s=3.0)
    assert c.plausible("a", 15, 9, now=100.0, round_s=3.0) == 11
    assert c.plausible("a", 15, 9, now=120.0, round_s=3.0) == 15            # 20 s = 6.7 of our rounds: up to 37
    assert c.plausible("a", 10**9, 9, now=120.0, round_s=3.0) == 9 + 2 + 26
    assert c.plausible("a", 10**9, 9, now=120.0) == 11                      # no round time known: rounds only


def test_sybils_in_a_joiners_first_listing_are_outvoted_by_the_median():
    """Three Sybils claiming 10^9 beside four honest peers at round ~20: the median is an honest claim."""
    c = RoundClaims(slack=3, speedup=4.0)
    listing = {"h1": 19, "h2": 20, "h3": 20, "h4": 21, "s1": 10**9, "s2": 10**9, "s3": 10**9}
    c.observe(listing, own_round=None)
    b = c.believed(listing, 0)
    assert max(b.values()) <= 24 and b["h2"] == 20
    assert median_cap([], 3) is None


def test_a_peer_that_left_is_capped_anew_when_it_comes_back():
    c = RoundClaims(slack=1, speedup=1.0)
    c.observe({"a": 5, "b": 5}, own_round=5)
    c.forget_absent({"a"})
    c.observe({"a": 6, "b": 500}, own_round=6)
    assert c.plausible("b", 500, 6) == 6 + 1


def test_exchanging_for_longer_than_a_round_is_not_ready():
    seen = {"honest": ("exchanging", 7, 100.0), "forever": ("exchanging", 7, 10.0), "t": ("training", 3, 0.0)}
    limit = ready_max_age_s(10.0, 30.0, 15.0)
    assert limit == pytest.approx(50.0)
    assert stale_ready(seen, 100.0 + 20, limit) == {"forever"}
    assert ready_max_age_s(10.0, 30.0, 15.0, own_round_s=40.0) == pytest.approx(120.0)   # overlap: a long phase


def test_expiry_is_capped_and_a_record_never_refreshed_is_dropped():
    assert expiry_cap(1e12, 1000.0, 45.0) == 1045.0
    assert expiry_cap(1010.0, 1000.0, 45.0) == 1010.0
    seen = {"fresh": (999.0, 990.0), "frozen": (500.0, 900.0)}
    assert frozen_records(seen, 1000.0, 45.0) == {"frozen"}
