"""protocol/donors.py: a donor's metadata checked against its header and its stream, donors chosen by how long we
have seen them (not by the round they claim), and two donors checked against each other (issue 29)."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from gasloc.protocol.codes import Code
from gasloc.protocol.donors import adopted_round, check_metadata, cross_check, pick_donors

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("meta, code", [
    ({"round": 12, "num_outer": 0, "peer_id": "QmD"}, Code.OK),
    ({}, Code.OK),                                   # nothing claimed: the header and the stream say it
    ({"round": 12, "extra": [1, 2], "z_prev": "x"}, Code.OK),   # unknown keys are ignored
    ({"round": "soon"}, Code.BAD_HEADER),
    ({"round": -7}, Code.BAD_HEADER),
    ({"round": 10**9}, Code.BAD_HEADER),             # contradicts the header's 12
    ({"round": 12.0}, Code.BAD_HEADER),
    ({"round": True}, Code.BAD_HEADER),
    ({"num_outer": 2}, Code.BAD_HEADER),
    ({"num_outer": None}, Code.BAD_HEADER),
    ({"peer_id": "QmSomeoneElse"}, Code.DISTRUSTED),  # it would have the joiner blame an honest peer
    ({"peer_id": None}, Code.DISTRUSTED),
])
def test_metadata_is_checked_against_the_header_and_the_stream(meta, code):
    got, why = check_metadata(meta, reply_round=12, num_outer=0, donor="QmD")
    assert got == code and (why == "") == (code == Code.OK)


def test_metadata_that_is_no_object_is_a_code():
    for meta in (None, [], "round", 3):
        assert check_metadata(meta, reply_round=1, num_outer=0, donor="QmD")[0] == Code.BAD_HEADER
    assert check_metadata({}, reply_round=-1, num_outer=0, donor="QmD")[0] == Code.BAD_HEADER


def test_donors_are_chosen_by_tenure_not_by_claimed_round():
    """Today's rule put the top 3 claimed rounds first: a Sybil claiming 10^9 was in every joiner's first three.
    By tenure, peers we have seen for minutes come first, and the claim orders nothing."""
    rounds = {"old1": 40, "old2": 41, "old3": 39, "sybil": 10**9, "new": 42}
    states = dict.fromkeys(rounds, "training")
    tenure = {"old1": 300.0, "old2": 290.0, "old3": 280.0, "sybil": 5.0, "new": 6.0}
    firsts = Counter()
    for seed in range(200):
        order = pick_donors(rounds, states, tenure, pool=3, rng=random.Random(seed))
        assert set(order[:3]) == {"old1", "old2", "old3"} and set(order[3:]) == {"sybil", "new"}
        firsts[order[0]] += 1
    assert all(firsts[p] > 30 for p in ("old1", "old2", "old3"))   # spread: no peer is every joiner's donor


def test_a_joiner_without_tenure_draws_at_random_and_skips_what_cannot_donate():
    rounds = {"a": 5, "b": 5, "c": 0, "d": 7, "e": 6}
    states = {"a": "training", "b": "exchanging", "c": "training", "d": "joining", "e": "training"}
    seen = Counter()
    for seed in range(300):
        order = pick_donors(rounds, states, {}, pool=3, rng=random.Random(seed), exclude={"e"})
        assert set(order) == {"a", "b"}       # round 0 (trained nothing), joining, excluded: no donors
        seen[order[0]] += 1
    assert min(seen.values()) > 100


def test_a_fork_asks_the_holders_of_its_groups_model_first_if_they_can_donate_at_all():
    """A DiLoCo fork (protocol/epochs.py FORKED) downloads from the members that hold its group's model: a donor by
    tenure could be its own half of the group, and it would stay the fork."""
    rounds = {"old": 9, "mate": 9, "h1": 9, "h2": 9, "gone": 9}
    states = dict.fromkeys(rounds, "training")
    tenure = {"old": 300.0, "mate": 290.0, "h1": 5.0, "h2": 4.0, "gone": 1.0}
    for seed in range(20):
        order = pick_donors(rounds, states, tenure, pool=2, rng=random.Random(seed), first=("h2", "h1", "nobody"),
                            exclude={"gone"})
        assert order[:2] == ["h2", "h1"] and set(order[2:]) == {"old", "mate"}
    # a holder that cannot donate (excluded, joining) is not asked first either
    assert "gone" not in pick_donors(rounds, states, tenure, pool=2, rng=random.Random(0), first=("gone",),
                                     exclude={"gone"})


def test_two_donors_that_agree_confirm_the_first_and_a_disagreement_goes_to_our_own_data():
    ok = cross_check(0.01, 2.0, 2.1, agree=0.1)
    assert ok.first and ok.agreed
    liar_first = cross_check(0.8, 3.5, 2.0, agree=0.1)           # the first donor's state is worse on our batches
    assert not liar_first.first and not liar_first.agreed
    liar_second = cross_check(0.8, 2.0, 3.5, agree=0.1)
    assert liar_second.first and not liar_second.agreed
    assert not cross_check(float("nan"), float("nan"), 2.0, agree=0.1).first


def test_the_adopted_round_is_the_lowest_checked_one_cut_to_what_we_believe():
    assert adopted_round([12, 11], None) == 11
    assert adopted_round([10**9], 15) == 15          # a liar moves the lr schedule at most to the cap
    assert adopted_round([12], 15) == 12
    assert adopted_round([3], -4) == 0


def test_a_donor_claiming_past_what_we_believe_is_no_donor():
    """H5's adversary bench (donor-round: a peer that trains honestly but announces and replies round 10^9, header
    and metadata alike) had its state adopted 4 times in one run: consistent lies pass every format check. Past
    what we believe of it, its reply is refused, and its listing keeps it out of the donor order."""
    assert check_metadata({"round": 10**9}, reply_round=10**9, num_outer=0, donor="QmD", max_round=30)[0] \
        == Code.DISTRUSTED
    assert check_metadata({}, reply_round=30, num_outer=0, donor="QmD", max_round=30)[0] == Code.OK
    believed = {"h1": 20, "liar": 25}
    states = dict.fromkeys(believed, "training")
    order = pick_donors(believed, states, {}, pool=3, rng=random.Random(0),
                        claimed_rounds={"h1": 20, "liar": 10**9})
    assert order == ["h1"]


def test_a_record_may_trail_its_state_but_not_run_ahead_of_it():
    from gasloc.protocol.donors import MAX_RECORD_LEAD, record_overclaims
    assert not record_overclaims(None, 5) and not record_overclaims(3, 5) and not record_overclaims(5, 5)
    assert not record_overclaims(5 + MAX_RECORD_LEAD, 5)
    assert record_overclaims(6 + MAX_RECORD_LEAD, 5) and record_overclaims(1001, 1)
    # checked with the reply's header, before a byte of its payload is read (it was checked after the download)
    code, why = check_metadata({"round": 1}, reply_round=1, num_outer=0, donor="QmD", listed_round=1001)
    assert code == Code.DISTRUSTED and "record claims round 1001" in why
    assert check_metadata({"round": 5}, reply_round=5, num_outer=0, donor="QmD",
                          listed_round=5 + MAX_RECORD_LEAD)[0] == Code.OK


def test_the_peers_whose_trust_our_guard_lowered_are_asked_last_the_most_trusted_first():
    """Not left out: the odd one out of a 3-peer swarm has rejected the very peers it must download from."""
    rounds = {"old": 9, "mid": 9, "new": 9, "bad": 9, "worse": 9}
    states = dict.fromkeys(rounds, "training")
    tenure = {"bad": 900.0, "worse": 800.0, "old": 300.0, "mid": 200.0, "new": 5.0}
    for seed in range(50):
        order = pick_donors(rounds, states, tenure, pool=3, rng=random.Random(seed), trust={"worse": 0.1, "bad": 0.4})
        assert set(order[:3]) == {"old", "mid", "new"} and order[3:] == ["bad", "worse"], order
    # every candidate's trust lowered: all still asked, the most trusted first
    assert pick_donors({"x": 3, "y": 3}, {}, {}, pool=3, rng=random.Random(0), trust={"x": 0.2, "y": 0.9}) \
        == ["y", "x"]
