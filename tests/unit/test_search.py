"""The partner-search policy (protocol/search.py) on a virtual clock: no sockets, no sleeps, no wall-clock bounds."""
from __future__ import annotations

import random

import pytest

from gasloc.protocol.guard import GuardConfig, TrustBook, Verdict
from gasloc.protocol.partners import Backoff
from gasloc.protocol.search import Call, Finish, PartnerPolicy, SearchRules, Sight, Wait

RULES = SearchRules(partner_deadline_s=10.0, retry_interval_s=0.25, exchange_timeout_s=30.0)


def policy(rules: SearchRules = RULES, seed: int = 0, avoid_recent: int = 1) -> PartnerPolicy:
    return PartnerPolicy(rules, Backoff(min_backoff_s=2.0, max_backoff_s=60.0, busy_cooldown_s=0.5),
                         avoid_recent=avoid_recent, rng=random.Random(seed))


def sight(live, ready=(), **kw) -> Sight:
    return Sight(live=set(live), ready={p: 1.0 for p in ready}, **kw)


def run_until_finish(search, see, t0=0.0, limit=1000):
    """Step the search, advancing the virtual clock by each Wait; (actions, finish time)."""
    now, actions = t0, []
    for _ in range(limit):
        a = search.next(see(now), now)
        actions.append(a)
        if isinstance(a, Finish):
            return actions, now
        assert isinstance(a, Wait), a
        now += a.seconds
    raise AssertionError("the search never finished")


def test_nobody_ready_waits_at_the_retry_pace_and_finishes_exactly_at_the_deadline():
    s = policy().begin(100.0)
    actions, end = run_until_finish(s, lambda now: sight({"a", "b"}), t0=100.0)
    assert end == pytest.approx(110.0)
    assert actions[-1] == Finish("deadline")
    assert all(w.seconds == pytest.approx(0.25) for w in actions[:-2])
    assert 0 <= actions[-2].seconds <= 0.25  # the last wait is cut to what is left


def test_alone_finishes_at_once_and_stopping_too():
    assert policy().begin(0.0).next(sight(set()), 0.0) == Finish("alone")
    assert policy().begin(0.0).next(sight({"a"}, {"a"}, stopping=True), 0.0) == Finish("stopping")


def test_a_ready_peer_is_called():
    assert policy().begin(0.0).next(sight({"a", "b"}, {"b"}), 1.0) == Call("b")


def test_a_late_incoming_exchange_is_allowed_to_finish():
    """At the deadline a responder exchange in flight gets its own deadline, not cut off."""
    s = policy().begin(0.0)
    assert s.next(sight({"a"}, engaged_as_responder=True), 5.0) == Wait(0.25)  # before the deadline: wait as usual
    assert s.next(sight({"a"}, engaged_as_responder=True), 10.0) == Finish("deadline", 31.0)


def test_busy_from_the_partner_costs_it_a_cooldown_and_us_a_random_pause():
    p = policy()
    s = p.begin(0.0)
    pause = s.called("b", "busy", 1.0)
    assert 0 <= pause <= RULES.retry_interval_s
    assert s.next(sight({"b", "c"}, {"b"}), 1.2) == Wait(0.25)     # b is cooling down (0.5 s)
    assert s.next(sight({"b", "c"}, {"b"}), 1.6) == Call("b")      # and then callable again
    assert p.backoff.failures == {}                                 # busy is not a failure


def test_busy_from_our_own_side_costs_the_partner_nothing():
    s = policy().begin(0.0)
    s.called("b", "busy", 1.0, local=True)
    assert s.next(sight({"b"}, {"b"}), 1.0) == Call("b")


def test_two_peers_that_call_each_other_at_once_both_get_busy_and_the_random_pauses_part_them():
    """BUSY from both sides: each is engaged as initiator when the other's call arrives. Their pauses differ, so
    the next attempt is not simultaneous again."""
    a, b = policy(seed=1), policy(seed=2)
    sa, sb = a.begin(0.0), b.begin(0.0)
    assert sa.next(sight({"b"}, {"b"}), 0.0) == Call("b") and sb.next(sight({"a"}, {"a"}), 0.0) == Call("a")
    pa, pb = sa.called("b", "busy", 0.01), sb.called("a", "busy", 0.01)
    assert pa != pb
    # the one that wakes first calls (the other is still waiting for a caller, its offer free) and succeeds
    first, other = ("a", "b") if pa < pb else ("b", "a")
    s_first = sa if first == "a" else sb
    t = 0.01 + min(pa, pb)
    assert s_first.next(sight({other}, {other}), max(t, 0.51)) == Call(other)


def test_backoff_grows_with_failures_up_to_its_cap_and_clears_on_success():
    p = policy()
    s = p.begin(0.0)
    now, delays = 0.0, []
    for _ in range(8):
        s.called("b", "timeout", now)
        delays.append(s.backoff_of("b", now))
        now += delays[-1]
    for d, n in zip(delays, range(1, 9)):
        assert d == pytest.approx(min(60.0, 2.0 * 2 ** (n - 1)), rel=0.21)  # +-20% jitter
    assert max(delays) <= 60.0 * 1.2
    s = p.begin(now)  # a later round: the backoff carries over
    s.called("b", "failed", now)
    assert s.next(sight({"b"}, {"b"}), now + 1.0) == Wait(0.25)  # blocked while in backoff
    p.succeeded("b")
    assert s.next(sight({"b"}, {"b"}), now + 1.0) == Call("b")


def test_a_recent_partner_is_passed_over_in_the_first_half_unless_it_is_the_only_one():
    p = policy()
    p.succeeded("b")
    s = p.begin(0.0)
    assert s.next(sight({"b", "c"}, {"b"}), 1.0) == Wait(0.25)   # c may still become ready
    assert s.next(sight({"b", "c"}, {"b"}), 5.0) == Call("b")    # second half: anyone
    assert p.begin(0.0).next(sight({"b"}, {"b"}), 1.0) == Call("b")  # b is all there is
    # c is training and due only after the first half (5 s): not worth the wait
    assert p.begin(0.0).next(sight({"b", "c"}, {"b"}, training={"c": 6.0}), 1.0) == Call("b")
    assert p.begin(0.0).next(sight({"b", "c"}, {"b"}, training={"c": 4.0}), 1.0) == Wait(0.25)


def test_overlap_searches_past_the_deadline_until_the_cut():
    s = policy().begin(0.0, window_s=30.0)
    assert s.next(sight({"a"}, cut=False), 12.0) == Wait(0.25)     # deadline passed, inner steps still running
    assert s.next(sight({"a"}, cut=True), 12.0) == Finish("deadline")
    # and never sooner than a plain round: a short inner phase still searches partner_deadline_s
    short = policy().begin(0.0, window_s=1.0)
    assert short.next(sight({"a"}, cut=True), 5.0) == Wait(0.25)
    assert short.window_s == 10.0


SLOW = SearchRules(partner_deadline_s=10.0, retry_interval_s=0.25, slower_link_ratio=3.0, slower_link_open_share=0.0)


def test_slower_link_rule_passes_over_slow_peers_in_the_first_half_and_declines_their_calls():
    p = policy(SLOW)
    s = p.begin(0.0)
    rates = {"fast": 30e6, "slow": 3e6}
    see = dict(rates=rates, own_link=30e6)
    assert s.next(sight({"fast", "slow"}, {"slow"}, **see), 1.0) == Wait(0.25)
    assert s.passed == {"slow"}
    assert p.declines("slow", 3e6, 30e6, 2.0) and not p.declines("fast", 30e6, 30e6, 2.0)
    assert s.next(sight({"fast", "slow"}, {"slow"}, **see), 6.0) == Call("slow")  # second half: anyone
    assert not p.declines("slow", 3e6, 30e6, 6.0)
    p.end()
    assert not p.declines("slow", 3e6, 30e6, 1.0)  # no search, nothing to wait for


def test_slower_link_rule_explores_unmeasured_peers_first_until_it_can_tell_classes_apart():
    """While exploring, a measured peer is neither called nor accepted in the first half: the slow peer of the e2e
    swarm (it calls everyone) otherwise took each fast peer in turn and the fast ones never met (CI)."""
    p = policy(SLOW)
    s = p.begin(0.0)
    rates = {"met": 3e6, "new": 0.0}
    assert s.next(sight({"met", "new"}, {"met"}, rates=rates, own_link=3e6), 1.0) == Wait(0.25)
    assert p.declines("met", 3e6, 3e6, 1.5) and not p.declines("new", 0.0, 3e6, 1.5)
    assert not p.declines("met", 3e6, 3e6, 6.0)  # second half: anyone
    assert s.next(sight({"met", "new"}, {"met", "new"}, rates=rates, own_link=3e6), 1.0) == Call("new")
    # once a slower class is in sight, exploring is over: the slower-link rule decides alone
    s2 = p.begin(10.0)
    told = {"met": 3e6, "fast": 30e6, "new": 0.0}
    assert s2.next(sight({"met", "fast", "new"}, {"fast"}, rates=told, own_link=30e6), 10.5) == Call("fast")
    assert not s2.exploring and not p.declines("new", 0.0, 30e6, 10.6)


def test_an_unmeasured_peer_in_its_busy_cooldown_is_still_explored():
    """A BUSY from the unmeasured peer ("engaged") puts it in a 0.5-s cooldown; the search must go on declining the
    measured slow peer meanwhile. When the cooldown dropped it from the exploring set, the search called the slow
    peer in that half second (or accepted its call), and a fast peer paired with the slow one instead of the other
    fast one."""
    p = policy(SLOW)
    s = p.begin(0.0)
    see = dict(rates={"slow": 3e6, "fast": 0.0}, own_link=3e6)
    assert s.next(sight({"slow", "fast"}, {"slow", "fast"}, **see), 1.0) == Call("fast")
    s.called("fast", "busy", 1.1)                       # engaged with someone else: a short cooldown
    assert s.next(sight({"slow", "fast"}, {"slow", "fast"}, **see), 1.2) == Wait(0.25)  # neither is called
    assert s.exploring == {"fast"}
    assert p.declines("slow", 3e6, 3e6, 1.3)
    assert s.next(sight({"slow", "fast"}, {"slow", "fast"}, **see), 1.7) == Call("fast")  # cooldown over
    # a peer that failed us is another matter: it is not waited for during its backoff (2 s), the measured one
    # may be taken; once the backoff is over it is the one to explore again
    s.called("fast", "timeout", 1.8)
    assert s.next(sight({"slow", "fast"}, {"slow", "fast"}, **see), 1.9) == Call("slow")
    assert not p.declines("slow", 3e6, 3e6, 2.0)
    assert s.next(sight({"slow", "fast"}, {"slow", "fast"}, **see), 4.5) == Call("fast")
    assert s.exploring == {"fast"} and p.declines("slow", 3e6, 3e6, 4.6)
    # and a BUSY from it now is a cooldown again, not its old failure's backoff: still explored, the slow one waits
    s.called("fast", "busy", 4.6)
    assert s.next(sight({"slow", "fast"}, {"slow", "fast"}, **see), 4.7) == Wait(0.25)
    assert s.exploring == {"fast"} and p.declines("slow", 3e6, 3e6, 4.8)


def test_open_share_makes_some_searches_open_to_every_link():
    rules = SearchRules(slower_link_ratio=3.0, slower_link_open_share=0.5)
    p = policy(rules, seed=3)
    picky = [p.begin(0.0).picky for _ in range(400)]
    assert sum(picky) == 200 and all(a != b for a, b in zip(picky, picky[1:]))  # every other one, not by chance
    quarter = [policy(SearchRules(slower_link_ratio=3.0, slower_link_open_share=0.25), seed=s) for s in range(2)]
    opened = [[not q.begin(0.0).picky for _ in range(12)] for q in quarter]
    assert [sum(o) for o in opened] == [3, 3] and opened[0] != opened[1]  # 3 of 12, peers out of step
    assert not any(policy(RULES).begin(0.0).picky for _ in range(10))  # ratio 0: the rule is off


def test_a_search_that_is_not_picky_serves_the_slower_peers_first():
    """2 fast peers that become ready together and 1 slow one: the searches left open serve the slow peer (called
    first even though it was our last partner, other callers declined) for the first half, then anyone."""
    p = policy(SearchRules(partner_deadline_s=10.0, slower_link_ratio=3.0, slower_link_open_share=1.0), avoid_recent=3)
    p.succeeded("slow")
    s = p.begin(0.0)
    assert not s.picky
    see = dict(rates={"fast": 30e6, "slow": 3e6}, own_link=30e6)
    assert s.next(sight({"fast", "slow"}, {"fast", "slow"}, **see), 0.1) == Call("slow")
    assert s.serving == {"slow"}
    assert p.declines("fast", 30e6, 30e6, 0.2) and not p.declines("slow", 3e6, 30e6, 0.2)
    assert not p.declines("fast", 30e6, 30e6, 6.0)  # second half: anyone
    s.called("slow", "busy", 0.3, gone=True)  # it paired with someone else: the fast one is fair game again
    assert s.next(sight({"fast", "slow"}, {"fast", "slow"}, **see), 0.4) == Call("fast")
    assert not s.serving and not p.declines("fast", 30e6, 30e6, 0.5)
    # no slow peer ready: nothing to serve, anyone ready is taken
    s2 = p.begin(1.0)
    assert s2.next(sight({"fast", "slow"}, {"fast"}, **see), 1.1) == Call("fast")


def test_a_serving_search_does_not_serve_a_slow_peer_it_turns_away():
    """The slow peer was rejected once (trust below busy_below): a search left open serves nobody, so the fast
    peer is called at once and not declined; before, it served the distrusted peer, which it never called, and
    declined the other fast peer for half the window (e2e 3-peer swarm: both fast peers waited 5 s a round)."""
    p = PartnerPolicy(SearchRules(partner_deadline_s=10.0, slower_link_ratio=3.0, slower_link_open_share=1.0),
                      Backoff(2.0, 60.0, 0.5), avoid_recent=3, rng=random.Random(0), trust=TrustBook(GuardConfig()))
    p.judged("slow", Verdict("reject", 1.0, 0.1, 0.0), 0.0)
    s = p.begin(1.0)
    see = dict(rates={"fast": 30e6, "slow": 3e6}, own_link=30e6)
    assert s.next(sight({"fast", "slow"}, {"fast", "slow"}, **see), 1.1) == Call("fast")
    assert not s.serving and not p.declines("fast", 30e6, 30e6, 1.2)


def test_no_free_offer_holds_until_the_peer_announces_a_new_state():
    """A fast peer answered "no free offer" (it was computing, or paired): not called while the listing shows the
    state it was in when it answered; once it announces a state entered after the answer (training again, then
    exchanging: a fast round is shorter than a slow peer's search) it is waited for and called."""
    s = policy(ADAPT).begin(0.0)
    assert s.next(sight({"fast"}, {"fast"}, entered={"fast": -3.0}), 0.0) == Call("fast")
    s.called("fast", "busy", 0.1, gone=True)
    assert s.next(sight({"fast"}, {"fast"}, entered={"fast": -3.0}), 0.5) == Finish("nobody coming")
    s = policy(ADAPT).begin(0.0)
    s.called("fast", "busy", 0.1, gone=True)
    # training since 1.0 and due at 2.0: coming, so waited for
    assert isinstance(s.next(sight({"fast"}, training={"fast": 2.0}, entered={"fast": 1.0}), 1.1), Wait)
    assert s.next(sight({"fast"}, {"fast"}, entered={"fast": 2.0}), 2.1) == Call("fast")


def test_bandwidth_weighting_prefers_the_faster_announcement():
    rules = SearchRules(bandwidth_weighting=True)
    p = policy(rules, seed=5, avoid_recent=0)
    picks = [p.begin(0.0).next(Sight(live={"a", "b"}, ready={"a": 9.0, "b": 1.0}), 1.0).peer for _ in range(500)]
    assert 0.85 < picks.count("a") / 500 < 0.95


# ---- the adaptive deadline (SearchRules.adaptive)
ADAPT = SearchRules(partner_deadline_s=10.0, retry_interval_s=0.25, adaptive=True, adaptive_k=3.0,
                    partner_deadline_min_s=1.0, adaptive_samples=8, adaptive_min_samples=3)


def test_adaptive_deadline_is_the_fixed_one_until_it_has_history_then_median_plus_k_mad():
    p = policy(ADAPT)
    assert p.deadline_s() == 10.0
    for w in (2.0, 2.4, 1.6):
        p.succeeded("b", waited_s=w)
    # median 2.0, MAD 0.4: 2.0 + 3 * 0.4
    assert p.deadline_s() == pytest.approx(3.2)
    s = p.begin(100.0)
    actions, end = run_until_finish(s, lambda now: sight({"a"}, training={"a": 101.0}), t0=100.0)
    assert end == pytest.approx(103.2) and actions[-1] == Finish("deadline")


def test_adaptive_deadline_ignores_one_outlier_and_stays_within_its_bounds():
    p = policy(ADAPT)
    for w in (0.5, 0.5, 0.6, 0.4, 9.0):  # one partner took 9 s: median and MAD barely move
        p.succeeded("b", waited_s=w)
    assert p.deadline_s() == pytest.approx(1.0)  # 0.5 + 3 * 0.1 = 0.8, raised to the 1 s floor
    q = policy(ADAPT)
    for w in (1.0, 9.0, 20.0):
        q.succeeded("b", waited_s=w)
    assert q.deadline_s() == 10.0  # capped by partner_deadline_s
    fixed = policy(RULES)
    for w in (0.5, 0.5, 0.5):
        fixed.succeeded("b", waited_s=w)
    assert fixed.deadline_s() == 10.0  # adaptive off: the fixed deadline whatever the history


def test_a_deadline_hit_while_someone_was_coming_counts_so_the_estimate_grows_back():
    p = policy(ADAPT)
    for w in (0.2, 0.2, 0.2):
        p.succeeded("b", waited_s=w)
    assert p.deadline_s() == pytest.approx(1.0)
    deadlines = []
    for _ in range(10):  # the swarm slowed down: b now needs 4 s, and keeps missing the short deadline (its
        s = p.begin(0.0)  # expected time says 0.5 s: a claim, or an estimate from an older speed)
        _, end = run_until_finish(s, lambda now: sight({"b"}, training={"b": 0.5}))
        deadlines.append(end)
    assert deadlines[0] == pytest.approx(1.0)
    assert deadlines == sorted(deadlines) and deadlines[-1] >= 4.0


def test_nobody_coming_finishes_at_once():
    """No peer ready and every training peer expected ready only after our deadline (they paired and started their
    next inner phase): solo at once. ADAPT's deadline here is the fixed 10 s (no history yet)."""
    s = policy(ADAPT).begin(0.0)
    assert s.next(sight({"a", "b"}, training={"a": 12.0, "b": 11.0}), 0.0) == Finish("nobody coming")
    # one of them expected ready before our deadline: it is coming, wait for it
    s = policy(ADAPT).begin(0.0)
    assert s.next(sight({"a", "b"}, training={"a": 12.0, "b": 4.0}), 0.0) == Wait(0.25)
    # overdue (its estimate has passed) still counts as coming until the deadline
    assert s.next(sight({"a", "b"}, training={"a": 12.0, "b": -3.0}), 0.0) == Wait(0.25)
    # a ready peer is coming by definition; a joining peer (neither ready nor training) is not
    assert policy(ADAPT).begin(0.0).next(sight({"a"}, {"a"}), 0.0) == Call("a")
    assert policy(ADAPT).begin(0.0).next(sight({"j"}), 0.0) == Finish("nobody coming")
    # a responder exchange in flight with us is never cut off
    s = policy(ADAPT).begin(0.0)
    assert s.next(sight({"a"}, training={"a": 30.0}, engaged_as_responder=True), 0.0) == Wait(0.25)
    # adaptive off: the fixed rules wait for the deadline
    assert policy(RULES).begin(0.0).next(sight({"a"}, training={"a": 30.0}), 0.0) == Wait(0.25)


def test_round_counts_do_not_decide_who_is_coming():
    """Two peers whose round counts drifted apart (a resumed peer, a late joiner): the one behind in rounds still
    waits for the one ahead when that one's inner phase ends before the deadline. The old rule (a training peer
    with a round past ours is not coming) sent the peer behind solo every round, and the pair apart for good."""
    p = policy(ADAPT)
    for w in (1.5, 2.0, 2.5):
        p.succeeded("x", waited_s=w)
    s = p.begin(0.0)  # deadline 2.0 + 3 * 0.5 = 3.5 s
    see = lambda now: sight({"ahead"}, {"ahead"}) if now >= 2.0 else sight({"ahead"}, training={"ahead": 2.0})
    now = 0.0
    while isinstance(a := s.next(see(now), now), Wait):
        now += a.seconds
    assert a == Call("ahead") and now == pytest.approx(2.0)


def test_an_overlapped_search_waits_for_its_cut_even_when_nobody_is_coming_and_learns_nothing():
    p = policy(ADAPT)
    s = p.begin(0.0, window_s=5.0)
    see = dict(training={"a": 20.0})
    assert s.next(sight({"a"}, cut=False, **see), 0.0) == Wait(0.25)  # searching costs nothing before the cut
    assert s.next(sight({"a"}, cut=True, **see), 0.0) == Finish("nobody coming")
    s = p.begin(0.0, window_s=5.0)
    assert s.next(sight({"a"}, cut=True, training={"a": 13.0}), 12.0) == Finish("deadline")
    assert len(p.waits) == 0  # overlapped waits are hidden by inner steps: not samples


def test_odd_swarm_on_a_virtual_clock_adaptive_against_fixed():
    """Three peers with equal rounds of 4 s: each round two pair and the third is left over. With the fixed
    deadline the leftover waits for a partner until one of the others comes back a round later; adaptive, it
    sees both in an inner phase that ends after its deadline and goes solo at once. Idle seconds per round of the leftover, both ways,
    from the same policy code."""
    def leftover_wait(rules: SearchRules) -> float:
        p = policy(rules)
        for w in (0.1, 0.2, 0.15):
            p.succeeded("x", waited_s=w)
        s = p.begin(0.0)
        compute_s = 4.0  # a and b exchanged at t=0 and are now training round 8, ready again at t=4
        see = lambda now: (sight({"a", "b"}, {"a", "b"}) if now >= compute_s
                           else sight({"a", "b"}, training={"a": compute_s, "b": compute_s}))
        now = 0.0
        while True:
            a = s.next(see(now), now)
            if not isinstance(a, Wait):
                return now
            now += a.seconds

    assert leftover_wait(RULES) == pytest.approx(4.0)   # idle until a partner is back
    assert leftover_wait(ADAPT) == 0.0


def test_a_partner_without_a_free_offer_is_not_coming_whatever_the_stale_listing_says():
    """The listing (up to ~1 s old) still shows a peer "exchanging" after it paired with someone else; its BUSY
    "no free offer" tells us it is done with this round: it is neither called again nor waited for."""
    s = policy(ADAPT).begin(0.0)
    stale = sight({"a", "b"}, {"a", "b"})
    first = s.next(stale, 0.0)
    assert isinstance(first, Call)
    s.called(first.peer, "busy", 0.0, gone=True)
    other = next(iter({"a", "b"} - {first.peer}))
    assert s.next(stale, 0.6) == Call(other)
    s.called(other, "busy", 0.6, gone=True)
    assert s.next(stale, 1.2) == Finish("nobody coming")
    # engaged elsewhere (or calling us at the same moment) is not gone: it may still become free
    s = policy(ADAPT).begin(0.0)
    s.called("a", "busy", 0.0)
    assert s.next(sight({"a"}, {"a"}), 0.1) == Wait(0.25)


def test_a_peer_we_must_not_call_is_never_called_but_still_waited_for():
    """A peer behind NAT attached to no forwarder (uncallable: it calls us): we wait for its call instead of
    dialling, and do not finish as if alone."""
    s = policy().begin(0.0)
    actions, end = run_until_finish(s, lambda now: sight({"nat"}, {"nat"}, uncallable={"nat"}))
    assert end == pytest.approx(10.0) and not any(isinstance(a, Call) for a in actions)
    # with a callable peer ready too, that one is called
    assert policy().begin(0.0).next(sight({"nat", "pub"}, {"nat", "pub"}, uncallable={"nat"}), 0.0) == Call("pub")
